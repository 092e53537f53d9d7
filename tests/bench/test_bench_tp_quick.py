"""``benchmarks/bench_tp.py`` imports, refuses to run without its GPUs, and its report
states the two ratios it is judged by (its ``--quick`` CPU run spawns engines: too slow
for CI; run it by hand)."""

import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_bench_tp_refuses_without_gpus_and_reports_its_ratios(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_tp", None)
    import bench_tp

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench_tp.main(["--out", str(tmp_path)]) == 2
    assert "needs 2 CUDA GPUs" in capsys.readouterr().err
    point = {"batch1": {"step_ms": 10.0, "collective_ms_per_step": None},
             "ragged8": {"decode_tok_s": 100.0}}
    res = {"meta": {"date": "d", "gpu": "g", "commit": "c", "torch": "t", "triton": "x"},
           "model": "m", "kv_type": "q4_0", "tp": 2, "prompt_len": 8, "output_len": 4,
           "sizes": {"1": point, "2": point}, "batch1_step_ratio": 0.5,
           "ragged8_throughput_ratio": 1.7}
    text = bench_tp.markdown(res)
    assert "0.50x TP=1 (target <= 0.6x)" in text and "1.70x (target >= 1.6x)" in text
