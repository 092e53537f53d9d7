"""``benchmarks/bench_spec_e2e.py --quick`` runs end to end on the CPU and writes its report,
and its imposed acceptance keeps drafts as a run of independent coin flips would.

The speeds are meaningless here; what is checked is that every (batch, k, a) point ran its
requests to the end and that the speed-up is its tok/s over plain decoding's."""

import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_spec_e2e", None)
    import bench_spec_e2e

    return bench_spec_e2e


def test_quick_run_writes_every_point(tmp_path, monkeypatch):
    bench = _bench(monkeypatch)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "spec_e2e_quick.json").read_text())
    assert [p["batch"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        plain = p["plain"]
        assert plain["decode_tokens"] == p["batch"] * (res["output_len"] - 1)
        assert sorted(p["k"]) == ["1", "2", "3", "4"]
        for k, by_scheduling in p["k"].items():
            assert sorted(by_scheduling) == ["async", "sync"]
            for r in (r for by_a in by_scheduling.values() for r in by_a.values()):
                assert r["decode_tokens"] >= p["batch"] * (res["output_len"] - int(k) - 1)
                assert math.isclose(r["speedup"], r["decode_tok_s"] / plain["decode_tok_s"])
                assert 1.0 <= r["mean_acceptance_length"] <= int(k) + 1
    assert (tmp_path / "spec_e2e_quick.png").is_file()


def test_imposed_acceptance_keeps_a_geometric_run(monkeypatch):
    """P(m kept of d) = a^m (1 - a) for m < d and a^d for m = d: a chi-square test over
    20,000 verifies of 3 drafts at a = 0.7 (critical value 16.27 for 3 degrees of freedom
    at p = 0.001)."""
    bench = _bench(monkeypatch)
    from pagedserve.engine.spec_step import SpeculativeDecoding
    from pagedserve.engine.speculative import SpeculativeConfig

    spec = SpeculativeDecoding(SpeculativeConfig("mtp", 3), drafter=None, max_model_len=64)
    stats = spec.stats
    bench.ImposedAcceptance(spec, 0.7, seed=1)
    target = torch.zeros(4, 10)
    target[:, 9] = 1.0
    n = 20_000
    rng = random.Random(2)
    for _ in range(n):
        draft = SimpleNamespace(token_ids=[rng.randrange(9) for _ in range(3)])
        out = spec._verify(None, None, target, draft)
        m = len(out.tokens) - 1
        assert out.tokens == [*draft.token_ids[:m], 9]
    expected = [n * 0.7 ** m * 0.3 for m in range(3)] + [n * 0.7 ** 3]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(stats.num_by_accepted, expected))
    assert chi2 < 16.27, (stats.num_by_accepted, expected)
    assert stats.num_accepted_tokens == sum(m * c for m, c in enumerate(stats.num_by_accepted))


def test_imposed_acceptance_is_close_to_its_mean_within_a_short_run(monkeypatch):
    """100 verifies of 3 drafts at a = 0.7, the size of a batch-1 run, emit 2.533 tokens
    per verify (1 + a + a^2 + a^3) to within 0.03 from any seed; independent draws miss
    by 0.12 at one standard deviation."""
    bench = _bench(monkeypatch)
    from pagedserve.engine.spec_step import SpeculativeDecoding
    from pagedserve.engine.speculative import SpeculativeConfig

    for seed in range(5):
        spec = SpeculativeDecoding(SpeculativeConfig("mtp", 3), drafter=None, max_model_len=64)
        imposed = bench.ImposedAcceptance(spec, 0.7, seed=seed)
        emitted = [imposed.kept(None, 3) + 1 for _ in range(100)]
        assert abs(sum(emitted) / 100 - (1 + 0.7 + 0.49 + 0.343)) < 0.03, (seed, emitted)
