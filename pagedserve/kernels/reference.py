"""Torch reference ops: the CPU execution path, and the neighbour of the float64 oracle.

Shapes use: T new tokens, B sequences, Hq query heads, Hkv K/V heads (Hq % Hkv == 0),
D head_dim, block_size rows per block. Every op reads and writes K/V through
``KVBlockStorage`` and ``pagedserve.kv.formats``, so quantization has one definition.
"""

from __future__ import annotations

import torch

from pagedserve.kv import formats
from pagedserve.kv.formats import KVBlockStorage


def kv_write(
    cache: KVBlockStorage, rows: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize ``rows`` and scatter them into their pool slots.

    Args:
        cache: K or V storage of one layer.
        rows: ``[T, Hkv, D]`` new K or V rows, any float dtype.
        slot_mapping: int64 ``[T]``; ``block_id * block_size + offset``, or -1 to skip
            (padding rows).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    if rows.shape[0] == 0:
        return
    bs = cache.block_size
    block, offset = slot_mapping // bs, slot_mapping % bs
    data, scales = formats.quantize(rows, cache.kv_type)  # [T, Hkv, W], [T, Hkv, D/32]
    # data is [num_blocks, Hkv, block_size, W] (for K and V of one type a view of their
    # shared buffer): index (block, :, offset).
    cache.data[block, :, offset] = data
    if scales is not None and cache.scales is not None:
        cache.scales[block, :, offset] = scales


def gather_kv(
    cache: KVBlockStorage, block_table: torch.Tensor, length: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantized K or V of one sequence, ``[Hkv, length, D]`` in ``dtype``.

    Args:
        block_table: int32 ``[>= ceil(length / block_size)]`` block ids of the sequence.
    """
    bs = cache.block_size
    n_blocks = -(-length // bs)
    ids = block_table[:n_blocks].long()
    data = cache.data[ids]  # [n_blocks, Hkv, bs, W]
    scales = cache.scales[ids] if cache.scales is not None else None
    rows = formats.dequantize(data, scales, cache.kv_type, dtype)  # [n_blocks, Hkv, bs, D]
    rows = rows.transpose(0, 1).reshape(rows.shape[1], n_blocks * bs, -1)
    return rows[:, :length]


def paged_decode_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query token per sequence against its paged K/V.

    Args:
        q: ``[B, Hq, D]``.
        block_tables: int32 ``[B, max_blocks]``.
        seq_lens: int32 ``[B]``; a zero-length sequence yields zeros.
        scale: softmax scale (``D ** -0.5`` for Qwen3.5).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``; accumulation in float32.
    """
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    for b in range(B):
        if lens[b] == 0:
            continue
        k = gather_kv(cache_k, block_tables[b], lens[b])  # [Hkv, L, D]
        v = gather_kv(cache_v, block_tables[b], lens[b])
        out[b] = attend(q[b].float(), k, v, scale)
    return out.to(q.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of ``q`` ``[Hq, D]`` over ``k``, ``v`` ``[Hkv, L, D]`` (GQA)."""
    Hq, Hkv = q.shape[0], k.shape[0]
    qg = q.reshape(Hkv, Hq // Hkv, -1)  # [Hkv, group, D]
    scores = torch.einsum("hgd,hld->hgl", qg, k) * scale
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hgl,hld->hgd", p, v).reshape(Hq, -1)
