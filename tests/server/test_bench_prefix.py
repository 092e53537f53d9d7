"""``benchmarks/bench_prefix.py --quick``: caching on and off through real servers on the
CPU, with every report file written and every reusable token hit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prefix_quick(serve_env, tmp_path, monkeypatch):
    for k, v in serve_env.items():
        monkeypatch.setenv(k, v)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_prefix
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert bench_prefix.main(["--quick", "--sweep-checkpoints", "4", "--out",
                              str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefix_quick.json").read_text())
    on, off = report["on"], report["off"]
    assert on["agent"]["hit_rate"] == 1.0 and on["chat"]["2"]["hit_rate"] == 1.0
    assert off["agent"]["cached_tokens"] == 0 and off["server"]["prefix_caching"] is False
    assert on["metrics"]["prefix_cache_hits_total"] >= on["agent"]["cached_tokens"]
    assert on["metrics"]["kv_cache_usage_perc"] == 0.0
    default = on["server"]["prefix_checkpoints"]  # the caching-on run is the last point
    assert [p["checkpoints"] for p in report["budget_sweep"]] == [4, default]
    assert "## Targets" in (tmp_path / "prefix_quick.md").read_text()
    assert (tmp_path / "prefix_quick.png").read_bytes()[:4] == b"\x89PNG"
