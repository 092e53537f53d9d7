"""``benchmarks/bench_spec.py --quick`` runs end to end on the CPU and writes its report.

The figures are meaningless here (the torch reference on the tiny model); what is checked
is that every (batch, k) point was timed and that the predictions follow their formula:
expected tokens ``sum_{i<=k} a^i``, over the step's time in decode steps (the CPU has no
rollback graph, so no rollback time)."""

import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_writes_every_point(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_spec", None)
    import bench_spec

    assert bench_spec.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "spec_quick.json").read_text())
    assert [p["batch"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert sorted(p["k"]) == ["1", "2", "3", "4"]
        for k, r in p["k"].items():
            assert r["decode_ms"] > 0 and r["rollback_ms"] is None
            step = (r["verify_ms"] + r["draft_ms"]) / r["decode_ms"]
            assert math.isclose(r["cost_in_decode_steps"], step)
            pred = r["predicted"]["0.7"]
            tokens = (1 - 0.7 ** (int(k) + 1)) / (1 - 0.7)
            assert math.isclose(pred["tokens_per_step"], tokens)
            assert math.isclose(pred["speedup"], tokens / step)
    md = (tmp_path / "spec_quick.md").read_text()
    assert "(verify + draft) / decode" in md and (tmp_path / "spec_quick.png").is_file()


def test_quick_run_over_a_draft_vocabulary(tmp_path, monkeypatch):
    """``--draft-vocab-size``: the drafts run through the subset head, and the report says
    how many ids it drafts over."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_spec", None)
    import bench_spec

    assert bench_spec.main(["--quick", "--out", str(tmp_path), "--draft-vocab-size", "64"]) == 0
    res = json.loads((tmp_path / "spec_quick_draft64.json").read_text())
    assert 64 <= res["draft_vocab_rows"] < res["vocab_size"]
    assert f"drafts over {res['draft_vocab_rows']} of" in \
        (tmp_path / "spec_quick_draft64.md").read_text()


def test_prediction_counts_the_rollback_when_any_sequence_rejects(monkeypatch):
    """A step rolls back once when some of its B sequences rejected a draft, which at
    per-token acceptance a happens with probability 1 - a^(kB)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_spec", None)
    import bench_spec

    got = bench_spec.predictions(20.0, 22.0, 3.0, 2.0, 3, 8)["0.7"]
    step = 22.0 + 3.0 + (1 - 0.7 ** 24) * 2.0
    assert math.isclose(got["step_ms"], step)
    assert math.isclose(got["speedup"], (1 + 0.7 + 0.49 + 0.343) * 20.0 / step)
