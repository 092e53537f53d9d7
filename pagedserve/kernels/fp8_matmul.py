"""The FP8 linear layer's Triton entry point: argument checks and the one method rule.

Two methods, chosen by the number of rows ``M`` of ``x``:

- ``weight_only`` (``M < W8A8_MIN_ROWS``, decode): ``fp8_gemv``, bandwidth-bound; the
  activations stay in their dtype.
- ``w8a8`` (``M >= W8A8_MIN_ROWS``, prefill): ``fp8_activations`` quantizes the rows per
  1x128 group, then ``fp8_gemm`` runs the e4m3 tensor-core GEMM.

The two differ in what they compute (the w8a8 activations are rounded to e4m3); both
write the activation dtype. Shapes alone decide every launch, nothing waits on the
device, and every buffer comes from torch's allocator or the caller, so a call is
capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import fp8_gemm, fp8_gemv
from pagedserve.kernels.decode_plan import device_num_sms
from pagedserve.kernels.fp8_activations import quantize_activations
from pagedserve.quant import fp8

METHODS = ("weight_only", "w8a8")
# From this many rows on, ``method=None`` quantizes the activations and runs the FP8
# tensor-core GEMM; below, the weight-only kernel. The two cross between 32 and 64 rows
# for the MLP projections on an H100 (docs/kernel-decisions.md, "FP8 linear layers").
W8A8_MIN_ROWS = 64
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def method_for(rows: int) -> str:
    """The default method for ``rows`` rows of activations (module doc)."""
    return "w8a8" if rows >= W8A8_MIN_ROWS else "weight_only"


def check_args(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               parts: tuple[int, ...]) -> None:
    """``ValueError`` naming the first argument that does not fit ``fp8_linear``."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {ACTIVATION_DTYPES}")
    if weight.dtype != fp8.FP8_DTYPE or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {fp8.FP8_DTYPE} [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    if sum(parts) != n or min(parts, default=0) <= 0:
        raise ValueError(f"parts {parts} do not sum to the weight's {n} rows")
    want = (sum(fp8.num_blocks(p) for p in parts), fp8.num_blocks(k))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv must be float32 {want}, got {scale_inv.dtype} "
                         f"{tuple(scale_inv.shape)}")
    if scale_inv.stride(1) != 1:
        raise ValueError("scale_inv's last dim must be contiguous")
    devices = {t.device for t in (x, weight, scale_inv)}
    if len(devices) != 1:
        raise ValueError(f"x, weight and scale_inv are on different devices: {devices}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, parts: tuple[int, ...],
    counters: torch.Tensor | None = None, method: str | None = None,
    gemv_config: fp8_gemv.GemvConfig | None = None,
    gemm_config: fp8_gemm.GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for an FP8 block weight, Triton (see ``kernels.ops.fp8_linear``).

    ``gemv_config`` / ``gemm_config`` replace the launch rules (tests, benchmarks).
    """
    check_args(x, weight, scale_inv, parts)
    if method is not None and method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)} (or None)")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    # A ragged fused weight's row -> scale row map: device ops only (no copy from the host).
    scale_rows = None if fp8.uniform_block_rows(parts) else \
        fp8.scale_rows(parts, x.device).to(torch.int32)
    if (method or method_for(m)) == "w8a8":
        xq, xs = quantize_activations(x2)
        y = fp8_gemm.gemm(xq, xs, weight, scale_inv, scale_rows, x.dtype,
                          gemm_config or fp8_gemm.launch_config(m))
    else:
        config = gemv_config or fp8_gemv.launch_config(m, n, k, device_num_sms(x.device))
        if counters is None:
            counters = torch.zeros(-(-n // config.block_n), dtype=torch.int32, device=x.device)
        elif counters.dtype != torch.int32 or counters.device != x.device:
            raise ValueError(f"counters must be int32 on {x.device}, got {counters.dtype} "
                             f"on {counters.device}")
        y = fp8_gemv.gemv(x2, weight, scale_inv, scale_rows, counters, config)
    return y.reshape(*lead, n)
