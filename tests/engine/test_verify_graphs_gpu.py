"""CUDA: speculative verify steps through the verify graphs (``engine/verify_graphs.py``)
and their rollback through the rollback graphs (``engine/rollback_graphs.py``).

Greedy speculative output with the graphs equals the eager engine's (``cuda_graphs``
off) and plain decoding's, each equal or first differing at a near-tie (``near_tie``: a
padded batch and a verify step's row count change the GEMMs' rounding), at batch 1 and
several batch sizes, k = 1..3; pure verify steps do replay a graph, and those that reject
a draft a rollback graph, whose states equal the eager rollback's; and a warmed-up
speculative engine compiles nothing during requests. Skipped without CUDA (run with
``gpu_run.sh tests-gpu-engine``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
from near_tie import assert_equal_or_near_ties
from spec_gpu_common import greedy_items, save_spec_checkpoint, spec_engine
from test_engine import prompts, run_keeping_requests

from pagedserve.engine import compile_watch
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory) -> Path:
    return save_spec_checkpoint(tmp_path_factory.mktemp("verify-graphs"))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_verify_graphs_match_eager_and_plain_decoding(spec_dir, k, batch):
    graphed = spec_engine(spec_dir, k)
    graphs = graphed.runner.verify_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    replays: list[int] = []
    run = graphs.run
    graphs.run = lambda b: replays.append(b.num_seqs) or run(b)
    got = run_keeping_requests(graphed, greedy_items(batch))
    assert replays and max(replays) == batch, replays  # pure verify steps replayed
    eager = spec_engine(spec_dir, k, cuda_graphs=False)
    assert eager.runner.verify_graphs is None
    assert_equal_or_near_ties(got, run_keeping_requests(eager, greedy_items(batch)))
    plain = spec_engine(spec_dir, None)
    assert plain.runner.verify_graphs is None
    assert_equal_or_near_ties(run_keeping_requests(plain, greedy_items(batch)), got)
    for engine in (graphed, eager):
        assert engine.kv.pool.num_used_blocks == 0
        assert engine.runner.state_pool.num_used_slots == 0


def _count_rollbacks(engine: LLMEngine) -> list[tuple[int, ...]]:
    """Log the rows of each rollback graph replay of ``engine``."""
    graphs = engine.runner.rollback_graphs
    assert graphs is not None
    replays: list[tuple[int, ...]] = []
    run = graphs.run
    graphs.run = lambda num_rows: replays.append(tuple(num_rows)) or run(num_rows)
    return replays


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_rollback_graphs_match_eager_rollback_and_plain_decoding(spec_dir, k, batch):
    graphed = spec_engine(spec_dir, k)
    rollback = graphed.runner.rollback_graphs
    assert rollback is not None and rollback.sizes == [1, 2, 4, 8]
    replays = _count_rollbacks(graphed)
    got = run_keeping_requests(graphed, greedy_items(batch))
    assert replays and max(len(r) for r in replays) == batch, replays
    assert all(any(0 < n <= k for n in r) for r in replays), replays
    eager = spec_engine(spec_dir, k)  # the same verify graphs, rolled back eagerly
    eager.runner.rollback_graphs = None
    assert_equal_or_near_ties(got, run_keeping_requests(eager, greedy_items(batch)))
    plain = spec_engine(spec_dir, None)
    assert_equal_or_near_ties(run_keeping_requests(plain, greedy_items(batch)), got)
    assert graphed.kv.pool.num_used_blocks == 0
    assert graphed.runner.state_pool.num_used_slots == 0


@pytest.mark.parametrize("num_rows", [[2, 0, 1], [1, 4, 3], [4, 4, 1]])
def test_rollback_graph_states_equal_the_eager_rollbacks(spec_dir, num_rows):
    """One verify replay of 3 sequences (padded to 4), then the rollback graph or the
    eager rollback from the same states: the slots agree to the rounding of the single-row
    kernels; the null slot and every other slot are untouched."""
    engine = spec_engine(spec_dir, 3, max_num_seqs=4)
    runner, kv = engine.runner, engine.kv
    verify, rollback = runner.verify_graphs, runner.rollback_graphs
    assert verify is not None and rollback is not None
    chunks = []
    for prompt in prompts(5, [20, 21, 22]):
        handle = kv.create()
        slot = runner.state_pool.slot(runner.state_pool.acquire())
        assert kv.reserve(handle, len(prompt))
        runner.execute(build_forward_batch([SeqChunk(handle, slot, tuple(prompt), 0)], kv,
                                           runner.device))
        kv.commit(handle, len(prompt))
        assert kv.reserve(handle, 4)
        chunks.append(SeqChunk(handle, slot, tuple(prompt[:4]), len(prompt)))
    with torch.inference_mode():
        runner.save_states([c.state_slot for c in chunks])
        out = runner.verify(build_forward_batch(chunks, kv, runner.device))
        assert out is not None and verify.last_size == 4
        verified = [t.clone() for t in (runner.state_pool.conv_state,
                                         runner.state_pool.recurrent_state)]
        record = out.gdn_inputs
        redo = [i for i, n in enumerate(num_rows) if 0 < n]
        replay = [SeqChunk(chunks[i].kv_handle, chunks[i].state_slot,
                           chunks[i].token_ids[:num_rows[i]], chunks[i].start_pos)
                  for i in sorted(redo, key=lambda i: num_rows[i] > 1)]
        rows = [4 * i + j for i in sorted(redo, key=lambda i: num_rows[i] > 1)
                for j in range(num_rows[i])]
        runner.restore_states([chunks[i].state_slot for i in redo])
        runner.advance_linear_states(build_forward_batch(replay, kv, runner.device),
                                     record, rows)
        eager = [t.clone() for t in (runner.state_pool.conv_state,
                                     runner.state_pool.recurrent_state)]
        runner.state_pool.conv_state.copy_(verified[0])
        runner.state_pool.recurrent_state.copy_(verified[1])
        assert runner.roll_back_verify(num_rows)
        torch.cuda.synchronize()
        graphed = (runner.state_pool.conv_state, runner.state_pool.recurrent_state)
    live = [c.state_slot for c in chunks]
    others = [s for s in range(graphed[0].shape[1]) if s not in live]
    for got, want, was in zip(graphed, eager, verified):
        torch.testing.assert_close(got[:, live].float(), want[:, live].float(),
                                   atol=2e-2, rtol=2e-2)
        assert torch.equal(got[:, others], was[:, others])  # the null slot among them
        for slot, n in zip(live, num_rows):
            if n == 0:
                assert torch.equal(got[:, slot], was[:, slot])


def test_no_compile_after_warm_up_with_speculation(spec_dir):
    engine = spec_engine(spec_dir, 3, max_num_seqs=4, cache_type_k="q8_0", cache_type_v="q4_0")
    assert "warm_up" in engine.startup_seconds and engine.runner.verify_graphs is not None
    assert engine.runner.rollback_graphs is not None
    rollbacks = _count_rollbacks(engine)
    compiled: list[str] = []
    watched = compile_watch.compiles_after_warm_up()
    previous = triton.knobs.runtime.jit_post_compile_hook  # the engine's compile watch
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(
        f"{kw.get('repr', '?')} {kw['compile'].get('constants')}" if "compile" in kw else "?"
    ) or (previous(*a, **kw) if previous else None)
    try:
        # Batch sizes, prompt lengths and arrivals the warm-up did not use: every verify
        # graph size, eager verify steps beside prompts, drafts cut near max_tokens.
        lengths = [3, 77, 150, 11, 33, 60]
        for i, p in enumerate(prompts(23, lengths)):
            temperature = 0.0 if i % 2 else 0.8
            engine.add_request(f"q{i}", p, SamplingParams(
                max_tokens=9 + 4 * i, temperature=temperature, ignore_eos=True, seed=i))
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert compiled == [], "\n".join(compiled)
    assert compile_watch.compiles_after_warm_up() == watched  # dynamo's traces too
    assert rollbacks  # rollback graphs replayed
    assert engine.kv.pool.num_used_blocks == 0
