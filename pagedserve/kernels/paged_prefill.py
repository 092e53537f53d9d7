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

import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels import guards
from pagedserve.kv.formats import KVBlockStorage

# Storage type codes (the kernels' ``K_TYPE`` / ``V_TYPE`` constexprs).
TYPE_CODES = {"f16": 0, "bf16": 1, "q8_0": 2, "q4_0": 3}
LOG2E = 1.4426950408889634
# Split-KV limits: each split reads at least this many keys; at most this many splits.
SPLIT_MIN_KEYS = 512
MAX_SPLITS = 16


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
    # A row that has seen no key yet (only in a split of the key range) keeps m = -inf;
    # exponents are taken against 0 there, so that it adds nothing instead of NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_tile(v_ptr, vs_ptr, rows, valid, offs_d, V_TYPE, D, Q_DTYPE, NATIVE)
    acc = acc * alpha[:, None] + _dot(_operand(p, Q_DTYPE, NATIVE), v, NATIVE)
    return acc, m_new, l_i


# Step-dependent integers are not specialized (Triton would otherwise compile a variant
# for each of "equals 1" and "divisible by 16"), so that a warm-up covers every launch.
@triton.jit(do_not_specialize=["seq_begin", "num_seqs", "num_splits", "num_rows",
                               "stride_tab"])
def _paged_prefill_kernel(
    q_ptr, o_ptr, part_acc_ptr, part_ml_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr,
    qsl_ptr, seq_lens_ptr, seq_begin, num_seqs, num_splits, num_rows, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tab,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    ROWS_PER_HEAD: tl.constexpr, K_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
    SPLIT: tl.constexpr,
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
    # This program's share of the key range: whole tiles, split ``num_splits`` ways.
    split = tl.program_id(2)
    tiles_per_split = (kv_end + BLOCK_N * num_splits - 1) // (BLOCK_N * num_splits)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, kv_end)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for start_n in range(lo, tl.minimum(hi, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, table_row,
            start_n, kv_end, key_limit, kvh, qk_scale, HKV, ROWS_PER_HEAD, BS, K_TYPE,
            V_TYPE, D, Q_DTYPE, NATIVE, BLOCK_N, False)
    for start_n in range(tl.maximum(lo, full_end), hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, tables_ptr, table_row,
            start_n, kv_end, key_limit, kvh, qk_scale, HKV, ROWS_PER_HEAD, BS, K_TYPE,
            V_TYPE, D, Q_DTYPE, NATIVE, BLOCK_N, True)

    if SPLIT:
        # Partials [num_splits, T, Hq, D] and [num_splits, T, Hq, 2] (m, l), for the merge.
        row = (split.to(tl.int64) * num_rows + token) * (HKV * G) + head
        tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["seq_begin", "num_seqs", "num_splits", "num_rows"])
def _merge_splits_kernel(
    o_ptr, part_acc_ptr, part_ml_ptr, qsl_ptr, seq_begin, num_seqs, num_splits, num_rows,
    stride_ot, stride_oh, HQ: tl.constexpr, D: tl.constexpr,
):
    """``o[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``, M = max_s m_s, for
    the rows of sequences ``seq_begin ..`` (program t takes row ``seq_begin + t``, a
    lower bound of the first such row: every earlier sequence holds at least one)."""
    token = (seq_begin + tl.program_id(0)).to(tl.int64)
    head = tl.program_id(1)
    if (token < tl.load(qsl_ptr + seq_begin)) | (token >= tl.load(qsl_ptr + num_seqs)):
        return
    offs_d = tl.arange(0, D)
    m_max = tl.load(part_ml_ptr + (token * HQ + head) * 2)
    for s in range(1, num_splits):
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + ((s * num_rows + token) * HQ + head) * 2))
    acc = tl.zeros((D,), tl.float32)
    den = m_max * 0.0
    for s in range(0, num_splits):
        row = (s * num_rows + token) * HQ + head
        w = tl.math.exp2(tl.load(part_ml_ptr + row * 2) - m_max)
        den += w * tl.load(part_ml_ptr + row * 2 + 1)
        acc += w * tl.load(part_acc_ptr + row * D + offs_d)
    tl.store(o_ptr + token * stride_ot + head * stride_oh + offs_d,
             (acc / den).to(o_ptr.dtype.element_ty))


def launch_config(head_dim: int, group: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for one head_dim and GQA group.

    ``BLOCK_M`` rows hold ``BLOCK_M // group`` positions of every query head of a group,
    so it is at least the group's next power of 2. 128 x 64 tiles over 8 warps: the
    fastest of the launches measured at head_dim 256 on the H200, for every K/V type,
    although they spill about 100 bytes of registers there (docs/kernel-decisions.md).
    """
    return max(128, triton.next_power_of_2(group)), 64, 8, 2


def max_tiles(num_tokens: int, num_seqs: int, block_m: int, group: int) -> int:
    """Grid size along the tiles: an upper bound on ``sum_b ceil(n_b / QPT)`` for any
    split of ``num_tokens`` rows among ``num_seqs`` sequences (each adds at most one
    partial tile)."""
    qpt = block_m // group
    return -(-num_tokens // qpt) + num_seqs


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(num_programs: int, longest_keys: int, sm_count: int) -> int:
    """How many ways to split the key range: enough programs to fill the GPU twice when
    the tiles alone leave SMs idle, each split at least ``SPLIT_MIN_KEYS`` keys long."""
    if num_programs >= sm_count:
        return 1
    return max(1, min(-(-2 * sm_count // num_programs), longest_keys // SPLIT_MIN_KEYS,
                      MAX_SPLITS))


def paged_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, out: torch.Tensor, seq_begin: int = 0,
    query_start_loc_cpu: list[int] | None = None, seq_lens_cpu: list[int] | None = None,
    num_splits: int | None = None,
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
        query_start_loc_cpu, seq_lens_cpu: host copies; with them, few long sequences
            split their key range over more programs (``split_count``).
        num_splits: force the split count (``None``: ``split_count``, or 1 without the
            host copies).

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
    block_m, block_n, warps, stages = launch_config(D, group)
    qpt = block_m // group
    # Rows of sequences before seq_begin hold one token each (decode rows).
    grid_tiles = max_tiles(T - seq_begin, num_seqs - seq_begin, block_m, group)
    if num_splits is None:
        num_splits = 1
        if query_start_loc_cpu is not None and seq_lens_cpu is not None:
            qsl = query_start_loc_cpu
            programs = Hkv * sum(-(-(qsl[b + 1] - qsl[b]) // qpt)
                                 for b in range(seq_begin, num_seqs))
            num_splits = split_count(max(programs, 1), max(seq_lens_cpu[seq_begin:]),
                                     _sm_count(q.device))
    part_acc = part_ml = out  # unused without splits
    if num_splits > 1:
        part_acc = torch.empty(num_splits, T, Hq, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_splits, T, Hq, 2, dtype=torch.float32, device=q.device)
    k_scales = cache_k.scales if cache_k.scales is not None else cache_k.data
    v_scales = cache_v.scales if cache_v.scales is not None else cache_v.data
    _paged_prefill_kernel[(grid_tiles, Hkv, num_splits)](
        q, out, part_acc, part_ml, cache_k.data, k_scales, cache_v.data, v_scales,
        block_tables, query_start_loc, seq_lens, seq_begin, num_seqs, num_splits, T,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        HKV=Hkv, G=group, D=D, BS=cache_k.block_size,
        ROWS_PER_HEAD=interleave * cache_k.block_size,
        K_TYPE=TYPE_CODES[cache_k.kv_type], V_TYPE=TYPE_CODES[cache_v.kv_type],
        BLOCK_M=block_m, BLOCK_N=block_n, NATIVE=q.is_cuda, SPLIT=num_splits > 1,
        num_warps=warps, num_stages=stages,
    )
    if num_splits > 1:
        _merge_splits_kernel[(T - seq_begin, Hq)](
            out, part_acc, part_ml, query_start_loc, seq_begin, num_seqs, num_splits, T,
            out.stride(0), out.stride(1), HQ=Hq, D=D, num_warps=4,
        )
    return out
