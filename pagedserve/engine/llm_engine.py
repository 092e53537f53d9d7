"""``LLMEngine``: add requests, abort them, and ``step()`` them forward together.

One step reads as: schedule -> prepare inputs -> forward -> sample -> post-process.
On CUDA, steady decode steps are launched one step ahead of their read-back (async
scheduling, ``lookahead.py``). The engine is single-threaded; ``AsyncEngine`` drives it
from a background thread. A failure in one request's own work ends that request with
``finish_reason: "error"``; any other exception escapes ``step()`` (``failures.py``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve import plan as planning
from pagedserve.engine import compile_watch
from pagedserve.engine.batch_builder import HostStaging, SeqChunk, build_forward_batch
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.draft_vocab import draft_vocab
from pagedserve.engine.drafter import Drafter, MTPDrafter
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.failures import FINISH_ERROR, describe, is_fatal
from pagedserve.engine.lookahead import InflightStep, TokenReadback, lookahead_chunks
from pagedserve.engine.prefix_cache import (
    PrefixCache,
    logits_with_cached_rows,
    num_checkpoints_for,
    tap_slots_for,
)
from pagedserve.engine.prompt_logprobs import record_prompt_logprobs
from pagedserve.engine.request import Request, RequestStatus, SamplingParams, TokenLogprob
from pagedserve.engine.runner import MAX_SPLIT_PREFILL_CHUNKS, ModelRunner, RunnerConfig
from pagedserve.engine.sampler import (
    SamplerOutput,
    SamplingTensors,
    apply_token_bitmask,
    ban_tokens,
    plain_argmax,
    sample,
)
from pagedserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from pagedserve.engine.spec_async import AsyncSpeculation, ChainStep
from pagedserve.engine.spec_step import SpeculativeDecoding
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.engine.warmup import warm_up
from pagedserve.kv.handles import Handle
from pagedserve.kv.memory import GiB
from pagedserve.kv.prefix_hash import salt_of
from pagedserve.model.fp8_linear import describe_weights
from pagedserve.model.loader import LoadedModel, load_model, read_model_config
from pagedserve.parallel.start import start_tensor_parallel, tensor_parallel_model

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    request: Request | None = None  # the live request (read-only for callers)
    error: str | None = None  # why the request failed (finish_reason "error")


@dataclass
class EngineStats:
    num_prompt_tokens: int = 0  # forwarded prompt tokens (recomputed ones count again)
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_lookahead_steps: int = 0  # steps launched before the previous one was read back


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 drafter: Drafter | None = None) -> None:
        """``drafter`` replaces the MTP head as the speculative drafter (tests)."""
        self.config = config
        started = time.perf_counter()
        compile_watch.disarm()  # loading and graph capture compile; the warm-up arms it
        spec = config.speculative()
        mtp = spec is not None and drafter is None
        tp_size = config.tensor_parallel_size
        if spec is not None and spec.draft_vocab_size is not None:
            # Its range is the model's vocabulary: checked before any weight loads.
            spec.check_draft_vocab(loaded.config.vocab_size if loaded is not None
                                   else read_model_config(config.model)[2].vocab_size)
        if tp_size > 1:
            if loaded is not None:
                raise ValueError("a tensor-parallel engine loads its own weight shards on "
                                 "each rank; pass no LoadedModel")
            cfg, dtype = tensor_parallel_model(config)  # checked; no weight read yet
        else:
            self.loaded = loaded or load_model(config.model, config.device, config.dtype,
                                               progress=config.progress,
                                               quantization=config.quantization, mtp=mtp)
            if mtp and self.loaded.model.mtp is None:
                raise ValueError("speculative method 'mtp' needs the model loaded with its "
                                 "MTP head (load_model(..., mtp=True))")
            cfg = self.loaded.config
            dtype = next(self.loaded.model.parameters()).dtype
        # Seconds per start-up phase (``warm_up`` adds its own).
        self.startup_seconds = {"weights": time.perf_counter() - started}
        max_len = config.max_model_len or min(4096, cfg.max_position_embeddings)
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max-model-len {max_len} exceeds the model's "
                             f"max_position_embeddings ({cfg.max_position_embeddings})")
        self.max_model_len = max_len
        device_type = torch.device(config.device).type
        sched_config = SchedulerConfig.for_device(
            device_type, max_num_seqs=config.max_num_seqs, max_model_len=max_len,
            prefill_chunk=config.prefill_chunk, idle_prefill_chunk=config.idle_prefill_chunk,
            max_num_batched_tokens=config.max_num_batched_tokens,
            # Beside decode rows, as many prompt chunks as one step replays in graphs.
            max_mixed_prompt_chunks=MAX_SPLIT_PREFILL_CHUNKS)
        budget = sched_config.max_num_batched_tokens
        # With speculation a checkpoint keeps its last token's hidden state for the drafter.
        bytes_per_checkpoint = planning.bytes_per_checkpoint(cfg, dtype, spec is not None)
        num_checkpoints = num_checkpoints_for(
            config.checkpoint_memory_bytes(), bytes_per_checkpoint, config.max_num_seqs)
        caching = config.prefix_caching and config.kv_layout == "paged" and num_checkpoints > 0
        if config.prefix_caching and not caching:
            log.info("prefix caching is off: %s", "no state checkpoint fits its memory budget"
                     if config.kv_layout == "paged"
                     else f"the {config.kv_layout} K/V layout has no shareable blocks")
        num_checkpoints = num_checkpoints if caching else 0
        tap_slots = tap_slots_for(sched_config.longest_chunk,
                                  config.prefix_checkpoint_interval) if caching else 0
        runner_config = RunnerConfig(
            max_model_len=max_len, max_num_seqs=config.max_num_seqs,
            num_blocks=config.num_blocks, gpu_memory_utilization=config.gpu_memory_utilization,
            cuda_graphs=config.cuda_graphs, prefill_graph_tokens=sched_config.prefill_chunk,
            num_checkpoints=num_checkpoints, state_tap_slots=tap_slots,
            state_snapshots=spec is not None,
            checkpoint_hidden=spec is not None,
            verify_rows=spec.num_speculative_tokens + 1 if spec is not None else 0,
            verify_graph_tokens=budget)
        self.runner: ModelRunner
        if tp_size > 1:
            self.loaded, self.runner = start_tensor_parallel(config, runner_config,
                                                             self.startup_seconds)
        else:
            subset = None
            if mtp and spec is not None:
                subset = draft_vocab(spec.draft_vocab_size, cfg.vocab_size,
                                     self.loaded.tokenizer, self.loaded.generation.eos_token_ids)
            self.runner = ModelRunner(self.loaded.model, config.cache_config(), runner_config,
                                      draft_vocab=subset)
        self.startup_seconds["kv_cache_and_graphs"] = (
            time.perf_counter() - started - sum(self.startup_seconds.values()))
        log.info("weights loaded in %.1f s; K/V cache, compiles and CUDA graphs in %.1f s",
                 *self.startup_seconds.values())
        log.info("weights: %s", describe_weights(self.loaded.model))
        self.kv = self.runner.create_kv_manager()
        self.prefix: PrefixCache | None = None
        if caching:
            salt = salt_of(cfg, str(dtype), config.cache_type_k, config.cache_type_v,
                           config.block_size)
            self.prefix = PrefixCache(self.kv, self.runner.state_pool,
                                      self.runner.checkpoint_pool, salt,
                                      config.prefix_checkpoint_interval,
                                      speculative=spec is not None, num_tap_slots=tap_slots,
                                      graphed_chunk_tokens=self.runner.graphed_prefill_tokens)
            log.info("prefix caching on: %d state checkpoints of %.1f MiB (state, a logits "
                     "row and, with speculation, a hidden row; %.2f GiB), one "
                     "every %d prompt tokens and at each prompt's and request's end",
                     num_checkpoints, bytes_per_checkpoint / 2**20,
                     num_checkpoints * bytes_per_checkpoint / GiB,
                     config.prefix_checkpoint_interval)
        self.spec: SpeculativeDecoding | None = None
        if spec is not None:
            self.spec = SpeculativeDecoding(
                spec, drafter or MTPDrafter(self.runner, self.kv), max_len)
            graphs = self.runner.verify_graphs
            how = {True: "replay CUDA graphs", False: "run eagerly"}
            log.info("speculative decoding: %s, %d tokens per step (verify steps of up to %d "
                     "sequences verifying every draft replay CUDA graphs, other verify steps "
                     "run eagerly; their rollbacks %s; the MTP head's passes %s)", spec.method,
                     spec.num_speculative_tokens, graphs.sizes[-1] if graphs else 0,
                     how[self.runner.rollback_graphs is not None],
                     how[self.runner.draft_graphs is not None])
            head = self.runner.draft_head
            if head is not None and head.ids is not None:
                log.info("draft vocabulary: %d of %d token ids (draft_vocab_size %d, plus the "
                         "tokenizer's special and EOS ids), their LM-head rows %.1f MiB",
                         head.num_rows, cfg.vocab_size, spec.draft_vocab_size,
                         head.nbytes / 2**20)
            elif head is not None:
                log.info("draft vocabulary: all %d token ids", cfg.vocab_size)
        self.scheduler = Scheduler(sched_config, self.kv, self.runner.state_pool, self.prefix,
                                   self.spec.draft_limit if self.spec is not None else None)
        cuda = self.runner.device.type == "cuda"
        # Pinned buffers for each step's host->device copies (CUDA only; see HostStaging).
        self._staging = HostStaging(self.runner.device, budget, config.max_num_seqs,
                                    self.runner.max_blocks_per_seq) if cuda else None
        # Async scheduling (lookahead.py): on CUDA by default; on the CPU every op is
        # synchronous, so it would only cost the extra row after a late stop. Off under
        # tensor parallelism: workers build each step from its host form, which a
        # lookahead step's ids (still on rank 0's device) are not in. With speculation
        # (spec_async.py) it launches verify steps ahead only through their CUDA graphs,
        # so by default only where those are captured.
        default = cuda and tp_size == 1 and (spec is None or config.cuda_graphs)
        self.async_scheduling = default if config.async_scheduling is None \
            else config.async_scheduling
        self._inflight: InflightStep | ChainStep | None = None
        self.last_launch = ""  # what the last launched forward pass held (debug logs)
        self._readback = TokenReadback(config.max_num_seqs) if cuda else None
        if self.spec is not None and self.async_scheduling:
            self.spec.chain = AsyncSpeculation(self)
            if self.spec.chain.graphs_ready():
                log.info("async scheduling with speculative decoding: steady verify steps "
                         "run on the device and launch before the previous step's tokens "
                         "are read; other steps run synchronously")
            else:
                log.warning("async scheduling with speculative decoding launches steps "
                            "ahead only through the verify, rollback and draft CUDA "
                            "graphs, which this runner lacks: every speculative step "
                            "runs synchronously")
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = cfg.vocab_size
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._seed_rng = random.Random(config.seed)
        self.stats = EngineStats()
        self._structured: StructuredOutputs | None = None
        self._structured_lock = threading.Lock()
        self._failed: list[RequestOutput] = []  # failed outside post-processing
        if cuda if config.warm_up is None else config.warm_up:
            self.warm_up()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (a single-device engine holds nothing
        that outlives it)."""
        self.runner.close()

    @property
    def structured(self) -> StructuredOutputs:
        """The grammar compiler and its cache, made on first use (any thread)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputs(
                    self.tokenizer, self.vocab_size,
                    list(self.loaded.generation.eos_token_ids), self.config.max_num_seqs,
                    self.runner.device)
            return self._structured

    # ---- requests ---------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
    ) -> Request:
        """Tokenize and validate without touching the queues (safe from any thread).

        Raises ``ValueError`` naming the problem for a request that can never run.
        """
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = self.loaded.require_tokenizer().encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if params.prompt_logprobs is not None and (self.spec is not None
                                                   or self.config.tensor_parallel_size > 1):
            raise ValueError("prompt_logprobs is not supported with speculative decoding or "
                             "tensor parallelism")
        eos = () if params.ignore_eos else self.loaded.generation.eos_token_ids
        req = Request(request_id, ids, params, eos_token_ids=eos)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        self.scheduler.check_fits(req)
        if params.structured is not None:
            req.grammar = self.structured.new_grammar(params.structured)
        return req

    def enqueue(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.sample_seed = (req.params.seed if req.params.seed is not None
                           else self._seed_rng.getrandbits(63))
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.stop,
                include_stop=req.params.include_stop_str_in_output)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
    ) -> Request:
        req = self.make_request(request_id, prompt, params)
        self.enqueue(req)
        return req

    def warm_up(self) -> float:
        """Run one of each kind of step (``warmup.py``) so that no request waits for a
        compile; returns and logs the seconds it took. Call it on an idle engine."""
        compile_watch.disarm()
        seconds = warm_up(self)
        compile_watch.arm()
        self.startup_seconds["warm_up"] = seconds
        self.stats = EngineStats()
        if self.spec is not None:
            self.spec.reset_stats()
        self.reset_prefix_cache()
        log.info("warm-up (every kind of step compiled and tuned) in %.1f s", seconds)
        return seconds

    def abort_request(self, request_id: str) -> bool:
        """Abort and free at once; False if the id is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        self._detok.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        req.finished_time = time.monotonic()
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks and checkpoints) no request holds."""
        if self.prefix is not None:
            self.prefix.reset()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one forward pass to its sampled tokens and return what it produced.

        With async scheduling (``lookahead``) the next steady decode step is launched
        before this one is read back, so a forward pass may still be in flight on return;
        ``has_unfinished_requests`` counts it.
        """
        if self.spec is not None:
            self.last_launch = "a speculative step"
            outputs = self.spec.step(self)
            return self._take_failed() + outputs
        if self._inflight is None:
            self._inflight = self._launch_scheduled()
            if self._inflight is None:
                return self._take_failed()
        done = self._inflight
        assert isinstance(done, InflightStep)
        ahead = self._launch_lookahead(done) if self.async_scheduling else None
        self._inflight = ahead
        outputs = self._post_process(done)
        if ahead is not None and ahead.logits is not None:
            # Its grammars have seen ``done``'s tokens now: its sampling can be queued.
            self._queue_sampling(ahead, tokens_ahead=0)
        return self._take_failed() + outputs

    def _take_failed(self) -> list[RequestOutput]:
        failed, self._failed = self._failed, []
        return failed

    def fail_request(self, req: Request, exc: BaseException) -> RequestOutput:
        """End ``req`` because its own work raised ``exc``: free its blocks and slot, and
        report ``finish_reason: "error"``. Re-raises a fatal ``exc`` (``failures.py``)."""
        if is_fatal(exc):
            raise exc
        log.error("request %s failed; the others continue", req.request_id, exc_info=exc)
        self.abort_request(req.request_id)
        return RequestOutput(req.request_id, [], "", True, FINISH_ERROR,
                             num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=len(req.output_token_ids), request=req,
                             error=describe(exc))

    def _launch_scheduled(self) -> InflightStep | None:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            if self.kv.pending_copies:  # of admissions preempted within the step
                self.runner.apply_pending_copies(self.kv)
            return None
        # Zero-token chunks (every token cached) go last: their logits rows are stored ones,
        # after the forward pass's.
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens == 0)
        sampling = [i for i, c in enumerate(chunks) if c.completes]
        forwarded = [c for c in chunks if c.num_tokens]
        taps = [self._take_taps(c) for c in forwarded]
        return self._launch(chunks, sampling,
                            [self._seq_chunk(c, taps=t) for c, t in zip(forwarded, taps)],
                            taps=taps)

    def _launch_lookahead(self, previous: InflightStep) -> InflightStep | None:
        chunks = lookahead_chunks(previous, self.scheduler, self.kv, self.max_model_len)
        if chunks is None or previous.sampled is None:
            return None
        # The token ids are the previous step's samples, still on the device: the host
        # batch gets a placeholder, and ``_launch`` swaps in the device tensor.
        seq_chunks = [self._seq_chunk(c, ids=(0,)) for c in chunks]
        self.stats.num_lookahead_steps += 1
        # A grammar's mask needs the previous token: such a step's sampling waits for
        # ``previous`` to be read back (``step``), its forward pass does not.
        defer = any(c.request.grammar is not None for c in chunks)
        return self._launch(chunks, list(range(len(chunks))), seq_chunks,
                            input_ids=previous.sampled.token_ids, defer_sampling=defer)

    def _launch(self, chunks: list[ScheduledChunk], sampling: list[int],
                seq_chunks: list[SeqChunk], input_ids: torch.Tensor | None = None,
                defer_sampling: bool = False,
                taps: list[list[tuple[int, Handle]]] | None = None) -> InflightStep:
        """Queue one forward pass of ``seq_chunks`` (the first chunks; any others forward
        no token) and (unless deferred) its sampling on the device; nothing waits for it.
        ``taps``: each forwarded chunk's state taps (``_take_taps``), checkpointed after
        the pass."""
        if self.kv.pending_copies:
            self.runner.apply_pending_copies(self.kv)
        logits = None
        if seq_chunks:
            batch = build_forward_batch(seq_chunks, self.kv, self.runner.device,
                                        staging=self._staging)
            if log.isEnabledFor(logging.DEBUG):
                rows = [c.num_tokens for c in chunks[:len(seq_chunks)]]
                self.last_launch = (f"{rows.count(1)} decode rows, prompt chunks "
                                    f"{[n for n in rows if n > 1]}")
            if input_ids is not None:
                batch.input_ids = input_ids  # [B] int64, already on the device
                batch.host = None  # its host form holds placeholder ids now
            forwarded = chunks[:len(seq_chunks)]
            if any(c.request.params.prompt_logprobs is not None for c in forwarded):
                hidden = self.runner.forward_hidden(batch)  # [T, H], eagerly
                logits = self.runner.compute_logits(hidden[batch.logits_indices])
                record_prompt_logprobs(self.runner, forwarded, batch, hidden)
            else:
                logits = self.runner.execute(batch)
        if self.prefix is not None and logits is not None:  # queued after the forward pass:
            for i, c in enumerate(chunks[:len(seq_chunks)]):  # its states and logits rows
                end = c.start_pos + c.num_tokens
                if taps is not None:
                    self.prefix.save_taps(c.request, taps[i])
                if self.prefix.wants_checkpoint(c.request, c.start_pos, end):
                    self.prefix.save(c.request, end, logits[i])
        if len(seq_chunks) < len(chunks):
            logits = logits_with_cached_rows(
                logits, [c.request for c in chunks[len(seq_chunks):]])
        step = InflightStep(chunks, sampling, None, logits=logits)
        if not defer_sampling:
            self._queue_sampling(step, tokens_ahead=int(input_ids is not None))
        return step

    def _queue_sampling(self, step: InflightStep, tokens_ahead: int) -> None:
        """Queue the sampling of ``step``, whose forward pass is queued already."""
        logits, step.logits = step.logits, None  # [B, V] float32
        assert logits is not None
        reqs = [step.chunks[i].request for i in step.sampling]
        try:
            sampled = self._sample(logits, reqs, step.sampling, tokens_ahead)
        except Exception as exc:  # noqa: BLE001 - fatal unless one request's work raised
            stand_ins = self._isolate_sampling_failure(reqs, exc)
            sampled = self._sample(logits, stand_ins, step.sampling, tokens_ahead)
        step.sampled = sampled
        if (sampled is not None and self._readback is not None
                and sampled.sampled_logprob is None):
            step.readback = self._readback.start(sampled.token_ids)

    def _isolate_sampling_failure(self, reqs: list[Request],
                                  exc: Exception) -> list[Request]:
        """After the sampling of ``reqs`` raised ``exc``: fail each request whose own host
        work (its settings row, its grammar's mask) raises alone, and return ``reqs`` with
        a greedy stand-in for each failed one (its row is dropped at read-back, as an
        aborted request's is). Re-raises ``exc`` when it is fatal or no single request
        reproduces it."""
        if is_fatal(exc):
            raise exc
        culprits = {}
        for r in reqs:
            try:
                SamplingTensors.from_requests([r], self.vocab_size, "cpu")
                if r.grammar is not None and r.status is RequestStatus.RUNNING:
                    self.structured.fill_bitmask([r.grammar])
            except Exception as own:  # noqa: BLE001 - this request's own failure
                culprits[r.request_id] = own
        if not culprits:
            raise exc
        stand_ins = []
        for r in reqs:
            if r.request_id in culprits:
                self._failed.append(self.fail_request(r, culprits[r.request_id]))
                r = Request(r.request_id, [0], SamplingParams(temperature=0.0))
            stand_ins.append(r)
        return stand_ins

    def _seq_chunk(self, c: ScheduledChunk, ids: tuple[int, ...] | None = None,
                   taps: list[tuple[int, Handle]] | None = None) -> SeqChunk:
        """``c`` as the batch builder takes it; ``ids`` default to the request's tokens;
        ``taps``: its state taps' positions and slots."""
        req = c.request
        if ids is None:
            ids = tuple(req.token_slice(c.start_pos, c.start_pos + c.num_tokens))
        pool = self.runner.state_pool
        slot = pool.slot(req.live_state_handle)
        return SeqChunk(req.live_kv_handle, slot, ids, c.start_pos,
                        tuple((p - c.start_pos, pool.slot(h)) for p, h in taps or ()))

    def _take_taps(self, c: ScheduledChunk) -> list[tuple[int, Handle]]:
        """Spare state slots for the checkpoints inside prefill chunk ``c`` (none without
        prefix caching, and none in a chunk with drafts)."""
        if self.prefix is None or c.num_draft:
            return []
        return self.prefix.take_taps(c.request, c.start_pos, c.start_pos + c.num_tokens)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], rows: list[int],
                tokens_ahead: int) -> SamplerOutput | None:
        if not reqs:
            return None
        if len(rows) != logits.shape[0]:  # some rows end a prefill chunk mid-prompt
            index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
            logits = logits.index_select(0, index)
        # Filled on the host while the device still runs the forward pass. A request that
        # finished since the launch (its row is dropped) takes no mask.
        grammars = [r.grammar if r.status is RequestStatus.RUNNING else None for r in reqs]
        bitmask = self.structured.fill_bitmask(grammars) \
            if any(g is not None for g in grammars) else None
        bitmask = ban_tokens(bitmask, _min_tokens_bans(reqs, tokens_ahead), len(reqs),
                             self.vocab_size, logits.device)
        if plain_argmax(reqs):
            if bitmask is not None:
                logits = apply_token_bitmask(logits, bitmask)
            return SamplerOutput(token_ids=logits.argmax(dim=-1))
        return sample(logits, SamplingTensors.from_requests(
            reqs, self.vocab_size, logits.device, tokens_ahead=tokens_ahead), bitmask)

    def _post_process(self, step: InflightStep) -> list[RequestOutput]:
        """Read ``step``'s tokens back (the one device -> host wait) and apply them.

        A request that finished or was aborted after ``step`` was launched (async
        scheduling) gets nothing from it: its blocks and slot are already free.
        """
        sampled = step.host_output()
        now = time.monotonic()
        live = [c.request.status is RequestStatus.RUNNING for c in step.chunks]
        for c, running in zip(step.chunks, live):
            if running:
                self.kv.commit(c.request.live_kv_handle, c.num_tokens)
                c.request.num_computed_tokens += c.num_tokens
                if self.prefix is not None:
                    self.prefix.on_commit(c.request)
        outputs = []
        for k, i in enumerate(step.sampling):
            if live[i] and sampled is not None:
                req = step.chunks[i].request
                token, logprob = _row(sampled, k, req.params.logprobs)
                outputs.append(self._append_token(req, token, logprob, now))
        self.stats.num_generation_tokens += len(outputs)
        self.stats.num_steps += 1
        if self.config.check_integrity:
            self.scheduler.check_integrity()
        return outputs

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None,
                      now: float, state_exact: bool = True) -> RequestOutput:
        """Append ``token`` to ``req``, check its stops, and finish it on one.
        ``state_exact``: its state slot holds exactly its computed tokens (a speculative
        step's stop on a kept draft leaves it past them), so a finish may checkpoint it."""
        req.output_token_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats.num_prompt_tokens += req.num_prompt_tokens
        req.last_token_time = now
        detok = self._detok.get(req.request_id)
        text = ""
        try:  # this request's own work: a failure here fails only this request
            status = self._stop_status(req, token)
            if detok is not None:
                text = detok.take_new_text(status is not None)
                req.output_text = detok.text
        except Exception as exc:  # noqa: BLE001 - fail_request re-raises a fatal one
            return self.fail_request(req, exc)
        if status is not None:
            # A step launched ahead has moved its state past its computed tokens.
            self.scheduler.finish(req, status,
                                  save_state=state_exact and not self.is_in_flight(req))
            req.finished_time = now
        if req.is_finished:
            self.requests.pop(req.request_id, None)
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            req.request_id, [token], text, req.is_finished, req.finish_reason,
            [logprob] if logprob is not None else [], req.num_prompt_tokens,
            len(req.output_token_ids), req)

    def is_in_flight(self, req: Request) -> bool:
        """Whether a step launched ahead (async scheduling) holds ``req``."""
        return self._inflight is not None and id(req) in self._inflight.request_ids

    def _stop_status(self, req: Request, token: int) -> RequestStatus | None:
        """Stop ids and EOS end a request (their text is not emitted); then a grammar that
        has terminated; then stop strings; then length: ``max_tokens`` or ``max_model_len``.
        Before ``min_tokens`` outputs, only length ends it (the sampler bans EOS and stop
        ids meanwhile)."""
        may_stop = len(req.output_token_ids) >= req.params.min_tokens
        if may_stop and (token in req.params.stop_token_ids or token in req.eos_token_ids):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and self._grammar_ends(req, token):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        detok = self._detok.get(req.request_id)
        if detok is not None and detok.append(token, check_stop=may_stop):
            req.stop_reason = detok.stopped_on
            return RequestStatus.FINISHED_STOPPED
        if (len(req.output_token_ids) >= req.params.max_tokens
                or req.num_tokens >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _grammar_ends(self, req: Request, token: int) -> bool:
        """Advance ``req``'s grammar by ``token``; True when nothing may follow."""
        assert req.grammar is not None
        if not req.grammar.accept(token):
            # The mask allowed only what the grammar accepts, so this is a bug; end the
            # request rather than generate past its grammar.
            log.error("request %s: token %d is outside its grammar; stopping it",
                      req.request_id, token)
            return True
        return req.grammar.terminated

    # ---- introspection ----------------------------------------------------------------
    def kv_cache_usage(self) -> float:
        """Fraction of K/V blocks owned by requests, in [0, 1] (cached ones count free)."""
        return self.kv.pool.utilization

    def prefix_cache_counts(self) -> dict[str, int]:
        """Prefix-cache counters and checkpoint-pool use (zeros with caching off)."""
        if self.prefix is None:
            return {}
        ckpt = self.prefix.checkpoints
        return {"prefix_cache_queries": self.prefix.stats.num_queries,
                "prefix_cache_hits": self.prefix.stats.num_hits,
                "num_prefix_checkpoints": ckpt.num_used,
                "prefix_checkpoint_capacity": ckpt.num_checkpoints}

    def spec_decode_counts(self) -> dict[str, Any]:
        """Speculative-decoding counters under vLLM's names (empty without speculation)."""
        if self.spec is None:
            return {}
        s = self.spec.stats
        return {"spec_decode_num_drafts": s.num_drafts,
                "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": tuple(s.accepted_per_pos)}

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)


def _min_tokens_bans(reqs: list[Request], tokens_ahead: int) -> list[tuple[int, list[int]]]:
    """(row, token ids) that row may not sample yet: EOS and stop ids before its
    ``min_tokens``-th output token."""
    bans = []
    for i, r in enumerate(reqs):
        if len(r.output_token_ids) + tokens_ahead < r.params.min_tokens:
            ids = [*r.eos_token_ids, *r.params.stop_token_ids]
            if ids:
                bans.append((i, ids))
    return bans


def _row(sampled: dict, k: int, num_logprobs: int | None) -> tuple[int, TokenLogprob | None]:
    token = sampled["token_ids"][k]
    if num_logprobs is None:
        return token, None
    top = []
    if num_logprobs > 0:
        top = list(zip(sampled["top_ids"][k][:num_logprobs],
                       sampled["top_logprobs"][k][:num_logprobs]))
    return token, TokenLogprob(token, sampled["sampled_logprob"][k], top)
