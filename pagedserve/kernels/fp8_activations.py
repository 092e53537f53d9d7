"""Triton dynamic activation quantization: rows to e4m3 in 1x128 groups (the w8a8 GEMM's A).

The checkpoints' ``activation_scheme: "dynamic"`` means activation scales are computed per
call, one per token and 128-column group, in the weight format's own rule
(``quant/fp8.py``)::

    x  [M, K]  ->  q  float8_e4m3fn [M, K]       x[m, k] ~ q[m, k] * s[m, k // 128]
                   s  float32 [M, ceil(K / 128)]
    per group:  s = amax(|x| over its columns) / 448   (1 for an all-zero group)
                q = round_e4m3(clamp(x / s, -448, 448))

The last group is partial when ``K`` is not a multiple of 128; its maximum is over the
columns that exist. With ``silu_mul`` the rows quantized are SwiGLU's product of a fused
``gate | up`` input ``[M, 2K]``: ``silu(gate) * up`` in float32, rounded to the input's
dtype (what the unfused product would store), so that a prefill's MLP never writes it.

Every float32 step of the quantization is IEEE: ``div_rn`` for both divisions (``/`` is
approximate on CUDA), and e4m3 rounding to nearest-even done with integer ops
(``e4m3_bits``), so the bits equal torch's ``float32 -> float8_e4m3fn`` cast of the same
quotient on the GPU and under the Triton interpreter alike (whose own float32 -> e4m3
cast loses the carry into the exponent: 31.45 becomes 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.quant import fp8

# (row, 128-column group) pairs per program, in row-major order of the pairs, and warps.
GROUPS = 16
NUM_WARPS = 4


@triton.jit
def e4m3_bits(v):
    """float32 ``v`` with ``|v| <= 448`` -> the uint8 bits of float8_e4m3fn, rounded to
    nearest-even (signed zeros kept).

    Normal results (``|v| >= 2^-6``) drop 20 of float32's 23 mantissa bits with
    round-to-nearest-even, the carry running into the exponent, then rebias the exponent
    from 127 to 7. Subnormals are multiples of 2^-9: ``|v| * 512`` rounded to an integer
    (adding and removing 2^23 rounds to nearest-even), whose codes 0..8 continue into the
    normal ones (code 8 is 2^-6).
    """
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    a = tl.abs(v)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a < 0.015625, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_groups(x):
    """float32 ``x`` ``[R, 128]``, one 128-column group a row -> ``(bits, scale)``: the
    uint8 e4m3 bits ``[R, 128]`` and float32 scales ``[R]`` of the module doc's rule
    (zeros past ``K`` leave the group's maximum as it is)."""
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    scale = tl.where(amax > 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)),
                     1.0)
    # Zeros (a decode tile's padding rows) skip the division, keeping their sign: divided,
    # they made the e4m3 decode form slower the fewer of its rows were real
    # (docs/kernel-decisions.md).
    nonzero = x != 0.0
    v = tl.math.div_rn(tl.where(nonzero, x, 1.0), tl.broadcast_to(scale[:, None], x.shape))
    v = tl.where(nonzero, tl.minimum(tl.maximum(v, -448.0), 448.0), x)
    return e4m3_bits(v), scale


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, num_groups, K, KB, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr, SILU_MUL: tl.constexpr,
):
    pair = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS] (row, group) pairs
    row = (pair // KB).to(tl.int64)
    group = pair % KB
    cols = group[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]
    ok = (cols < K) & (pair < num_groups)[:, None]
    x_at = x_ptr + row[:, None] * stride_xm + cols  # [GROUPS, BLOCK]
    x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
    if SILU_MUL:  # x is the gate; up is K columns on
        up = tl.load(x_at + K, mask=ok, other=0.0).to(tl.float32)
        x = (x * tl.sigmoid(x) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    bits, scale = quantize_groups(x)
    tl.store(q_ptr + row[:, None] * stride_qm + cols, bits, mask=ok)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale, mask=pair < num_groups)


def quantize_activations(x: torch.Tensor, rows: int | None = None,
                         scales_row_contiguous: bool = False, silu_mul: bool = False,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization (module doc), Triton.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, last dim contiguous; with ``silu_mul``,
            ``[M, 2K]``: the gate's columns, then up's.
        rows: rows of the outputs, ``>= M`` (default ``M``); rows ``M ..`` are left
            unwritten (padding for a GEMM whose row count must be aligned).
        scales_row_contiguous: lay ``s`` out with its row index contiguous (stride
            ``(1, rows)``, the order cuBLAS's 1x128 block scales take) instead of
            row-major.
        silu_mul: quantize ``silu(gate) * up`` of ``x`` (module doc).

    Returns:
        ``(q, s)``: ``float8_e4m3fn`` ``[rows, K]`` and float32 ``[rows, ceil(K / 128)]``,
        new tensors (allocated through torch's allocator: capturable in a CUDA graph).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    if silu_mul:
        if k % 2:
            raise ValueError(f"silu_mul needs gate | up of even width, got {k} columns")
        k //= 2
    rows = m if rows is None else rows
    if rows < m:
        raise ValueError(f"rows must be >= the {m} rows of x, got {rows}")
    kb = fp8.num_blocks(k)
    q = torch.empty(rows, k, dtype=fp8.FP8_DTYPE, device=x.device)
    if scales_row_contiguous:
        s = torch.empty(kb, rows, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(rows, kb, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, s
    _quantize_kernel[(triton.cdiv(m * kb, GROUPS),)](
        x, q.view(torch.uint8), s, m * kb, k, kb, x.stride(0), q.stride(0), s.stride(0),
        s.stride(1), GROUPS=GROUPS, BLOCK=fp8.BLOCK, SILU_MUL=silu_mul, num_warps=NUM_WARPS,
    )
    return q, s
