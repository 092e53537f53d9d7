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


def test_chaos_quick_passes_every_check(serve_env, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # no copies outside tmp_path
    env.update(serve_env)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out-dir", str(tmp_path),
                           "--name", "c"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "c.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert set(checks) == {"workload_sent", "no_5xx", "no_unexpected_errors", "no_leaks",
                           "preempted", "outputs_match", "clean_exit"}
    assert all(c["passed"] for c in checks.values()), checks
    assert report["passed"] and report["metrics_after_chaos"]["num_preemptions"] > 0
    results = report["results"]
    assert results.get("stream_cut:cut", 0) > 0 and results.get("whole_timeout:timed_out", 0) > 0
    assert len(report["matches"]) >= 10
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "| outputs_match | pass |" in (tmp_path / "c.md").read_text()
