"""CUDA: prefill CUDA graphs give the eager steps' tokens (bf16: equal, or first differing
at a near-tie of rounding, ``near_tie``), and a warmed-up engine compiles nothing during
requests. Skipped without CUDA (run with ``gpu_run.sh tests-gpu``)."""

from __future__ import annotations

import pytest
import torch
import triton
from near_tie import assert_equal_or_near_ties
from test_engine import prompts, run_keeping_requests

from pagedserve.engine import compile_watch
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _engine(model_dir, **kw) -> LLMEngine:
    # Every prefill chunk fits the 64-row graphs, idle steps included.
    kw.setdefault("prefill_chunk", 64)
    kw.setdefault("idle_prefill_chunk", 64)
    kw.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=128,
        max_model_len=512, check_integrity=True, progress=False, **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=5)


def _run(engine: LLMEngine, lengths: list[int], max_tokens: int = 8):
    """Each prompt alone (so that every prefill step holds one sequence)."""
    out = {}
    for i, prompt in enumerate(prompts(5, lengths)):
        out.update(run_keeping_requests(engine, [(0, f"r{i}", prompt, greedy(max_tokens))]))
    return out


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_prefill_graphs_match_eager_prefill(model_dir, kv_type):
    lengths = [2, 5, 16, 17, 63, 64, 65, 200, 300]  # 65..300: chunks over a cached prefix
    graphs = _engine(model_dir, cache_type_k=kv_type, cache_type_v=kv_type)
    assert graphs.runner.prefill_graphs is not None
    replays = []
    run = graphs.runner.prefill_graphs.run
    graphs.runner.prefill_graphs.run = lambda batch: replays.append(batch.num_tokens) or run(batch)
    got = _run(graphs, lengths)
    eager = _engine(model_dir, cache_type_k=kv_type, cache_type_v=kv_type, cuda_graphs=False)
    assert eager.runner.prefill_graphs is None
    assert_equal_or_near_ties(got, _run(eager, lengths))
    assert len(replays) >= len(lengths)  # every prompt's prefill went through a graph
    assert graphs.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_mixed_steps_split_into_both_graphs(model_dir, kv_type):
    # Prompts arriving while others decode, one or two at a time: steps of decode rows
    # beside their chunks, and of two chunks alone, replay the decode graph and the prefill
    # graph once per chunk, and give the eager steps' tokens.
    lengths, arrivals = [9, 31, 40, 100, 23, 17, 60], [0, 0, 2, 5, 8, 8, 12]
    items = [(a, f"r{i}", p, greedy(20))
             for i, (a, p) in enumerate(zip(arrivals, prompts(7, lengths)))]
    graphs = _engine(model_dir, cache_type_k=kv_type, cache_type_v=kv_type, max_num_seqs=8)
    splits = []  # (decode rows, prefill chunks) of each step that split
    split = graphs.runner._split_for_graphs

    def recording(batch):
        out = split(batch)
        if out is not None:
            splits.append((batch.num_decode_seqs, batch.num_seqs - batch.num_decode_seqs))
        return out

    graphs.runner._split_for_graphs = recording
    got = run_keeping_requests(graphs, items)
    eager = _engine(model_dir, cache_type_k=kv_type, cache_type_v=kv_type, max_num_seqs=8,
                    cuda_graphs=False)
    assert_equal_or_near_ties(got, run_keeping_requests(eager, items))
    assert (0, 2) in splits and any(d > 0 and n == 2 for d, n in splits), splits
    assert len(splits) >= 4 and graphs.kv.pool.num_used_blocks == 0


def test_no_compile_after_warm_up(model_dir):
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=4,
        prefill_chunk=64, max_num_batched_tokens=128, max_model_len=512,
        cache_type_k="q4_0", cache_type_v="q8_0", progress=False))
    assert "warm_up" in engine.startup_seconds  # on CUDA the engine warms up as it starts
    compiled: list[str] = []
    # Each compile is named with its specialization (each argument's type with its
    # alignment or divisibility mark, launch options, constants), so that a failure says
    # which argument the warm-up did not cover.
    watched = compile_watch.compiles_after_warm_up()
    previous = triton.knobs.runtime.jit_post_compile_hook  # the engine's compile watch
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(
        f"{kw.get('repr', '?')} {kw['compile'].get('constants')}" if "compile" in kw else "?"
    ) or (previous(*a, **kw) if previous else None)
    try:
        # Lengths, batch mixes and prefixes the warm-up did not use.
        for i, prompt in enumerate(prompts(9, [3, 77, 150, 11, 250])):
            engine.add_request(f"q{i}", prompt, greedy(6))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], "\n".join(compiled)
    assert compile_watch.compiles_after_warm_up() == watched  # dynamo's traces too
