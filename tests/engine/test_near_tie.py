"""The GPU tests' near-tie comparison (``near_tie``) must pass equal runs and catch a run
that samples with the wrong noise index, as a lookahead race would."""

from __future__ import annotations

import pytest
from near_tie import assert_equal_or_near_ties
from test_engine import prompts, run_keeping_requests

from pagedserve.engine import sampler
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams


def _run(loaded, items):
    engine = LLMEngine(EngineConfig(model="unused", device="cpu", max_num_seqs=4,
                                    max_model_len=256, progress=False), loaded=loaded)
    return run_keeping_requests(engine, items)


def _items(logprobs: int | None = 20):
    ps = prompts(21, [7, 30, 12])
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=s,
                             logprobs=logprobs, ignore_eos=True) for s in (1, 2, 3)]
    return [(i, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]


def test_equal_runs_pass(loaded):
    assert assert_equal_or_near_ties(_run(loaded, _items()), _run(loaded, _items())) == 0


@pytest.mark.parametrize("one_sided", [False, True], ids=["both-logprobs", "one-side"])
def test_a_shifted_noise_index_fails(loaded, monkeypatch, one_sided):
    """Also when only the clean run has logprobs (a lookahead run returns none)."""
    clean = _run(loaded, _items())
    noise = sampler.exponential_noise
    monkeypatch.setattr(sampler, "exponential_noise",
                        lambda lo, hi, step, vocab: noise(lo, hi, step + 1, vocab))
    shifted = _run(loaded, _items(None if one_sided else 20))
    with pytest.raises(AssertionError, match="beyond a near-tie"):
        assert_equal_or_near_ties(clean, shifted)
