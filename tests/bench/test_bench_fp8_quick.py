"""``benchmarks/bench_fp8.py --quick`` runs end to end on the CPU and writes its report.

The figures are meaningless here (the torch reference on a toy hybrid); what is checked is
that every part ran over the model's projections, and that the report carries what the
H200 run is read for: the decode step against its floors, the prefill totals, the
crossover of the two FP8 methods."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_writes_every_part(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_fp8", None)
    import bench_fp8

    assert bench_fp8.main(["--quick", "--backend", "reference", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fp8.json").read_text())
    names = {s["name"] for s in res["shapes"]}
    assert {"mlp.gate_up_proj", "mlp.down_proj", "self_attn.qkv_proj", "lm_head",
            "linear_attn.in_proj[in_proj_qkv,in_proj_z]",
            "linear_attn.in_proj[in_proj_b,in_proj_a]"} <= names
    assert {s["fp8"] for s in res["shapes"] if s["name"] in
                ("lm_head", "linear_attn.in_proj[in_proj_b,in_proj_a]")} == {False}
    step = res["decode"]["steps"]["1"]
    assert step["fp8_bytes"] < step["bf16_bytes"] and step["fp8_floor_ms"] > 0
    assert {"weight_only", "bf16"} <= set(res["decode"]["points"][0]["us"])
    assert set(res["prefill"]["totals"]) == {"w8a8", "weight_only", "bf16"}
    assert {r["rows"] for r in res["crossover"]} == {1, res["w8a8_min_rows"]}
    md = (tmp_path / "fp8.md").read_text()
    assert "FP8 floor ms" in md and "Crossover" in md and (tmp_path / "fp8.png").is_file()
