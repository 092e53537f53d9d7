"""Probe: the FP8 prefill's activation quantization launch (``fp8_activations``) at 8192 rows.

Times ``quantize_activations`` into the cuBLAS layout for the 27B shape's GEMM inputs
(hidden 5120, attention and GDN outputs 6144, the MLP's 17408) and the SwiGLU form on the
MLP's ``gate | up`` rows, for each launch (row-and-group pairs per program, warps), and
prints microseconds and the bytes moved per second (16-bit input read, e4m3 and scales
written)::

    python benchmarks/tools/probe_quantize.py [--rows 8192] [--launches 16/4,32/8,...]

Writes ``probe_quantize.json`` to $OUT when set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.kernels import fp8_activations  # noqa: E402

# name: (columns quantized, silu_mul)
INPUTS = {"hidden 5120": (5120, False), "out 6144": (6144, False),
          "mlp 17408": (17408, False), "gate|up 17408": (17408, True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--launches", default="16/4,32/4,32/8,64/4,64/8,128/8",
                    help="GROUPS/NUM_WARPS pairs, comma-separated")
    args = ap.parse_args()
    launches = [tuple(int(v) for v in spec.split("/")) for spec in args.launches.split(",")]
    results = []
    for name, (k, silu_mul) in INPUTS.items():
        x = torch.randn(args.rows, 2 * k if silu_mul else k, device="cuda").bfloat16()
        moved = x.numel() * 2 + args.rows * k + args.rows * (k // 128) * 4
        for groups, warps in launches:
            fp8_activations.GROUPS, fp8_activations.NUM_WARPS = groups, warps
            call = functools.partial(fp8_activations.quantize_activations, x,
                                     scales_row_contiguous=True, silu_mul=silu_mul)
            us = 1e3 * do_bench(call, warmup=50, rep=300)
            results.append({"input": name, "groups": groups, "warps": warps, "us": us,
                            "gb_s": moved / us / 1e3})
            print(f"{name:>14}  {groups:>3}/{warps}  {us:8.1f} us  {moved / us / 1e3:7.0f} GB/s",
                  flush=True)
    out = os.environ.get("OUT")
    if out:
        meta = {"gpu": torch.cuda.get_device_name(), "rows": args.rows,
                "commit": os.environ.get("PAGEDSERVE_COMMIT", "")}
        Path(out, "probe_quantize.json").write_text(json.dumps({"meta": meta,
                                                                "results": results}, indent=1))


if __name__ == "__main__":
    main()
