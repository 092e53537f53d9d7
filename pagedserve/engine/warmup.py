"""Warm-up: one of each kind of step the scheduler can produce, before the first request.

Triton compiles a kernel at its first launch of each specialization, and fla-core and the
compiled elementwise ops tune and compile at their first call of each shape class; on the
27B shape that took most of a minute, inside the first request's time to first token. The
kernels that vary by step mark their step-dependent integers ``do_not_specialize``, so one
launch of each kind covers all of them. The kinds:

* a prompt of two full idle-step chunks and a short tail: a chunk from position 0, a chunk over a
  cached prefix (the dequantized method for long quantized chunks), a short chunk over a long
  prefix (the kernel's split key range), then decode (graph replays);
* where ``max_model_len`` is shorter than the token budget, as many longest prompts as
  fill one step together (kernels whose tuning is keyed by a step's total rows, such as
  fla's L2 norm, see the largest step);
* three prompts of different lengths together: several prefill sequences in one step
  (fla's varlen path), and steps that mix decode rows with a prefill chunk;
* one-token and short prompts (the prefill graphs, when captured);
* with speculation, requests that verify every draft (the verify graphs' replays, which
  the runner captured, with their tokens decided greedily and by sampling) beside one
  whose prompt arrives meanwhile and ones that near their end (eager verify steps),
  then one replay of every draft graph the runner captured (``DraftGraphs.replay_all``,
  over padding: a graph's first launch uploads it) and of each rollback graph once no
  request is live (it keeps no rows, so it writes only a free slot:
  ``RollbackGraphs.replay_idle``). A warm-up drafter rarely guesses right (the MTP head
  of random or unrelated prompts), yet a rollback's shapes are its kept-row counts: the
  greedy requests keep ``0, 1, .., d`` drafts in turn (``_keeping_in_turn``), so that
  every count reaches the rollback's graph, its eager ops and the compiled ones among
  them. Their tokens are the warm-up's own and are discarded.

Where long chunks take cuDNN's fused attention (``ops.LONG_CHUNK_METHOD``), they need a
cuDNN plan per power-of-two bucket of their lengths; every bucket the engine's chunks and
``max_model_len`` allow is built first (``ops.build_long_chunk_plans``), on zero tensors.

Every warm-up request runs to its end, so the pools are empty again afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedserve.engine.request import SamplingParams
from pagedserve.kernels import ops

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.request import Request
    from pagedserve.engine.spec_step import SpeculativeDecoding

WARMUP_PREFIX = "__warmup"


@contextlib.contextmanager
def _keeping_in_turn(spec: SpeculativeDecoding) -> Iterator[None]:
    """Within: a greedy request's verify keeps ``0, 1, .., d`` of its ``d`` drafts in
    turn, then the target's own token at the first one not kept (what a drafter that
    guessed that many would give); sampled requests are decided as always."""
    previous = spec.kept_drafts
    turn = itertools.count()

    def in_turn(req: Request, d: int) -> int | None:
        return next(turn) % (d + 1) if req.params.greedy else None

    spec.kept_drafts = in_turn
    try:
        yield
    finally:
        spec.kept_drafts = previous


def build_long_chunk_plans(engine: LLMEngine) -> int:
    """The cuDNN plans of every long chunk ``engine`` can schedule, where long chunks take
    cuDNN (``ops.build_long_chunk_plans``); returns the calls made."""
    r, sched = engine.runner, engine.scheduler.config
    return ops.build_long_chunk_plans(
        r.num_heads, r.num_kv_heads, r.model_config.head_dim, r.dtype, r.device,
        max(sched.prefill_chunk, sched.idle_prefill_chunk), engine.max_model_len)


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to their end; return the seconds it took."""
    start = time.perf_counter()
    rng = random.Random(0)
    chunk = engine.scheduler.config.prefill_chunk
    idle_chunk = engine.scheduler.config.idle_prefill_chunk
    longest = engine.scheduler.token_capacity - 8

    def prompt(n: int) -> list[int]:
        return [rng.randrange(engine.vocab_size) for _ in range(max(1, min(n, longest)))]

    def run(lengths: list[int], stagger: bool, max_tokens: int = 4,
            greedy_every: int = 0) -> None:
        for i, n in enumerate(lengths):
            greedy = bool(greedy_every) and i % greedy_every == 0
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"{WARMUP_PREFIX}-{n}-{i}", prompt(n),
                               replace(params, temperature=0.0) if greedy else params)
            if stagger:  # the next prompt arrives while this one decodes: mixed steps
                for _ in range(2):
                    engine.step()
        while engine.has_unfinished_requests():
            engine.step()

    build_long_chunk_plans(engine)
    run([2 * idle_chunk + 3], stagger=False)
    budget = engine.scheduler.config.max_num_batched_tokens
    together = min(engine.scheduler.config.max_num_seqs, -(-budget // max(1, longest)))
    if together > 1:  # prompts shorter than a step: several fill one together
        run([longest] * together, stagger=False)
    run([5, 40, chunk + 1], stagger=True)
    run([1, 17, 300], stagger=False)
    if engine.spec is not None:
        k = engine.spec.config.num_speculative_tokens
        with _keeping_in_turn(engine.spec):
            run([7, 9, 30], stagger=True, max_tokens=4 * (k + 1), greedy_every=2)
            run([11, 5], stagger=False, max_tokens=6 * (k + 1), greedy_every=1)
        if engine.runner.draft_graphs is not None:
            engine.runner.draft_graphs.replay_all()
        if engine.runner.rollback_graphs is not None:
            engine.runner.rollback_graphs.replay_idle()
    return time.perf_counter() - start
