"""Where a decode call's time goes: per-program timelines of the decode kernels.

The benchmark's per-call time of a short case is far above its bytes' share of the
copy bandwidth (one 4K q4_0 sequence: about 22 us for 4.7 MB). This launches the
library's kernel for the type (the Gluon ``fragment`` kernels: ``quant_fragments`` for
q4_0 and q8_0, ``float_fragments`` for f16) once with ``trace=``, so that every program
records the global timer at six points (``decode_trace.TRACE_FIELDS``), and prints, per
case, the phases over all programs (relative to the first program's entry)::

    entry -> planned -> loop -> looped -> stored -> merged
     plan     prologue   tiles   epilogue  count and merge

Beside them, in the same process and by the benchmark's method (CUDA-graph replay over
rotating input copies), the untraced call's time, and the floor of one graph node: an
empty kernel over the same grid. ``--layout contiguous`` traces the padded contiguous
layout of the same values. Writes ``trace_decode.json`` to ``--out`` (or $OUT).

    python benchmarks/tools/trace_decode.py --kv-type q4_0 --cases ragged 4096x1 131072x1
    python benchmarks/tools/trace_decode.py --kv-type f16 --cases 4096x2 --layout contiguous
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/tools/
import _common  # noqa: E402
import bench_attention as ba  # noqa: E402
from probe_decode import parse_case  # noqa: E402

from pagedserve.kernels import paged_decode  # noqa: E402
from pagedserve.kernels.decode_plan import DecodeWorkspace, default_occupancy  # noqa: E402
from pagedserve.kernels.decode_trace import TRACE_FIELDS  # noqa: E402

FIELD = {name: i for i, name in enumerate(TRACE_FIELDS)}  # a record's column of each field
PHASES = (("plan", "entry", "planned"), ("prologue", "planned", "loop"),
          ("tiles", "loop", "looped"), ("epilogue", "looped", "stored"),
          ("merge", "stored", "merged"))


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def summarize(rec: torch.Tensor) -> dict:
    """Phase statistics of trace records ``[programs, 8]`` (programs with work only)."""
    f = FIELD
    rows = [r for r in rec.tolist() if r[f["planned"]] != 0]
    t0 = min(r[f["entry"]] for r in rows)
    us = [{k: (r[i] - t0) / 1e3 for k, i in f.items() if k not in ("sm", "tiles")}
          | {"sm": r[f["sm"]], "tiles": r[f["tiles"]]} for r in rows]
    out = {"programs": len(us), "span_us": max(u["merged"] for u in us),
           "entry_p50_us": _pct([u["entry"] for u in us], 0.5),
           "entry_max_us": max(u["entry"] for u in us),
           "looped_p50_us": _pct([u["looped"] for u in us], 0.5),
           "looped_max_us": max(u["looped"] for u in us),
           "stored_p50_us": _pct([u["stored"] for u in us], 0.5),
           "stored_max_us": max(u["stored"] for u in us),
           "tiles_max": max(u["tiles"] for u in us)}
    for name, a, b in PHASES:
        d = [u[b] - u[a] for u in us]
        out[f"{name}_p50_us"] = _pct(d, 0.5)
        out[f"{name}_max_us"] = max(d)
    per_tile = [(u["looped"] - u["loop"]) / u["tiles"] for u in us if u["tiles"] > 0]
    out["tile_p50_us"] = _pct(per_tile, 0.5)
    last = max(us, key=lambda u: u["merged"])
    out["last"] = {k: round(v, 3) for k, v in last.items()}
    sms = [u["sm"] for u in us]
    out["programs_per_sm_max"] = max(sms.count(s) for s in set(sms))
    # When each SM's last loop ended: co-resident programs share an SM unevenly (one ends
    # early, the other then runs alone), so the programs' own ends overstate imbalance.
    sm_end: dict[int, float] = {}
    for u in us:
        sm_end[u["sm"]] = max(sm_end.get(u["sm"], 0.0), u["looped"])
    out["sm_looped_p10_us"] = _pct(list(sm_end.values()), 0.1)
    out["sm_looped_p50_us"] = _pct(list(sm_end.values()), 0.5)
    out["sm_looped_max_us"] = max(sm_end.values())
    return out


def sm_tile_correlation(rec_a: list[list[int]], rec_b: list[list[int]],
                        min_tiles: int = 4) -> float:
    """Pearson correlation, over the SMs, of the mean time per tile of the programs each SM
    ran (``min_tiles`` tiles or more) in two calls' records: near 1 when the same SMs are
    slow in both calls (the speed belongs to the SM, not to the call); NaN with fewer than
    three SMs in common."""
    f = FIELD

    def per_sm(rec: list[list[int]]) -> dict[int, float]:
        times: dict[int, list[float]] = {}
        for r in rec:
            if r[f["planned"]] and r[f["tiles"]] >= min_tiles:
                times.setdefault(r[f["sm"]], []).append(
                    (r[f["looped"]] - r[f["loop"]]) / r[f["tiles"]])
        return {sm: statistics.fmean(t) for sm, t in times.items()}

    a, b = per_sm(rec_a), per_sm(rec_b)
    common = sorted(set(a) & set(b))
    if len(common) < 3:
        return math.nan
    return statistics.correlation([a[s] for s in common], [b[s] for s in common])


def trace_case(kv_type: str, lens: tuple[int, ...], layout: str = "paged") -> dict:
    ws = DecodeWorkspace(8, ba.HQ, ba.HKV, ba.D, "cuda",
                         occupancy=default_occupancy(kv_type, kv_type))
    nbytes = ba.live_bytes(kv_type, lens)
    copies = ba.copies_for(nbytes, _common.run_meta()["l2_bytes"], ba.FULL)
    inputs = [ba.paged_inputs(kv_type, lens, seed=11 + i, device="cuda") for i in range(copies)]
    if layout == "contiguous":
        inputs = [ba.contiguous_of(inp, max(lens)) for inp in inputs]

    def call(inp, trace=None):  # the library's launch for the type, size and layout
        return paged_decode.paged_decode_attention(
            inp.q, inp.k, inp.v, inp.tables, inp.lens, ba.SCALE, workspace=ws, out=inp.out,
            validate=False, trace=trace)

    cfg = paged_decode.resolve_config(None, inputs[0].k, inputs[0].v, inputs[0].tables)
    grid = paged_decode.decode_grid(ws, len(lens), cfg)
    trace = torch.zeros(math.prod(grid), 8, dtype=torch.int64, device="cuda")
    for _ in range(3):  # compile both variants, warm up
        call(inputs[0])
        call(inputs[-1], trace)
    err = ba.rel_err(inputs[-1].out, inputs[-1])
    runs, records = [], []
    for i in range(5):  # each after an idle GPU: one traced call, alone
        torch.cuda.synchronize()
        trace.zero_()
        call(inputs[i % copies], trace)
        torch.cuda.synchronize()
        rec = trace.cpu()
        runs.append(summarize(rec))
        records.append(rec.tolist())
    best = min(runs, key=lambda r: r["span_us"])
    calls = [lambda inp=inp: call(inp) for inp in inputs]
    empty = [lambda: _empty_kernel[grid](trace)] * len(calls)
    return {"lens": f"{lens[0]}x{len(lens)}" if len(set(lens)) == 1 else "ragged",
            "layout": layout,
            "live_mb": nbytes / 1e6, "max_err": err,
            "graph_us": _common.time_calls(calls, "graph"),
            "empty_kernel_graph_us": _common.time_calls(empty, "graph"),
            "span_us_runs": [round(r["span_us"], 2) for r in runs], **best,
            "sm_tile_correlation": sm_tile_correlation(records[0], records[1]),
            # Each run's raw records, one row per program (grid order): TRACE_FIELDS.
            "records": records}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-type", choices=("q4_0", "q8_0", "f16"), default="q4_0")
    ap.add_argument("--layout", choices=("paged", "contiguous"), default="paged")
    ap.add_argument("--cases", nargs="+", default=["ragged", "4096x1", "131072x1"])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("trace_decode needs a GPU (the timer and SM reads are PTX)")
    copy_bw = _common.copy_bandwidth_gbs()
    results = []
    cols = ["case", "MB", "graph us", "empty us", "span us", "entry p50/max", "plan",
            "prologue", "tiles (max)", "tile us", "epilogue", "merge p50/max", "last end"]
    print(f"{args.kv_type}, {args.layout}, copy bandwidth {copy_bw:.0f} GB/s; phases: p50 over "
          "programs, us")
    print(" | ".join(cols))
    for spec in args.cases:
        r = trace_case(args.kv_type, parse_case(spec, ba.RAGGED), args.layout)
        results.append(r)
        print(" | ".join(str(x) for x in [
            r["lens"], f"{r['live_mb']:.1f}", f"{r['graph_us']:.1f}",
            f"{r['empty_kernel_graph_us']:.1f}", f"{r['span_us']:.1f}",
            f"{r['entry_p50_us']:.2f}/{r['entry_max_us']:.2f}", f"{r['plan_p50_us']:.2f}",
            f"{r['prologue_p50_us']:.2f}", f"{r['tiles_p50_us']:.1f} ({r['tiles_max']})",
            f"{r['tile_p50_us']:.3f}", f"{r['epilogue_p50_us']:.2f}",
            f"{r['merge_p50_us']:.2f}/{r['merge_max_us']:.2f}", r["last"]]))
        print(f"   own work done (stored) p50 {r['stored_p50_us']:.2f} max "
              f"{r['stored_max_us']:.2f}; loop ended p50 {r['looped_p50_us']:.2f} max "
              f"{r['looped_max_us']:.2f}; spans of 5 runs: {r['span_us_runs']}; "
              f"max err {r['max_err']:.1e}")
        print(f"   each SM's last loop end p10 {r['sm_looped_p10_us']:.1f} p50 "
              f"{r['sm_looped_p50_us']:.1f} max {r['sm_looped_max_us']:.1f}; per-SM time per "
              f"tile, correlation between calls 1 and 2: {r['sm_tile_correlation']:.2f}")
    if args.out:
        path = Path(args.out) / "trace_decode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": _common.run_meta(), "copy_bw_gbs": copy_bw,
                                    "kv_type": args.kv_type, "layout": args.layout,
                                    "cases": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
