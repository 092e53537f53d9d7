"""CUDA: the MTP drafter's passes through their graphs (``engine/draft_graphs.py``).

Greedy speculative output with the draft graphs equals the eager drafter's (draft graphs
off, verify graphs on) and plain decoding's, each equal or first differing at a near-tie
(``near_tie``: a padded batch changes the GEMMs' rounding), at batch 1 and several batch
sizes, k = 1..3; the propose and observe graphs replay; and a warmed-up speculative engine
compiles nothing during requests. Skipped without CUDA (run with
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
from pagedserve.engine.request import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory) -> Path:
    return save_spec_checkpoint(tmp_path_factory.mktemp("draft-graphs"))


def _count_replays(graphs, log: list) -> None:
    """Log each replay of ``graphs``' propose and observe passes in ``log``."""
    if graphs.propose is not None:
        replay = graphs.propose.replay
        graphs.propose.replay = lambda s, j: log.append(("propose", s, j)) or replay(s, j)
    run = graphs.observe.run
    graphs.observe.run = lambda b, h: log.append(("observe", b.num_seqs)) or run(b, h)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_draft_graphs_match_eager_drafting_and_plain_decoding(spec_dir, k, batch):
    graphed = spec_engine(spec_dir, k)
    graphs = graphed.runner.draft_graphs
    assert graphs is not None and graphs.observe.sizes == [1, 2, 4, 8]
    assert (graphs.propose is None) == (k == 1)
    replays: list[tuple] = []
    _count_replays(graphs, replays)
    got = run_keeping_requests(graphed, greedy_items(batch))
    assert ("observe", batch) in replays, replays
    if k > 1:
        assert any(r[0] == "propose" and r[1] >= batch for r in replays), replays
    eager = spec_engine(spec_dir, k)
    eager.runner.draft_graphs = None  # the drafter's eager passes, verify graphs kept
    assert_equal_or_near_ties(got, run_keeping_requests(eager, greedy_items(batch)))
    plain = spec_engine(spec_dir, None)
    assert plain.runner.draft_graphs is None
    assert_equal_or_near_ties(run_keeping_requests(plain, greedy_items(batch)), got)
    for engine in (graphed, eager):
        assert engine.kv.pool.num_used_blocks == 0
        assert engine.runner.state_pool.num_used_slots == 0


@pytest.mark.parametrize("batch", [1, 8])
def test_draft_graphs_over_a_draft_vocabulary(spec_dir, batch):
    """A subset head (ids below 100 and the three special ids, 103 of 320): the graphs'
    draft buffers are 103 wide, every draft lies in the subset, and the output is the
    eager drafter's and plain decoding's (or parts from them at a near-tie)."""
    graphed = spec_engine(spec_dir, 3, draft_vocab_size=100)
    head, graphs = graphed.runner.draft_head, graphed.runner.draft_graphs
    assert head is not None and graphs is not None and graphs.propose is not None
    subset = set(head.ids.tolist())
    assert subset == set(range(100)) | {256, 257, 258}
    assert graphs.propose.buffers["logits"].shape[-1] == 103
    assert graphs.observe.buffers["tail_logits"].shape[-1] == 103
    drafted: list[int] = []
    propose = graphed.spec.drafter.propose

    def proposing(wants):
        out = propose(wants)
        for d in out.drafts():
            drafted.extend(d.token_ids)
        return out

    graphed.spec.drafter.propose = proposing
    replays: list[tuple] = []
    _count_replays(graphs, replays)
    got = run_keeping_requests(graphed, greedy_items(batch))
    assert any(r[0] == "propose" for r in replays), replays
    assert drafted and set(drafted) <= subset
    eager = spec_engine(spec_dir, 3, draft_vocab_size=100)
    eager.runner.draft_graphs = None
    assert_equal_or_near_ties(got, run_keeping_requests(eager, greedy_items(batch)))
    plain = spec_engine(spec_dir, None)
    assert_equal_or_near_ties(run_keeping_requests(plain, greedy_items(batch)), got)


def test_warm_up_replays_every_draft_graph_and_nothing_compiles_after(spec_dir, monkeypatch):
    from pagedserve.engine.draft_graphs import DraftGraphs

    replayed: list[int] = []
    replay_all = DraftGraphs.replay_all
    monkeypatch.setattr(DraftGraphs, "replay_all",
                        lambda self: replayed.append(1) or replay_all(self))
    engine = spec_engine(spec_dir, 3, max_num_seqs=4, cache_type_k="q8_0", cache_type_v="q4_0")
    assert "warm_up" in engine.startup_seconds and engine.runner.draft_graphs is not None
    assert replayed == [1]
    compiled: list[str] = []
    watched = compile_watch.compiles_after_warm_up()
    previous = triton.knobs.runtime.jit_post_compile_hook  # the engine's compile watch
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(
        f"{kw.get('repr', '?')} {kw['compile'].get('constants')}" if "compile" in kw else "?"
    ) or (previous(*a, **kw) if previous else None)
    try:
        lengths = [3, 77, 150, 11, 33, 60]
        for i, p in enumerate(prompts(29, lengths)):
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
    assert engine.kv.pool.num_used_blocks == 0
