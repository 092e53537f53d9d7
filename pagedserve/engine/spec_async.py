"""Async scheduling for speculative steps: a verify step launched before the previous
one's tokens reach the host.

A synchronous speculative step (``spec_step.py``) reads its verify rows back, decides on
the host, and only then launches the drafter's observe pass, the rollback and the next
step's proposals: the GPU waits while the host decides, commits, detokenizes, schedules
and builds the next batch. In a steady run of verify steps, every decision can be made on
the device, so a step is a chain of launches that needs nothing from the host but what it
knows before the step (block tables, state slots, sampling settings)::

    propose    k drafts per sequence from its tail (the drafter's propose graphs; a
               sampled request's drafts drawn between the passes)
    verify     the verify graph over [pending token, drafts], rows c .. c + k
    decide     m kept drafts and the token at row m: for a greedy request the drafts
               that equal the target's argmax, then the argmax; for a sampled one
               rejection sampling (``rejection_sample_rows``); the m + 1 emitted ids
    roll back  the rollback graph, with m + 1 rows for each sequence where m < k
    observe    the drafter's observe graph over every verify row, the K/V writes of
               rows past m masked: the new tail is the head's output at row c + m
    read back  [emitted ids | m] to pinned host memory, with no wait

The chain of step N+1 is launched before step N is read: its rows start at N's
``c + m + 1``, computed on the device, its pending token is N's bonus token and its
tails are N's observe outputs. The host applies N's tokens one step late::

    host   | launch N | launch N+1 | read N, apply | launch N+2 | read N+1, apply ...
    GPU    |   . . .  N  . . . . . | N+1 . . . . . . . . . . . | N+2 ...

What the host cannot know at launch time it covers:

- **K/V rows.** N+1 writes rows ``c + m + 1 .. c + m + 1 + k``; the host reserves them
  for every ``m`` (through ``c + 2(k + 1)``), so every row N+1 may write has its block
  in the table it uploads, and the slots are looked up on the device
  (``slots_from_tables``). Blocks that only rejected rows reached go back when the last
  step of the run is read (``unreserve``), as after a synchronous step.
- **Length limits.** A step goes ahead only when the step after it drafts ``k`` whatever
  N keeps: ``max_tokens`` and ``max_model_len`` leave room for ``2(k + 1)`` more tokens.
- **A stop found late** (EOS, a stop id or string among N's tokens): N+1 computed rows of
  a finished request. Its blocks and slot are freed when N is read (every later use is
  launched after N+1, on the same stream), N+1's rows of it are dropped when N+1 is
  read, and its state, moved past its tokens, is not checkpointed.
- **What goes ahead**: steps whose every chunk verifies ``k`` drafts, whose requests have
  no grammar and no ``min_tokens`` still to reach, while the head of the queue cannot be
  admitted, and whose batch the verify, rollback and draft graphs hold. Any other step
  runs synchronously once nothing is in flight. Logprobs are computed on the device with
  the decision and read back beside the tokens; a logit bias is added to every verify row
  on the device; penalties count each sequence's outputs in a history kept on the device
  (``Sampling``), grown by each step's kept tokens.

The tokens are the synchronous engine's: the decisions are ``verify_greedy``'s and
``verify_sampled``'s, with the noise of the same output indices (the index of a step's
first token moves on the device with ``m``, as its rows do); an imposed acceptance
(``SpeculativeDecoding.kept_drafts``: benchmarks and the warm-up) is drawn at launch and
applied on the device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.batch_builder import build_forward_batch, slots_from_tables
from pagedserve.engine.drafter import MTPDrafter
from pagedserve.engine.lookahead import HostTokens, LaunchedStep, TokenReadback
from pagedserve.engine.request import (
    GREEDY_TEMPERATURE,
    MAX_LOGPROBS,
    Request,
    RequestStatus,
    TokenLogprob,
)
from pagedserve.engine.sampler import (
    SamplingTensors,
    adjusted_logits,
    filtered_logits,
    sample,
    uses_host_history,
)
from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.engine.spec_verify import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    Verified,
    draw_drafts,
    race_rows,
    uniforms_rows,
)
from pagedserve.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine, RequestOutput


@dataclass
class ChainStep(LaunchedStep):
    """A launched speculative step whose tokens the host has not read.

    ``chunks``: its verify chunks (a step launched ahead places them as if the step
    before kept every draft; the host learns the real start when that step is read).
    Device tensors: ``bonus`` int64 ``[B]`` the token at row ``m``; ``kept`` int64 ``[B]``
    the drafts kept (``m``); ``hidden`` ``[B r, H]`` the verify rows' final hidden
    states; ``tail_hidden`` ``[B, H]`` and ``tail_logits`` float32 ``[B, N']`` the
    drafter's new tails; ``result`` int64 ``[B, r + 1]`` the emitted ids and ``m``, on
    their way to the host in ``readback`` (CUDA); ``sampling``: the sampled rows'
    settings, ``None`` when every request is greedy; ``logprobs``: the verify rows'
    log-probabilities, when some request asks for them; ``imposed``: each sequence's
    imposed kept count (-1: decided), when one is imposed."""

    chunks: list[ScheduledChunk]
    bonus: torch.Tensor
    kept: torch.Tensor
    hidden: torch.Tensor
    tail_hidden: torch.Tensor
    tail_logits: torch.Tensor
    result: torch.Tensor
    readback: HostTokens | None
    sampling: Sampling | None
    logprobs: ChainLogprobs | None
    imposed: list[int] | None

    def host_result(self) -> list[list[int]]:
        """``[B][r + 1]``: each sequence's emitted ids, then ``m``; waits for the device."""
        flat = self.readback.wait() if self.readback is not None else self.result.flatten().tolist()
        width = self.result.shape[1]
        return [flat[i:i + width] for i in range(0, len(flat), width)]


@dataclass
class ChainLogprobs:
    """The model's own log-probabilities at a chain step's verify rows, as the
    synchronous step reports them: ``values`` float32 ``[B, r, 1 + 2n]``, each row's
    emitted token's, then the top ``n`` ids (exact in float32 below 2^24) and their
    log-probabilities; on their way to the host in ``readback`` (CUDA)."""

    values: torch.Tensor
    top: int
    readback: HostTokens | None

    @functools.cached_property
    def host_values(self) -> list[float]:
        """``values`` flattened on the host; waits for the device."""
        if self.readback is not None:
            return self.readback.wait()
        return self.values.flatten().tolist()

    def host(self, seq: int, num_rows: int, n: int, tokens: list[int]) -> list[TokenLogprob]:
        """Sequence ``seq``'s first ``num_rows`` rows, whose emitted tokens are
        ``tokens``, with their top ``n`` (``n <= top``)."""
        _, r, width = self.values.shape
        out = []
        for j in range(num_rows):
            start = (seq * r + j) * width
            row = self.host_values[start:start + width]
            top = list(zip(map(int, row[1:1 + n]), row[1 + self.top:1 + self.top + n]))
            out.append(TokenLogprob(tokens[j], row[0], top))
        return out


@dataclass
class Sampling:
    """The settings of a chain's requests (built when the chain starts: they do not
    change), ``index`` int64 ``[B]`` the output index of each sequence's first token of
    the step, and with penalties ``outputs`` int64 ``[B, W]`` each sequence's outputs so
    far (padded with ``vocab_size``), all on the device."""

    settings: SamplingTensors
    index: torch.Tensor
    outputs: torch.Tensor | None
    vocab_size: int

    @property
    def sampled(self) -> torch.Tensor:
        """bool ``[B]``: the rows that sample (the others are greedy)."""
        return self.settings.temperature >= GREEDY_TEMPERATURE

    def verify_rows(self, drafts: torch.Tensor) -> SamplingTensors:
        """The settings of each sequence's verify rows, for drafts int64 ``[B, k]``: row
        ``j`` draws output index ``index + j``, and with penalties its history is the
        outputs followed by the first ``j`` drafts (``SamplingTensors.along_drafts``)."""
        n, k = drafts.shape
        device = drafts.device
        steps = (self.index[:, None] + torch.arange(k + 1, device=device)).reshape(-1)
        histories = None
        if self.outputs is not None:
            before = torch.arange(k, device=device)[None, :] < torch.arange(
                k + 1, device=device)[:, None]  # [r, k]: draft i precedes row j
            tail = torch.where(before[None], drafts[:, None, :], self.vocab_size)  # [B, r, k]
            histories = torch.cat([self.outputs.repeat_interleave(k + 1, dim=0),
                                   tail.reshape(n * (k + 1), k)], dim=1)
        return self.settings.rows_repeated(k + 1, steps, histories)

    def after(self, kept: torch.Tensor, emitted: torch.Tensor, width: int) -> Sampling:
        """The next step's, after this one emitted ``emitted[:, :m + 1]`` (int64 ``[B, r]``,
        ``m = kept``): ``m + 1`` tokens further, the outputs at least ``width`` wide."""
        outputs = self.outputs
        if outputs is not None:
            n, r = emitted.shape
            grow = max(0, width - outputs.shape[1])
            outputs = torch.cat([outputs, outputs.new_full((n, grow), self.vocab_size)], 1)
            row = torch.arange(r, device=emitted.device)
            emitted_only = torch.where(row[None] <= kept[:, None], emitted, self.vocab_size)
            outputs.scatter_(1, self.index[:, None] + row, emitted_only)
        return Sampling(self.settings, self.index + kept + 1, outputs, self.vocab_size)


class PinnedUpload:
    """Two pinned int64 rows used in turn for a step's one small host->device copy (the
    imposed acceptance), so that the copy does not wait for the stream: the row a step
    uses is written again two launches later, after that step has been read."""

    def __init__(self, max_len: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._rows = [torch.empty(max_len, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.device = device

    def __call__(self, values: list[int]) -> torch.Tensor:
        row = self._rows[self._turn][: len(values)]
        self._turn ^= 1
        row.copy_(torch.tensor(values, dtype=torch.long))
        if self.device.type == "cpu":
            return row.clone()
        return row.to(self.device, non_blocking=True)


class AsyncSpeculation:
    """The chains of one engine's steady speculative steps (module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        assert engine.spec is not None
        self.engine = engine
        self.spec = engine.spec
        self.k = k = self.spec.config.num_speculative_tokens
        self.r = k + 1
        device = engine.runner.device
        max_seqs = engine.config.max_num_seqs
        cuda = device.type == "cuda"
        self._readback = TokenReadback(max_seqs * (self.r + 1)) if cuda else None
        self._logprob_readback = (TokenReadback(max_seqs * self.r * (1 + 2 * MAX_LOGPROBS),
                                                torch.float32) if cuda else None)
        self._imposed = PinnedUpload(max_seqs, device)

    def graphs_ready(self) -> bool:
        """Whether the runner holds every graph a chain replays (else no step goes
        ahead: every speculative step runs synchronously)."""
        rn = self.engine.runner
        return (rn.verify_graphs is not None and rn.rollback_graphs is not None
                and rn.draft_graphs is not None and isinstance(self.spec.drafter, MTPDrafter)
                and (self.k == 1 or rn.draft_graphs.propose is not None))

    # ---- launching --------------------------------------------------------------------
    def launch(self, chunks: list[ScheduledChunk]) -> ChainStep | None:
        """The chain of a scheduled step, or ``None`` when the step is not a steady one
        (it then runs synchronously)."""
        e, k = self.engine, self.k
        if not all(c.num_draft == k and c.num_tokens == self.r for c in chunks):
            return None
        reqs = [c.request for c in chunks]
        if not self._steady(reqs):
            return None
        seq_chunks = [e._seq_chunk(c, ids=(*c.request.token_slice(c.start_pos, c.start_pos + 1),
                                           *[0] * k)) for c in chunks]
        batch = build_forward_batch(seq_chunks, e.kv, e.runner.device, staging=e._staging)
        assert isinstance(self.spec.drafter, MTPDrafter)
        sampling = None
        if (not all(q.params.greedy for q in reqs) or uses_host_history(reqs)
                or any(q.params.logit_bias for q in reqs)):
            # Nothing is in flight: a plain upload costs no overlap.
            settings = SamplingTensors.from_requests(reqs, e.vocab_size, e.runner.device)
            sampling = Sampling(settings, settings.step, settings.output_ids, e.vocab_size)
        return self._chain(chunks, batch, *self.spec.drafter.tails(reqs), sampling)

    def launch_after(self, prev: ChainStep) -> ChainStep | None:
        """The chain of the step after ``prev``, launched before ``prev`` is read, or
        ``None`` when that step must wait for the scheduler."""
        e, k, r = self.engine, self.k, self.r
        reqs = [c.request for c in prev.chunks]
        if any(q.status is not RequestStatus.RUNNING for q in reqs):
            return None  # finished or aborted since the launch
        if e.scheduler.can_admit_next() or not self._steady(reqs):
            return None
        if not all(self._room_after_next(q) for q in reqs):
            return None
        for q in reqs:  # committed: prev's start c; rows up to c + 2r - 1 may be written
            if not e.kv.reserve(q.live_kv_handle, 2 * r):
                return None  # the pool is full: the scheduler preempts once prev is read
        if e.kv.pending_copies:  # none in practice: a sequence's partial block is private
            e.runner.apply_pending_copies(e.kv)
        # Placed as if prev kept every draft (c + r), then moved back by k - m there.
        chunks = [ScheduledChunk(q, r, q.num_computed_tokens + r, k) for q in reqs]
        batch = build_forward_batch([e._seq_chunk(c, ids=(0,) * r) for c in chunks], e.kv,
                                    e.runner.device, staging=e._staging)
        shift = k - prev.kept  # [B]
        positions = batch.positions.view(-1, r) - shift[:, None]  # [B, r]
        batch.positions = positions.reshape(-1)
        batch.seq_lens = batch.seq_lens - shift.to(torch.int32)
        batch.slot_mapping = slots_from_tables(batch.block_tables, positions,
                                               e.kv.block_size).reshape(-1)
        batch.input_ids.view(-1, r)[:, 0].copy_(prev.bonus)
        e.stats.num_lookahead_steps += 1
        sampling = None
        if prev.sampling is not None:  # histories wide enough for two more steps
            width = max(len(q.output_token_ids) for q in reqs) + 2 * r
            sampling = prev.sampling.after(prev.kept, prev.result[:, :r], width)
        return self._chain(chunks, batch, prev.tail_hidden, prev.tail_logits, sampling)

    def _steady(self, reqs: list[Request]) -> bool:
        """Whether a chain may run ``reqs``: no grammar, no ``min_tokens`` left to reach,
        and a batch every graph holds."""
        if not self.graphs_ready():
            return False
        if any(q.grammar is not None or q.resume_hidden is not None
               or len(q.output_token_ids) < q.params.min_tokens for q in reqs):
            return False
        rn, n = self.engine.runner, len(reqs)
        assert rn.verify_graphs is not None and rn.draft_graphs is not None
        propose = rn.draft_graphs.propose
        return (n <= rn.verify_graphs.sizes[-1] and rn.draft_graphs.observe.fits([self.r] * n)
                and (propose is None or propose.holds(n, self.k)))

    def _room_after_next(self, req: Request) -> bool:
        """Whether the step after the one in flight drafts ``k`` however many that one
        keeps (it emits at most ``r`` tokens)."""
        p, k, r = req.params, self.k, self.r
        return (p.max_tokens - (len(req.output_token_ids) + r) - 1 >= k
                and self.spec.max_model_len - (req.num_tokens + r) - 1 >= k)

    def _chain(self, chunks: list[ScheduledChunk], batch: ForwardBatch,
               tail_hidden: torch.Tensor, tail_logits: torch.Tensor,
               sampling: Sampling | None) -> ChainStep:
        """Queue one step's chain on ``batch`` (its verify rows placed, each sequence's
        pending token in its first row) from the drafter's tails ``[B, H]``, ``[B, N']``."""
        e, k, r = self.engine, self.k, self.r
        rn = e.runner
        reqs = [c.request for c in chunks]
        imposed, imposed_host = None, None
        if self.spec.kept_drafts is not None:
            drawn = [self.spec.kept_drafts(q, k) for q in reqs]
            imposed_host = [-1 if m is None else m for m in drawn]
            imposed = self._imposed(imposed_host)  # [B]
        positions = batch.positions.view(-1, r)  # [B, r]
        drafts, draft_probs = self._propose(tail_hidden, tail_logits, positions[:, 0],
                                            batch.block_tables, sampling)
        batch.input_ids.view(-1, r)[:, 1:].copy_(drafts)
        batch.host = None  # its host form holds placeholder ids and positions now
        rn.save_states([rn.state_pool.slot(q.live_state_handle) for q in reqs])
        out = rn.verify(batch)
        assert out is not None, "a steady step's batch is one the verify graphs hold"
        kept, chosen = self._decide(out.logits, drafts, draft_probs, sampling, imposed)
        bonus = chosen[:, None]  # [B, 1]
        emitted = torch.cat([drafts, bonus], dim=1).scatter_(1, kept[:, None], bonus)
        rn.roll_back_verify(torch.where(kept < k, kept + 1, 0).to(torch.int32))
        tail_hidden, tail_logits = self._observe(batch, out.hidden, emitted, kept)
        result = torch.cat([emitted, kept[:, None]], dim=1)  # [B, r + 1]
        readback = self._readback.start(result.flatten()) if self._readback else None
        tops = [q.params.logprobs for q in reqs if q.params.logprobs is not None]
        logprobs = self._logprobs(out.logits, emitted, max(tops)) if tops else None
        return ChainStep(chunks, chosen, kept, out.hidden, tail_hidden, tail_logits,
                         result, readback, sampling, logprobs, imposed_host)

    def _logprobs(self, logits: torch.Tensor, emitted: torch.Tensor,
                  top: int) -> ChainLogprobs:
        """The log-probabilities of the model's own distribution (before filters) at
        every verify row: the emitted token's and the ``top`` best."""
        logp = torch.log_softmax(logits, dim=-1)  # [B r, V]
        parts = [logp.gather(1, emitted.reshape(-1, 1))]
        if top:
            values, ids = logp.topk(top, dim=-1)
            parts += [ids.float(), values]
        rows = torch.cat(parts, dim=1).view(emitted.shape[0], self.r, -1)  # [B, r, 1 + 2n]
        readback = (self._logprob_readback.start(rows.flatten())
                    if self._logprob_readback is not None else None)
        return ChainLogprobs(rows, top, readback)

    def _decide(self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                sampling: Sampling | None, imposed: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(m, token at row m)``, int64 ``[B]`` each, from the verify rows' logits
        float32 ``[B r, V]``: greedy rows as ``verify_greedy``, sampled rows by
        ``rejection_sample_rows`` (``q`` ``[B, k, V]`` the drafts' distributions),
        imposed counts (``>= 0``) with the target's argmax after them, as
        ``SpeculativeDecoding._verify`` decides."""
        k, r = self.k, self.r
        raw_best = logits.argmax(dim=-1).view(-1, r)  # [B, r]
        rows, scores, best = None, logits, raw_best
        if sampling is not None:
            rows = sampling.verify_rows(drafts)
            if rows.any_penalty or rows.bias is not None:
                scores = adjusted_logits(logits, rows)  # [B r, V]
                best = scores.argmax(dim=-1).view(-1, r)
        kept = (best[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)  # [B]
        chosen = best.gather(1, kept[:, None])[:, 0]
        if rows is not None and not rows.all_greedy:
            assert sampling is not None and q is not None
            s_kept, s_chosen = rejection_sample_rows(logits, scores, drafts, q, rows,
                                                     sampling.index)
            kept = torch.where(sampling.sampled, s_kept, kept)
            chosen = torch.where(sampling.sampled, s_chosen, chosen)
        if imposed is not None:
            forced = imposed >= 0
            kept = torch.where(forced, imposed, kept)
            chosen = torch.where(forced, raw_best.gather(1, kept[:, None])[:, 0], chosen)
        return kept, chosen

    def _propose(self, tail_hidden: torch.Tensor, tail_logits: torch.Tensor,
                 starts: torch.Tensor, block_tables: torch.Tensor, sampling: Sampling | None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts from the tails, int64 ``[B, k]`` (views of the propose graphs'
        buffers, read by this step's launches before the next proposal), and with
        ``sampling`` of a batch with sampled rows, the distributions ``[B, k, V]`` they
        drew from (``None`` when every row is greedy: their drafts are the argmax).
        ``starts`` int64 ``[B]``: each sequence's computed tokens ``c``."""
        rn, k = self.engine.runner, self.k
        assert rn.draft_head is not None and rn.draft_graphs is not None
        q: list[torch.Tensor] = []
        if sampling is not None and sampling.settings.all_greedy:
            sampling = None  # a bias or penalties alone: the verify rows read them, drafts do not
        if k == 1:
            ids = rn.draft_head.token_ids(tail_logits.argmax(dim=-1))  # [B]
            if sampling is not None:
                q.append(self._draw(tail_logits, ids, sampling, 0))
            return ids[:, None], torch.stack(q, dim=1) if q else None
        graphs = rn.draft_graphs.propose
        assert graphs is not None
        n = len(starts)
        rows = starts[:, None] + torch.arange(k - 1, device=starts.device)  # [B, k - 1]
        size = graphs.load_on_device(
            tail_hidden, tail_logits, rows,
            slots_from_tables(block_tables, rows, self.engine.kv.block_size), block_tables)
        ids, logits = graphs.buffers["ids"], graphs.buffers["logits"]  # [k, P], [k, P, N']
        for j in range(k):
            if j:
                graphs.replay(size, j)  # embeds draft j, as drawn
            if sampling is not None:
                q.append(self._draw(logits[j, :n], ids[j, :n], sampling, j))
        return ids[:k, :n].T, torch.stack(q, dim=1) if q else None

    def _draw(self, logits: torch.Tensor, ids: torch.Tensor, sampling: Sampling,
              j: int) -> torch.Tensor:
        """Draft ``j`` of the sampled rows: overwrite ``ids`` int64 ``[B]`` there with a
        draw from each row's filtered distribution over the whole vocabulary (from the
        draft logits float32 ``[B, N']``), with the draft stream's noise at output index
        ``index + j``, as ``MTPDrafter._draw_sampled``; return the distributions
        ``[B, V]``."""
        assert self.engine.runner.draft_head is not None
        full = self.engine.runner.draft_head.full_logits(logits)  # [B, V]
        drawn, probs = draw_drafts(full, sampling.settings, sampling.index + j)
        ids.copy_(torch.where(sampling.sampled, drawn, ids))
        return probs

    def _observe(self, batch: ForwardBatch, hidden: torch.Tensor, emitted: torch.Tensor,
                 kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The observe graph over every verify row of ``batch`` (row ``j`` of a sequence
        fed ``hidden``'s row and ``emitted[:, j]``, the token after it), with the K/V
        writes of rows past ``kept`` masked: the causal attention of a kept row never
        reads a later one. Returns the tails at row ``c + m``: ``[B, H]``, ``[B, N']``."""
        rn, r = self.engine.runner, self.r
        assert rn.draft_graphs is not None
        n = emitted.shape[0]
        row = torch.arange(r, device=emitted.device)
        keep = (row[None, :] <= kept[:, None]).reshape(-1)  # [B r]
        observed = ForwardBatch(
            input_ids=emitted.reshape(-1),
            positions=batch.positions + 1,  # RoPE position i + 1 for K/V row i
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
            block_tables=batch.block_tables,
            slot_mapping=torch.where(keep, batch.slot_mapping, -1),
            state_slots=batch.state_slots,
            logits_indices=torch.arange(n, device=emitted.device) * r + kept,
            num_decode_seqs=0, query_start_loc_cpu=batch.query_start_loc_cpu,
            seq_lens_cpu=batch.seq_lens_cpu)
        return rn.draft_graphs.observe.run(observed, hidden)

    # ---- reading ----------------------------------------------------------------------
    def finish(self, step: ChainStep) -> list[RequestOutput]:
        """Read ``step``'s tokens and apply them; a request finished or aborted since
        its launch gets nothing from it."""
        e, k, r = self.engine, self.k, self.r
        rows = step.host_result()
        chunks, verified = [], {}
        for i, c in enumerate(step.chunks):
            req = c.request
            chunks.append(ScheduledChunk(req, r, req.num_computed_tokens, k))
            if req.status is RequestStatus.RUNNING:
                m = rows[i][r]
                tokens = rows[i][:m + 1]
                n = req.params.logprobs
                logprobs: list[TokenLogprob | None] = [None] * (m + 1)
                if n is not None and not (step.imposed and step.imposed[i] >= 0):
                    assert step.logprobs is not None
                    logprobs = list(step.logprobs.host(i, m + 1, n, tokens))
                verified[i] = Verified(tokens, logprobs)
                self.spec.stats.record(k, m)
        outputs = self.spec._apply(e, chunks, list(range(0, len(chunks) * r + 1, r)),
                                   step.hidden, {}, verified)
        for i, c in enumerate(chunks):
            req = c.request
            if req.status is RequestStatus.RUNNING:
                MTPDrafter.set_tail(req, req.num_computed_tokens, step.tail_hidden[i],
                                    step.tail_logits[i])
        return outputs


def rejection_sample_rows(logits: torch.Tensor, scores: torch.Tensor, drafts: torch.Tensor,
                          q: torch.Tensor, rows: SamplingTensors, index: torch.Tensor,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_sampled`` for a whole batch on the device: ``(m, token at row m)``, int64
    ``[B]`` each.

    Args:
        logits: float32 ``[B r, V]``, each sequence's ``r = k + 1`` verify rows;
            scores: ``adjusted_logits`` of them (the logit bias and penalties applied;
            ``logits`` itself without either).
        drafts: int64 ``[B, k]``; q: float32 ``[B, k, V]`` the distributions they were
            drawn from.
        rows: the settings of the ``B r`` rows (``Sampling.verify_rows``); index: int64
            ``[B]`` the output index of each sequence's first draft.

    Draft ``j`` is kept while ``u_j q_j(t_j) <= p_j(t_j)``; the first rejected one is
    replaced by a draw from ``max(0, p_m - q_m)``; after ``k`` kept comes the plain
    sampler's draw from ``p_k``. The noise is that of output index ``index + j`` in each
    stream, as ``verify_sampled`` draws it."""
    n, k = drafts.shape
    r, device = k + 1, drafts.device
    seed_lo, seed_hi = rows.seed_lo.view(n, r)[:, 0], rows.seed_hi.view(n, r)[:, 0]  # [B]
    p = torch.softmax(filtered_logits(scores, rows), dim=-1).view(n, r, -1)  # [B, r, V]
    p_draft = p[:, :k].gather(2, drafts[..., None])[..., 0]  # [B, k]
    q_draft = q.gather(2, drafts[..., None])[..., 0]
    steps = index[:, None] + torch.arange(k, device=device)  # [B, k]
    u = uniforms_rows(seed_lo.repeat_interleave(k), seed_hi.repeat_interleave(k),
                      steps.reshape(-1), ACCEPT_STREAM).view(n, k)
    kept = (u * q_draft <= p_draft).long().cumprod(dim=1).sum(dim=1)  # [B]
    # After k kept drafts, the plain sampler's own draw.
    bonus = sample(logits, rows, scores=scores).token_ids.view(n, r)[:, k]
    at = kept.clamp(max=k - 1)
    seq = torch.arange(n, device=device)
    p_m, q_m = p[seq, at], q[seq, at]  # [B, V]
    residual = (p_m - q_m).clamp_min(0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_m)
    fix = race_rows(residual, seed_lo, seed_hi, index + at, RESIDUAL_STREAM)
    return kept, torch.where(kept == k, bonus, fix)
