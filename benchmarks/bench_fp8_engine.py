"""FP8 weights against bf16 through the whole engine, on the Qwen3.5-27B shape.

Issue 37's engine-level targets, bf16 and FP8 side by side in one run (one after the
other, each in a fresh process: both weight sets do not fit one GPU at once). Random bf16
weights of the real shape; the FP8 side quantizes the same weights while loading
(``quantization="fp8"``, 128x128 blocks, as ``--quantization fp8`` does). Each side
builds one engine with the server's step sizes and paged q4_0 K/V, then measures
through ``LLMEngine.step()`` (``bench_engine``'s method: synthetic contexts, async scheduling):

- decode ms per step: one sequence at 8K, 8 ragged (128K + 7x8K), 16 ragged
  (128K + 7x8K + 8x4K);
- prefill: the median TTFT of three 8K prompts (after an untimed one), as tokens per second.

A third side, ``fp8_w8a8_decode`` (``--sides bf16 fp8 fp8_w8a8_decode``), runs the FP8
weights with the decode kernel's e4m3 form from 2 rows on (``fp8_matmul.W8A8_GEMV_MIN_ROWS``
set in its own process): the engine-level measure of rounding decode rows to e4m3.

Writes ``docs/benchmarks/fp8_engine.{md,json,png}`` (and copies to ``$OUT``).

    python benchmarks/bench_fp8_engine.py [--steps 20] [--sides bf16 fp8]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from bench_engine import WORKLOADS, fill_pool, time_decode, time_ttft  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.kv.memory import GiB  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 1024
PRESET = "preset:qwen3.5-27b"
DECODE = ("1 x 8K", "8 ragged (128K + 7x8K)", "16 ragged (128K + 7x8K + 8x4K)")
PREFILL_LEN = 8 * K
MAX_MODEL_LEN = 128 * K + 256
# (measure, unit, FP8 target: ("<=", value) absolute, or ("x", ratio) against bf16)
TARGETS = {
    "1 x 8K": ("ms/step", ("<=", 8.5)),
    "8 ragged (128K + 7x8K)": ("tok/s", (">=", 800.0)),
    "16 ragged (128K + 7x8K + 8x4K)": ("tok/s", (">=", 1450.0)),
    "prefill 8K": ("tok/s", ("x", 1.4)),
}


SIDES = ("bf16", "fp8", "fp8_w8a8_decode")


def run_side(side: str, steps: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    quantization = "fp8" if side.startswith("fp8") else None
    if side == "fp8_w8a8_decode":
        from pagedserve.kernels import fp8_matmul

        fp8_matmul.W8A8_GEMV_MIN_ROWS = 2  # this worker process only
    loaded = load_model(PRESET, "cuda", "bfloat16", progress=False, quantization=quantization)
    load_s = time.perf_counter() - t0
    cfg = EngineConfig(model=PRESET, device="cuda", dtype="bfloat16", cache_type_k="q4_0",
                       cache_type_v="q4_0", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                       quantization=quantization, gpu_memory_utilization=0.92, progress=False)
    t = time.perf_counter()
    engine = LLMEngine(cfg, loaded=loaded)
    ready_s = time.perf_counter() - t
    print(f"{side}: weights {loaded.weights_bytes / 1e9:.1f} GB in {load_s:.0f} s, engine "
          f"ready in {ready_s:.0f} s, {engine.kv.pool.num_blocks} blocks", flush=True)
    fill_pool(engine)
    res = {"weights_gb": loaded.weights_bytes / 1e9, "ready_s": ready_s,
           "kv_gib": engine.runner.memory_usage().kv_bytes / GiB, "decode": {}}
    for name in DECODE:
        r = time_decode(engine, WORKLOADS[name], steps, warmup)
        res["decode"][name] = r
        print(f"  {name:32s} {r['ms_per_step_p50']:7.2f} ms/step  {r['tok_per_s']:7.1f} tok/s",
              flush=True)
    ttft = time_ttft(engine, PREFILL_LEN)
    res["prefill_8k"] = {"ttft_s": ttft, "tok_per_s": PREFILL_LEN / ttft}
    print(f"  prefill 8K: TTFT {ttft:.3f} s ({PREFILL_LEN / ttft:.0f} tok/s)", flush=True)
    del engine, loaded
    gc.collect()
    torch.cuda.empty_cache()
    return res


def measures(side: dict) -> dict[str, float]:
    """The four target measures of one side, in their units."""
    d = side["decode"]
    return {"1 x 8K": d["1 x 8K"]["ms_per_step_p50"],
            DECODE[1]: d[DECODE[1]]["tok_per_s"], DECODE[2]: d[DECODE[2]]["tok_per_s"],
            "prefill 8K": side["prefill_8k"]["tok_per_s"]}


def verdict(name: str, fp8: float, bf16: float | None) -> str:
    op, value = TARGETS[name][1]
    if op == "x":
        if bf16 is None:
            return "-"
        ok = fp8 / bf16 >= value
        return f"{fp8 / bf16:.2f}x (target >= {value}x): {'met' if ok else 'missed'}"
    ok = fp8 <= value if op == "<=" else fp8 >= value
    return f"target {op} {value:g}: {'met' if ok else 'missed'}"


def markdown(res: dict) -> str:
    sides = res["sides"]
    got = {s: measures(v) for s, v in sides.items()}
    out = ["# FP8 weights against bf16 through the engine (Qwen3.5-27B shape)", "",
           _common.meta_line(res["meta"]), "",
           "Random bf16 weights; FP8 = the same weights quantized while loading (128x128 "
           "blocks). Paged q4_0 K/V, the server's step sizes, async scheduling; decode p50 "
           "over the timed steps (`bench_engine` method), prefill = the median TTFT of "
           "three 8K prompts.", ""]
    shown = [s for s in SIDES if s in got]
    fp8_sides = [s for s in shown if s != "bf16"]
    rows = []
    for name, (unit, _) in TARGETS.items():
        vals = {s: got[s][name] for s in got}
        rows.append([name, unit, *(f"{vals[s]:.2f}" for s in shown),
                     *(verdict(name, vals[s], vals.get("bf16")) for s in fp8_sides)])
    out.append(_common.md_table(["measure", "unit", *shown,
                                 *(f"{s} against target" for s in fp8_sides)], rows))
    out += ["", _common.md_table(
        ["side", "weights GB", "K/V pool GiB", "engine ready s"],
        [[s, f"{v['weights_gb']:.1f}", f"{v['kv_gib']:.1f}", f"{v['ready_s']:.0f}"]
         for s, v in sides.items()])]
    return "\n".join(out) + "\n"


def figure(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    got = {s: measures(v) for s, v in res["sides"].items()}
    names = [n for n in TARGETS if n != "1 x 8K"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(got)
    for j, side in enumerate(got):
        ax.bar([i + width * j for i in range(len(names))], [got[side][n] for n in names],
               width, label=side)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_title(f"FP8 vs bf16 weights, 27B shape, {res['meta']['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", nargs="+", default=["bf16", "fp8"], choices=list(SIDES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_engine needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"meta": _common.run_meta(), "sides": {}}
    spawn = multiprocessing.get_context("spawn")
    for side in args.sides:
        with spawn.Pool(1) as worker:
            res["sides"][side] = worker.apply(run_side, (side, args.steps, args.warmup))
    paths = _common.write_outputs(args.out, "fp8_engine", res, markdown(res),
                                  lambda p: figure(res, p))
    print(markdown(res))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
