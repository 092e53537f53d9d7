"""Side-by-side timing of chosen decode launches and cases, paged and contiguous.

``bench_attention.py`` sweeps and then measures the issue's whole grid (about three
minutes of device time). This times only the launches and cases named on the command
line, paged and contiguous, in one process, so that a question like "is 64-row q8_0 at
168 registers faster than 128 rows?" costs seconds. Every output is checked against the
torch reference like the benchmark's (max error / max |ref| <= 5e-3; a miss prints
``FAIL``). Inputs, timing and the reference are ``bench_attention``'s.

    python benchmarks/tools/probe_decode.py --kv-type q8_0 --cases ragged 16384x8 4096 \\
        --launch element:64:4:1:128:168:3 packed:64:4:1:128:168:3 [--sdpa] [--dry-run]

A launch is ``MODE:BLOCK_N:WARPS:STAGES:MIN_PARTITION:MAXNREG:OCCUPANCY[:TABLE_READ]``
(``MAXNREG`` ``-`` for none; ``TABLE_READ`` ``row`` or ``block``, with ``-now`` for
``table_ahead=False``; ``row`` unless given); ``default`` is the library's choice for the
type. A case is ``ragged`` (128K + 7 x 8K) or ``LENxN``. ``--window N`` shuffles the
paged blocks only within runs of N consecutive blocks (1: each sequence's blocks in
order): is a gap the table or the memory placement, and at what scale? ``--block-size``
sets the paged blocks' tokens (16 in the engine) for the same question. A launch that
fails (say, out of shared memory) prints its error and the probe goes on. Prints one
row per (case, launch) and writes ``probe_decode.json`` to $OUT when set.
``--contig-default`` times the contiguous side with the library's launch (a paged-only
what-if against the benchmark's baseline). ``--dry-run`` runs toy sizes on the CPU under
``TRITON_INTERPRET=1`` to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/tools/
import _common  # noqa: E402
import bench_attention as ba  # noqa: E402

from pagedserve.kernels.decode_plan import DecodeConfig  # noqa: E402


def parse_launch(spec: str, kv_type: str) -> ba.Launch:
    if spec == "default":
        return ba.library_launch(kv_type)[0]
    parts = spec.split(":")
    if len(parts) not in (7, 8):
        raise SystemExit(f"bad launch {spec!r}: want MODE:BLOCK_N:WARPS:STAGES:MIN_PARTITION:"
                         "MAXNREG:OCCUPANCY[:TABLE_READ] or 'default'")
    mode, block_n, warps, stages, min_p, maxnreg, occ = parts[:7]
    table = _common.table_read_fields(parts[7] if len(parts) == 8 else "row")
    return ba.Launch(DecodeConfig(block_n=int(block_n), num_warps=int(warps),
                                  num_stages=int(stages), min_partition=int(min_p),
                                  quant_dot=mode,
                                  maxnreg=None if maxnreg == "-" else int(maxnreg), **table),
                     float(occ))


def parse_case(spec: str, ragged: tuple[int, ...]) -> tuple[int, ...]:
    if spec == "ragged":
        return ragged
    length, _, count = spec.partition("x")
    try:
        return (int(length),) * int(count or 1)
    except ValueError:
        raise SystemExit(f"bad case {spec!r}: want 'ragged' or LENxN, e.g. 16384x8") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-type", choices=("f16", "q8_0", "q4_0"), required=True)
    ap.add_argument("--cases", nargs="+", default=["ragged"])
    ap.add_argument("--launch", nargs="+", default=["default"])
    ap.add_argument("--sdpa", action="store_true", help="also time torch SDPA (f16 only)")
    ap.add_argument("--window", type=int, default=0,
                    help="shuffle paged blocks only within runs of this many consecutive "
                         "blocks (1: in order; 0, the default: the whole pool)")
    ap.add_argument("--block-size", type=int, default=ba.BS,
                    help="tokens per paged block (a what-if: the engine's is 16)")
    ap.add_argument("--contig-default", action="store_true",
                    help="time the contiguous side with the library's launch whatever the "
                         "paged launch (a paged-only what-if against the benchmark's baseline)")
    ap.add_argument("--min-seconds", type=float, default=0.05,
                    help="time each side for at least this long (bench_attention.py times "
                         "0.15 s per side): does a sustained load, with the GPU at its power "
                         "cap, change the ratio?")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    launches = [parse_launch(s, args.kv_type) for s in args.launch]
    library = parse_launch("default", args.kv_type)
    if args.dry_run:
        device, sizes, method = "cpu", ba.DRY, "eager"
    elif torch.cuda.is_available():
        device, sizes, method = "cuda", ba.FULL, "graph"
    else:
        raise SystemExit("needs a CUDA device (or --dry-run under TRITON_INTERPRET=1)")
    bench = ba.Bench(sizes, device, (method,), l2=50 << 20)
    rows = []
    for case in args.cases:
        lens = parse_case(case, sizes.ragged)
        paged = bench.copies(args.kv_type, lens, seed=7, window=args.window,
                             block_size=args.block_size)
        contig = [ba.contiguous_of(p, max(lens)) for p in paged]
        sdpa_us = None
        if args.sdpa and args.kv_type == "f16":
            sdpa_us = _common.time_calls([lambda i=i: ba.sdpa(i, "full") for i in contig], method)
        for spec, launch in zip(args.launch, launches, strict=True):
            row = {"case": case, "lens": list(lens), **launch.as_dict(), "sdpa_us": sdpa_us}
            try:
                contig_launch = library if args.contig_default else launch
                sides = {name: [lambda i=i, lc=lc: bench.runner.ours(i, lc) for i in inputs]
                         for name, inputs, lc in (("paged", paged, launch),
                                                  ("contig", contig, contig_launch))}
                for name, us in _common.time_sides(sides, method, min_rounds=8,
                                                   min_seconds=args.min_seconds).items():
                    row[f"{name}_us"] = us
                for name, inputs in (("paged", paged), ("contig", contig)):
                    row[f"{name}_err"] = ba.rel_err(inputs[0].out, paged[0])
            except Exception as exc:  # e.g. out of shared memory: report, go on
                row["error"] = repr(exc)[:300]
                rows.append(row)
                print(f"{case:>10} {spec:>26}  ERROR {row['error'][:120]}", flush=True)
                continue
            ok = max(row["paged_err"], row["contig_err"]) <= ba.CHECK_BOUND
            rows.append(row)
            print(f"{case:>10} {spec:>26}  paged "
                  f"{row['paged_us']:9.1f} us  contig {row['contig_us']:9.1f} us  "
                  f"paged/contig {row['contig_us'] / row['paged_us']:.3f}"
                  + (f"  vs SDPA {sdpa_us / row['paged_us']:.2f}x" if sdpa_us else "")
                  + ("" if ok else f"  FAIL err {max(row['paged_err'], row['contig_err']):.1e}"),
                  flush=True)
    if os.environ.get("OUT"):
        meta = _common.run_meta()
        Path(os.environ["OUT"], "probe_decode.json").write_text(
            json.dumps({**meta, "kv_type": args.kv_type, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
