"""Drafters: who proposes the tokens a verify step checks.

The engine talks to a drafter at two points of every speculative step:

- ``propose``, after scheduling: for each sequence that speculates, ``d`` draft tokens
  (and their distributions, or ``None`` for a deterministic drafter). The K/V rows
  ``[c, c + d]`` of such a sequence (``c`` its computed tokens) are reserved by then.
  A drafter that computes its drafts on the device may hand them over there
  (``Proposal.device_ids``): the engine then queues the verify pass on them before the
  host reads them, so the device does not wait for the host between the two.
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

Every draft comes from the runner's ``draft_head``: logits over the draft vocabulary
(``N'`` ids, ``engine/draft_vocab.py``; all ``V`` without a subset), a tail's included. A
greedy request's draft is the target id of the logits' argmax (proposed deterministically:
its ``Draft`` carries no distribution); a sampled request's is a draw, with its own
temperature and filters, from ``q`` over the whole vocabulary with probability 0
outside the draft vocabulary, and that ``q`` is what the verify step's rejection
sampling reads, so the output keeps the target's distribution.

On CUDA both run the runner's captured graphs (``engine/draft_graphs.py``) where one holds
the batch: ``propose`` for up to the largest decode graph's sequences, and ``observe``
where every sequence keeps ``1 .. k + 1`` rows ending at its frontier (the verify chunks
of a speculative step, and plain decode rows). Prompt chunks, larger batches and the CPU
run the same pass eagerly. A graph's batch is padded, so its drafts are the eager pass's
up to the rounding the padded row count changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch, table_width
from pagedserve.engine.draft_graphs import ProposeGraphs
from pagedserve.engine.request import Request
from pagedserve.engine.runner import ModelRunner
from pagedserve.engine.sampler import SamplingTensors
from pagedserve.engine.spec_verify import draw_drafts
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
    drawn from (before the request's temperature and filters; ``-inf`` at ids the drafter
    cannot propose), or ``None``: proposed deterministically (each ``q_j`` one-hot)."""

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


class Proposal:
    """The drafts of one ``propose`` call, in its requests' order.

    ``device_ids``: int64 ``[B, d_max]`` on the device, row ``i``'s first ``d_i`` entries
    request ``i``'s drafts, or ``None`` (the drafts are on the host only). A view of the
    drafter's buffers, valid until its next ``propose``. ``drafts()`` reads the ids to the
    host once, when first asked.
    """

    def __init__(self, drafts: list[Draft] | None = None, *,
                 device_ids: torch.Tensor | None = None, num_drafts: list[int] | None = None,
                 logits: list[torch.Tensor | None] | None = None) -> None:
        if (drafts is None) == (device_ids is None):
            raise ValueError("a proposal holds either host drafts or device ids")
        self._drafts = drafts
        self.device_ids = device_ids
        self._num_drafts = num_drafts or []
        self._logits = logits or [None] * len(self._num_drafts)

    @property
    def num_drafts(self) -> list[int]:
        if self._drafts is not None:
            return [len(d.token_ids) for d in self._drafts]
        return self._num_drafts

    def drafts(self) -> list[Draft]:
        if self._drafts is None:
            assert self.device_ids is not None
            rows = self.device_ids.tolist()  # [B][d_max]: the one host read
            self._drafts = [Draft(r[:d], q)
                            for r, d, q in zip(rows, self._num_drafts, self._logits)]
        return self._drafts


class Drafter(Protocol):
    def ready(self, req: Request) -> bool: ...

    def propose(self, wants: list[DraftRequest]) -> Proposal: ...

    def observe(self, kept: list[Observed]) -> None: ...


@dataclass
class _Tail:
    """The MTP head's output at row ``num_computed - 1`` of a request."""

    num_computed: int
    hidden: torch.Tensor  # [H]
    logits: torch.Tensor  # [N'] float32, over the draft vocabulary


class MTPDrafter:
    """Drafts with the MTP head of ``runner``'s model over ``kv``'s block tables."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        if not runner.has_mtp:
            raise ValueError("MTPDrafter needs a model loaded with its MTP head")
        assert runner.draft_head is not None
        self.runner = runner
        self.kv = kv
        self.head = runner.draft_head
        self.vocab_size = runner.model_config.vocab_size

    def ready(self, req: Request) -> bool:
        """Whether ``req`` has its tail at its computed tokens (drafting can start)."""
        tail = getattr(req, "draft_tail", None)
        return isinstance(tail, _Tail) and tail.num_computed == req.num_computed_tokens

    @staticmethod
    def tails(reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """The tails of ``reqs`` (each ``ready``): the head's outputs ``[B, H]`` and their
        draft logits ``[B, N']``."""
        tails = [q.draft_tail for q in reqs]
        assert all(isinstance(t, _Tail) for t in tails)
        return torch.stack([t.hidden for t in tails]), torch.stack([t.logits for t in tails])

    @staticmethod
    def set_tail(req: Request, num_computed: int, hidden: torch.Tensor,
                 logits: torch.Tensor) -> None:
        """Give ``req`` the tail an observe computed elsewhere (an async speculative
        step's observe graph, ``spec_async.py``): the head's output ``hidden`` ``[H]`` at
        row ``num_computed - 1`` and its draft logits ``[N']``."""
        req.draft_tail = _Tail(num_computed, hidden, logits)

    def observe(self, kept: list[Observed]) -> None:
        if not kept:
            return
        chunks = [SeqChunk(o.request.live_kv_handle, o.slot, tuple(o.next_ids), o.start)
                  for o in kept]
        batch = build_forward_batch(chunks, self.kv, self.runner.device)
        batch.positions = batch.positions + 1  # RoPE position i + 1 for K/V row i
        hidden = torch.cat([o.hidden for o in kept])  # [T, H]
        graphs = self.runner.draft_graphs
        observe = graphs.observe if graphs is not None else None
        frontier = [i for i, o in enumerate(kept) if o.frontier]
        if (observe is not None and len(frontier) == len(kept)
                and observe.fits(batch.query_lens_cpu())):
            last, logits = observe.run(batch, hidden)  # [B, H], [B, N']
        else:
            out = self.runner.mtp_forward(batch, hidden)  # [T, H]
            if not frontier:
                return
            ends = [q - 1 for q in batch.query_start_loc_cpu[1:]]
            last = out[[ends[i] for i in frontier]]  # [F, H]
            logits = self.runner.draft_logits(last)  # [F, N']
        for row, i in enumerate(frontier):
            o = kept[i]
            o.request.draft_tail = _Tail(o.start + len(o.next_ids), last[row], logits[row])

    def propose(self, wants: list[DraftRequest]) -> Proposal:
        if not wants:
            return Proposal([])
        hidden, first = self.tails([w.request for w in wants])  # [B, H], [B, N']
        d_max = max(w.num_drafts for w in wants)
        graphs = self.runner.draft_graphs
        propose = graphs.propose if graphs is not None else None
        if d_max > 1 and propose is not None and propose.holds(len(wants), d_max):
            return self._propose_graphed(propose, wants, hidden, first)
        logits = [first]  # d x [B, N']
        ids = [self._choose(logits[0], wants, 0)]
        for j in range(1, d_max):
            live = [i for i, w in enumerate(wants) if w.num_drafts > j]
            chunks = [SeqChunk(wants[i].request.live_kv_handle, wants[i].slot,
                               (ids[-1][i],), wants[i].start + j - 1) for i in live]
            batch = build_forward_batch(chunks, self.kv, self.runner.device)
            batch.positions = batch.positions + 1
            out = self.runner.mtp_forward(batch, hidden[live])  # [b, H]
            hidden = hidden.clone()
            hidden[live] = out
            step_logits = logits[-1].clone()
            step_logits[live] = self.runner.draft_logits(out)
            logits.append(step_logits)
            ids.append(self._choose(step_logits, wants, j))
        stacked = torch.stack(logits, dim=1)  # [B, d_max, N']
        return Proposal([Draft([ids[j][i] for j in range(w.num_drafts)], self._q(stacked[i], w))
                         for i, w in enumerate(wants)])

    def _propose_graphed(self, graphs: ProposeGraphs, wants: list[DraftRequest],
                         hidden: torch.Tensor, first: torch.Tensor) -> Proposal:
        """``propose`` through the captured passes: ``hidden`` ``[B, H]`` and ``first``
        ``[B, N']`` the tails'. Pass ``j`` writes K/V row ``start + j - 1`` of each sequence
        that drafts more than ``j`` tokens; the greedy drafts stay on the device (sampled
        ones are drawn between passes, there too), and so does the proposal."""
        d_max = max(w.num_drafts for w in wants)
        rows = [[w.start + j for j in range(w.num_drafts - 1)] for w in wants]
        slots = [[self.kv.slot_of(w.request.live_kv_handle, r) for r in rs]
                 for w, rs in zip(wants, rows)]
        handles = [w.request.live_kv_handle for w in wants]
        tables, _ = self.kv.batch_view(handles, table_width(
            max(len(self.kv.block_table(h)) for h in handles), self.kv.max_blocks_per_seq))
        size = graphs.load(hidden, first, rows, slots, tables)
        n = len(wants)
        ids, logits = graphs.buffers["ids"], graphs.buffers["logits"]  # [k, P], [k, P, N']
        self._draw_sampled(logits[0, :n], wants, 0, ids[0, :n])
        for j in range(1, d_max):
            graphs.replay(size, j)
            self._draw_sampled(logits[j, :n], wants, j, ids[j, :n])
        stacked = logits[:d_max, :n].transpose(0, 1)  # [B, d_max, N'], the buffers
        return Proposal(device_ids=ids[:d_max, :n].T,  # [B, d_max]
                        num_drafts=[w.num_drafts for w in wants],
                        logits=[self._q(stacked[i], w) for i, w in enumerate(wants)])

    def _q(self, logits: torch.Tensor, want: DraftRequest) -> torch.Tensor | None:
        """What ``Draft.logits`` holds for ``want``'s drafts from their draft logits
        ``[>= d, N']``: a new ``[d, V]`` (``-inf`` outside the draft vocabulary) for a
        sampled request, ``None`` for a greedy one (its drafts are the argmax)."""
        if want.request.params.greedy:
            return None
        return self.head.full_logits(logits[:want.num_drafts])

    def _choose(self, logits: torch.Tensor, wants: list[DraftRequest], j: int) -> list[int]:
        """Draft ``j`` of each row from its draft logits ``[B, N']``: the argmax's target
        id for greedy requests, else a draw from the request's own filtered distribution
        with the draft stream's noise."""
        ids = self.head.token_ids(logits.argmax(dim=-1))  # [B]
        self._draw_sampled(logits, wants, j, ids)
        return ids.tolist()

    def _draw_sampled(self, logits: torch.Tensor, wants: list[DraftRequest], j: int,
                      ids: torch.Tensor) -> None:
        """Overwrite ``ids`` int64 ``[B]`` (on the device, no sync) at each sampled
        request that drafts a token ``j``: its draw from its own filtered distribution
        over the whole vocabulary, from the draft logits float32 ``[B, N']`` (probability
        0 outside the draft vocabulary), with the draft stream's noise."""
        rows = [i for i, w in enumerate(wants)
                if not w.request.params.greedy and j < w.num_drafts]
        if not rows:
            return
        reqs = [wants[i].request for i in rows]
        st = SamplingTensors.from_requests(reqs, self.vocab_size, logits.device, tokens_ahead=j)
        at = torch.tensor(rows, device=logits.device)
        index = torch.tensor([len(r.output_token_ids) + j for r in reqs], device=logits.device)
        drawn, _ = draw_drafts(self.head.full_logits(logits[at]), st, index)  # [S], [S, V]
        ids[at] = drawn
