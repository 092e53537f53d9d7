"""Drafters: who proposes the tokens a verify step checks.

The engine talks to a drafter at two points of every speculative step:

- ``propose``, after scheduling: for each sequence that speculates, ``d`` draft tokens
  (and their distributions, or ``None`` for a deterministic drafter). The K/V rows
  ``[c, c + d]`` of such a sequence (``c`` its computed tokens) are reserved by then.
- ``observe``, after verifying: the rows of the step that the target keeps, with their
  final hidden states and the token that follows each row.

``MTPDrafter`` runs the checkpoint's MTP head (``model/mtp.py``). Its K/V row ``i`` holds
(``h_i``, ``x_{i+1}``) and is written by ``observe`` for every row the target keeps (prompt
chunks included), so that invariant holds below each sequence's computed tokens::

    target rows    0 .. c-1 computed, c = num_computed_tokens; x_c pending (sampled)
    MTP rows       0 .. c-1 = (h_i, x_{i+1}): exact, written by observe
                   c .. c+d-2   drafting scratch (propose), rewritten by the next observe

Under prefix caching a shared block's MTP rows are exact for every request that matches
it, since block names cover the token after each block (``prefix_cache.py``); after a hit
at ``p`` the first ``observe`` of the request starts at row ``p - 1`` (fed the
checkpoint's hidden state), rewriting the one row a copied tail block may hold for
another next token.

``observe`` also keeps, per request, the head's output at row ``c - 1`` (its ``tail``):
draft 1 comes from its logits, and drafts 2..d chain one-row passes, each feeding the
head its own previous output as the hidden state (as vLLM's MTP proposer does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.request import Request
from pagedserve.engine.runner import ModelRunner
from pagedserve.engine.sampler import SamplingTensors, filtered_logits
from pagedserve.engine.spec_verify import DRAFT_STREAM, race
from pagedserve.kv.kv_manager import KVCacheManager


@dataclass(frozen=True)
class DraftRequest:
    """``request`` speculates ``num_drafts`` tokens from K/V row ``start`` (its computed
    tokens), in state slot ``slot``."""

    request: Request
    slot: int
    start: int
    num_drafts: int


@dataclass(frozen=True)
class Draft:
    """``token_ids`` proposed; ``logits`` float32 ``[d, V]`` of the distributions they were
    drawn from (before the request's temperature and filters), or ``None``: proposed
    deterministically (each ``q_j`` one-hot)."""

    token_ids: list[int]
    logits: torch.Tensor | None = None


@dataclass(frozen=True)
class Observed:
    """Rows ``[start, start + len(next_ids))`` of ``request`` are kept: ``hidden``
    ``[n, H]`` their final hidden states, ``next_ids`` the token after each row.
    ``frontier``: the last row is the request's last computed one (drafting resumes
    from it)."""

    request: Request
    slot: int
    start: int
    next_ids: list[int]
    hidden: torch.Tensor
    frontier: bool


class Drafter(Protocol):
    def ready(self, req: Request) -> bool: ...

    def propose(self, wants: list[DraftRequest]) -> list[Draft]: ...

    def observe(self, kept: list[Observed]) -> None: ...


@dataclass
class _Tail:
    """The MTP head's output at row ``num_computed - 1`` of a request."""

    num_computed: int
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [V] float32


class MTPDrafter:
    """Drafts with the MTP head of ``runner``'s model over ``kv``'s block tables."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        if not runner.has_mtp:
            raise ValueError("MTPDrafter needs a model loaded with its MTP head")
        self.runner = runner
        self.kv = kv
        self.vocab_size = runner.model_config.vocab_size

    def ready(self, req: Request) -> bool:
        """Whether ``req`` has its tail at its computed tokens (drafting can start)."""
        tail = getattr(req, "draft_tail", None)
        return isinstance(tail, _Tail) and tail.num_computed == req.num_computed_tokens

    def observe(self, kept: list[Observed]) -> None:
        if not kept:
            return
        chunks = [SeqChunk(o.request.live_kv_handle, o.slot, tuple(o.next_ids), o.start)
                  for o in kept]
        batch = build_forward_batch(chunks, self.kv, self.runner.device)
        batch.positions = batch.positions + 1  # RoPE position i + 1 for K/V row i
        hidden = torch.cat([o.hidden for o in kept])  # [T, H]
        out = self.runner.mtp_forward(batch, hidden)  # [T, H]
        ends = [q - 1 for q in batch.query_start_loc_cpu[1:]]
        frontier = [i for i, o in enumerate(kept) if o.frontier]
        if not frontier:
            return
        last = out[[ends[i] for i in frontier]]  # [F, H]
        logits = self.runner.compute_logits(last)  # [F, V]
        for row, i in enumerate(frontier):
            o = kept[i]
            o.request.draft_tail = _Tail(o.start + len(o.next_ids), last[row], logits[row])

    def propose(self, wants: list[DraftRequest]) -> list[Draft]:
        if not wants:
            return []
        tails = [w.request.draft_tail for w in wants]
        assert all(isinstance(t, _Tail) for t in tails)
        hidden = torch.stack([t.hidden for t in tails])  # [B, H]
        logits = [torch.stack([t.logits for t in tails])]  # d x [B, V]
        ids = [self._choose(logits[0], wants, 0)]
        for j in range(1, max(w.num_drafts for w in wants)):
            live = [i for i, w in enumerate(wants) if w.num_drafts > j]
            chunks = [SeqChunk(wants[i].request.live_kv_handle, wants[i].slot,
                               (ids[-1][i],), wants[i].start + j - 1) for i in live]
            batch = build_forward_batch(chunks, self.kv, self.runner.device)
            batch.positions = batch.positions + 1
            out = self.runner.mtp_forward(batch, hidden[live])  # [b, H]
            hidden = hidden.clone()
            hidden[live] = out
            step_logits = logits[-1].clone()
            step_logits[live] = self.runner.compute_logits(out)
            logits.append(step_logits)
            ids.append(self._choose(step_logits, wants, j))
        stacked = torch.stack(logits, dim=1)  # [B, d_max, V]
        return [Draft([ids[j][i] for j in range(w.num_drafts)], stacked[i, :w.num_drafts])
                for i, w in enumerate(wants)]

    def _choose(self, logits: torch.Tensor, wants: list[DraftRequest], j: int) -> list[int]:
        """Draft ``j`` of each row: the argmax for greedy requests, else a draw from the
        request's own filtered distribution with the draft stream's noise."""
        out = logits.argmax(dim=-1).tolist()  # [B]
        for i, w in enumerate(wants):
            req = w.request
            if req.params.greedy or j >= w.num_drafts:
                continue
            st = SamplingTensors.from_requests([req], self.vocab_size, logits.device,
                                               tokens_ahead=j)
            probs = torch.softmax(filtered_logits(logits[i:i + 1], st), dim=-1)
            index = torch.tensor([len(req.output_token_ids) + j], device=logits.device)
            out[i] = int(race(probs, req.sample_seed, index, DRAFT_STREAM)[0])
        return out
