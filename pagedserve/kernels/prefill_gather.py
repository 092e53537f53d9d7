"""Prefill attention for long chunks over quantized K/V: dequantize once, then the kernel.

The paged kernel dequantizes each K/V tile once per query tile it serves, so for chunks
of many rows over q8_0/q4_0 storage most of its time goes to dequantizing the same rows
again and again (docs/kernel-decisions.md). This method first copies every prefill
sequence's cached rows, dequantized to the model dtype, out of the pool into a scratch
pool of 16-bit blocks laid out in order, then runs the same paged kernel over it::

    pool (any type, shuffled blocks)        scratch pool, 16-bit, in order
    seq b0: table [7, 2, 9]        --->     blocks 0 1 2      table [0, 1, 2]
    seq b1: table [4, 11]          --->     blocks 3 4        table [3, 4]

Rows past a sequence's length in its last scratch block are left unwritten; the kernel
never reads past ``seq_lens``. The copy moves each cached row once per layer and step, a
small fraction of the attention's time at these sizes. Its launch sizes come from the
host copies of the lengths, so this path runs eagerly (not in CUDA graphs).

``gather_rows`` (the rows packed, ``[total, Hkv, D]``) is the same copy for callers that
want plain rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import guards, paged_prefill
from pagedserve.kernels.paged_prefill import TYPE_CODES, _load_kv_tile
from pagedserve.kv.formats import KVBlockStorage

GATHER_BLOCK_T = 32


@triton.jit(do_not_specialize=["total_rows", "stride_tab"])
def _gather_rows_kernel(
    data_ptr, scale_ptr, out_ptr, tables_ptr, cum_ptr, row_seq_ptr, out_block_ptr,
    total_rows, stride_tab, stride_ot, stride_oh,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, ROWS_PER_HEAD: tl.constexpr,
    KV_TYPE: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr,
    BLOCKED: tl.constexpr,
):
    # One program: BLOCK_T rows of the concatenated sequences, one K/V head.
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
    if BLOCKED:  # scratch pool [blocks, Hkv, BS, D]: sequence b from block out_block[b]
        first = tl.load(out_block_ptr + seq, mask=valid, other=0).to(tl.int64)
        dest = ((first + pos // BS) * HKV + kvh) * BS + pos % BS
        offs = dest[:, None] * D + offs_d[None, :]
    else:  # packed rows [total, Hkv, D]
        offs = packed.to(tl.int64)[:, None] * stride_ot + kvh * stride_oh + offs_d[None, :]
    tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def _launch_gather(cache: KVBlockStorage, block_tables: torch.Tensor, cum_k: torch.Tensor,
                   total_rows: int, out: torch.Tensor,
                   out_blocks: torch.Tensor | None) -> None:
    interleave = guards.check_row_layout(cache, "cache")
    rows = torch.arange(total_rows, dtype=torch.int32, device=out.device)
    row_seq = (torch.searchsorted(cum_k, rows, right=True) - 1).to(torch.int32)  # [total]
    scales = cache.scales if cache.scales is not None else cache.data
    grid = (triton.cdiv(total_rows, GATHER_BLOCK_T), cache.num_kv_heads)
    _gather_rows_kernel[grid](
        cache.data, scales, out, block_tables, cum_k, row_seq,
        out_blocks if out_blocks is not None else cum_k, total_rows,
        block_tables.stride(0), out.stride(0), out.stride(1),
        HKV=cache.num_kv_heads, D=cache.head_dim, BS=cache.block_size,
        ROWS_PER_HEAD=interleave * cache.block_size, KV_TYPE=TYPE_CODES[cache.kv_type],
        BLOCK_T=GATHER_BLOCK_T, NATIVE=out.is_cuda, BLOCKED=out_blocks is not None,
        num_warps=4,
    )


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
    if total_rows:
        _launch_gather(cache, block_tables, cum_k, total_rows, out, None)
    return out


def dequantized_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out: torch.Tensor, seq_begin: int, query_start_loc_cpu: list[int],
    seq_lens_cpu: list[int],
) -> torch.Tensor:
    """The same contract as ``paged_prefill.paged_prefill_attention``, over a scratch
    pool of the rows dequantized to ``q.dtype``; ``*_cpu`` are the host copies."""
    bs = cache_k.block_size
    lens = seq_lens[seq_begin:]
    blocks = (lens + bs - 1) // bs  # [N] scratch blocks per sequence
    first = torch.zeros(seq_lens.shape[0], dtype=torch.int32, device=q.device)
    first[seq_begin:] = torch.cumsum(blocks, 0, dtype=torch.int32) - blocks  # [B]
    total_blocks = sum(-(-n // bs) for n in seq_lens_cpu[seq_begin:])
    max_blocks = max(-(-n // bs) for n in seq_lens_cpu[seq_begin:])
    tables = first[:, None] + torch.arange(max_blocks, dtype=torch.int32,
                                           device=q.device)[None]  # [B, max_blocks]
    cum_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    cum_k[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
    total_rows = sum(seq_lens_cpu[seq_begin:])
    kind = "bf16" if q.dtype == torch.bfloat16 else "f16"
    scratch = []
    for cache in (cache_k, cache_v):
        dense = KVBlockStorage.allocate(kind, total_blocks, bs, cache.num_kv_heads,
                                        cache.head_dim, q.device)
        _launch_gather(cache, block_tables[seq_begin:], cum_k, total_rows, dense.data,
                       first[seq_begin:])
        scratch.append(dense)
    return paged_prefill.paged_prefill_attention(
        q, scratch[0], scratch[1], tables, query_start_loc, seq_lens, scale, out,
        seq_begin, query_start_loc_cpu, seq_lens_cpu)
