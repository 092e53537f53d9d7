"""Iteration-level scheduling: who runs in the next forward pass, and with how many tokens.

Policy, per step, within ``max_num_batched_tokens``:

1. Running decodes (one pending token each), oldest first: users already streaming never
   stall behind a long prompt.
2. Running prefills, oldest first, chunked. While any sequence decodes in the step, the
   prompts together take at most ``prefill_chunk`` tokens in at most
   ``max_mixed_prompt_chunks`` chunks, so that the decoding users' step stays short; in
   a step with no decode row each prompt takes at most ``idle_prefill_chunk``, which
   may be larger, since nobody waits on that step but the prompts themselves. A burst,
   more prompts able to advance than rows decoding, takes the idle sizes too
   (``bursts_take_idle_sizes``): one long step then delays fewer users' next token than
   it brings first tokens to, where the bound would admit the prompts one step at a time.
3. Waiting requests, first come first served (preempted ones at the front), while a state
   slot, a sequence row and the chunk's blocks are free, within the same prompt-token
   bound. Admission never preempts.

When a running sequence cannot grow, the newest running sequence is preempted: its blocks
and slot are freed and it goes back to the front of the queue, to be re-prefilled from its
prompt plus the tokens it already generated. The oldest request is never the victim while
a newer one runs, so it cannot starve.

With a ``PrefixCache``, an admitted request starts at the longest cached prefix of its
tokens (its K/V blocks shared, its recurrent state restored from a checkpoint), a leaving
request leaves its blocks and state cached (so a preempted one mostly resumes where it
stopped), and prefill chunks end at the prompt's checkpoint positions.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.engine.prefix_cache import PrefixCache
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.kv.state_pool import StatePool


@dataclass(frozen=True)
class StepSizes:
    """A device's default step sizes, in prompt tokens: ``chunk`` per step, all prompts
    together, while any sequence decodes; ``idle_chunk`` per prompt while none does;
    ``budget`` per step."""

    chunk: int
    idle_chunk: int
    budget: int


# On CUDA a lone prompt advances 8192 tokens a step: GEMMs of that many rows run near the
# tensor cores' peak, and the host's per-step work is amortized. Once any sequence
# decodes, a step carries at most 512 prompt tokens, so that a decode step carrying a
# prefill chunk replays the decode and prefill graphs in about 70 ms on the 27B shape
# (docs/kernel-decisions.md, "Prefill step sizes"). The CPU runs small steps: its
# per-token cost does not fall with step size.
STEP_SIZES = {"cuda": StepSizes(chunk=512, idle_chunk=8192, budget=8192),
              "cpu": StepSizes(chunk=512, idle_chunk=512, budget=2048)}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    prefill_chunk: int = 512
    max_model_len: int = 4096
    idle_prefill_chunk: int = 0  # 0: prefill_chunk
    # Prompt chunks (of more than one token) a step with decode rows may carry; None: any.
    max_mixed_prompt_chunks: int | None = None
    # Whether the bound on prompt tokens beside decode rows lifts while prompts outnumber
    # the decode rows (module doc, 2).
    bursts_take_idle_sizes: bool = True

    @classmethod
    def for_device(cls, device_type: str, *, max_num_seqs: int, max_model_len: int,
                   prefill_chunk: int | None = None, idle_prefill_chunk: int | None = None,
                   max_num_batched_tokens: int | None = None,
                   max_mixed_prompt_chunks: int | None = None) -> SchedulerConfig:
        """The device's step sizes (``STEP_SIZES``) wherever the caller gives none. A given
        budget caps the default chunks; a given chunk raises the default idle chunk."""
        sizes = STEP_SIZES["cuda" if device_type == "cuda" else "cpu"]
        budget = max_num_batched_tokens or max(sizes.budget, max_num_seqs)
        chunk = prefill_chunk or min(sizes.chunk, budget)
        idle = idle_prefill_chunk or max(chunk, min(sizes.idle_chunk, budget))
        return cls(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                   prefill_chunk=chunk, max_model_len=max_model_len,
                   idle_prefill_chunk=idle, max_mixed_prompt_chunks=max_mixed_prompt_chunks)

    @property
    def longest_chunk(self) -> int:
        """The most tokens one prefill chunk can hold."""
        return min(self.max_num_batched_tokens, max(self.prefill_chunk,
                                                    self.idle_prefill_chunk))

    def __post_init__(self) -> None:
        if self.idle_prefill_chunk == 0:
            object.__setattr__(self, "idle_prefill_chunk", self.prefill_chunk)
        for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk",
                     "max_model_len", "idle_prefill_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be an integer > 0, "
                                 f"got {value!r}")
        chunks = self.max_mixed_prompt_chunks
        if chunks is not None and (not isinstance(chunks, int) or chunks <= 0):
            raise ValueError(f"max_mixed_prompt_chunks must be None or an integer > 0, "
                             f"got {chunks!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"max-num-seqs ({self.max_num_seqs}) so every running sequence can decode "
                "in each step"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` forwarded this step, from ``start_pos``; the
    last ``num_draft`` of them are draft tokens to verify (speculative decoding). 0 tokens:
    a request admitted with every token cached, which samples from its stored logits."""

    request: Request
    num_tokens: int
    start_pos: int
    num_draft: int = 0

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the request's last known token (so it samples)."""
        return self.start_pos + self.num_tokens - self.num_draft == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decode chunks first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode(self) -> int:
        return sum(1 for c in self.chunks if c.num_tokens == 1)


class Scheduler:
    """Queues of requests over one ``KVCacheManager`` and one ``StatePool``."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, states: StatePool,
                 prefix: PrefixCache | None = None,
                 draft_limit: Callable[[Request], int] | None = None) -> None:
        """``draft_limit(request)``: draft tokens a decoding request may verify in its
        next step (speculative decoding; ``None``: none). Its decode chunk then holds
        ``1 + drafts`` rows, within the step's budget."""
        if kv.max_num_seqs < config.max_num_seqs or states.num_slots < config.max_num_seqs:
            raise ValueError(
                f"max-num-seqs {config.max_num_seqs} exceeds the sequence rows "
                f"({kv.max_num_seqs}) or state slots ({states.num_slots}) allocated"
            )
        self.config = config
        self.kv = kv
        self.states = states
        self.prefix = prefix
        self.draft_limit = draft_limit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # State taps the step being scheduled may still place (prefix_cache.py).
        self._taps_left = 0

    # ---- queue management -------------------------------------------------------------
    @property
    def kv_capacity(self) -> int:
        """Most tokens of K/V one sequence can ever hold: the whole pool, or its table."""
        return min(self.kv.pool.num_blocks * self.kv.block_size, self.kv.max_tokens_per_seq)

    @property
    def token_capacity(self) -> int:
        """Most tokens (prompt + generated) one sequence can ever hold here."""
        return min(self.config.max_model_len, self.kv_capacity)

    def check_fits(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` could never run, whatever else finishes."""
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty; at least one token is required")
        if n >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but max_model_len is "
                f"{self.config.max_model_len}: there is no room to generate; the prompt "
                f"must be shorter than {self.config.max_model_len} tokens"
            )
        need = min(n + request.params.max_tokens, self.config.max_model_len)
        capacity = self.kv_capacity
        if need > capacity:
            raise ValueError(
                f"the request needs up to {need} tokens of K/V (prompt {n} + max_tokens "
                f"{request.params.max_tokens}), but the K/V pool holds at most {capacity} "
                "tokens for one sequence; lower max_tokens or the prompt length"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Stop ``request`` wherever it is and free its blocks and slot at once (a step of
        it may be in flight: its state is not checkpointed)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED_ABORTED

    def finish(self, request: Request, status: RequestStatus, save_state: bool = True) -> None:
        """``request`` is done. ``save_state``: its state slot holds exactly its computed
        tokens (no later step of it is in flight), so it may be checkpointed."""
        self.running.remove(request)
        self._release(request, save_state)
        request.status = status

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decode: list[ScheduledChunk] = []
        prefill: list[ScheduledChunk] = []
        preempted: list[Request] = []
        self._taps_left = self.prefix.num_tap_slots if self.prefix is not None else 0

        chunk_cap = self.config.prefill_chunk
        prompt_budget = budget  # the prompt tokens the step may still take
        chunks_left: int | None = None  # the prompt chunks it may still take (None: any)
        for want_decode in (True, False):
            if not want_decode:
                if decode and not self._prompts_outnumber(len(decode)):
                    prompt_budget = min(budget, self.config.prefill_chunk)
                    chunks_left = self.config.max_mixed_prompt_chunks
                else:
                    chunk_cap = self.config.idle_prefill_chunk
            for req in list(self.running):
                if req not in self.running or (req.num_pending_tokens == 1) != want_decode:
                    continue
                if not want_decode and chunks_left == 0:
                    break
                n = self._chunk_len(req, min(budget, prompt_budget), chunk_cap)
                if n == 0:
                    continue
                drafts = 0
                if want_decode and self.draft_limit is not None:
                    drafts = max(0, min(self.draft_limit(req), budget - n))
                if not self._reserve_or_preempt(req, n + drafts, preempted):
                    continue
                budget -= n + drafts
                if not want_decode:
                    prompt_budget -= n
                    if n > 1 and chunks_left is not None:
                        chunks_left -= 1
                chunk = ScheduledChunk(req, n + drafts, req.num_computed_tokens, drafts)
                (decode if want_decode or n == 1 else prefill).append(chunk)
                self._use_taps(chunk)

        while (self.waiting and min(budget, prompt_budget) > 0 and chunks_left != 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            admitted = self._admit(req, min(budget, prompt_budget), chunk_cap)
            if admitted is None:
                break  # head of the queue waits for memory; FCFS, no overtaking
            self.waiting.popleft()
            self.running.append(req)
            budget -= admitted
            prompt_budget -= admitted
            if admitted > 1 and chunks_left is not None:
                chunks_left -= 1
            chunk = ScheduledChunk(req, admitted, req.num_computed_tokens)
            (decode if admitted == 1 else prefill).append(chunk)
            self._use_taps(chunk)
        # A request scheduled early in the step can be the victim of a later reservation,
        # and can even be re-admitted from the queue's front: keep only chunks that start
        # where their request now stands.
        chunks = [c for c in decode + prefill if c.request.status is RequestStatus.RUNNING
                  and c.start_pos == c.request.num_computed_tokens]
        return SchedulerOutput(chunks, preempted)

    def _prompts_outnumber(self, decode_rows: int) -> bool:
        """Whether more prompts could advance this step than ``decode_rows`` rows decode
        (``bursts_take_idle_sizes``): running prefills and the waiting requests that
        free sequence rows could admit."""
        if not self.config.bursts_take_idle_sizes:
            return False
        prefilling = sum(1 for r in self.running if r.num_pending_tokens > 1)
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        return prefilling + admissible > decode_rows

    def _chunk_len(self, req: Request, budget: int, chunk_cap: int) -> int:
        pending = req.num_pending_tokens
        if pending == 1:
            return min(pending, budget)
        n = min(pending, budget, chunk_cap)
        if self.prefix is not None:
            n = self.prefix.chunk_limit(req, req.num_computed_tokens, n, self._taps_left)
        return n

    def _use_taps(self, chunk: ScheduledChunk) -> None:
        """Count the state taps ``chunk`` takes against the step's spare slots."""
        if self.prefix is not None and not chunk.num_draft:
            self._taps_left -= len(self.prefix.tap_positions(
                chunk.request, chunk.start_pos, chunk.start_pos + chunk.num_tokens))

    def _reserve_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        while not self.kv.reserve(req.live_kv_handle, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def can_admit_next(self) -> bool:
        """Whether the next ``schedule()`` could admit the head of the queue (a sequence
        row, a state slot and its first chunk's blocks are free)."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        # The budget left after every running sequence's decode row.
        budget = self.config.max_num_batched_tokens - len(self.running)
        cap = self.config.prefill_chunk if self.running else self.config.idle_prefill_chunk
        return (self.kv.num_free_seq_rows > 0 and self.states.num_free_slots > 0
                and budget > 0 and self._blocks_free_for(
                    self._chunk_len(self.waiting[0], budget, cap)))

    def _blocks_free_for(self, n: int) -> bool:
        # Keep a small reserve of free blocks for running sequences to grow into, so a new
        # admission is not preempted on the very next step (vLLM keeps a 1% watermark too).
        # A lone request is admitted whenever it fits at all.
        watermark = max(1, self.kv.pool.num_blocks // 100) if self.running else 0
        return self.kv.pool.num_free_blocks >= self.kv.blocks_needed(n) + watermark

    def _admit(self, req: Request, budget: int, chunk_cap: int) -> int | None:
        """Admit ``req`` (from its longest cached prefix) with its first chunk reserved;
        returns that chunk's length (0: every token was cached, the chunk samples from the
        stored logits), or ``None`` and no change when memory is short."""
        hit = None
        req.resume_hidden = None
        # Prompt logprobs need every prompt row's hidden state: such a request is admitted
        # as if nothing were cached.
        if self.prefix is not None and req.params.prompt_logprobs is None:
            match = self.prefix.match(req)
            self.prefix.set_branch(req, match)
            hit = match.hit
        req.num_computed_tokens = hit.num_tokens if hit is not None else 0
        n = self._chunk_len(req, budget, chunk_cap)
        tail_copy = int(hit is not None and hit.tail_block is not None)
        handle = None
        if hit is not None and self.prefix is not None and self._blocks_free_for(n + tail_copy):
            handle = self.prefix.resume(req, hit)
        if handle is None and (hit is not None or not self._blocks_free_for(n)):
            req.num_computed_tokens = 0
            return None
        req.kv_handle = handle or self.kv.create()
        req.state_handle = self.states.acquire()
        if not self.kv.reserve(req.kv_handle, n):
            self._release(req)
            req.num_computed_tokens = 0
            return None
        if self.prefix is not None:
            if hit is not None:
                self.prefix.restore(req, hit, self.states.slot(req.state_handle))
                if req.first_scheduled_time is None:
                    req.num_cached_tokens = min(hit.num_tokens, req.num_prompt_tokens)
            self.prefix.count(req.num_tokens, req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req, save_state=True)  # nothing of it is in flight while scheduling
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request, save_state: bool = False) -> None:
        keep_tail = False
        if req.kv_handle is not None and req.state_handle is not None \
                and self.prefix is not None:
            keep_tail = self.prefix.on_release(req, save_state)
        if req.kv_handle is not None:
            self.kv.free(req.kv_handle, keep_tail=keep_tail)
            req.kv_handle = None
        if req.state_handle is not None:
            self.states.release(req.state_handle)
            req.state_handle = None

    def check_integrity(self) -> None:
        """Pools consistent, and every live sequence belongs to exactly one running request."""
        self.kv.check_invariants()
        self.states.check_invariants()
        if self.prefix is not None:
            self.prefix.check_invariants()
        if self.kv.num_live_seqs != len(self.running):
            raise AssertionError(f"{self.kv.num_live_seqs} live sequences for "
                                 f"{len(self.running)} running requests")
        if self.states.num_used_slots != len(self.running):
            raise AssertionError(f"{self.states.num_used_slots} slots in use for "
                                 f"{len(self.running)} running requests")
        for req in self.running:
            if self.kv.num_tokens(req.live_kv_handle) != req.num_computed_tokens:
                raise AssertionError(f"request {req.request_id}: cache holds "
                                     f"{self.kv.num_tokens(req.live_kv_handle)} tokens, "
                                     f"computed {req.num_computed_tokens}")
        for req in self.waiting:
            if req.kv_handle is not None or req.state_handle is not None:
                raise AssertionError(f"waiting request {req.request_id} holds memory")
