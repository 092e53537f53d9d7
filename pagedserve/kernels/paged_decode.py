"""Triton paged decode attention: one query token per sequence over paged (or contiguous) K/V.

The entry point for every decode kernel: on a GPU the library's launches for q4_0, q8_0
and f16 K and V run Gluon kernels (``quant_fragments``, ``float_fragments``;
``quant_dot="fragment"``), and this module's Triton kernel runs everything else, and
those launches wherever the Gluon kernels do not apply (``GLUON_KERNELS``,
``select_kernel``, ``triton_fallback``).

One launch does everything. Program ``(c, h)`` takes chunk ``c`` of the partition plan
(``decode_plan``: sizes, balance, the two-level merge) for K/V head ``h``. It loads the
G = Hq/Hkv query heads of that K/V head as the rows of its dots, so each K/V row is read
once for the whole group, and walks its token range in tiles of ``block_n`` rows with an
online softmax in float32::

    tile loop, per program                           end of program
    -------------------------------------------      -------------------------------------
    ids   = table[b, tok // bs]  (one tile ahead)    one chunk:  out = acc / l
    rows  = payload of ids (masked if id invalid)    else:       partial (acc, m, l) ->
    s     = q . k   [G_PAD, block_n] (f32)                       workspace slot c; count;
    m, l, acc <- online softmax update                           last of group merges,
                                                                 last group -> out (LSE)

Layouts: the *paged* layout reads tile rows through the block table (``PAGED=True``);
the *contiguous* layout is the same ``KVBlockStorage`` with one block per sequence whose
block_size is the padded length, and its tiles compute addresses directly
(``PAGED=False``, chosen when ``block_tables`` has one column). Both walk the same tiles,
so the contiguous kernel is the paged one minus the table lookup. In either layout K and
V may have their own buffers or share them side by side (``KVBlockStorage.allocate_pair``,
the library's layout for K and V of one type): a row's index then steps
``INTERLEAVE * block_size`` rows per (block, head) (``INTERLEAVE``, a ``constexpr``, is
``KVBlockStorage.interleave``: 1 or 2), the same for K and V, payloads and scales.

Error bounds against a float64 oracle on the dequantized stored values (q in bf16 or f16,
relative to the largest output magnitude; ``tests/kernels/kernel_oracle.py``):
f16 / q8_0 / q4_0 K and V: 2e-3 (p is rounded to f16 for the tensor cores, 2^-11);
bf16 K or V: 1e-2 (bf16 operands, 2^-8). Quantization error itself is not counted: the
oracle reads the same stored values. q in float32 is rounded to the dot dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from pagedserve.kernels import float_fragments, guards, quant_fragments
from pagedserve.kernels.decode_merge import MERGE_UNROLL, NEG_BIG, finish_split, store_stats
from pagedserve.kernels.decode_plan import (
    MERGE_GROUP,
    DecodeConfig,
    DecodeWorkspace,
    default_config,
    default_occupancy,
    locate_chunk,
    triton_float_config,
)
from pagedserve.kernels.decode_trace import record_program, stamp
from pagedserve.kernels.kv_tiles import (
    load_q,
    rescale,
    store_rows,
    tile_pv,
    tile_scores,
)
from pagedserve.kv import formats
from pagedserve.kv.formats import KVBlockStorage

LOG2E = 1.4426950408889634


@triton.jit
def _tile_block_ids(table_row, start, tok_hi, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block id of each row of the tile at token ``start``, one table load per row:
    int32 ``[BLOCK_N]``, -1 past ``tok_hi``."""
    tok = start + tl.arange(0, BLOCK_N)
    return tl.load(table_row + tok // BS, mask=tok < tok_hi, other=-1)


@triton.jit
def _block_first_rows(table_row, start, tok_hi, num_blocks, num_kv_heads, h,
                      BS: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pool row of the first row of each ``BS``-row block of the tile at token ``start``
    (a multiple of ``BS``): int32 ``[BLOCK_N // BS]``, -1 for a block past ``tok_hi`` or
    whose id lies outside the pool. Per block, so that a row costs one add."""
    blk = start // BS + tl.arange(0, BLOCK_N // BS)
    ids = tl.load(table_row + blk, mask=blk * BS < tok_hi, other=-1)
    return tl.where((ids >= 0) & (ids < num_blocks),
                    (ids * num_kv_heads + h) * (INTERLEAVE * BS), -1)


# Counts vary per call; specializing on them (== 1, % 16) would only multiply compiles.
@triton.jit(do_not_specialize=["batch", "num_blocks", "capacity", "chunk_budget",
                               "max_chunks", "num_kv_heads"])
def _paged_decode_kernel(
    q_ptr, out_ptr,  # [B, Hq, D]
    kd_ptr, ks_ptr, vd_ptr, vs_ptr,  # K/V payload and scales (scales: any pointer if float)
    table_ptr, lens_ptr,  # int32 [B, max_blocks], int32 [B]
    part_acc_ptr, part_ml_ptr, group_counter_ptr, seq_counter_ptr,  # workspace
    batch, num_blocks, capacity, chunk_budget, max_chunks, num_kv_heads,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
    qk_scale,  # softmax scale * log2(e)
    trace_ptr,  # int64 [Hkv * programs per head, 8] (decode_trace) when TRACE
    G: tl.constexpr, G_PAD: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, INTERLEAVE: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_PARTITION: tl.constexpr,
    K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, QUANT_DOT: tl.constexpr,
    ACC: tl.constexpr, PAGED: tl.constexpr,
    MERGE_UNROLL: tl.constexpr, MERGE_GROUP: tl.constexpr, NATIVE: tl.constexpr,
    TABLE_READ: tl.constexpr, TABLE_AHEAD: tl.constexpr, TRACE: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    slot = h * tl.num_programs(0) + pid
    stamp(trace_ptr, slot, 0, TRACE)
    NG: tl.constexpr = D // 32
    num_chunks, chunk, b, seq_chunks, first, tok_lo, tok_hi = locate_chunk(
        lens_ptr, batch, capacity, chunk_budget, pid, tl.arange(0, B_PAD), False, BLOCK_N,
        MIN_PARTITION, False
    )
    if chunk >= num_chunks:
        return
    stamp(trace_ptr, slot, 1, TRACE)
    record_program(trace_ptr, slot, chunk, tl.cdiv(tok_hi - tok_lo, BLOCK_N), TRACE)

    if K_TYPE == "bf16":
        q = load_q(q_ptr + b * stride_qb + h * G * stride_qh, stride_qh, G, G_PAD, D, NG,
                   tl.bfloat16, False)
    else:
        q = load_q(q_ptr + b * stride_qb + h * G * stride_qh, stride_qh, G, G_PAD, D, NG,
                   tl.float16, K_TYPE == "q4_0" and QUANT_DOT == "packed")  # halves
    m_i = tl.full([G_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if ACC == "halves":
        acc = tl.zeros([G_PAD, D // 2, 2], tl.float32)
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)

    table_row = table_ptr + b * stride_tb
    lane = tl.arange(0, BLOCK_N)
    # Payload elements per row: q4_0 packs two values per byte.
    K_WIDTH: tl.constexpr = D // 2 if K_TYPE == "q4_0" else D
    V_WIDTH: tl.constexpr = D // 2 if V_TYPE == "q4_0" else D
    # BY_BLOCK: one table load per block; each block's first pool row is computed once
    # and a row adds its offset in the block.
    BY_BLOCK: tl.constexpr = PAGED and TABLE_READ == "block"
    # Rows that are not valid (past the length, or in a block whose id lies outside the
    # pool) are never read: every K/V load is masked by ``valid``, except the payload
    # loads of the packed quantized tiles, which read row 0 instead (``kv_tiles``). Only
    # those need the clamp: it costs a select per row.
    K_FLOAT: tl.constexpr = K_TYPE == "f16" or K_TYPE == "bf16"
    V_FLOAT: tl.constexpr = V_TYPE == "f16" or V_TYPE == "bf16"
    CLAMP_ROWS: tl.constexpr = QUANT_DOT == "packed" and not (K_FLOAT and V_FLOAT)
    if PAGED:
        # TABLE_AHEAD: block ids run one tile ahead of the rows they address, so that the
        # table lookup's latency hides behind the current tile instead of preceding it
        # (at the cost of the registers that hold them).
        if TABLE_AHEAD:
            if BY_BLOCK:
                rows_next = _block_first_rows(table_row, tok_lo, tok_hi, num_blocks,
                                              num_kv_heads, h, BS, INTERLEAVE, BLOCK_N)
            else:
                ids_next = _tile_block_ids(table_row, tok_lo, tok_hi, BS, BLOCK_N)
    else:
        # One block per sequence, of ``capacity`` rows (padded to the longest).
        block0 = tl.load(table_row)
        block0_ok = (block0 >= 0) & (block0 < num_blocks)
    stamp(trace_ptr, slot, 2, TRACE)
    for start in range(tok_lo, tok_hi, BLOCK_N):
        tok = start + lane
        valid = tok < tok_hi
        # Row (b, h, t) of K and of V is row (b * Hkv + h) * (INTERLEAVE * rows per
        # block) + t from each one's payload and scale pointers (``formats``' byte
        # diagram; ``guards.check_row_layout``): one int32 index addresses all four.
        if BY_BLOCK:
            if TABLE_AHEAD:
                block_row = rows_next
                rows_next = _block_first_rows(table_row, start + BLOCK_N, tok_hi, num_blocks,
                                              num_kv_heads, h, BS, INTERLEAVE, BLOCK_N)
            else:
                block_row = _block_first_rows(table_row, start, tok_hi, num_blocks,
                                              num_kv_heads, h, BS, INTERLEAVE, BLOCK_N)
            NB: tl.constexpr = BLOCK_N // BS
            block_row = tl.reshape(tl.broadcast_to(block_row[:, None], (NB, BS)), (BLOCK_N,))
            valid = valid & (block_row >= 0)
            row_idx = block_row + lane % BS  # a tile starts on a block boundary
        else:
            if PAGED:
                if TABLE_AHEAD:
                    ids = ids_next
                    ids_next = _tile_block_ids(table_row, start + BLOCK_N, tok_hi, BS, BLOCK_N)
                else:
                    ids = _tile_block_ids(table_row, start, tok_hi, BS, BLOCK_N)
                valid = valid & (ids >= 0) & (ids < num_blocks)
                row_idx = (ids * num_kv_heads + h) * (INTERLEAVE * BS) + tok % BS
            else:
                valid = valid & block0_ok
                row_idx = (block0 * num_kv_heads + h) * (INTERLEAVE * capacity) + tok
        if CLAMP_ROWS:
            row_idx = tl.where(valid, row_idx, 0)
        row_idx = row_idx.to(tl.int64)
        k_row = row_idx * K_WIDTH
        v_row = row_idx * V_WIDTH
        ks_row = row_idx * NG
        vs_row = row_idx * NG

        s = tile_scores(q, kd_ptr, ks_ptr, k_row, ks_row, valid, K_TYPE, D, NG, QUANT_DOT,
                        NATIVE)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = rescale(acc, alpha, ACC)
        acc = tile_pv(acc, p, vd_ptr, vs_ptr, v_row, vs_row, valid, V_TYPE, D, NG, QUANT_DOT,
                      NATIVE)
        m_i = m_new

    stamp(trace_ptr, slot, 3, TRACE)
    if seq_chunks == 1:
        # The common short-sequence case: no partials, no merge.
        # Zero length -> zeros, never NaN; l >= 1 whenever any row was live.
        inv = tl.where(l_i > 0.0, 1.0 / tl.maximum(l_i, 1.0), 0.0)
        store_rows(out_ptr + b * stride_ob + h * G * stride_oh, stride_oh, acc, inv,
                   G, G_PAD, D, NG, ACC)
        stamp(trace_ptr, slot, 4, TRACE)
    else:
        head_acc = part_acc_ptr + h * max_chunks * G * D
        head_ml = part_ml_ptr + h * max_chunks * G * 2
        ones = tl.full([G_PAD], 1.0, tl.float32)
        store_rows(head_acc + chunk * G * D, D, acc, ones, G, G_PAD, D, NG, ACC)
        store_stats(head_ml + chunk * G * 2, m_i, l_i, tl.arange(0, G_PAD), G)
        stamp(trace_ptr, slot, 4, TRACE)
        finish_split(out_ptr + b * stride_ob + h * G * stride_oh, stride_oh, head_acc,
                     head_ml, group_counter_ptr + h * max_chunks,
                     seq_counter_ptr + b * num_kv_heads + h, chunk, first, seq_chunks,
                     tl.arange(0, GP), tl.arange(0, D), tl.arange(0, D), G, D, MERGE_UNROLL,
                     MERGE_GROUP)
    stamp(trace_ptr, slot, 5, TRACE)


# Scratch for callers that pass no workspace, one per (device, Hq, Hkv, D, occupancy), grown to the
# largest batch seen. Its counters return to zero after every launch, so reuse is safe on
# one stream; CUDA graphs must bring their own (a buffer first allocated inside a capture
# would belong to that graph's memory pool).
_DEFAULT_WORKSPACES: dict[tuple, DecodeWorkspace] = {}


def _default_workspace(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
    occupancy: float,
) -> DecodeWorkspace:
    key = (device, num_q_heads, num_kv_heads, head_dim, occupancy)
    ws = _DEFAULT_WORKSPACES.get(key)
    if ws is None or ws.max_batch < batch:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "paged_decode_attention needs an explicit workspace= while a CUDA graph is "
                "being captured (allocate a DecodeWorkspace before capture and keep it)"
            )
        ws = DecodeWorkspace(max(batch, 8), num_q_heads, num_kv_heads, head_dim, device,
                             occupancy=occupancy)
        _DEFAULT_WORKSPACES[key] = ws
    return ws


def accumulator_layout(v_type: str, quant_dot: str) -> str:
    """Layout of the kernel's output accumulator (``kv_tiles.store_rows``): two half tiles
    for q4_0 V in ``packed`` mode, else ``[G_PAD, D]``."""
    if v_type == "q4_0" and quant_dot == "packed":
        return "halves"
    return "flat"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def launch_constants(
    cfg: DecodeConfig, k_type: str, v_type: str, group: int, head_dim: int,
    block_size: int, *, paged: bool, max_batch: int, native: bool, interleave: int,
    trace: bool = False,
) -> dict:
    """The kernel's compile-time arguments for one launch (``benchmarks/tools/decode_sass.py``
    compiles the kernel offline from the same ones; ``interleave``: the storages'
    ``KVBlockStorage.interleave``; ``trace``: the variant that records each program's
    ``decode_trace.TRACE_FIELDS``). Cached: eager decode calls it per layer per step;
    callers must not modify the dict."""
    gp = _next_pow2(group)
    return dict(
        G=group, G_PAD=max(16, gp), GP=gp, D=head_dim, BS=block_size if paged else 1,
        INTERLEAVE=interleave,
        # The plan's vectors span the workspace's max batch: one compile for all batches.
        B_PAD=max(2, _next_pow2(max_batch)), BLOCK_N=cfg.block_n,
        MIN_PARTITION=cfg.min_partition,
        K_TYPE=k_type, V_TYPE=v_type, QUANT_DOT=cfg.quant_dot,
        ACC=accumulator_layout(v_type, cfg.quant_dot),
        PAGED=paged, MERGE_GROUP=MERGE_GROUP, NATIVE=native,
        MERGE_UNROLL=MERGE_GROUP if cfg.quant_dot == "fragment" else MERGE_UNROLL,
        # Per-block reads need whole blocks per tile; otherwise one read per row.
        TABLE_READ=cfg.table_read if paged and cfg.block_n % block_size == 0 else "row",
        TABLE_AHEAD=cfg.table_ahead, TRACE=trace,
    )


def resolve_config(config: DecodeConfig | None, cache_k: KVBlockStorage,
                   cache_v: KVBlockStorage, block_tables: torch.Tensor) -> DecodeConfig:
    """``config``, or the library's launch for these storages and tables
    (``default_config`` by types, the tokens the tables address, layout and batch)."""
    if config is not None:
        return config
    batch, max_blocks = block_tables.shape
    return default_config(cache_k.kv_type, cache_v.kv_type,
                          batch * max_blocks * cache_k.block_size, paged=max_blocks > 1,
                          batch=batch)


# (K type, V type) -> the Gluon kernel that runs a ``quant_dot="fragment"`` launch, on both
# layouts, where its ``supports`` holds: on a GPU, head_dim 256, at most 8 query heads per
# K/V head (and for f16, paged blocks of a power of 2 >= 16 tokens and a ring that fits in
# shared memory; for q8_0 / q4_0, a ring of at least two stages). Every other launch, and
# these off their shapes, runs this module's Triton kernel (``triton_fallback``).
GLUON_KERNELS = {
    ("f16", "f16"): "float_fragments",
    ("q8_0", "q8_0"): "quant_fragments",
    ("q4_0", "q4_0"): "quant_fragments",
}


def select_kernel(cfg: DecodeConfig, q: torch.Tensor, cache_k: KVBlockStorage,
                  cache_v: KVBlockStorage, paged: bool) -> str:
    """The kernel that runs ``cfg`` over these storages: ``"float_fragments"``,
    ``"quant_fragments"`` (``GLUON_KERNELS``) or ``"triton"``."""
    if cfg.quant_dot != "fragment":
        return "triton"
    kernel = GLUON_KERNELS.get((cache_k.kv_type, cache_v.kv_type))
    if kernel == "float_fragments" and float_fragments.supports(q, cache_k, cache_v, cfg,
                                                                paged=paged):
        return kernel
    if kernel == "quant_fragments" and quant_fragments.supports(q, cache_k, cache_v, cfg):
        return kernel
    return "triton"


def triton_fallback(cfg: DecodeConfig, library_choice: bool, k_type: str, v_type: str,
                    tokens: int, paged: bool) -> DecodeConfig:
    """The Triton kernel's launch for a ``fragment`` config that no Gluon kernel runs.

    Quantized K or V: the same values from the Triton kernel's 16-byte-vector
    dequantization (``packed``), with the table read just in time; the library's own
    choice (``library_choice``) starts from the types' plain launch, since the wide
    small-batch launches are the Gluon kernel's. f16 / bf16: the Triton float launch
    (``triton_float_config``).
    """
    if formats.spec(k_type).quantized or formats.spec(v_type).quantized:
        base = default_config(k_type, v_type) if library_choice else cfg
        return dataclasses.replace(base, quant_dot="packed", table_ahead=False)
    return triton_float_config(tokens, paged)


def decode_grid(workspace: DecodeWorkspace, batch: int,
                config: DecodeConfig) -> tuple[int, int]:
    """The grid of a launch of ``config``: ``max(W, B)`` chunks per K/V head, W its
    budget (``DecodeWorkspace.budget_for``; the plan never makes more chunks,
    ``decode_plan``), by the K/V heads."""
    return max(workspace.budget_for(config), batch), workspace.num_kv_heads


def paged_decode_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
    workspace: DecodeWorkspace | None = None, out: torch.Tensor | None = None,
    config: DecodeConfig | None = None, validate: bool | None = None,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence, Triton.

    Args:
        q: ``[B, Hq, D]`` float16/bfloat16/float32, last dim contiguous; D in 64/128/256.
        cache_k, cache_v: ``KVBlockStorage`` of one layer over the same pool
            ``[num_blocks, Hkv, block_size, *]``; their types are independent; both in
            their own buffers or both side by side (``KVBlockStorage.allocate_pair``).
        block_tables: int32 ``[B, max_blocks]``; entries past a sequence's last block are
            ignored (-1 by convention). One column means the contiguous layout.
        seq_lens: int32 ``[B]``; clamped on the device to ``[0, max_blocks * block_size]``.
        scale: softmax scale.
        workspace: buffers of the partition plan; keep one per stream, and pass it when
            capturing CUDA graphs. ``None`` uses a cached one for this device and shape.
        out: ``[B, Hq, D]`` in ``q.dtype`` to write into (a CUDA graph's static output).
        config: tile choices; default ``default_config`` of the K and V types, the
            tokens the tables address (``B * capacity``), the layout and ``B``
            (``resolve_config``).
        validate: full check of block ids and lengths (one sync); default from
            ``PAGEDSERVE_VALIDATE``.
        trace: diagnostics: int64 ``[programs, 8]`` (programs: the product of
            ``decode_grid``) receives each program's timestamps, SM and tile count
            (``decode_trace.TRACE_FIELDS``; ``benchmarks/tools/trace_decode.py``), from a
            separately compiled variant of either kernel.

    Returns:
        ``out``: ``[B, Hq, D]`` in ``q.dtype``; a zero-length sequence yields zeros.
    """
    guards.check_decode_args(q, cache_k, cache_v, block_tables, seq_lens, out)
    B, Hq, D = q.shape
    Hkv, bs, num_blocks = cache_k.num_kv_heads, cache_k.block_size, cache_k.num_blocks
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * bs
    if B * capacity >= 2**31:
        raise ValueError(
            f"batch {B} x table capacity {capacity} tokens overflows the plan's int32 sums"
        )
    if guards.validate_requested(validate):
        guards.check_block_tables(block_tables, seq_lens, num_blocks, bs)
    if workspace is None:
        workspace = _default_workspace(
            B, Hq, Hkv, D, q.device, default_occupancy(cache_k.kv_type, cache_v.kv_type))
    else:
        workspace.check_fits(B, Hq, Hkv, D, q.device)
    cfg = resolve_config(config, cache_k, cache_v, block_tables)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out

    paged = max_blocks > 1
    kernel = select_kernel(cfg, q, cache_k, cache_v, paged)
    if kernel == "triton" and cfg.quant_dot == "fragment":
        cfg = triton_fallback(cfg, config is None, cache_k.kv_type, cache_v.kv_type,
                              B * capacity, paged)
    constants = launch_constants(cfg, cache_k.kv_type, cache_v.kv_type, Hq // Hkv, D, bs,
                                 paged=paged, max_batch=workspace.max_batch,
                                 native=q.is_cuda, interleave=cache_k.interleave,
                                 trace=trace is not None)
    ks = cache_k.scales if cache_k.scales is not None else cache_k.data
    vs = cache_v.scales if cache_v.scales is not None else cache_v.data
    # Both kernels take the same grid and run-time arguments; untraced, the trace pointer
    # is a placeholder (the output), never written. The grid's chunks per head,
    # max(W, B), are the plan's budget as the device plan takes it (``locate_chunk``).
    grid = decode_grid(workspace, B, cfg)
    args = (
        q, out, cache_k.data, ks, cache_v.data, vs, block_tables, seq_lens,
        workspace.part_acc, workspace.part_ml, workspace.group_counters,
        workspace.seq_counters,
        B, num_blocks, capacity, grid[0], workspace.max_chunks, Hkv,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale * LOG2E, out if trace is None else trace,
    )
    if trace is not None and (trace.dtype != torch.int64 or trace.device != q.device
                              or tuple(trace.shape) != (grid[0] * grid[1], 8)):
        raise ValueError(
            f"trace must be int64 [{grid[0] * grid[1]}, 8] on {q.device}, got "
            f"{trace.dtype} {list(trace.shape)} on {trace.device}")
    if kernel == "float_fragments":
        float_fragments.launch(grid, args, constants, cfg.num_warps, cfg.num_stages,
                               cfg.maxnreg)
    elif kernel == "quant_fragments":
        quant_fragments.launch(grid, args, constants, cache_k.kv_type, cfg.num_warps,
                               cfg.block_n // cfg.num_warps, cfg.maxnreg, cfg.num_stages)
    elif trace is not None and not q.is_cuda:
        raise ValueError("trace= needs a GPU: the timer and SM reads are PTX, which the "
                         "Triton interpreter does not run")
    else:
        _paged_decode_kernel[grid](*args, **constants, num_warps=cfg.num_warps,
                                   num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
    return out
