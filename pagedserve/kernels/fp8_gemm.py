"""Triton w8a8 FP8 GEMM for many rows (prefill): e4m3 activations x e4m3 weights on the
tensor cores, with a block scale on each side.

The activations are quantized first, per token and 128-column group
(``fp8_activations``), as the checkpoints' ``activation_scheme: "dynamic"`` says. With
``xq, xs`` the activations' e4m3 values and scales and ``wq, ws`` the weight's::

    y[m, n] = sum over k blocks kb of  xs[m, kb] * ws[scale_row(n), kb]
                                       * sum_{k in kb} xq[m, k] * wq[n, k]

Each 128-column block is one e4m3 dot into float32 (on the H200 the FP8 MMA's own
accumulation is narrower than float32, so promoting every 128 columns bounds its error),
scaled by the outer product of the two scale vectors and added to a float32 accumulator;
the output is rounded once to the activation dtype. The scales inside the K loop and the
promotion every block follow DeepSeek-V3's fine-grained FP8 GEMM (the design behind
vLLM's and SGLang's block-FP8 Triton kernels); this kernel is written from the formula.

Programs take output tiles in groups of ``GROUP_M`` row tiles (the Triton matmul
tutorial's order), so that the weight tiles a group shares are read from L2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_tiles import dot_f32, load_weight_tile, scale_rows_of
from pagedserve.quant import fp8


@dataclass(frozen=True)
class GemmConfig:
    """One launch's tiles (``BLOCK_K`` is the scale block, 128). The defaults reach 560-596
    TFLOP/s at 8192 rows on an H100, below cuBLAS bf16; other tiles are untried
    (docs/kernel-decisions.md, "FP8 linear layers")."""

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")
        if self.group_m < 1:
            raise ValueError(f"group_m must be >= 1, got {self.group_m}")


def launch_config(m: int) -> GemmConfig:
    """128 x 128 tiles; 64-row tiles when ``m`` fits one."""
    if m <= 64:
        return GemmConfig(block_m=64, num_warps=4)
    return GemmConfig()


@triton.jit
def _gemm_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, srow_ptr, out_ptr,
    M, N, K, stride_xm, stride_xsm, stride_wn, stride_sr, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
    GROUP_M: tl.constexpr, ROW_MAP: tl.constexpr, NATIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_ok = rows_m < M
    n_ok = rows_n < N
    srow = scale_rows_of(srow_ptr, rows_n, n_ok, ROW_MAP, BLOCK)  # [BLOCK_N]
    x_rows = xq_ptr + rows_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    xs_rows = xs_ptr + rows_m.to(tl.int64) * stride_xsm  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK)):
        k = kb * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = load_weight_tile(w_ptr, stride_wn, rows_n, n_ok, k, k_ok)  # [BLOCK, BLOCK_N]
        a_s = tl.load(xs_rows + kb, mask=m_ok, other=0.0)  # [BLOCK_M]
        b_s = tl.load(s_ptr + srow * stride_sr + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += dot_f32(a, b, NATIVE, False) * (a_s[:, None] * b_s[None, :])
    out_ptrs = out_ptr + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
    scale_rows: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig,
) -> torch.Tensor:
    """``y`` of the module doc. Arguments are checked by the caller (``kernels.fp8_linear``).

    Args:
        xq: ``float8_e4m3fn`` ``[M, K]``, last dim contiguous; ``xs`` float32
            ``[M, ceil(K / 128)]`` (``fp8_activations.quantize_activations``).
        weight: ``float8_e4m3fn`` ``[N, K]``, contiguous; ``scale_inv`` float32
            ``[R, ceil(K / 128)]``.
        scale_rows: int32 ``[N]`` scale row of each weight row, or ``None`` for ``n // 128``.
        out_dtype: the output's dtype (the activations').

    Returns:
        ``[M, N]`` in ``out_dtype``.
    """
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _gemm_kernel[grid](
        xq, xs, weight, scale_inv, weight if scale_rows is None else scale_rows, out,
        m, n, k, xq.stride(0), xs.stride(0), weight.stride(0), scale_inv.stride(0),
        out.stride(0), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK=fp8.BLOCK,
        GROUP_M=config.group_m, ROW_MAP=scale_rows is not None, NATIVE=xq.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
