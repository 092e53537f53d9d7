"""Triton paged prefill attention: every prefill sequence of a step in one launch.

Each sequence's new rows (its chunk) attend causally to its cached prefix and to
themselves, read straight from the block pool in any storage type (f16, bf16, q8_0,
q4_0; K and V independent) and dequantized in registers. The chunk's own K/V rows are
already in the pool when this runs (the model writes them first), so the chunk is just
the tail of the keys::

    sequence b:   cached prefix (ctx rows)        this chunk (n rows)
    keys          [ 0 ............... ctx-1 ][ ctx ............ ctx+n-1 ]
    query i of the chunk sees keys 0 .. ctx + i

One program owns one query tile of one sequence for one K/V head. A tile packs the
``G = Hq / Hkv`` query heads that share the K/V head, row-major by position, so that every
K/V tile is loaded once for all of them (GQA)::

    tile rows m = 0 .. BLOCK_M - 1:   position p0 + m // G,   query head kvh * G + m % G
    (QPT = BLOCK_M // G positions per tile; the last BLOCK_M - QPT * G rows are padding)

FlashAttention-2's online softmax runs over K/V tiles of ``BLOCK_N`` keys in two loops:
keys every row of the tile sees (no mask), then the causal diagonal (masked). Programs
find their sequence and tile from ``query_start_loc`` on the device, and the grid is an
upper bound that depends only on the step's token and sequence counts (surplus programs
exit at once), so a launch reads no device data on the host and can be captured in a CUDA
graph. Within a sequence, tiles launch from the last (the longest causal range) to the
first, so that long programs start early and short ones fill the tail of the wave.

Pool rows are addressed as the decode kernels address them (``kv/formats.py``): row
``(block * Hkv + h) * (interleave * block_size) + t`` from each storage's own pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import guards
from pagedserve.kv.formats import KVBlockStorage

# Storage type codes (the kernels' ``K_TYPE`` / ``V_TYPE`` constexprs).
TYPE_CODES = {"f16": 0, "bf16": 1, "q8_0": 2, "q4_0": 3}
LOG2E = 1.4426950408889634


@triton.jit
def _operand(x, Q_DTYPE: tl.constexpr, NATIVE: tl.constexpr):
    """``x`` rounded to the model dtype, as a dot operand. On a GPU that is ``Q_DTYPE``
    itself; the Triton interpreter keeps bfloat16 as raw bits with no arithmetic, so there
    the rounded values are widened back to float32 (exactly) for an IEEE float32 dot."""
    if NATIVE:
        y = x.to(Q_DTYPE)
    else:
        y = x.to(tl.float32).to(Q_DTYPE).to(tl.float32)
    return y


@triton.jit
def _dot(a, b, NATIVE: tl.constexpr):
    if NATIVE:
        c = tl.dot(a, b)
    else:
        c = tl.dot(a, b, input_precision="ieee")
    return c


@triton.jit
def _load_kv_tile(data_ptr, scale_ptr, rows, valid, offs_d, KV_TYPE: tl.constexpr,
                  D: tl.constexpr, Q_DTYPE: tl.constexpr, NATIVE: tl.constexpr):
    """``[BLOCK_N, D]`` values of pool rows ``rows`` (int64 ``[BLOCK_N]``) as dot operands;
    rows where ``valid`` is false read as zeros."""
    mask = valid[:, None]
    if KV_TYPE == 0 or KV_TYPE == 1:
        vals = tl.load(data_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    else:
        # One fp16 scale per group of 32 values, applied to the group as a whole.
        NG: tl.constexpr = D // 32
        offs_g = tl.arange(0, NG)
        d = tl.load(scale_ptr + rows[:, None] * NG + offs_g[None, :], mask=mask,
                    other=0.0).to(tl.float32)  # [N, NG]
        if KV_TYPE == 2:  # q8_0: value = qs * d
            qs = tl.load(data_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0)
            groups = tl.reshape(qs.to(tl.float32), (rows.shape[0], NG, 32)) * d[:, :, None]
        else:  # q4_0: byte j of group g holds values g*32 + j (low nibble), g*32 + 16 + j
            W: tl.constexpr = D // 2
            offs_b = tl.arange(0, W)
            packed = tl.load(data_ptr + rows[:, None] * W + offs_b[None, :], mask=mask,
                             other=0)  # [N, D / 2]
            packed = tl.reshape(packed, (rows.shape[0], NG, 16))
            halves = tl.join(packed & 15, packed >> 4)  # [N, NG, 16 (j), 2 (lo, hi)]
            nibbles = tl.reshape(tl.permute(halves, (0, 1, 3, 2)), (rows.shape[0], NG, 32))
            groups = (nibbles.to(tl.float32) - 8.0) * d[:, :, None]
        vals = tl.reshape(groups, (rows.shape[0], D))
    return _operand(vals, Q_DTYPE, NATIVE)


@triton.jit
def _pool_rows(tables_ptr, table_row, keys, valid, kvh, HKV: tl.constexpr,
               ROWS_PER_HEAD: tl.constexpr, BS: tl.constexpr):
    """Pool row index (int64) of each key position of one sequence, for K/V head kvh."""
    block = tl.load(tables_ptr + table_row + keys // BS, mask=valid, other=0).to(tl.int64)
    return (block * HKV + kvh) * ROWS_PER_HEAD + keys % BS


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, table_row,
                 start_n, kv_end, key_limit, kvh, qk_scale,
                 HKV: tl.constexpr, ROWS_PER_HEAD: tl.constexpr, BS: tl.constexpr,
                 K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, D: tl.constexpr,
                 Q_DTYPE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """One online-softmax step over keys ``start_n .. start_n + BLOCK_N - 1``."""
    offs_d = tl.arange(0, D)
    keys = start_n + tl.arange(0, BLOCK_N)
    valid = keys < kv_end
    rows = _pool_rows(tables_ptr, table_row, keys, valid, kvh, HKV, ROWS_PER_HEAD, BS)
    k = _load_kv_tile(k_ptr, ks_ptr, rows, valid, offs_d, K_TYPE, D, Q_DTYPE, NATIVE)
    s = _dot(q, tl.trans(k), NATIVE) * qk_scale  # [M, N] float32, in log2 units
    if CAUSAL:
        s = tl.where(keys[None, :] < key_limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(v_ptr, vs_ptr, rows, valid, offs_d, V_TYPE, D, Q_DTYPE, NATIVE)
    acc = acc * alpha[:, None] + _dot(_operand(p, Q_DTYPE, NATIVE), v, NATIVE)
    return acc, m_new, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, o_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, qsl_ptr, seq_lens_ptr,
    seq_begin, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tab,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    ROWS_PER_HEAD: tl.constexpr, K_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
):
    Q_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    QPT: tl.constexpr = BLOCK_M // G  # query positions per tile
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Which sequence and tile: tiles are numbered sequence after sequence.
    seq = seq_begin * 0 - 1  # int32 scalars, carried through the loop
    tile = seq_begin * 0
    first_tile = seq_begin * 0
    for b in range(seq_begin, num_seqs):
        n_b = tl.load(qsl_ptr + b + 1) - tl.load(qsl_ptr + b)
        tiles_b = (n_b + QPT - 1) // QPT
        here = (pid >= first_tile) & (pid < first_tile + tiles_b)
        seq = tl.where(here, b, seq)
        tile = tl.where(here, tiles_b - 1 - (pid - first_tile), tile)  # last tile first
        first_tile += tiles_b
    if seq < 0:
        return

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    p0 = tile * QPT

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    pos = p0 + offs_m // G  # [M] position in the chunk
    head = kvh * G + offs_m % G  # [M] query head
    row_ok = (offs_m < QPT * G) & (pos < q_len)
    token = (q_start + pos).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q = _operand(q, Q_DTYPE, NATIVE)  # [M, D]

    key_limit = ctx + pos + 1  # [M] exclusive: row m sees keys < key_limit[m]
    kv_end = ctx + tl.minimum(p0 + QPT, q_len)
    full_end = ((ctx + p0 + 1) // BLOCK_N) * BLOCK_N  # keys below: seen by every row
    table_row = seq.to(tl.int64) * stride_tab

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, table_row,
            start_n, kv_end, key_limit, kvh, qk_scale, HKV, ROWS_PER_HEAD, BS, K_TYPE,
            V_TYPE, D, Q_DTYPE, NATIVE, BLOCK_N, False)
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, table_row,
            start_n, kv_end, key_limit, kvh, qk_scale, HKV, ROWS_PER_HEAD, BS, K_TYPE,
            V_TYPE, D, Q_DTYPE, NATIVE, BLOCK_N, True)

    out = acc / l_i[:, None]
    tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_config(head_dim: int, group: int, quantized: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for one head_dim, GQA group and
    whether K or V is quantized.

    ``BLOCK_M`` rows hold ``BLOCK_M // group`` positions of every query head of a group,
    so it is at least the group's next power of 2. Tiles are the largest that compile for
    sm_90 without spilling registers: a quantized K/V tile is dequantized in registers
    before it is stored for the tensor cores, so its tiles are half as long.
    """
    if head_dim == 256:
        block_m, block_n = 64, 32 if quantized else 64
    else:
        block_m, block_n = 128, 32 if quantized else 64
    return max(block_m, triton.next_power_of_2(group)), block_n, 8, 2


def max_tiles(num_tokens: int, num_seqs: int, block_m: int, group: int) -> int:
    """Grid size along the tiles: an upper bound on ``sum_b ceil(n_b / QPT)`` for any
    split of ``num_tokens`` rows among ``num_seqs`` sequences (each adds at most one
    partial tile)."""
    qpt = block_m // group
    return -(-num_tokens // qpt) + num_seqs


def paged_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out: torch.Tensor, seq_begin: int = 0,
) -> torch.Tensor:
    """Causal attention of the new rows of sequences ``seq_begin .. B - 1``.

    Args:
        q: ``[T, Hq, D]`` the step's query rows (sequences concatenated; rows of
            sequences before ``seq_begin`` are neither read nor written).
        cache_k, cache_v: the layer's K and V storage, already holding the new rows.
        block_tables: int32 ``[B, max_blocks]``; one column of ``max_model_len`` rows is
            the contiguous layout.
        query_start_loc: int32 ``[B + 1]`` cu_seqlens of the new rows, on the device.
        seq_lens: int32 ``[B]`` cached rows per sequence after the step (prefix + new).
        scale: softmax scale.
        out: ``[T, Hq, D]`` in ``q.dtype``; rows of sequences ``seq_begin ..`` written.
        seq_begin: first sequence to attend (the step's decode rows come before it).

    Returns:
        ``out``.
    """
    T, Hq, D = q.shape
    Hkv = cache_k.num_kv_heads
    group = Hq // Hkv
    num_seqs = seq_lens.shape[0]
    if num_seqs <= seq_begin or T == 0:
        return out
    interleave = guards.check_row_layout(cache_k, "cache_k")
    quantized = "q" in cache_k.kv_type[0] + cache_v.kv_type[0]
    block_m, block_n, warps, stages = launch_config(D, group, quantized)
    # Rows of sequences before seq_begin hold one token each (decode rows).
    grid = (max_tiles(T - seq_begin, num_seqs - seq_begin, block_m, group), Hkv)
    k_scales = cache_k.scales if cache_k.scales is not None else cache_k.data
    v_scales = cache_v.scales if cache_v.scales is not None else cache_v.data
    _paged_prefill_kernel[grid](
        q, out, cache_k.data, k_scales, cache_v.data, v_scales, block_tables,
        query_start_loc, seq_lens, seq_begin, num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        HKV=Hkv, G=group, D=D, BS=cache_k.block_size,
        ROWS_PER_HEAD=interleave * cache_k.block_size,
        K_TYPE=TYPE_CODES[cache_k.kv_type], V_TYPE=TYPE_CODES[cache_v.kv_type],
        BLOCK_M=block_m, BLOCK_N=block_n, NATIVE=q.is_cuda, num_warps=warps,
        num_stages=stages,
    )
    return out
