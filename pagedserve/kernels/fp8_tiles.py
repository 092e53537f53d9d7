"""What the two FP8 linear kernels share: a weight tile, its block scales, and the dot.

The weight is ``float8_e4m3fn`` ``[N, K]`` (K contiguous) with float32 ``scale_inv``
``[R, ceil(K / 128)]`` (``quant/fp8.py``). A kernel's K loop steps one 128-column block
at a time, so each step of a tile of rows reads one scale column::

    k block kb:   w tile  [128, BLOCK_N]  = weight[rows, kb*128 : kb*128 + 128]^T
                  scales  [BLOCK_N]       = scale_inv[scale_row(rows), kb]

The scale row of weight row ``n`` is ``n // 128`` when the fused parts are uniform
(``fp8.uniform_block_rows``: every published shape), else ``scale_rows[n]`` from the
int32 map (``fp8.scale_rows``) that the caller passes (``ROW_MAP``).

``NATIVE`` is false under the Triton interpreter, whose bfloat16 ``tl.dot`` returns
garbage: there every dot widens its operands to float32 (exactly) and runs an IEEE
float32 dot, the same values as the GPU's tensor-core dot up to accumulation order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_rows_of(srow_ptr, rows_n, n_ok, ROW_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """int64 ``[BLOCK_N]``: the ``scale_inv`` row of each weight row (0 past ``N``)."""
    if ROW_MAP:
        srow = tl.load(srow_ptr + rows_n, mask=n_ok, other=0).to(tl.int64)
    else:
        srow = tl.where(n_ok, rows_n // BLOCK, 0).to(tl.int64)
    return srow


@triton.jit
def load_weight_tile(w_ptr, stride_wn, rows_n, n_ok, k, k_ok):
    """``float8_e4m3fn`` ``[BLOCK_K, BLOCK_N]``: the weight's rows ``rows_n`` at columns
    ``k``, transposed for ``x @ w``; zeros outside ``N`` and ``K``."""
    ptrs = w_ptr + rows_n.to(tl.int64)[None, :] * stride_wn + k[:, None]
    return tl.load(ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)


@triton.jit
def dot_f32(a, b, NATIVE: tl.constexpr, IEEE: tl.constexpr):
    """float32 ``a @ b``. On the GPU the operands' own dtype runs on the tensor cores
    (``IEEE``: float32 operands as IEEE float32, not TF32); under the interpreter both
    are widened to float32 first (module doc)."""
    if NATIVE:
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return c
