"""Prefill attention for long chunks: gather the K/V rows into packed rows, then flash.

For chunks of many rows the attention is compute-bound, and FlashAttention-2's varlen
kernel (bundled with torch) runs it faster than the paged Triton kernel
(docs/kernel-decisions.md). It needs each sequence's keys as contiguous rows, so one
Triton launch first copies every prefill sequence's cached rows, dequantized to the model
dtype, out of the block pool into one packed buffer::

    packed K (and V), [total_k, Hkv, D]:
        | seq b0: rows 0 .. L0-1 | seq b1: rows 0 .. L1-1 | ...      (cum_k = [0, L0, L0+L1, ...])

    flash varlen: queries [total_q, Hq, D] (cum_q), keys/values packed (cum_k), causal
    aligned to the lower right: query i of a chunk of n rows over L rows sees keys
    0 .. L - n + i (flash's causal mask when a sequence has fewer queries than keys).

The gather moves each cached row once per layer and step, a small fraction of the
attention's time at these sizes. Launch sizes come from the host copies of the lengths,
so this path runs eagerly (not in CUDA graphs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import guards
from pagedserve.kernels.paged_prefill import TYPE_CODES, _load_kv_tile
from pagedserve.kv.formats import KVBlockStorage

GATHER_BLOCK_T = 32


@triton.jit(do_not_specialize=["total_rows", "stride_tab"])
def _gather_rows_kernel(
    data_ptr, scale_ptr, out_ptr, tables_ptr, cum_ptr, row_seq_ptr,
    total_rows, stride_tab, stride_ot, stride_oh,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, ROWS_PER_HEAD: tl.constexpr,
    KV_TYPE: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
):
    kvh = tl.program_id(1)
    packed = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T] packed row
    valid = packed < total_rows
    seq = tl.load(row_seq_ptr + packed, mask=valid, other=0)  # sequence, from 0
    pos = packed - tl.load(cum_ptr + seq, mask=valid, other=0)  # row within the sequence
    block = tl.load(tables_ptr + seq.to(tl.int64) * stride_tab + pos // BS, mask=valid,
                    other=0).to(tl.int64)
    rows = (block * HKV + kvh) * ROWS_PER_HEAD + pos % BS
    offs_d = tl.arange(0, D)
    vals = _load_kv_tile(data_ptr, scale_ptr, rows, valid, offs_d, KV_TYPE, D,
                         out_ptr.dtype.element_ty, NATIVE)
    tl.store(out_ptr + packed.to(tl.int64)[:, None] * stride_ot + kvh * stride_oh
             + offs_d[None, :], vals.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def gather_rows(cache: KVBlockStorage, block_tables: torch.Tensor, cum_k: torch.Tensor,
                total_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Every cached row of the sequences of ``block_tables``, packed.

    Args:
        block_tables: int32 ``[N, max_blocks]``, the sequences to gather.
        cum_k: int32 ``[N + 1]`` on the device: row offsets of each sequence in the
            output (``[0, L0, L0 + L1, ...]``).
        total_rows: ``cum_k[-1]``, known on the host.

    Returns:
        ``[total_rows, Hkv, D]`` in ``dtype``.
    """
    Hkv, D = cache.num_kv_heads, cache.head_dim
    out = torch.empty(total_rows, Hkv, D, dtype=dtype, device=cache.data.device)
    if total_rows == 0:
        return out
    interleave = guards.check_row_layout(cache, "cache")
    rows = torch.arange(total_rows, dtype=torch.int32, device=out.device)
    row_seq = (torch.searchsorted(cum_k, rows, right=True) - 1).to(torch.int32)  # [total]
    scales = cache.scales if cache.scales is not None else cache.data
    grid = (triton.cdiv(total_rows, GATHER_BLOCK_T), Hkv)
    _gather_rows_kernel[grid](
        cache.data, scales, out, block_tables, cum_k, row_seq, total_rows,
        block_tables.stride(0), out.stride(0), out.stride(1),
        HKV=Hkv, D=D, BS=cache.block_size, ROWS_PER_HEAD=interleave * cache.block_size,
        KV_TYPE=TYPE_CODES[cache.kv_type], BLOCK_T=GATHER_BLOCK_T, NATIVE=out.is_cuda,
        num_warps=4,
    )
    return out


def flash_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out: torch.Tensor, seq_begin: int, query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """The same contract as ``paged_prefill.paged_prefill_attention``, through a packed
    gather and flash varlen; ``*_cpu`` are the host copies of the lengths."""
    t0 = query_start_loc_cpu[seq_begin]
    new_lens = [query_start_loc_cpu[b + 1] - query_start_loc_cpu[b]
                for b in range(seq_begin, len(seq_lens_cpu))]
    lens = seq_lens_cpu[seq_begin:]
    cum_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
    cum_k[1:] = torch.cumsum(seq_lens[seq_begin:], 0, dtype=torch.int32)
    cum_q = (query_start_loc[seq_begin:] - query_start_loc[seq_begin]).to(torch.int32)
    tables = block_tables[seq_begin:]
    k = gather_rows(cache_k, tables, cum_k, sum(lens), q.dtype)  # [total_k, Hkv, D]
    v = gather_rows(cache_v, tables, cum_k, sum(lens), q.dtype)
    o = torch.ops.aten._flash_attention_forward(
        q[t0:].contiguous(), k, v, cum_q, cum_k, max(new_lens), max(lens), 0.0, True, False,
        scale=scale)[0]  # [total_q, Hq, D]
    out[t0:] = o
    return out
