"""Probe: which scale layouts ``torch._scaled_mm`` reads for 1x128 x 128x128 FP8 GEMMs.

cuBLAS's block-scaled e4m3 GEMM takes the activations' 1x128 group scales and the
weights' 128x128 block scales in layouts that its documentation fixes and torch passes
through unchecked: a wrong stride runs without error and gives wrong numbers. This probe
runs each candidate layout on one problem against the dequantized float32 matmul and
prints the error of each, relative to the largest output::

    A  e4m3 [M, K]   scales [M, K/128]       1x128 groups
    B  e4m3 [N, K]   scales [N/128, K/128]   128x128 blocks (the checkpoints' own)
    out = (A * sA) @ (B * sB).T

Candidates for sA: row-major, or outer-dimension (M) contiguous. For sB: ``sB.T`` (the
view, K/128 contiguous), ``sB.T`` copied contiguous, and ``sB`` itself. K/128 is a
multiple of 4 unless ``--k`` says otherwise.

    python benchmarks/tools/probe_scaled_mm.py [--m 256] [--n 768] [--k 1024]

Writes ``probe_scaled_mm.json`` to $OUT when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.kernels.fp8_activations import quantize_activations  # noqa: E402
from pagedserve.quant import fp8  # noqa: E402


def candidates(xs: torch.Tensor, scale_inv: torch.Tensor) -> dict[str, tuple]:
    """(scale_a, scale_b) per named layout."""
    a_layouts = {"a_row_major": xs.contiguous(), "a_m_contiguous": xs.t().contiguous().t()}
    b_layouts = {"b_T_view": scale_inv.t(), "b_T_copy": scale_inv.t().contiguous(),
                 "b_plain": scale_inv}
    return {f"{an}+{bn}": (a, b) for an, a in a_layouts.items() for bn, b in b_layouts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--n", type=int, default=768)
    ap.add_argument("--k", type=int, default=1024)
    args = ap.parse_args()
    m, n, k = args.m, args.n, args.k
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    # Scales that differ by group and block, so that a transposed grid shows.
    col_scale = torch.logspace(-1, 1, k // fp8.BLOCK, device=dev).repeat_interleave(fp8.BLOCK)
    row_scale = torch.logspace(-2, 0, n // fp8.BLOCK, device=dev).repeat_interleave(fp8.BLOCK)
    x = (torch.randn(m, k, device=dev, generator=gen) * col_scale).bfloat16()
    w = torch.randn(n, k, device=dev, generator=gen) * row_scale[:, None]
    weight, scale_inv = fp8.quantize(w)
    xq, xs = quantize_activations(x)
    x_deq = (xq.float().view(m, k // fp8.BLOCK, fp8.BLOCK) * xs[:, :, None]).view(m, k)
    ref = F.linear(x_deq, fp8.dequantize(weight, scale_inv, (n,), torch.float32))
    results = {"m": m, "n": n, "k": k, "torch": torch.__version__,
               "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "layouts": {}}
    for name, (sa, sb) in candidates(xs, scale_inv).items():
        try:
            out = torch._scaled_mm(xq, weight.t(), scale_a=sa, scale_b=sb,
                                   out_dtype=torch.bfloat16).float()
            err = float((out - ref).abs().max() / ref.abs().max())
            results["layouts"][name] = {"error": err, "strides": [list(sa.stride()),
                                                                  list(sb.stride())]}
            print(f"{name:28s} rel. error {err:.3g}  strides a {sa.stride()} b {sb.stride()}")
        except Exception as exc:  # noqa: BLE001 - a refused layout is a result here
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            results["layouts"][name] = {"refused": msg}
            print(f"{name:28s} refused: {msg}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "probe_scaled_mm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
