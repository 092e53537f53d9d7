"""Speculative steps: draft, verify ``d + 1`` rows per sequence, keep what the target
would have chosen, roll the rest back.

One step (its tokens are read back before the next is scheduled)::

    schedule        a decoding request that may speculate gets 1 + d rows (d <= k),
                    reserved in the K/V manager like any chunk
    propose         the drafter's d tokens per such request (left on the device when its
                    graphs made them: a pure verify batch copies them in there, and the
                    host reads them, with every verify row's argmax, once the forward
                    pass is queued, so the device does not wait for the host between)
    save states     each speculating sequence's state slot, to its spare
    forward         the whole batch; logits of every verify row and of the last row of
                    each chunk that completes; the Gated DeltaNet layers record their
                    inputs at the verify rows (``GdnRecord``). A pure verify step (below)
                    replays a CUDA graph; any other step runs eagerly
    decide          plain rows: the sampler; verify rows: ``spec_verify`` (m <= d kept)
    observe         the drafter sees the rows kept (the MTP head writes its K/V rows)
    roll back       where m < d: the slot back from its spare, then each Gated DeltaNet
                    layer's conv and delta rule advanced over the m + 1 kept rows' recorded
                    inputs (their attention K/V rows, written by the verify pass, stand);
                    after a verify graph, one replay of a rollback graph (one kernel
                    launch) does it for the whole step; the reservation past the kept
                    rows is dropped, which frees the blocks only rejected rows used
    append          a row committed, then its token appended, one at a time: a stop
                    (EOS, stop id or string, max_tokens, max_model_len) inside the kept
                    run ends it there, with the rows below the stop committed

Rollback by re-advancing: the recurrent GDN state cannot be rewound, and the Gated
DeltaNet ops return only the state after a chunk's last row. A kept row's inputs to each
GDN layer do not depend on the rejected rows after it (every layer is causal), so the
verify pass's own inputs at the kept rows, run through each layer's conv and delta rule
from the saved state, leave the state where a forward pass of the kept rows would: the
projections, attention and MLPs are not run again. Keeping the state after each verified
row (``k + 1`` spare slots written by the GDN kernels) would save even that; it needs
those kernels to write intermediate states.

Prefix caching (``prefix_cache.py``) stays exact under speculation:

* **K/V.** Only committed rows count: a block is named (and so cached) only once every
  row of it is committed, and a committed row is the verify pass's write of a kept token
  (a rejected row's position is written again by the step that commits it). The blocks
  only rejected rows reached are past the committed ones, never named nor shared (a
  sequence's partly filled last block is private: prefix hits copy it), and go back to
  the pool when the reservation is dropped.
* **Checkpoints.** The prompt's checkpoints (its end, each interval, the branch point)
  fall on prefill chunks, which never carry drafts: they are saved right after the
  forward pass with that chunk's last row's logits and hidden state. A finish or
  preemption checkpoints the state at the committed length, which the rollback has left
  exact; the one exception, a stop on a kept draft before the run's last token, leaves
  the state past the committed rows and is not checkpointed. No checkpoint position falls
  inside a verify step's kept run, so none needs the state partway through one.
* **The drafter.** Block names cover the token after each block and a hit always copies
  the block of its last row, and each checkpoint keeps its last token's hidden state: the
  drafter's first rows after a hit at ``p`` start at ``p - 1``, fed that state
  (``_observe``), so its rows are what a cold run writes (``drafter.py``).
* **Zero-token chunks** (every token cached) forward nothing: they sample from the stored
  logits row like a plain completing chunk.

Each verify row is scored as the plain sampler would score that output index had the
drafts before it been generated: its noise index, its penalties' counts
(``SamplingTensors.along_drafts``), its grammar mask (``StructuredOutputs.
bitmask_along``: the matcher walks the drafts and rolls back) and, below ``min_tokens``
outputs, its ban of EOS and stop ids. So the kept tokens are the ones the plain sampler
allows, and the first draft it would not allow is replaced by an allowed token; the
drafts themselves are unconstrained. The drafter may propose from a vocabulary subset
(``draft_vocab_size``, ``engine/draft_vocab.py``): a sampled draft's ``q`` is then 0
outside it, and every verify row still scores the whole vocabulary, so the kept tokens
do not depend on the subset, only how many drafts are kept does.

Steps here are synchronous: the next step's rows start at the committed length, which a
verify step fixes only once its tokens are read back, and the drafter's first draft comes
from the kept rows' hidden states. With async scheduling (``spec_async.py``), steady
verify steps instead run as chains of device work that compute those on the
device, each launched before the previous one is read; every other step runs here.

CUDA graphs: a step whose chunks all verify ``k`` drafts (``k + 1`` rows each, no plain
decode rows, no prompt chunk) and whose batch a captured size holds is a *pure verify*
step: it replays the runner's verify graph (``engine/verify_graphs.py``), which computes
every row's hidden state, logits and recorded Gated DeltaNet inputs. The graph runs the
eager pass's kernels (the delta rule of short chunks walks their rows,
``kernels/gdn_recurrent.py``, in both), on a batch padded to the captured size, so its
tokens are the eager step's up to the rounding that the padded row count changes. Any
other step (a prompt chunk, a request drafting fewer than ``k`` near its end, a request
that does not speculate) runs eagerly. The drafter's passes replay graphs of their own
where one holds them (``engine/draft_graphs.py``): ``propose`` for any batch of up to the
largest decode graph's sequences, ``observe`` where every kept run is ``1 .. k + 1`` rows
ending at its sequence's frontier, as in every pure verify step.

A pure verify step in which some sequence rejected a draft rolls back by one replay of
the rollback graph of the same size (``engine/rollback_graphs.py``): a single kernel
launch (``kernels/gdn_rollback.py``) sets each sequence that rejected one, in every Gated
DeltaNet layer, to its spare advanced over its first ``m + 1`` rows of the verify graph's
record, with the row counts (0 for the others) the only thing the host writes. Eagerly, a
rollback is a restore and a handful of launches per Gated DeltaNet layer, which the host
issues slower than the GPU runs them. Other steps roll back eagerly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.drafter import Draft, Drafter, DraftRequest, Observed, Proposal
from pagedserve.engine.lookahead import InflightStep
from pagedserve.engine.prefix_cache import logits_with_cached_rows
from pagedserve.engine.request import Request, RequestStatus, TokenLogprob
from pagedserve.engine.sampler import (
    SamplingTensors,
    adjusted_logits,
    apply_token_bitmask,
    ban_tokens,
    filtered_logits,
    has_penalty,
    sample,
)
from pagedserve.engine.scheduler import ScheduledChunk
from pagedserve.engine.spec_async import AsyncSpeculation, ChainStep
from pagedserve.engine.spec_verify import Verified, verify_greedy, verify_sampled
from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.kv.handles import Handle
from pagedserve.model.forward_batch import GdnRecord

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine, RequestOutput


@dataclass
class SpecStats:
    """vLLM's speculative-decoding counters: ``num_drafts`` verify rows-sets (one per
    speculating sequence and step), their draft tokens, the drafts kept, and the drafts
    kept at each position 0..k-1."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # Verifies that kept exactly m drafts, by m (0..k): which rollback branch ran.
    num_by_accepted: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_kept: int) -> None:
        """One verify of ``num_draft`` drafts that kept the first ``num_kept``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_kept
        for j in range(num_kept):
            self.accepted_per_pos[j] += 1
        self.num_by_accepted[num_kept] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify (kept drafts + the target's own), 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpeculativeDecoding:
    """The speculative step of one engine, with its drafter and counters."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int) -> None:
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        # Imposed acceptance: ``(request, d) -> m`` keeps the first ``m`` of a request's
        # ``d`` drafts and emits the target's own token after them (``None`` for a
        # request: decided as usual). The warm-up keeps every count in turn
        # (``warmup.py``); benchmarks set an acceptance rate. ``None``: off.
        self.kept_drafts: Callable[[Request, int], int | None] | None = None
        # Async scheduling's chains (``spec_async.py``), set by the engine; ``None``: off.
        self.chain: AsyncSpeculation | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        """Counters from zero (after the warm-up, whose verifies are not the server's)."""
        k = self.config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * k, num_by_accepted=[0] * (k + 1))

    def draft_limit(self, req: Request) -> int:
        """Drafts ``req`` verifies next step: ``k``, fewer near ``max_tokens`` or
        ``max_model_len``."""
        p = req.params
        if not self.drafter.ready(req):
            return 0
        return max(0, min(self.config.num_speculative_tokens,
                          p.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens - 1))

    @torch.inference_mode()
    def step(self, e: LLMEngine) -> list[RequestOutput]:
        """One speculative step. With async scheduling (``chain``, ``spec_async.py``) a
        steady step runs as a chain of device work, and the next one is launched
        before its tokens are read; any other step runs synchronously (``_step``), once
        nothing is in flight."""
        chain = self.chain
        if e._inflight is None:
            plan = e.scheduler.schedule()
            if e.kv.pending_copies:
                e.runner.apply_pending_copies(e.kv)
            if not plan.chunks:
                return []
            chunks = sorted(plan.chunks, key=_batch_order)
            launched = chain.launch(chunks) if chain is not None else None
            if launched is None:
                return self._step(e, chunks)
            e._inflight = launched
        done = e._inflight
        assert chain is not None and isinstance(done, ChainStep)
        e._inflight = chain.launch_after(done)
        return chain.finish(done)

    def _step(self, e: LLMEngine, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """The synchronous step of ``chunks`` (scheduled, in ``_batch_order``)."""
        forwarded = [i for i, c in enumerate(chunks) if c.num_tokens]  # a leading run
        spec = [i for i, c in enumerate(chunks) if c.num_draft]
        slots = [e.runner.state_pool.slot(c.request.live_state_handle) for c in chunks]
        proposal = self.drafter.propose(
            [DraftRequest(chunks[i].request, slots[i], chunks[i].start_pos,
                          chunks[i].num_draft) for i in spec])
        pure = len(spec) == len(chunks)  # every chunk verifies (the graph may hold it)
        # Drafts left on the device go into the batch there (``_forward``), when every
        # chunk is one pending token and as many drafts; the host reads them after.
        on_device = (pure and proposal.device_ids is not None
                     and len(set(proposal.num_drafts)) == 1)
        drafts = None if on_device else dict(zip(spec, proposal.drafts()))
        taps = {i: e._take_taps(chunks[i]) for i in forwarded}
        seq_chunks = self._seq_chunks(e, chunks, forwarded, drafts, taps)
        if spec:
            e.runner.save_states([slots[i] for i in spec])
        hidden, qsl, record, all_logits = self._forward(
            e, seq_chunks, spec, pure, proposal if on_device else None)
        plain = [i for i, c in enumerate(chunks) if c.completes and not c.num_draft]
        saving = [i for i in forwarded if e.prefix is not None and not chunks[i].num_draft
                  and e.prefix.wants_checkpoint(chunks[i].request, chunks[i].start_pos,
                                                chunks[i].start_pos + chunks[i].num_tokens)]
        ends = [i for i in forwarded if i in plain or i in saving]  # rows whose logits count
        rows = [qsl[i + 1] - 1 for i in ends]
        for i in spec:
            rows += range(qsl[i + 1] - 1 - chunks[i].num_draft, qsl[i + 1])
        logits = all_logits  # a pure verify step's graph: every row's, in order
        if logits is None:
            logits = e.runner.compute_logits(hidden[rows]) if rows else None  # [R, V]
        else:
            assert rows == list(range(hidden.shape[0])), rows
        end_logits = {i: logits[k] for k, i in enumerate(ends)} if logits is not None else {}
        for i in forwarded:  # queued after the forward pass that computed these states
            if taps[i]:
                assert e.prefix is not None
                rows = [qsl[i] + p - chunks[i].start_pos - 1 for p, _ in taps[i]]
                e.prefix.save_taps(chunks[i].request, taps[i], list(hidden[rows]))
        for i in saving:
            assert e.prefix is not None
            c = chunks[i]
            e.prefix.save(c.request, c.start_pos + c.num_tokens, end_logits[i],
                          hidden[qsl[i + 1] - 1])
        sampled = self._sample_plain(e, chunks, plain, end_logits)
        best = self._verify_argmax(chunks, spec, logits, len(ends))
        if drafts is None:
            drafts = dict(zip(spec, proposal.drafts()))
            seq_chunks = self._seq_chunks(e, chunks, forwarded, drafts)
        verified: dict[int, Verified] = {}
        offset = len(ends)
        for i in spec:
            d = chunks[i].num_draft
            assert logits is not None
            first = offset - len(ends)
            verified[i] = self._verify(e, chunks[i].request, logits[offset:offset + d + 1],
                                       drafts[i], best[first:first + d + 1] if best else None)
            offset += d + 1
        self._observe(chunks, slots, qsl, hidden, sampled, verified)
        self._roll_back(e, chunks, slots, verified, seq_chunks, spec, record,
                        graphed=all_logits is not None)
        return self._apply(e, chunks, qsl, hidden, sampled, verified)

    @staticmethod
    def _seq_chunks(e: LLMEngine, chunks: list[ScheduledChunk], forwarded: list[int],
                    drafts: dict[int, Draft] | None,
                    taps: dict[int, list[tuple[int, Handle]]] | None = None,
                    ) -> list[SeqChunk]:
        """What the forward pass writes for each forwarded chunk: its tokens, then its
        drafts (``drafts`` ``None``: zeros in their place, the drafts still on the
        device), with its state taps (``taps``, none when not given)."""
        seq_chunks = []
        for i in forwarded:
            c = chunks[i]
            ids = c.request.token_slice(c.start_pos, c.start_pos + c.num_tokens - c.num_draft)
            if c.num_draft:
                ids += drafts[i].token_ids if drafts is not None else [0] * c.num_draft
            seq_chunks.append(e._seq_chunk(c, tuple(ids), taps[i] if taps else None))
        return seq_chunks

    def _forward(self, e: LLMEngine, seq_chunks: list[SeqChunk], spec: list[int],
                 pure: bool, proposal: Proposal | None,
                 ) -> tuple[torch.Tensor, list[int], GdnRecord | None, torch.Tensor | None]:
        """The forward pass of ``seq_chunks``: every row's final hidden state ``[T, H]``,
        the rows' ``query_start_loc``, the verify rows' recorded Gated DeltaNet inputs
        (for ``_roll_back``), and, when a verify graph ran the step (``pure``: every chunk
        verifies), every row's logits ``[T, V]`` (else ``None``). With ``proposal``, every
        chunk is one token and ``d`` drafts, which come from its ``device_ids``. A step of
        only zero-token chunks forwards nothing."""
        if not seq_chunks:
            return torch.empty(0, e.runner.model_config.hidden_size, device=e.runner.device,
                               dtype=e.runner.dtype), [0], None, None
        batch = build_forward_batch(seq_chunks, e.kv, e.runner.device, staging=e._staging)
        qsl = batch.query_start_loc_cpu
        if proposal is not None:
            assert proposal.device_ids is not None
            d = proposal.num_drafts[0]
            assert batch.num_tokens == batch.num_seqs * (d + 1), (batch.num_tokens, d)
            rows = batch.input_ids.view(batch.num_seqs, d + 1)  # [B, 1 + d]
            rows[:, 1:].copy_(proposal.device_ids[:, :d])
            batch.host = None  # its host form holds placeholder ids now
        graphed = e.runner.verify(batch) if pure else None
        if graphed is not None:  # every row is a verify row
            return graphed.hidden, qsl, GdnRecord(None, graphed.gdn_inputs), graphed.logits
        if spec:
            verify_rows = [r for i in spec for r in range(qsl[i], qsl[i + 1])]
            batch.gdn_record = GdnRecord(
                torch.tensor(verify_rows, dtype=torch.long, device=e.runner.device), [])
        return e.runner.forward_hidden(batch), qsl, batch.gdn_record, None

    # ---- deciding ---------------------------------------------------------------------
    def _sample_plain(self, e: LLMEngine, chunks: list[ScheduledChunk], plain: list[int],
                      end_logits: dict[int, torch.Tensor],
                      ) -> dict[int, tuple[int, TokenLogprob | None]]:
        """The sampler's token (and logprob) for each completing chunk without drafts:
        from its last row's logits, or from the stored row of a zero-token chunk."""
        if not plain:
            return {}
        forwarded = [i for i in plain if chunks[i].num_tokens]
        cached = [chunks[i].request for i in plain if not chunks[i].num_tokens]
        logits = torch.stack([end_logits[i] for i in forwarded]) if forwarded else None
        if cached:  # zero-token chunks come last
            logits = logits_with_cached_rows(logits, cached)
        step = InflightStep([chunks[i] for i in plain], list(range(len(plain))), None,
                            logits=logits)
        e._queue_sampling(step, tokens_ahead=0)
        out = step.host_output()
        if out is None:
            return {}
        from pagedserve.engine.llm_engine import _row

        return {i: _row(out, k, chunks[i].request.params.logprobs)
                for k, i in enumerate(plain) if chunks[i].request.status is RequestStatus.RUNNING}

    @staticmethod
    def _verify_argmax(chunks: list[ScheduledChunk], spec: list[int],
                       logits: torch.Tensor | None, first: int) -> list[int] | None:
        """The argmax of every verify row (rows ``first ..`` of ``logits``), read to the
        host in one transfer, when some speculating request is greedy (``_verify`` takes
        its rows' from it where nothing changes its scores); else ``None``."""
        if logits is None or not any(chunks[i].request.params.greedy for i in spec):
            return None
        return logits[first:].argmax(dim=-1).tolist()

    def _verify(self, e: LLMEngine, req: Request, target: torch.Tensor,
                draft: Draft, best: list[int] | None = None) -> Verified:
        """``target`` float32 ``[d + 1, V]``: the verify rows of ``req``; ``best``: their
        argmax, when read already. Under a grammar each row is first masked to what the
        grammar allows after the drafts before it (``StructuredOutputs.bitmask_along``);
        logprobs stay the model's own."""
        d = len(draft.token_ids)
        m = self.kept_drafts(req, d) if self.kept_drafts is not None else None
        if m is not None:  # imposed: the first m drafts, then the target's argmax
            last = best[m] if best is not None else int(target[m].argmax())
            self.stats.record(d, m)
            return Verified([*draft.token_ids[:m], last], [None] * (m + 1))
        bitmask = None
        if req.grammar is not None:
            bitmask = e.structured.bitmask_along(req.grammar, draft.token_ids)
        done, stops = len(req.output_token_ids), [*req.eos_token_ids, *req.params.stop_token_ids]
        bans = [(j, stops) for j in range(d + 1) if done + j < req.params.min_tokens and stops]
        bitmask = ban_tokens(bitmask, bans, d + 1, e.vocab_size, target.device)
        allowed = target if bitmask is None else apply_token_bitmask(target, bitmask)
        # Per-row settings cost host work: built only where a bias, penalties or sampling
        # read them.
        st = None
        if has_penalty(req.params) or req.params.logit_bias or not req.params.greedy:
            st = SamplingTensors.along_drafts(req, draft.token_ids, e.vocab_size,
                                              target.device)
        scores = allowed if st is None else adjusted_logits(allowed, st)
        if req.params.greedy:
            unchanged = scores is target  # no mask, ban, bias or penalty: ``best`` holds
            tokens = verify_greedy(scores, draft.token_ids, best if unchanged else None)
        else:
            assert st is not None
            p = torch.softmax(filtered_logits(scores, st), dim=-1)  # [d + 1, V]
            q = None
            if draft.logits is not None:
                q = torch.softmax(filtered_logits(draft.logits, st.first_rows(d)), dim=-1)
            tokens = verify_sampled(p, q, draft.token_ids, req.sample_seed,
                                    len(req.output_token_ids),
                                    sample(allowed, st, scores=scores).token_ids)
        self.stats.record(d, len(tokens) - 1)
        logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        n = req.params.logprobs
        if n is not None:
            logp = torch.log_softmax(target[:len(tokens)], dim=-1)  # the model's own
            for j, t in enumerate(tokens):
                top: list[tuple[int, float]] = []
                if n > 0:
                    vals, ids = logp[j].topk(n)
                    top = list(zip(ids.tolist(), vals.tolist()))
                logprobs[j] = TokenLogprob(t, float(logp[j, t]), top)
        return Verified(tokens, logprobs)

    # ---- after the forward pass ---------------------------------------------------------
    def _observe(self, chunks: list[ScheduledChunk], slots: list[int], qsl: list[int],
                 hidden: torch.Tensor, sampled: dict, verified: dict[int, Verified]) -> None:
        """Show the drafter every kept row with the token after it. After a prefix hit at
        ``p`` the request's first rows start at ``p - 1``, fed the checkpoint's hidden row
        (``Request.resume_hidden``): the drafter's row ``p - 1`` in the copied tail block
        held another request's next token."""
        kept = []
        for i, c in enumerate(chunks):
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            if i in verified:
                decided = verified[i].tokens
            elif c.completes:
                if i not in sampled:
                    continue
                decided = [sampled[i][0]]
            else:
                decided = []
            num_rows = len(decided) if i in verified else c.num_tokens
            first, end = c.start_pos, c.start_pos + num_rows
            rows = hidden[qsl[i]:qsl[i] + num_rows] if c.num_tokens else hidden[:0]
            if req.resume_hidden is not None:
                first -= 1
                rows = torch.cat([req.resume_hidden[None].to(rows.dtype), rows])
                req.resume_hidden = None
            next_ids = req.token_slice(first + 1, min(end + 1, req.num_tokens)) + decided
            assert len(next_ids) == end - first, (req.request_id, first, end, next_ids)
            if next_ids:
                kept.append(Observed(req, slots[i], first, next_ids, rows, c.completes))
        self.drafter.observe(kept)

    def _roll_back(self, e: LLMEngine, chunks: list[ScheduledChunk], slots: list[int],
                   verified: dict[int, Verified], seq_chunks: list[SeqChunk],
                   spec: list[int], record: GdnRecord | None, graphed: bool) -> None:
        """Slots of sequences that rejected a draft back to their spare, then advanced
        again over their kept rows from the verify step's recorded Gated DeltaNet inputs:
        the state ends at the last kept token. The kept rows' attention K/V, written by
        the verify pass, is already right. After a verify graph (``graphed``) the rollback
        graph of its size does it in one replay of one kernel launch (the other sequences
        count 0 rows: left as they are); otherwise it runs eagerly."""
        redo = [i for i, v in verified.items() if len(v.tokens) - 1 < chunks[i].num_draft]
        if not redo:
            return
        assert record is not None
        if graphed and e.runner.roll_back_verify(
                [len(verified[i].tokens) if i in redo else 0 for i in spec]):
            return
        e.runner.restore_states([slots[i] for i in redo])
        # Where each speculating chunk's rows start among the recorded rows.
        first, offset = {}, 0
        for i in spec:
            first[i] = offset
            offset += chunks[i].num_tokens
        redo.sort(key=lambda i: len(verified[i].tokens) > 1)  # single rows first
        replay = [SeqChunk(seq_chunks[i].kv_handle, slots[i],
                           seq_chunks[i].token_ids[:len(verified[i].tokens)],
                           seq_chunks[i].start_pos) for i in redo]
        rows = [first[i] + j for i in redo for j in range(len(verified[i].tokens))]
        e.runner.advance_linear_states(build_forward_batch(replay, e.kv, e.runner.device),
                                       record.inputs, rows)

    def _apply(self, e: LLMEngine, chunks: list[ScheduledChunk], qsl: list[int],
               hidden: torch.Tensor, sampled: dict,
               verified: dict[int, Verified]) -> list[RequestOutput]:
        """Commit each chunk's kept rows and append its tokens. A verify chunk commits one
        row before each token it appends, so that a stop on a kept draft leaves exactly
        the rows below it committed; its state has moved past them then, so it is not
        checkpointed."""
        now = time.monotonic()
        outputs = []
        for i, c in enumerate(chunks):
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            if i in verified:
                v = verified[i]
                pairs = list(zip(v.tokens, v.logprobs))
                steps = [1] * len(pairs)  # rows committed before each token
            else:
                pairs = [sampled[i]] if i in sampled else []
                steps = [c.num_tokens] * len(pairs) or [c.num_tokens]
            parts = []
            for j, n in enumerate(steps):
                self._commit(e, c, n, hidden, qsl[i] if c.num_tokens else 0)
                if j < len(pairs):
                    exact = j == len(steps) - 1  # the state holds every committed row
                    parts.append(e._append_token(req, *pairs[j], now, state_exact=exact))
                if req.status is not RequestStatus.RUNNING:
                    break
            if req.status is RequestStatus.RUNNING:
                if c.num_draft and not e.is_in_flight(req):  # else its next rows are
                    e.kv.unreserve(req.live_kv_handle)  # reserved past these
                if e.prefix is not None:
                    e.prefix.on_commit(req)
            if parts:
                outputs.append(_merge(parts))
                e.stats.num_generation_tokens += sum(len(p.new_token_ids) for p in parts)
        e.stats.num_steps += 1
        if e.config.check_integrity:
            e.scheduler.check_integrity()
        return outputs

    def _commit(self, e: LLMEngine, c: ScheduledChunk, n: int, hidden: torch.Tensor,
                first_row: int) -> None:
        """``n`` more rows of ``c``'s request written; with prefix caching, the hidden
        state of the last one (``c``'s rows start at row ``first_row`` of ``hidden``) is
        kept for a checkpoint that ends there."""
        req = c.request
        e.kv.commit(req.live_kv_handle, n)
        req.num_computed_tokens += n
        if e.prefix is not None and n:
            row = first_row + req.num_computed_tokens - 1 - c.start_pos
            req.last_hidden = (req.num_computed_tokens, hidden[row].clone())


def _batch_order(c: ScheduledChunk) -> int:
    """Single-row decodes first (the batch's decode rows), then verify chunks, then
    prompts, then zero-token chunks (every token cached: they forward nothing)."""
    if c.num_tokens == 0:
        return 3
    return 0 if c.num_tokens == 1 else 1 if c.num_draft else 2


def _merge(parts: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of a step as one (tokens, text and logprobs in order)."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    return replace(last, new_token_ids=[t for p in parts for t in p.new_token_ids],
                   new_text="".join(p.new_text for p in parts),
                   new_logprobs=[lp for p in parts for lp in p.new_logprobs])
