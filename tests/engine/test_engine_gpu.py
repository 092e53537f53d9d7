"""CUDA: async scheduling on real streams gives the same tokens as reading every step back.

On the CPU every op is synchronous, so the CPU tests (against transformers, in both modes)
cannot catch a race between a step in flight and the host. Here the lookahead step really
runs while the host reads the previous one back, through the CUDA-graph decode path and
the pinned read-back buffers. Run on the GPU machine; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from near_tie import assert_equal_or_near_ties
from test_engine import greedy, prompts, run_keeping_requests, run_with_arrivals

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _items(logprobs: int | None):
    ps = prompts(11, [5, 40, 23, 64, 9, 31])
    lp = {"ignore_eos": True, "logprobs": logprobs}
    params = [SamplingParams(max_tokens=40, temperature=0.0, **lp),
              SamplingParams(max_tokens=33, temperature=0.8, top_p=0.9, seed=5, **lp),
              SamplingParams(max_tokens=17, temperature=0.0, **lp),
              SamplingParams(max_tokens=25, temperature=1.0, top_k=20, seed=6, **lp),
              SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(7, 9, 11),
                             logprobs=logprobs),
              SamplingParams(max_tokens=48, temperature=0.0, **lp)]
    arrivals = [0, 0, 2, 3, 9, 20]
    return [(a, f"r{i}", p, sp) for i, (a, p, sp) in enumerate(zip(arrivals, ps, params))]


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_lookahead_matches_synchronous_steps_on_cuda(model_dir, kv_type):
    outputs = {}
    for lookahead in (False, True):
        engine = LLMEngine(EngineConfig(
            model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=4,
            prefill_chunk=16, max_num_batched_tokens=32, max_model_len=256,
            cache_type_k=kv_type, cache_type_v=kv_type, async_scheduling=lookahead,
            check_integrity=True, progress=False))
        # A step that returns logprobs does not look ahead: only the synchronous run
        # records them, for the near-tie check.
        items = _items(None if lookahead else 20)
        outputs[lookahead] = run_keeping_requests(engine, items)
        assert (engine.stats.num_lookahead_steps > 0) == lookahead
        assert engine.kv.pool.num_used_blocks == 0
        assert engine.runner.state_pool.num_used_slots == 0
    # The two modes batch differently (a lookahead step holds decode rows only, and so the
    # prefill chunks land in other steps), so bf16 rounding may flip a near-tie: on the
    # H200 a first sampled token differed at a gap of 0.16 nats, as the chaos run's bf16
    # logprobs drift by up to 0.4 between batch shapes. A race (a stale token, row or
    # noise index) picks a token outside the clean run's top 20 or far below its choice.
    assert sorted(outputs[True]) == [f"r{i}" for i in range(6)]
    assert_equal_or_near_ties(outputs[False], outputs[True], tol=0.3)


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_prefix_hits_match_caching_off_on_cuda(model_dir, kv_type):
    """bf16, CUDA graphs and async scheduling: a request resumed at 40 cached tokens (a
    copied partial block, a restored state checkpoint) gives the tokens of a cold prefill
    cut at the same position (each request alone, so that every GEMM has the same rows)."""
    base = prompts(12, [40])[0]
    probes = {f"p{i}": base + p for i, p in enumerate(prompts(13, [3, 20, 57]))}
    outputs = {}
    for caching in (True, False):
        engine = LLMEngine(EngineConfig(
            model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=4,
            prefill_chunk=40, idle_prefill_chunk=40, max_model_len=256,
            cache_type_k=kv_type, cache_type_v=kv_type,
            enable_prefix_caching=caching, check_integrity=True, progress=False))
        if caching:
            run_with_arrivals(engine, [(0, "donor", base, greedy(4))])
        outputs[caching] = {}
        for rid, p in probes.items():  # alone: the same GEMM shapes in both runs
            outputs[caching].update(run_with_arrivals(engine, [(0, rid, p, greedy(24))]))
        if caching:
            assert engine.prefix is not None and engine.prefix.stats.num_hits == 3 * 40
        assert engine.kv.pool.num_used_blocks == 0
    same = sum(a == b for rid in probes for a, b in zip(outputs[True][rid], outputs[False][rid]))
    print(f"\n{kv_type}: caching on vs off, {same}/{24 * len(probes)} tokens agree")
    assert outputs[True] == outputs[False]


def test_memory_cached_by_freed_tensors_counts_as_free_for_the_pool(model_dir, monkeypatch):
    """The K/V pool is sized from the device's free memory, and what torch's allocator
    keeps cached from freed tensors (the bf16 originals of weights quantized while
    loading) is free: when the engine reads the free memory, 5 GiB allocated and freed
    just before are no longer held in torch's cache, where they would count as used.

    The 5 GiB are 40 tensors of 128 MiB, as a model's weights are many tensors: the
    engine's own allocations reuse a few of the cached segments, which then stay (a
    segment is returned only when wholly free), and the rest must be returned."""
    cached_at_sizing = []
    read_free = torch.cuda.mem_get_info

    def spy(device=None):
        cached_at_sizing.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        return read_free(device)

    monkeypatch.setattr(torch.cuda, "mem_get_info", spy)
    garbage = [torch.empty(128 << 20, dtype=torch.uint8, device="cuda") for _ in range(40)]
    del garbage
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 5 << 30
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=4,
        max_model_len=256, warm_up=False, progress=False))
    assert engine.kv.pool.num_blocks > 0
    assert cached_at_sizing and max(cached_at_sizing) < 1 << 30, cached_at_sizing
