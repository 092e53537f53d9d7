"""``benchmarks/bench_prefill.py --quick`` runs end to end on the CPU and writes its report.

The figures are meaningless here; what is checked is that every part ran and that the
report carries what the GPU run is read for (step sizes, start-up phases, first vs tenth,
transformers' TTFT on the same weights)."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_writes_every_part(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_prefill", None)
    import bench_prefill

    assert bench_prefill.main(["--quick", "--out", str(tmp_path),
                               "--checkpoint-intervals", "16:cut,16,64"]) == 0
    res = json.loads((tmp_path / "prefill.json").read_text())
    assert {r["kv_type"] for r in res["op"]} == {"bf16", "q8_0", "q4_0"}
    defaults, chosen = res["ttft"]["configs"]
    assert (chosen["prefill_chunk"], chosen["idle_prefill_chunk"],
            chosen["max_num_batched_tokens"]) == (16, 32, 32)
    assert set(defaults["startup_s"]) >= {"weights", "warm_up"}
    assert len(defaults["first_vs_tenth"]["seconds"]) == 10
    assert set(defaults["ttft_s"]) == {"16", "48"}
    assert set(defaults["ttft_by_checkpoint_interval"]) == {"16:cut", "16", "64"}
    assert res["hf"]["ttft_s"] > 0
    md = (tmp_path / "prefill.md").read_text()
    assert "every 16 tokens, chunks cut: TTFT s" in md
    assert "every 64 tokens, tapped: TTFT s" in md
    assert "transformers (sdpa, same weights)" in md and (tmp_path / "prefill.png").is_file()
