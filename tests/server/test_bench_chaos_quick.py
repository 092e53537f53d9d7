"""``benchmarks/bench_chaos.py --quick``: the chaos run on the CPU with the tiny model. It
starts its own server, overloads a pool of a few blocks with streams and non-streaming
requests that clients abandon, and must pass every check (no 5xx, no leaks, preemptions,
outputs equal to solo reruns, clean exit). Its outputs go to a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_chaos.py"
sys.path.insert(0, str(SCRIPT.parent))
import bench_chaos  # noqa: E402


def _run(tokens: list[str], logprobs: list[float], tops: list[dict[str, float]]
         ) -> bench_chaos.Outcome:
    out = bench_chaos.Outcome(0, "stream", 4, len(tokens), False, result="complete")
    out.tokens, out.token_logprobs, out.top_logprobs = tokens, logprobs, tops
    return out


def test_compare_tells_near_ties_from_corruption():
    solo = _run(["a", "b", "c"], [-1.0, -2.0, -3.0],
                [{"a": -1.0}, {"b": -2.0, "x": -2.05, "y": -4.0}, {"c": -3.0}])
    same = bench_chaos.compare(_run(["a", "b", "c"], [-1.0, -2.001, -3.0], solo.top_logprobs),
                               solo, tolerance=0.2)
    assert same["verdict"] == "exact" and abs(same["drift"] - 0.001) < 1e-9
    # Rounding swapped b and x (0.05 apart in both runs): a near-tie at position 1.
    tie = _run(["a", "x", "q"], [-1.0, -2.04, -9.0],
               [{"a": -1.0}, {"x": -2.04, "b": -2.06}, {"q": -9.0}])
    verdict = bench_chaos.compare(tie, solo, tolerance=0.2)
    assert verdict["verdict"] == "near_tie" and verdict["position"] == 1
    assert abs(verdict["gap"] - 0.05) < 1e-9 and not verdict["gap_is_lower_bound"]
    # The chaos run chose y, 2 nats below the solo run's choice: corruption.
    bad = _run(["a", "y", "q"], [-1.0, -0.5, -9.0],
               [{"a": -1.0}, {"y": -0.5, "z": -0.6}, {"q": -9.0}])
    verdict = bench_chaos.compare(bad, solo, tolerance=0.2)
    assert verdict["verdict"] == "failed" and verdict["gap"] == 2.0
    # b is outside the chaos run's top list (a lower bound of 0.1 there), but the solo
    # side's exact 2.0 decides.
    assert verdict["gap_is_lower_bound"] is False
    short = bench_chaos.compare(_run(["a", "b"], [-1.0, -2.0], solo.top_logprobs[:2]), solo,
                                tolerance=0.2)
    assert short["verdict"] == "failed" and "lengths differ" in short["note"]


def test_checks_fail_on_5xx_leaks_and_no_preemption():
    ok = _run(["a"], [-1.0], [{"a": -1.0}])
    ok.status = 200
    broken = _run([], [], [])
    broken.status, broken.result, broken.error = 500, "refused", "internal error"
    idle = dict.fromkeys(bench_chaos.LEAK_GAUGES, 0.0) | {"num_preemptions": 0.0}
    leaked = idle | {"kv_cache_used_blocks": 3.0}
    results = bench_chaos.checks([ok, broken], idle, leaked, [{"verdict": "exact"}], 1, 1,
                                 {"health": 200, "exit_status": 0, "tracebacks": 0})
    passed = {c["check"]: c["passed"] for c in results}
    assert passed == {"workload_sent": True, "no_5xx": False, "no_unexpected_errors": False,
                      "no_leaks": False, "preempted": False, "outputs_match": True,
                      "clean_exit": True}
    detail = {c["check"]: c["detail"] for c in results}
    assert "at the end: kv_cache_used_blocks" in detail["no_leaks"] and "500: 1" in detail["no_5xx"]


def test_chaos_quick_passes_every_check(serve_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no copies outside tmp_path
    env.update(serve_env)
    # 20 requests: 5 of each kind, one burst of 4 long prompts that overfills the K/V pool,
    # and about 35 prefix checkpoints for a budget of 17 (7 MiB), so that checkpoints are
    # evicted while the chaos phase and the solo reruns restore others.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--num-requests", "20",
                           "--server-args", "--prefix-checkpoint-memory 7MiB",
                           "--out-dir", str(tmp_path), "--name", "c"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "c.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert set(checks) == {"workload_sent", "no_5xx", "no_unexpected_errors", "no_leaks",
                           "preempted", "outputs_match", "clean_exit"}
    assert all(c["passed"] for c in checks.values()), checks
    after = report["metrics_after_chaos"]
    assert report["passed"] and after["num_preemptions"] > 0
    assert after["prefix_checkpoint_usage_perc"] == 1.0  # full: later checkpoints evict
    results = report["results"]
    assert results.get("stream_cut:cut", 0) > 0 and results.get("whole_timeout:timed_out", 0) > 0
    assert len(report["matches"]) >= 10
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "| outputs_match | pass |" in (tmp_path / "c.md").read_text()
