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

Both results are exact in f16. Group scales are applied in one of two ways
(``DecodeConfig.quant_dot``):

- ``element``: one multiply per element dequantizes to f16, then one full-width dot.
- ``packed``: as ``element``, but two values per instruction. Rows arrive in 16-byte
  vectors; on a GPU a few PTX lines (``prmt``, ``lop3``, ``sub.f16x2`` or, for q4_0's
  high nibbles, ``fma.f16x2``, then ``mul.f16x2``) turn each 4-byte word into four
  (q8_0) or eight (q4_0) scaled f16 values, about two instructions per value where the
  generic path spends several. The values are the same
  bit for bit: ``int - offset`` is exact and the one multiply by the scale rounds once
  either way. A q4_0 tile is read as two *half tiles* of ``[N, D/2]``: one of the low
  nibbles, one of the high nibbles, each in its bytes' order. A half tile keeps the
  16-value runs of the loaded bytes, which is the shape the tensor cores' operand
  staging stores in 16-byte pieces; joining the halves into natural order interleaves
  them and costs one 2-byte shared-memory store per value. So each product runs as two
  dots: ``s = q_lo . lo + q_hi . hi`` (q split the same way) and
  ``acc_lo += p @ lo``, ``acc_hi += p @ hi`` (the accumulator keeps the halves, and
  ``store_rows`` writes natural columns)::

      q4_0 group g:  half h (0: lo, 1: hi), column g*16 + j  holds value  g*32 + 16h + j
                     (byte j of the group; ``lo``/``hi`` are its low/high nibble)

  Half tiles take about a quarter fewer loop instructions than joined nibbles and are
  faster on the H200 (docs/kernel-decisions.md). The PTX itself is checked on the host
  by ``tests/kernels/test_dequant_ptx.py``.

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
def _group_offsets(row_off, KV_TYPE: tl.constexpr, NG: tl.constexpr):
    """Payload offsets of a tile of rows, split into groups.

    Args:
        row_off: int64 ``[N]`` offset of each row's payload.

    Returns:
        int64 ``[N, NG, 32]``.
    """
    lane = tl.arange(0, 32)
    grp = tl.arange(0, NG)
    if KV_TYPE == "q8_0":
        within = lane
        stride = 32
    else:
        within = lane % 16
        stride = 16
    return (row_off[:, None, None] + grp[None, :, None] * stride) + within[None, None, :]


@triton.jit
def load_float_tile(data_ptr, row_off, valid, D: tl.constexpr):
    """f16/bf16 rows ``[N, D]`` (masked rows read as 0)."""
    cols = tl.arange(0, D)
    return tl.load(data_ptr + row_off[:, None] + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def load_group_tile(
    data_ptr, scale_ptr, row_off, scale_off, valid, KV_TYPE: tl.constexpr, NG: tl.constexpr,
):
    """Quantized rows as exact integers and their group scales.

    Returns:
        ``(ints, scales)``: f16 ``[N, NG, 32]`` and float32 ``[N, NG]``.
    """
    offs = _group_offsets(row_off, KV_TYPE, NG)
    grp = tl.arange(0, NG)
    ints = _exact_ints(data_ptr, offs, valid[:, None, None], KV_TYPE)
    sc = tl.load(scale_ptr + scale_off[:, None] + grp[None, :], mask=valid[:, None], other=0.0)
    return ints, sc.to(tl.float32)


def q4_dequant_asm(words: list[tuple[str, str, str]], scales: tuple[str, str]) -> str:
    """PTX that turns q4_0 bytes into f16x2 registers of ``(nibble - 8) * d``, exactly
    (the magic-number trick above, then one rounding by the scale).

    For each ``(a, b, selector)`` of ``words``, ``t = prmt(a, b, selector)`` must hold
    bytes ``[x0 x1 y0 y1]`` whose pairs ``(x0, y0)`` and ``(x1, y1)`` share a register:
    one ``lop3`` with ``0x000f000f | 0x64006400`` puts the low nibbles of x0 and y0 into
    the two halves of a register (f16 1024 + nibble), one with ``0x00f000f0`` their high
    nibbles (f16 1024 + 16 nibble), and ``t >> 8`` does the same for x1 and y1. Low:
    minus 1032 -> nibble - 8. High: times 1/16 minus 72 -> nibble - 8 in one ``fma`` with
    no shift (Marlin's trick for the upper nibble). Then times the scale register
    ``scales[0]`` (the first register of each word's pair) or ``scales[1]``.

    Outputs, with n words: ``$0 .. $2n-1`` the low-nibble pairs, word by word (x0/y0,
    then x1/y1), then ``$2n .. $4n-1`` the high-nibble pairs in the same order.
    """
    n = len(words)
    uses_zero = any("z" in (a, b) for a, b, _ in words)
    lines = ["{", f".reg .b32 t, u, {'z, ' if uses_zero else ''}nib, hinib, magic, off, "
             "sixteenth, hioff;"]
    if uses_zero:
        lines.append("mov.b32 z, 0;")
    lines += ["mov.b32 nib, 0x000f000f;", "mov.b32 hinib, 0x00f000f0;",
              "mov.b32 magic, 0x64006400;", "mov.b32 off, 0x64086408;",
              "mov.b32 sixteenth, 0x2c002c00;", "mov.b32 hioff, 0xd480d480;"]
    for k, (a, b, selector) in enumerate(words):
        lo, hi = 2 * k, 2 * n + 2 * k
        lines += [f"prmt.b32 t, {a}, {b}, {selector};",
                  f"lop3.b32 ${lo}, t, nib, magic, 0xea;",
                  f"lop3.b32 ${hi}, t, hinib, magic, 0xea;",
                  "shr.b32 u, t, 8;",
                  f"lop3.b32 ${lo + 1}, u, nib, magic, 0xea;",
                  f"lop3.b32 ${hi + 1}, u, hinib, magic, 0xea;"]
    lines += [f"sub.f16x2 ${j}, ${j}, off;" for j in range(2 * n)]
    lines += [f"fma.rn.f16x2 ${j}, ${j}, sixteenth, hioff;" for j in range(2 * n, 4 * n)]
    lines += [f"mul.f16x2 ${j}, ${j}, {scales[j % 2]};" for j in range(4 * n)]
    return "\n" + "\n".join(lines + ["}"]) + "\n"


# Each invocation takes 4 q4_0 bytes b0..b3 (one register, $4) and their group scale (two
# f16x2 registers, $5 and $6). t = [b0 b2 b1 b3], so that b0 pairs with b1 and b2 with b3.
# Outputs: the low-nibble values of b0..b3, then the high-nibble values (two f16x2
# registers each).
Q4_HALVES_ASM = tl.constexpr(q4_dequant_asm([("$4", "z", "0x3120")], ("$5", "$6")))

Q8_PAIRS_ASM = tl.constexpr("""
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
def _q4_halves(byte, scale, NATIVE: tl.constexpr):
    """q4_0 bytes ``[..., 16]`` (uint8) and their group scale (f16, broadcastable) ->
    ``(lo, hi)`` f16 ``[..., 16]``: ``(nibble - 8) * d`` of the low and high nibbles."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            Q4_HALVES_ASM, "=r,=r,=r,=r,r,r,r", [byte, scale],
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
            Q8_PAIRS_ASM, "=r,=r,r,r,r", [qs, scale],
            dtype=tl.float16, is_pure=True, pack=4,
        )
    else:
        return _q8_exact(qs) * scale


@triton.jit
def _row_group_scales(scale_ptr, scale_off, valid, NG: tl.constexpr):
    """The group scales of a tile's rows, f16 ``[N, NG, 1]`` (0 for rows not ``valid``,
    which zeroes every value of them: the packed loaders' masking)."""
    grp = tl.arange(0, NG)
    return tl.load(scale_ptr + scale_off[:, None] + grp[None, :], mask=valid[:, None],
                   other=0.0)[:, :, None]


@triton.jit
def load_q8_tile(data_ptr, scale_ptr, row_off, scale_off, valid, D: tl.constexpr,
                 NG: tl.constexpr, NATIVE: tl.constexpr):
    """q8_0 rows dequantized to f16 ``[N, D]``, four values per instruction pair on a GPU.

    Only the scales are masked: a row that is not ``valid`` must point at an in-bounds
    row (the kernel points it at row 0 of the pool), its scale loads as 0 and every value
    of it is an exact 0, whatever its payload holds. Unpredicated payload loads shorten
    the tile loop (no predicate per load).
    """
    grp = tl.arange(0, NG)
    lane = tl.arange(0, 32)
    d = _row_group_scales(scale_ptr, scale_off, valid, NG)  # [N, NG, 1] f16
    qs = tl.load(data_ptr + row_off[:, None, None] + grp[None, :, None] * 32
                 + lane[None, None, :])  # [N, NG, 32] int8
    return tl.reshape(_q8_values(qs, d, NATIVE), (row_off.shape[0], D))


@triton.jit
def load_q4_halves_tile(data_ptr, scale_ptr, row_off, scale_off, valid, D: tl.constexpr,
                        NG: tl.constexpr, NATIVE: tl.constexpr):
    """q4_0 rows dequantized to f16 as two half tiles ``(lo, hi)``, each ``[N, D/2]``:
    column ``g * 16 + j`` of ``lo`` is value ``g * 32 + j`` (byte j's low nibble), of
    ``hi`` value ``g * 32 + 16 + j`` (its high nibble). Masking as ``load_q8_tile``.
    """
    grp = tl.arange(0, NG)
    j = tl.arange(0, 16)
    d = _row_group_scales(scale_ptr, scale_off, valid, NG)  # [N, NG, 1] f16
    byte = tl.load(data_ptr + row_off[:, None, None] + grp[None, :, None] * 16
                   + j[None, None, :])  # [N, NG, 16] uint8
    lo, hi = _q4_halves(byte, d, NATIVE)
    return tl.reshape(lo, (row_off.shape[0], D // 2)), tl.reshape(hi, (row_off.shape[0], D // 2))


@triton.jit
def load_q(
    q_ptr, row_stride, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    NG: tl.constexpr, DOT_DTYPE: tl.constexpr, HALVES: tl.constexpr,
):
    """The query heads of one K/V head as dot rows (rows >= G are zero).

    Returns:
        in ``DOT_DTYPE``: ``[G_PAD, D/2, 2]`` (``HALVES``: the columns of q4_0 half tiles,
        last axis lo/hi; ``load_q4_halves_tile``) or ``[G_PAD, D]``.
    """
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * row_stride + cols[None, :],
                mask=(rows < G)[:, None], other=0.0)
    if HALVES:
        # [G_PAD, NG, h, j] -> [G_PAD, NG * 16, h]
        q = tl.reshape(tl.permute(tl.reshape(q, (G_PAD, NG, 2, 16)), (0, 1, 3, 2)),
                       (G_PAD, D // 2, 2))
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
        q: from ``load_q`` (halves for q4_0 K in ``packed`` mode).
        k_row, ks_row: int64 ``[N]`` offsets of each row's payload and scales.
        valid: ``[N]`` rows to read; others contribute 0 (the caller masks them to -inf).
    """
    if K_TYPE == "f16" or (K_TYPE == "bf16" and NATIVE):
        k = load_float_tile(k_data, k_row, valid, D)  # [N, D]
        return tl.dot(q, tl.trans(k))
    elif K_TYPE == "bf16":
        k = load_float_tile(k_data, k_row, valid, D).to(tl.float32)
        return tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
    elif QUANT_DOT == "packed" and K_TYPE == "q4_0":
        lo, hi = load_q4_halves_tile(k_data, k_scale, k_row, ks_row, valid, D, NG, NATIVE)
        q_lo, q_hi = tl.split(q)
        return tl.dot(q_hi, tl.trans(hi), tl.dot(q_lo, tl.trans(lo)))
    elif QUANT_DOT == "packed":
        k = load_q8_tile(k_data, k_scale, k_row, ks_row, valid, D, NG, NATIVE)
        return tl.dot(q, tl.trans(k))
    else:
        k, dk = load_group_tile(k_data, k_scale, k_row, ks_row, valid, K_TYPE, NG)
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
        acc: float32, laid out as ``store_rows`` documents: ``[G_PAD, D/2, 2]`` (q4_0 V,
            ``packed``) or ``[G_PAD, D]``.
        p: float32 ``[G_PAD, N]`` softmax numerators (0 on masked rows).
    """
    if V_TYPE == "f16" or (V_TYPE == "bf16" and NATIVE):
        v = load_float_tile(v_data, v_row, valid, D)  # [N, D]
        return tl.dot(p.to(v.dtype), v, acc)
    elif V_TYPE == "bf16":
        v = load_float_tile(v_data, v_row, valid, D).to(tl.float32)
        p16 = p.to(tl.bfloat16).to(tl.float32)  # the rounding a GPU applies to p
        return tl.dot(p16, v, acc, input_precision="ieee")
    elif QUANT_DOT == "packed" and V_TYPE == "q4_0":
        lo, hi = load_q4_halves_tile(v_data, v_scale, v_row, vs_row, valid, D, NG, NATIVE)
        p16 = p.to(tl.float16)
        acc_lo, acc_hi = tl.split(acc)
        return tl.join(tl.dot(p16, lo, acc_lo), tl.dot(p16, hi, acc_hi))
    elif QUANT_DOT == "packed":
        v = load_q8_tile(v_data, v_scale, v_row, vs_row, valid, D, NG, NATIVE)
        return tl.dot(p.to(tl.float16), v, acc)
    else:
        v, dv = load_group_tile(v_data, v_scale, v_row, vs_row, valid, V_TYPE, NG)
        v = tl.reshape(v * dv[:, :, None].to(tl.float16), (v.shape[0], D))
        return tl.dot(p.to(tl.float16), v, acc)


@triton.jit
def rescale(acc, alpha, ACC: tl.constexpr):
    """``acc`` rows times ``alpha`` ``[G_PAD]``."""
    if ACC == "halves":
        return acc * alpha[:, None, None]
    else:
        return acc * alpha[:, None]


@triton.jit
def store_rows(
    ptr, row_stride, acc, row_scale, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, NG: tl.constexpr, ACC: tl.constexpr,
):
    """Write rows ``r < G`` of ``acc * row_scale[r]`` to ``ptr + r * row_stride + col``,
    in natural column order whatever the accumulator's layout (``ACC``):

    - ``"flat"``: ``[G_PAD, D]``, column ``col``;
    - ``"halves"``: ``[G_PAD, D/2, 2]``, ``[r, g * 16 + j, h]`` is column
      ``g * 32 + 16 * h + j`` (``load_q4_halves_tile``).
    """
    rows = tl.arange(0, G_PAD)
    if ACC == "halves":
        c = tl.arange(0, D // 2)
        half = tl.arange(0, 2)
        col = (c // 16 * 32 + c % 16)[:, None] + half[None, :] * 16  # [D/2, 2]
        val = acc * row_scale[:, None, None]
        tl.store(ptr + rows[:, None, None] * row_stride + col[None, :, :],
                 val.to(ptr.dtype.element_ty), mask=(rows < G)[:, None, None])
    else:
        cols = tl.arange(0, D)
        val = acc * row_scale[:, None]
        tl.store(ptr + rows[:, None] * row_stride + cols[None, :],
                 val.to(ptr.dtype.element_ty), mask=(rows < G)[:, None])
