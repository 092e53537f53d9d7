"""Prefill attention: each chunk's queries against its sequence's cached prefix and itself.

The chunk's own K/V rows are already in the cache when this runs (the model writes every
token's K/V before attention reads it), so one code path serves the first chunk of a prompt
and every later one, and the result does not depend on how a prompt was chunked::

    sequence b:   cached prefix (ctx rows)        this chunk (n rows)
    keys          [ 0 ............... ctx-1 ][ ctx ............ ctx+n-1 ]
    query i of the chunk sees keys 0 .. ctx + i   (causal, offset by ctx)

K/V are gathered from the paged (or contiguous) storage and dequantized, then attended with
``F.scaled_dot_product_attention`` (GQA without repeating K/V) under a lower-right causal
bias, which SDPA runs with its flash kernel on CUDA (no mask is materialized, so a chunk deep
into a long context costs no ``[n, L]`` mask). On the CPU the gather and the softmax run in
float32; on CUDA in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from pagedserve.kernels.reference import gather_kv
from pagedserve.kv.formats import KVBlockStorage


def prefill_attention(
    q: torch.Tensor,
    cache_k: KVBlockStorage,
    cache_v: KVBlockStorage,
    block_tables: torch.Tensor,
    query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
    first_seq: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the prefill rows of a step.

    Args:
        q: ``[T_p, Hq, D]``, the query rows of sequences ``first_seq .. B - 1`` (the rows
            after the step's decode rows), concatenated.
        cache_k, cache_v: the layer's K and V storage, already holding these rows.
        block_tables: int32 ``[B, max_blocks]`` for the whole step.
        query_start_loc_cpu: ``B + 1`` offsets of each sequence's new tokens in the step.
        seq_lens_cpu: ``B`` cached tokens per sequence after the step (prefix + chunk).
        first_seq: index of the first prefill sequence (the step's ``num_decode_seqs``).
        scale: softmax scale.

    Returns:
        ``[T_p, Hq, D]`` in ``q.dtype``.
    """
    compute_dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    out = torch.empty_like(q)
    base = query_start_loc_cpu[first_seq]
    for b in range(first_seq, len(seq_lens_cpu)):
        start = query_start_loc_cpu[b] - base
        end = query_start_loc_cpu[b + 1] - base
        length = seq_lens_cpu[b]
        out[start:end] = _attend_chunk(
            q[start:end], cache_k, cache_v, block_tables[b], length, scale, compute_dtype
        )
    return out


def _attend_chunk(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_table: torch.Tensor, length: int, scale: float, dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence: ``q`` ``[n, Hq, D]`` over its ``length`` cached rows -> ``[n, Hq, D]``."""
    n = q.shape[0]
    context = length - n
    if context < 0:
        raise ValueError(f"sequence holds {length} cached rows but the chunk has {n} queries")
    k = gather_kv(cache_k, block_table, length, dtype)[None]  # [1, Hkv, L, D]
    v = gather_kv(cache_v, block_table, length, dtype)[None]
    qh = q.to(dtype).transpose(0, 1)[None]  # [1, Hq, n, D]
    # Lower-right alignment: query i of the chunk sits at row context + i.
    o = F.scaled_dot_product_attention(
        qh, k, v, attn_mask=causal_lower_right(n, length), scale=scale, enable_gqa=True
    )  # [1, Hq, n, D]
    return o[0].transpose(0, 1).to(q.dtype)  # [n, Hq, D]
