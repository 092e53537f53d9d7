"""Triton readers of K/V tiles in every storage type, and the two products of decode.

The byte layout is ``pagedserve.kv.formats``' (one row = one token of one K/V head)::

    f16/bf16  data row: D x 2 bytes
    q8_0      data row: D int8 (qs)                 scale row: D/32 fp16 (d per group)
    q4_0      data row: D/2 bytes, group g = bytes g*16 .. g*16+15
                        byte j: bits 3..0 -> value g*32 + j, bits 7..4 -> value g*32 + 16 + j

Quantized values reach the tensor cores as *exact* small integers in f16, built without
an int->float conversion instruction (conversions issue at a small fraction of the FMA
rate, one reason a naive q4_0 decode is slower than f16 despite reading 3.5x fewer
bytes). The integer goes into the low mantissa bits of a float16 whose exponent makes
the value 1024 + x, and one subtraction removes the 1024 and GGML's offset together
(the "magic number" conversion used by FasterTransformer and Marlin; written here from
the IEEE layout, not copied)::

    q4_0: bits = 0x6400 | nibble           -> 1024 + nibble ; minus 1032 -> nibble - 8
    q8_0: bits = 0x6400 + (128 + qs)       -> 1152 + qs     ; minus 1152 -> qs

Both results are exact in f16. Group scales are applied in one of three ways
(``DecodeConfig.quant_dot``):

- ``group``: per-group dots on the exact integers (batched over the D/32 groups). For K
  the scale multiplies the small per-group partial scores,
  ``s = sum_g d_g * (q_g . k_g)``; for V it is folded into p,
  ``o_g = (p * d_g) @ v_g``. No per-element scale multiply at all.
- ``element``: one multiply per element dequantizes to f16, then one full-width dot.
- ``packed``: as ``element``, but two values per instruction. Rows arrive in 16-byte
  vectors; on a GPU a few PTX lines (``prmt``, ``lop3``, ``sub.f16x2``, ``mul.f16x2``)
  turn each 4-byte word into four (q8_0) or eight (q4_0) scaled f16 values, about two
  instructions per value where the generic path spends several. The values are the same
  bit for bit: ``int - offset`` is exact and the one multiply by the scale rounds once
  either way. A q4_0 *K* tile keeps each byte's two nibbles side by side, so a group's
  columns come out in *pair order*; the score dot does not care about the order of its
  reduction axis as long as q is loaded in the same order (``load_q(PERM=True)``). This
  keeps the K tile in registers all the way into the tensor-core operand. A q4_0 *V* tile
  is produced in natural order (its columns are the output's)::

      q4_0 group g, pair order:  column g*32 + 2j + h  holds value  g*32 + 16h + j
                                 (byte j of the group, h = 0: low nibble, 1: high)

  The choice between orders and modes came from instruction counts of the compiled
  tile loop (``benchmarks/decode_sass.py``) and the H200 sweep; the PTX itself is
  checked on the host by ``tests/kernels/test_dequant_ptx.py``.

GQA: the dots take the query heads of one K/V head as rows, padded to ``G_PAD >= 16``
rows for ``tl.dot``; every K/V row is loaded once for all of them.

``NATIVE=False`` is for the Triton interpreter, which runs no inline PTX and keeps
bfloat16 as raw uint16 without bfloat16 arithmetic: the packed dequantization takes the
generic path there, and bf16 operands are widened to float32 (exactly) and multiplied in
IEEE float32. On a GPU bf16 tiles go to the tensor cores as they are.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _q4_exact(nibble):
    """int16 nibbles (0..15) -> ``nibble - 8`` in f16, exactly (the magic-number trick)."""
    return ((nibble & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0


@triton.jit
def _q8_exact(qs):
    """int8 ``qs`` -> ``qs`` in f16, exactly (the magic-number trick)."""
    return (qs.to(tl.int16) + 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _exact_ints(data_ptr, offs, mask, KV_TYPE: tl.constexpr):
    """Quantized payload at ``offs`` -> its integers (``nibble - 8`` or ``qs``) in f16.

    For q4_0, ``offs`` points at bytes; the last axis of ``offs`` must span the 32 values
    of a group: lanes 0..15 read the low nibbles of bytes 0..15, lanes 16..31 the high.
    """
    if KV_TYPE == "q8_0":
        return _q8_exact(tl.load(data_ptr + offs, mask=mask, other=0))  # int8
    else:
        lane = tl.arange(0, 32)
        shift = ((lane // 16) * 4).to(tl.int16)
        byte = tl.load(data_ptr + offs, mask=mask, other=0x88)  # uint8; masked -> 0
        return _q4_exact(byte.to(tl.int16) >> shift)


@triton.jit
def _group_offsets(row_off, KV_TYPE: tl.constexpr, NG: tl.constexpr, GROUP_FIRST: tl.constexpr):
    """Payload offsets of a tile of rows, split into groups.

    Args:
        row_off: int64 ``[N]`` offset of each row's payload.

    Returns:
        int64 ``[NG, N, 32]`` (``GROUP_FIRST``) or ``[N, NG, 32]``.
    """
    lane = tl.arange(0, 32)
    grp = tl.arange(0, NG)
    if KV_TYPE == "q8_0":
        within = lane
        stride = 32
    else:
        within = lane % 16
        stride = 16
    if GROUP_FIRST:
        return (row_off[None, :, None] + grp[:, None, None] * stride) + within[None, None, :]
    else:
        return (row_off[:, None, None] + grp[None, :, None] * stride) + within[None, None, :]


@triton.jit
def load_float_tile(data_ptr, row_off, valid, D: tl.constexpr):
    """f16/bf16 rows ``[N, D]`` (masked rows read as 0)."""
    cols = tl.arange(0, D)
    return tl.load(data_ptr + row_off[:, None] + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def load_group_tile(
    data_ptr, scale_ptr, row_off, scale_off, valid,
    KV_TYPE: tl.constexpr, NG: tl.constexpr, GROUP_FIRST: tl.constexpr,
):
    """Quantized rows as exact integers and their group scales.

    Returns:
        ``(ints, scales)``: f16 ``[NG, N, 32]`` and float32 ``[NG, N]`` (``GROUP_FIRST``),
        or f16 ``[N, NG, 32]`` and float32 ``[N, NG]``.
    """
    offs = _group_offsets(row_off, KV_TYPE, NG, GROUP_FIRST)
    grp = tl.arange(0, NG)
    if GROUP_FIRST:
        ints = _exact_ints(data_ptr, offs, valid[None, :, None], KV_TYPE)
        sc = tl.load(scale_ptr + scale_off[None, :] + grp[:, None], mask=valid[None, :], other=0.0)
    else:
        ints = _exact_ints(data_ptr, offs, valid[:, None, None], KV_TYPE)
        sc = tl.load(scale_ptr + scale_off[:, None] + grp[None, :], mask=valid[:, None], other=0.0)
    return ints, sc.to(tl.float32)


def _minus_offset_times_scale(scales: list[str]) -> str:
    """PTX lines shared by the q4_0 decoders: outputs ``$0..$3`` hold f16 pairs
    ``1024 + nibble``; subtract ``off`` (1032, so the value is ``nibble - 8``, exact) and
    multiply by the scale registers ``scales[i]`` (one rounding)."""
    return "".join([f"sub.f16x2 ${i}, ${i}, off;\n" for i in range(4)]
                   + [f"mul.f16x2 ${i}, ${i}, {r};\n" for i, r in enumerate(scales)])


# Each asm invocation takes 4 q4_0 bytes, each present twice (the input is the byte tile
# joined with itself, so that its shape is the output's: two registers [b0 b0 b1 b1] and
# [b2 b2 b3 b3]), and their group scale (four f16x2 registers). For byte b it builds one
# register whose low half is 0x6400 | (b & 15) and whose high half is 0x6400 | (b >> 4):
# u = w >> 4 puts each byte's high nibble in the low bits of that byte position, prmt
# gathers b (byte 0) and its high nibble (byte 2), and one lop3 masks and sets the
# exponent, giving the f16 pair (1024 + lo, 1024 + hi). Minus 1032 -> nibble - 8; times d.
# Output: the values of b0..b3 in pair order (lo, hi, lo, hi, ...), four f16x2 registers.
_Q4_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 t, u0, u1, nib, magic, off;
mov.b32 nib, 0x000f000f;
mov.b32 magic, 0x64006400;
mov.b32 off, 0x64086408;
shr.b32 u0, $4, 4;
shr.b32 u1, $5, 4;
prmt.b32 t, $4, u0, 0x0400;
lop3.b32 $0, t, nib, magic, 0xea;
prmt.b32 t, $4, u0, 0x0602;
lop3.b32 $1, t, nib, magic, 0xea;
prmt.b32 t, $5, u1, 0x0400;
lop3.b32 $2, t, nib, magic, 0xea;
prmt.b32 t, $5, u1, 0x0602;
lop3.b32 $3, t, nib, magic, 0xea;
""" + _minus_offset_times_scale(["$6", "$7", "$8", "$9"]) + "}")

# Each asm invocation takes 4 q4_0 bytes (one register) and their group scale (two f16x2
# registers). t = [b0 b2 b1 b3] (prmt), so that one lop3 with 0x000f000f | 0x64006400
# picks the low nibbles of b0 and b1 into the two halves of a register (f16 1024 +
# nibble); shifts by 8, 4 and 12 give the low nibbles of (b2, b3) and the high nibbles of
# (b0, b1) and (b2, b3). Minus 1032 -> nibble - 8; times d. Outputs: the low-nibble
# values of b0..b3, then the high-nibble values (two f16x2 registers each).
_Q4_HALVES_ASM = tl.constexpr("""
{
.reg .b32 t, u, z, nib, magic, off;
mov.b32 z, 0;
mov.b32 nib, 0x000f000f;
mov.b32 magic, 0x64006400;
mov.b32 off, 0x64086408;
prmt.b32 t, $4, z, 0x3120;
lop3.b32 $0, t, nib, magic, 0xea;
shr.b32 u, t, 8;
lop3.b32 $1, u, nib, magic, 0xea;
shr.b32 u, t, 4;
lop3.b32 $2, u, nib, magic, 0xea;
shr.b32 u, t, 12;
lop3.b32 $3, u, nib, magic, 0xea;
""" + _minus_offset_times_scale(["$5", "$6", "$5", "$6"]) + "}")

_Q8_PAIRS_ASM = tl.constexpr("""
{
.reg .b32 t, z, sign, magic, off;
mov.b32 z, 0;
mov.b32 sign, 0x00800080;
mov.b32 magic, 0x64006400;
mov.b32 off, 0x64806480;
prmt.b32 t, $2, z, 0x4140;
lop3.b32 t, t, sign, magic, 0xbe;
sub.f16x2 t, t, off;
mul.f16x2 $0, t, $3;
prmt.b32 t, $2, z, 0x4342;
lop3.b32 t, t, sign, magic, 0xbe;
sub.f16x2 t, t, off;
mul.f16x2 $1, t, $4;
}
""")
# q8_0, bytes b0..b3 -> [b0 0 b1 0] and [b2 0 b3 0]; (x ^ 0x80) | 0x6400 is the f16
# 1024 + (qs + 128); minus 1152 -> qs; times d.


@triton.jit
def _q4_pairs(byte, scale, NATIVE: tl.constexpr):
    """q4_0 bytes ``[..., 16]`` (uint8) and their group scale (f16, broadcastable) ->
    f16 ``[..., 16, 2]``: ``(nibble - 8) * d`` of each byte's low and high nibble."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            _Q4_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r,r,r",
            [tl.join(byte, byte), tl.expand_dims(scale, -1)],
            dtype=tl.float16, is_pure=True, pack=8,
        )
    else:
        b = byte.to(tl.int16)
        return tl.join(_q4_exact(b) * scale, _q4_exact(b >> 4) * scale)


@triton.jit
def _q4_halves(byte, scale, NATIVE: tl.constexpr):
    """q4_0 bytes ``[..., 16]`` (uint8) and their group scale (f16, broadcastable) ->
    ``(lo, hi)`` f16 ``[..., 16]``: ``(nibble - 8) * d`` of the low and high nibbles."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            _Q4_HALVES_ASM, "=r,=r,=r,=r,r,r,r", [byte, scale],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
        )
    else:
        b = byte.to(tl.int16)
        return _q4_exact(b) * scale, _q4_exact(b >> 4) * scale


@triton.jit
def _q8_values(qs, scale, NATIVE: tl.constexpr):
    """q8_0 payload ``[...]`` (int8) and its group scale (f16, broadcastable) ->
    ``qs * d`` in f16."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            _Q8_PAIRS_ASM, "=r,=r,r,r,r", [qs, scale],
            dtype=tl.float16, is_pure=True, pack=4,
        )
    else:
        return _q8_exact(qs) * scale


@triton.jit
def load_packed_tile(
    data_ptr, scale_ptr, row_off, scale_off, valid,
    KV_TYPE: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, NATIVE: tl.constexpr,
    PAIR_ORDER: tl.constexpr,
):
    """Quantized rows dequantized to f16 ``[N, D]``, two values per instruction on a GPU;
    q4_0 columns in pair order (``PAIR_ORDER``: K tiles, module docstring) or natural
    order (V tiles); q8_0 always natural.

    Only the scales are masked: a row that is not ``valid`` must point at an in-bounds
    row (the kernel points it at row 0 of the pool), its scale loads as 0 and every value
    of it is an exact 0, whatever its payload holds. Unpredicated payload loads shorten
    the tile loop (sm_90 SASS, ``benchmarks/decode_sass.py``: 1032 -> 810 instructions at
    64-row tiles and 8 warps).
    """
    grp = tl.arange(0, NG)
    d = tl.load(scale_ptr + scale_off[:, None] + grp[None, :], mask=valid[:, None],
                other=0.0)[:, :, None]  # [N, NG, 1] f16
    if KV_TYPE == "q8_0":
        lane = tl.arange(0, 32)
        offs = row_off[:, None, None] + grp[None, :, None] * 32 + lane[None, None, :]
        qs = tl.load(data_ptr + offs)  # [N, NG, 32] int8
        return tl.reshape(_q8_values(qs, d, NATIVE), (row_off.shape[0], D))
    j = tl.arange(0, 16)
    offs = row_off[:, None, None] + grp[None, :, None] * 16 + j[None, None, :]
    byte = tl.load(data_ptr + offs)  # [N, NG, 16] uint8
    if PAIR_ORDER:
        pairs = _q4_pairs(byte, d, NATIVE)  # [N, NG, 16, 2]
        return tl.reshape(pairs, (row_off.shape[0], D))
    else:
        lo, hi = _q4_halves(byte, d, NATIVE)  # [N, NG, 16] each
        vals = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [N, NG, 2, 16]
        return tl.reshape(vals, (row_off.shape[0], D))


@triton.jit
def pair_order(c):
    """Natural column of pair-order column ``c`` (q4_0, ``packed``)."""
    return (c // 32) * 32 + (c % 2) * 16 + (c % 32) // 2


@triton.jit
def load_q(
    q_ptr, row_stride, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    NG: tl.constexpr, K_GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, PERM: tl.constexpr,
):
    """The query heads of one K/V head as dot rows (rows >= G are zero); ``PERM``: columns
    in q4_0 pair order, to meet K tiles from ``load_packed_tile``.

    Returns:
        ``[NG, G_PAD, 32]`` (``K_GROUP``: per-group slices) or ``[G_PAD, D]``, in
        ``DOT_DTYPE``.
    """
    rows = tl.arange(0, G_PAD)
    if K_GROUP:
        grp = tl.arange(0, NG)
        lane = tl.arange(0, 32)
        offs = rows[None, :, None] * row_stride + grp[:, None, None] * 32 + lane[None, None, :]
        q = tl.load(q_ptr + offs, mask=(rows < G)[None, :, None], other=0.0)
    else:
        cols = tl.arange(0, D)
        if PERM:
            cols = pair_order(cols)
        q = tl.load(q_ptr + rows[:, None] * row_stride + cols[None, :],
                    mask=(rows < G)[:, None], other=0.0)
    # Through float32 (exact from f16/bf16): the interpreter converts bf16 only from fp32.
    return q.to(tl.float32).to(DOT_DTYPE)


@triton.jit
def tile_scores(
    q, k_data, k_scale, k_row, ks_row, valid,
    K_TYPE: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, QUANT_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """Raw scores ``q . k`` of a tile: float32 ``[G_PAD, N]``.

    Args:
        q: from ``load_q`` (group slices for quantized K in ``group`` mode).
        k_row, ks_row: int64 ``[N]`` offsets of each row's payload and scales.
        valid: ``[N]`` rows to read; others contribute 0 (the caller masks them to -inf).
    """
    if K_TYPE == "f16" or (K_TYPE == "bf16" and NATIVE):
        k = load_float_tile(k_data, k_row, valid, D)  # [N, D]
        return tl.dot(q, tl.trans(k))
    elif K_TYPE == "bf16":
        k = load_float_tile(k_data, k_row, valid, D).to(tl.float32)
        return tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    elif QUANT_DOT == "packed":
        k = load_packed_tile(k_data, k_scale, k_row, ks_row, valid, K_TYPE, D, NG, NATIVE, True)
        return tl.dot(q, tl.trans(k))
    elif QUANT_DOT == "group":
        k, dk = load_group_tile(k_data, k_scale, k_row, ks_row, valid, K_TYPE, NG, True)
        s = tl.dot(q, tl.trans(k, (0, 2, 1)))  # [NG, G_PAD, N] per-group partial scores
        return tl.sum(s * dk[:, None, :], axis=0)
    else:
        k, dk = load_group_tile(k_data, k_scale, k_row, ks_row, valid, K_TYPE, NG, False)
        k = tl.reshape(k * dk[:, :, None].to(tl.float16), (k.shape[0], D))
        return tl.dot(q, tl.trans(k))


@triton.jit
def tile_pv(
    acc, p, v_data, v_scale, v_row, vs_row, valid,
    V_TYPE: tl.constexpr, D: tl.constexpr, NG: tl.constexpr, QUANT_DOT: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """``acc + p @ v`` for one tile.

    Args:
        acc: float32 ``[NG, G_PAD, 32]`` (quantized V, ``group`` mode) or ``[G_PAD, D]``.
        p: float32 ``[G_PAD, N]`` softmax numerators (0 on masked rows).
    """
    if V_TYPE == "f16" or (V_TYPE == "bf16" and NATIVE):
        v = load_float_tile(v_data, v_row, valid, D)  # [N, D]
        return tl.dot(p.to(v.dtype), v, acc)
    elif V_TYPE == "bf16":
        v = load_float_tile(v_data, v_row, valid, D).to(tl.float32)
        p16 = p.to(tl.bfloat16).to(tl.float32)  # the rounding a GPU applies to p
        return tl.dot(p16, v, acc, input_precision="ieee")
    elif QUANT_DOT == "packed":
        v = load_packed_tile(v_data, v_scale, v_row, vs_row, valid, V_TYPE, D, NG, NATIVE, False)
        return tl.dot(p.to(tl.float16), v, acc)
    elif QUANT_DOT == "group":
        v, dv = load_group_tile(v_data, v_scale, v_row, vs_row, valid, V_TYPE, NG, True)
        pd = (p[None, :, :] * dv[:, None, :]).to(tl.float16)  # [NG, G_PAD, N]
        return tl.dot(pd, v, acc)  # [NG, G_PAD, 32]
    else:
        v, dv = load_group_tile(v_data, v_scale, v_row, vs_row, valid, V_TYPE, NG, False)
        v = tl.reshape(v * dv[:, :, None].to(tl.float16), (v.shape[0], D))
        return tl.dot(p.to(tl.float16), v, acc)


@triton.jit
def rescale(acc, alpha, ACC3: tl.constexpr):
    """``acc`` rows times ``alpha`` ``[G_PAD]``."""
    if ACC3:
        return acc * alpha[None, :, None]
    else:
        return acc * alpha[:, None]


@triton.jit
def store_rows(
    ptr, row_stride, acc, row_scale, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, NG: tl.constexpr, ACC3: tl.constexpr,
):
    """Write rows ``r < G`` of ``acc * row_scale[r]`` to ``ptr + r * row_stride + col``.

    A 3-D accumulator ``[NG, G_PAD, 32]`` lands in natural column order
    ``col = g * 32 + lane``.
    """
    rows = tl.arange(0, G_PAD)
    if ACC3:
        grp = tl.arange(0, NG)
        lane = tl.arange(0, 32)
        val = acc * row_scale[None, :, None]
        offs = rows[None, :, None] * row_stride + grp[:, None, None] * 32 + lane[None, None, :]
        tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=(rows < G)[None, :, None])
    else:
        cols = tl.arange(0, D)
        val = acc * row_scale[:, None]
        tl.store(ptr + rows[:, None] * row_stride + cols[None, :],
                 val.to(ptr.dtype.element_ty), mask=(rows < G)[:, None])
