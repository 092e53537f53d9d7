"""Triton K/V write: quantize new rows and scatter them into their pool slots.

One program per new token writes all K/V heads of that token::

    rows [T, Hkv, D] --(program t)--> slot = slot_mapping[t]     (-1: padding, skipped)
                                      block, offset = divmod(slot, block_size)
                                      data[block, :, offset, :]   <- payload of Hkv rows
                                      scales[block, :, offset, :] <- one fp16 per group

The quantized bits equal ``pagedserve.kv.formats.quantize`` (and so GGML's) exactly. Every
float32 step is the reference's own: IEEE division (``div_rn``; ``/`` is approximate on
CUDA), ``roundf`` as ``floor`` plus an exact comparison, and no fused multiply-adds
(``enable_fp_fusion=False``: ``x * inv + 8.5`` must round twice, as in numpy and C).
bf16 is rounded to nearest-even with integer ops, which the Triton interpreter (whose
float32 -> bf16 cast truncates) and the GPU execute alike.
A slot outside the pool is skipped, never written; validate mode reports it instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import guards
from pagedserve.kv.formats import KVBlockStorage


@triton.jit
def _bf16_bits(x):
    """float32 -> the int16 bits of bfloat16, rounded to nearest-even (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _store_float(data_ptr, x, head_off, cols, hmask, KV_TYPE: tl.constexpr):
    """x: float32 ``[H_PAD, D]``; bf16 storage is written through an int16 view."""
    if KV_TYPE == "bf16":
        val = _bf16_bits(x)
    else:
        val = x.to(tl.float16)
    tl.store(data_ptr + head_off[:, None] + cols[None, :], val, mask=hmask[:, None])


@triton.jit
def _inverse(d):
    """IEEE ``1 / d``, and 0 where ``d == 0`` (GGML's ``id``)."""
    safe = tl.where(d == 0.0, 1.0, d)
    return tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), safe))


@triton.jit
def _write_q8_0(data_ptr, scale_ptr, x, head_off, scale_head_off, hmask, NG: tl.constexpr):
    """x: float32 ``[H_PAD, NG, 32]``."""
    amax = tl.max(tl.abs(x), axis=2)  # [H_PAD, NG]
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv = _inverse(d)
    v = x * inv[:, :, None]
    a = tl.abs(v)
    whole = tl.floor(a)
    r = whole + tl.where(a - whole >= 0.5, 1.0, 0.0)  # C roundf: halves away from zero
    qs = tl.where(v < 0.0, -r, r).to(tl.int8)
    grp = tl.arange(0, NG)
    lane = tl.arange(0, 32)
    offs = head_off[:, None, None] + grp[None, :, None] * 32 + lane[None, None, :]
    tl.store(data_ptr + offs, qs, mask=hmask[:, None, None])
    tl.store(scale_ptr + scale_head_off[:, None] + grp[None, :], d.to(tl.float16),
             mask=hmask[:, None])


@triton.jit
def _write_q4_0(data_ptr, scale_ptr, lo, hi, head_off, scale_head_off, hmask, NG: tl.constexpr):
    """lo, hi: float32 ``[H_PAD, NG, 16]``, values 0..15 and 16..31 of each group."""
    lane = tl.arange(0, 16)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))  # [H_PAD, NG]
    # The signed value of largest magnitude, the first one on ties (GGML's argmax).
    first_lo = tl.min(tl.where(tl.abs(lo) == amax[:, :, None], lane[None, None, :], 64), axis=2)
    first_hi = tl.min(tl.where(tl.abs(hi) == amax[:, :, None], lane[None, None, :] + 16, 64),
                      axis=2)
    first = tl.minimum(first_lo, first_hi)
    # max over one selected element keeps its sign, -0.0 included (a sum would not).
    pick_lo = tl.where(lane[None, None, :] == first[:, :, None], lo, float("-inf"))
    pick_hi = tl.where(lane[None, None, :] + 16 == first[:, :, None], hi, float("-inf"))
    vmax = tl.maximum(tl.max(pick_lo, axis=2), tl.max(pick_hi, axis=2))
    d = tl.math.div_rn(vmax, tl.full(vmax.shape, -8.0, tl.float32))
    inv = _inverse(d)
    # x * inv + 8.5 >= 0 here, so floor is C's truncation.
    q_lo = tl.minimum(tl.maximum(tl.floor(lo * inv[:, :, None] + 8.5), 0.0), 15.0)
    q_hi = tl.minimum(tl.maximum(tl.floor(hi * inv[:, :, None] + 8.5), 0.0), 15.0)
    packed = q_lo.to(tl.uint8) | (q_hi.to(tl.uint8) << 4)  # [H_PAD, NG, 16]
    grp = tl.arange(0, NG)
    offs = head_off[:, None, None] + grp[None, :, None] * 16 + lane[None, None, :]
    tl.store(data_ptr + offs, packed, mask=hmask[:, None, None])
    tl.store(scale_ptr + scale_head_off[:, None] + grp[None, :], d.to(tl.float16),
             mask=hmask[:, None])


@triton.jit
def _kv_write_kernel(
    rows_ptr, slot_ptr, data_ptr, scale_ptr,
    num_slots, stride_rt, stride_rh,
    d_sb, d_sh, d_sr, s_sb, s_sh, s_sr,
    HKV: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    KV_TYPE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)  # int64
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // BS
    offset = slot % BS
    heads = tl.arange(0, H_PAD)
    hmask = heads < HKV
    head_off = block * d_sb + heads * d_sh + offset * d_sr  # int64 [H_PAD]
    row_ptr = rows_ptr + t.to(tl.int64) * stride_rt + heads * stride_rh  # [H_PAD]
    NG: tl.constexpr = D // 32
    if KV_TYPE == "f16" or KV_TYPE == "bf16":
        cols = tl.arange(0, D)
        x = tl.load(row_ptr[:, None] + cols[None, :], mask=hmask[:, None], other=0.0)
        _store_float(data_ptr, x.to(tl.float32), head_off, cols, hmask, KV_TYPE)
    else:
        scale_head_off = block * s_sb + heads * s_sh + offset * s_sr
        grp = tl.arange(0, NG)
        if KV_TYPE == "q8_0":
            lane = tl.arange(0, 32)
            x = tl.load(row_ptr[:, None, None] + grp[None, :, None] * 32 + lane[None, None, :],
                        mask=hmask[:, None, None], other=0.0).to(tl.float32)
            _write_q8_0(data_ptr, scale_ptr, x, head_off, scale_head_off, hmask, NG)
        else:
            lane = tl.arange(0, 16)
            base = row_ptr[:, None, None] + grp[None, :, None] * 32 + lane[None, None, :]
            lo = tl.load(base, mask=hmask[:, None, None], other=0.0).to(tl.float32)
            hi = tl.load(base + 16, mask=hmask[:, None, None], other=0.0).to(tl.float32)
            _write_q4_0(data_ptr, scale_ptr, lo, hi, head_off, scale_head_off, hmask, NG)


def kv_write(
    cache: KVBlockStorage, rows: torch.Tensor, slot_mapping: torch.Tensor, *,
    validate: bool | None = None,
) -> None:
    """Quantize ``rows`` and scatter them into their pool slots, Triton.

    Args:
        cache: K or V storage of one layer, ``[num_blocks, Hkv, block_size, *]``, in its
            own buffers or a view of a K/V pair's (``KVBlockStorage.allocate_pair``): rows
            are addressed by the storage's strides.
        rows: ``[T, Hkv, D]`` float16/bfloat16/float32, last dim contiguous.
        slot_mapping: int64 ``[T]``: ``block_id * block_size + offset``, or -1 to skip.
        validate: full check that every slot is -1 or in the pool (one sync); default
            from ``PAGEDSERVE_VALIDATE``. Without it, out-of-pool slots are skipped.
    """
    guards.check_kv_write_args(cache, rows, slot_mapping)
    num_slots = cache.num_blocks * cache.block_size
    if guards.validate_requested(validate):
        guards.check_slot_mapping(slot_mapping, num_slots)
    T = rows.shape[0]
    if T == 0:
        return
    Hkv = cache.num_kv_heads
    scales = cache.scales if cache.scales is not None else cache.data
    s_st = cache.scales.stride() if cache.scales is not None else (0, 0, 0, 1)
    d_st = cache.data.stride()
    data = cache.data.view(torch.int16) if cache.kv_type == "bf16" else cache.data
    _kv_write_kernel[(T,)](
        rows, slot_mapping, data, scales,
        num_slots, rows.stride(0), rows.stride(1),
        d_st[0], d_st[1], d_st[2], s_st[0], s_st[1], s_st[2],
        HKV=Hkv, H_PAD=max(2, 1 << (Hkv - 1).bit_length()), D=cache.head_dim,
        BS=cache.block_size, KV_TYPE=cache.kv_type,
        num_warps=4, enable_fp_fusion=False,
    )
