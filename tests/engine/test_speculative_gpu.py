"""CUDA: speculative decoding in bf16 gives plain decoding's greedy tokens, equal or first
differing at a near-tie (``near_tie``: a verify step scores k + 1 rows per sequence, a
decode step one, so their GEMMs round differently), takes every rollback branch with a
forced drafter, and ends with every block and slot free. Skipped without CUDA (run with
``gpu_run.sh tests-gpu-engine``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from near_tie import assert_equal_or_near_ties
from test_engine import run_keeping_requests
from test_spec_async import KeptInTurn, target_positions
from test_speculative import NEW, PROMPTS, ForcedDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from hybrid_checkpoints import build_hf_model  # noqa: E402
from mtp_checkpoints import build_mtp, save_with_mtp  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPE = "d256-gqa3-untied"  # head_dim 256: the library's decode kernels, not fallbacks
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory) -> Path:
    hf = build_hf_model(SHAPE)
    return save_with_mtp(hf, build_mtp(hf), tmp_path_factory.mktemp("spec-gpu"))


def _engine(path: Path, k: int | None, drafter=None, **kw) -> LLMEngine:
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine(EngineConfig(
        model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=3, max_model_len=128,
        check_integrity=True, progress=False, speculative_config=spec, **kw), drafter=drafter)


def _run(engine: LLMEngine, params: SamplingParams = GREEDY) -> dict:
    return run_keeping_requests(engine, [(0, str(i), p, params) for i, p in enumerate(PROMPTS)])


def _assert_pools_empty(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_matches_plain_decoding_on_cuda(spec_dir, k) -> None:
    plain = _run(_engine(spec_dir, None))
    engine = _engine(spec_dir, k)
    got = _run(engine)
    assert_equal_or_near_ties(plain, got)
    s = engine.spec.stats
    assert s.num_drafts > 0 and s.num_draft_tokens >= s.num_drafts
    _assert_pools_empty(engine)


def test_forced_drafts_roll_back_and_keep_on_cuda(spec_dir) -> None:
    """Drafts are the plain run's own tokens, corrupted at output indices 1 mod 5 and 2 mod
    7, so that drafts are both rejected (the state rolls back) and kept. Every length of
    kept run is asserted on the CPU, where float32 makes the two runs equal; here a
    near-tie may end a request's agreement with the plain run early."""
    plain = _run(_engine(spec_dir, None))
    vocab = build_hf_model(SHAPE).config.vocab_size
    drafter = ForcedDrafter({rid: list(r.output_token_ids) for rid, r in plain.items()},
                            lambda i: i % 5 == 1 or i % 7 == 2, vocab)
    engine = _engine(spec_dir, 3, drafter)
    got = _run(engine)
    assert_equal_or_near_ties(plain, got)
    kept = engine.spec.stats.num_by_accepted
    assert kept[0] > 0 and sum(kept[1:]) > 0, kept
    _assert_pools_empty(engine)


PLAIN_GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3])
def test_async_speculation_matches_plain_decoding_on_cuda(spec_dir, k) -> None:
    """Async scheduling's chains through the captured verify, rollback and draft graphs:
    plain decoding's greedy tokens (equal, or first differing at a near-tie), with steps
    launched ahead and nothing leaked."""
    plain = _run(_engine(spec_dir, None))
    engine = _engine(spec_dir, k, async_scheduling=True)
    assert engine.spec.chain is not None and engine.spec.chain.graphs_ready()
    got = _run(engine)  # with logprobs, which the chains report: both sides of a tie
    assert_equal_or_near_ties(plain, got)
    assert engine.stats.num_lookahead_steps > 0
    _assert_pools_empty(engine)


def test_async_speculation_keeps_every_count_as_the_synchronous_engine(spec_dir) -> None:
    """Every kept count imposed in turn: the chains (the decision, rollback counts and
    observe rows computed on the device) give the synchronous engine's tokens, up to
    the first kept draft on which the two part. Kept drafts are the MTP head's, whose
    observe pass runs over other rows in the two engines (a sequence's kept rows packed,
    or all its verify rows with the rest masked), so its bf16 rounding, and at a
    near-tie a draft, may differ; a token the target chose after the same context may
    not, since both replay the same verify graph."""
    outs, kept = {}, {}
    for async_scheduling in (False, True):
        engine = _engine(spec_dir, 3, async_scheduling=async_scheduling)
        kept[async_scheduling] = engine.spec.kept_drafts = KeptInTurn()
        got = _run(engine, PLAIN_GREEDY)
        outs[async_scheduling] = {rid: r.output_token_ids for rid, r in got.items()}
        assert all(n > 0 for n in engine.spec.stats.num_by_accepted)
        assert (engine.stats.num_lookahead_steps > 0) == async_scheduling
        _assert_pools_empty(engine)
    for rid, tokens in outs[True].items():
        diff = [i for i, (a, b) in enumerate(zip(outs[False][rid], tokens)) if a != b]
        if diff:
            chosen = target_positions(kept[True].decided[rid], len(tokens))
            assert diff[0] not in chosen, (rid, diff[0], outs[False][rid], tokens)


def test_async_speculation_with_seeded_sampling_repeats_on_cuda(spec_dir) -> None:
    """Seeded sampled requests beside greedy ones through the chains (drafts drawn and
    rejection sampling on the device): two runs give the same tokens, steps go ahead,
    nothing leaks."""
    params = [SamplingParams(max_tokens=NEW, temperature=0.8, top_k=40, seed=5 + i,
                             ignore_eos=True) if i != 1 else PLAIN_GREEDY for i in range(3)]
    outs = []
    for _ in range(2):
        engine = _engine(spec_dir, 3, async_scheduling=True)
        got = run_keeping_requests(engine, [(0, str(i), p, params[i])
                                            for i, p in enumerate(PROMPTS)])
        outs.append({rid: r.output_token_ids for rid, r in got.items()})
        assert engine.stats.num_lookahead_steps > 0
        _assert_pools_empty(engine)
    assert outs[0] == outs[1]
