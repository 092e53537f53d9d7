"""Gluon paged decode for f16 K and V: a ``cp.async`` ring whose block ids are read ahead.

Why a second f16 kernel. The Triton kernel (``paged_decode``) leaves the copy schedule to
Triton's software pipeliner, which re-reads a tile's block ids from the table right
before that tile's copies, so every paged tile issues its copies only after a table load
and the address arithmetic behind it, late in the iteration; that table read is most of
the Triton loop's paged-against-contiguous loss at short contexts
(docs/kernel-decisions.md). Here the schedule is explicit:

    prologue      q's load; ids of tiles 0 .. S-2 -> copies of those tiles (one commit
                  group each); ids of tile S - 1 (its copies) and of tile 0 (its mask);
                  q -> its operand layout (contiguous: before the copies)
    tile i        copies of tile i + S - 1 from ids in registers, commit
                  table loads used only by the next iteration: the ids of tile i + S
                  (its copies) and of tile i + 1 (its mask)
                  wait until tile i's group landed
                  S^T = K_i . q^T         K_i from the ring (ldmatrix)
                  P^T = online softmax of S^T over this warp's tokens
                  O^T += V_i^T . P^T      V_i^T from the ring (ldmatrix.trans)

Work split as in ``quant_fragments``: program ``(c, h)`` takes chunk ``c`` of the plan
(``decode_plan``) for K/V head ``h``; each of its W warps owns T = 16 tokens of every
``16 W``-token tile (one 16-token block of the pool), copies exactly those rows and keeps
its own online softmax, so no data crosses warps in the loop; the warps' states merge
once at the end. With K as the A operand the 8 query heads fill the n of the products
(``S^T = K . Q^T``, ``O^T = V^T . P^T``), as in ``quant_fragments``; the labels here are
head_dim itself. The pieces the two kernels share are ``fragment_warps``'.

The ring, one for K and one for V (f16, 64 KB per stage at 4 warps)::

    ring[s][w][t][d]    s = j % S for tile j; warp w's 16 rows: token 16 w + t of the
                        tile, i.e. row t of pool block table[(tile start) / 16 + w];
                        d in 16-byte units XOR-swizzled by t % 8, so that ldmatrix's
                        eight rows of one column hit eight different bank groups

Each warp writes (``cp.async``, one 512-byte row per instruction) and reads
(``ldmatrix``) only its own ``ring[s][w]``.
Rows past the chunk's end, or in a block outside the pool, are not read: their masked
copies (``cp.async`` with a source size of 0) write zeros, and their scores are masked to
-inf.

Shape: head_dim 256, f16 K and V, at most 8 query heads per K/V head, paged blocks of 16
tokens or a power of 2 above (each warp's 16 tokens lie in one block), on a GPU; else the
Triton kernel.

Paged programs issue their first tiles' copies before converting q (the block ids' round
trip would otherwise queue behind q's); contiguous ones convert q first. Each order is
the faster on its layout, and this kernel is the library's f16 launch on both layouts
(docs/kernel-decisions.md has the figures).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pagedserve.kernels.decode_trace import record_program, stamp
from pagedserve.kernels.fragment_warps import (
    HEAD_DIM,
    MAX_GROUP,
    SHARED_CONSTANTS,
    finish_program,
    initial_state,
    load_q,
    locate_program,
    q_operand,
    scores_to_b_operand,
    sequence_table,
    softmax_step,
    tile_rows,
    warp_block_ids,
)

TOKENS_PER_WARP = 16

# The plan's options for this kernel (``fragment_warps.locate_program``): every head takes
# its chunks in program order; chunk starts written as visible multiples of the tile.
UPPER_HEADS_REVERSED = gl.constexpr(False)
ALIGNED_START = gl.constexpr(True)


@functools.cache
def float_layouts(num_warps: int) -> dict:
    """The kernel's layouts (compile-time arguments) for ``num_warps`` warps."""
    w = num_warps
    return dict(
        MMA=gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1],
                                      instr_shape=[1, 16, 8]),
        # One warp copies one 512-byte row per instruction, 16 bytes per lane.
        COPY=gl.BlockedLayout([1, 1, 8], [1, 1, 32], [w, 1, 1], [2, 1, 0]),
        RING=gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[2, 1, 0]),
        MERGE=gl.BlockedLayout([1, 4], [1, 32], [w, 1], [1, 0]),
        Q_PERM=tuple(range(10)),  # labels are head_dim itself
    )


@gluon.jit
def _issue_copies(k_slot, v_slot, kd_ptr, vd_ptr, table_row, id0, start, tok_hi, num_blocks,
                  num_kv_heads, h, head_stride, W: gl.constexpr, BS: gl.constexpr,
                  PAGED: gl.constexpr, COPY: gl.constexpr):
    """``cp.async`` of the K and V rows of the tile at ``start`` into one ring stage, one
    commit group; rows not live are not read (their slots are zero-filled)."""
    T: gl.constexpr = 16  # TOKENS_PER_WARP
    ROWS: gl.constexpr = gl.SliceLayout(2, COPY)
    row, live = tile_rows(table_row, id0, id0, start, tok_hi, num_blocks, num_kv_heads, h,
                          head_stride, W, T, BS, PAGED, PAGED, ROWS)
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY)))
    offs = gl.where(live, row, 0).to(gl.int64)[:, :, None] * HEAD_DIM + d[None, None, :]
    mask = live[:, :, None]  # broadcast along d by the copy
    async_copy.async_copy_global_to_shared(k_slot, kd_ptr + offs, mask=mask)
    async_copy.async_copy_global_to_shared(v_slot, vd_ptr + offs, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _tile_ids(table_row, start, tok_hi, W: gl.constexpr, BS: gl.constexpr,
              PAGED: gl.constexpr, block0, ROWS: gl.constexpr):
    """Each warp's block id for the tile at ``start`` (``[W]`` in the warp slice of the
    ``[W, T]`` layout ``ROWS``, -1 past ``tok_hi``), or the contiguous layout's one
    block."""
    if PAGED:
        return warp_block_ids(table_row, start, tok_hi, W, 16, BS, ROWS)[0]
    else:
        return block0


@gluon.jit(do_not_specialize=["batch", "num_blocks", "capacity", "chunk_budget",
                              "max_chunks", "num_kv_heads"])
def float_fragment_kernel(
    q_ptr, out_ptr,  # [B, Hq, D]
    kd_ptr, ks_ptr, vd_ptr, vs_ptr,  # K and V rows (the scale pointers are unused)
    table_ptr, lens_ptr,  # int32 [B, max_blocks], int32 [B]
    part_acc_ptr, part_ml_ptr, group_counter_ptr, seq_counter_ptr,  # workspace
    batch, num_blocks, capacity, chunk_budget, max_chunks, num_kv_heads,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
    qk_scale,  # softmax scale * log2(e)
    trace_ptr,  # int64 [Hkv * programs per head, 8] (decode_trace) when TRACE
    G: gl.constexpr, GP: gl.constexpr, BS: gl.constexpr, INTERLEAVE: gl.constexpr,
    B_PAD: gl.constexpr, MIN_PARTITION: gl.constexpr, PAGED: gl.constexpr,
    MERGE_UNROLL: gl.constexpr, MERGE_GROUP: gl.constexpr,
    TRACE: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr,
    MMA: gl.constexpr, COPY: gl.constexpr, RING: gl.constexpr, MERGE: gl.constexpr,
    Q_PERM: gl.constexpr,
):
    T: gl.constexpr = 16  # TOKENS_PER_WARP
    BLOCK_N: gl.constexpr = W * T
    D: gl.constexpr = HEAD_DIM
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, 8] per-head state
    TOKENS: gl.constexpr = gl.SliceLayout(2, MMA)  # [W, T], S^T's m
    ROWS: gl.constexpr = gl.SliceLayout(2, COPY)  # [W, T], the copies' rows
    chunk, h, slot, num_chunks, b, seq_chunks, first, tok_lo, tok_hi = locate_program(
        lens_ptr, batch, capacity, chunk_budget, trace_ptr, W, BLOCK_N, B_PAD, MIN_PARTITION,
        UPPER_HEADS_REVERSED, ALIGNED_START, TRACE)
    if chunk >= num_chunks:
        return
    stamp(trace_ptr, slot, 1, TRACE)
    record_program(trace_ptr, slot, chunk, gl.cdiv(tok_hi - tok_lo, BLOCK_N), TRACE)

    # q's load goes out first. Its conversion into the operand layout waits for it at a
    # barrier: paged, after the first tiles' copies are issued, so that the block ids'
    # round trip does not wait behind q's; contiguous, before them. Each order is its
    # layout's faster on the H200 (docs/kernel-decisions.md).
    q_rows = load_q(q_ptr + b * stride_qb + h * G * stride_qh, stride_qh, G, W)
    if not PAGED:
        q = q_operand(q_rows, Q_PERM, False, B_OP)  # q^T [W, D, 8]
    acc = gl.zeros([W, D, MAX_GROUP], gl.float32, MMA)  # O^T
    m_i, l_i = initial_state(W, HEADS)

    table_row, head_stride, block0 = sequence_table(table_ptr, b, stride_tb, capacity, BS,
                                                    INTERLEAVE, PAGED)
    k_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, T, D], RING)
    v_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, T, D], RING)
    for j in gl.static_range(STAGES - 1):
        ids_j = _tile_ids(table_row, tok_lo + j * BLOCK_N, tok_hi, W, BS, PAGED, block0, ROWS)
        _issue_copies(k_ring.index(j), v_ring.index(j), kd_ptr, vd_ptr, table_row, ids_j,
                      tok_lo + j * BLOCK_N, tok_hi, num_blocks, num_kv_heads, h,
                      head_stride, W, BS, PAGED, COPY)
    # Block ids run ahead of their use: the copies' S - 1 tiles, the mask's one tile.
    ids_next = _tile_ids(table_row, tok_lo + (STAGES - 1) * BLOCK_N, tok_hi, W, BS, PAGED,
                         block0, ROWS)
    ids_mask = _tile_ids(table_row, tok_lo, tok_hi, W, BS, PAGED, block0, TOKENS)
    if PAGED:
        q = q_operand(q_rows, Q_PERM, False, B_OP)
    stamp(trace_ptr, slot, 2, TRACE)
    num_tiles = gl.cdiv(tok_hi - tok_lo, BLOCK_N)
    for i in range(num_tiles):
        # Copies of tile i + S - 1 into the stage that tile i - 1 was read from.
        ahead = tok_lo + (i + STAGES - 1) * BLOCK_N
        stage_ahead = (i + STAGES - 1) % STAGES
        _issue_copies(k_ring.index(stage_ahead), v_ring.index(stage_ahead), kd_ptr, vd_ptr,
                      table_row, ids_next, ahead, tok_hi, num_blocks, num_kv_heads, h,
                      head_stride, W, BS, PAGED, COPY)
        ids_next = _tile_ids(table_row, ahead + BLOCK_N, tok_hi, W, BS, PAGED, block0, ROWS)
        start = tok_lo + i * BLOCK_N
        live = tile_rows(table_row, ids_mask, ids_mask, start, tok_hi, num_blocks,
                         num_kv_heads, h, head_stride, W, T, BS, PAGED, PAGED, TOKENS)[1]
        ids_mask = _tile_ids(table_row, start + BLOCK_N, tok_hi, W, BS, PAGED, block0, TOKENS)
        async_copy.wait_group(STAGES - 1)
        stage = i % STAGES

        # S^T = K . Q^T
        k = k_ring.index(stage).load(A_OP)  # [W, T, D]
        st = mma_v2(k, q, gl.zeros([W, T, MAX_GROUP], gl.float32, MMA))
        p, alpha, m_i, l_i = softmax_step(st, live, qk_scale, m_i, l_i)
        p16 = scores_to_b_operand(p.to(gl.float16), B_OP)

        # O^T += V^T . P^T
        vt = v_ring.index(stage).permute([0, 2, 1]).load(A_OP)  # [W, D, T]
        acc = mma_v2(vt, p16, acc * alpha[:, None, :])
    async_copy.wait_group(0)

    finish_program(acc, acc, m_i, l_i, out_ptr, stride_ob, stride_oh, part_acc_ptr, part_ml_ptr,
                   group_counter_ptr, seq_counter_ptr, max_chunks, num_kv_heads, chunk, h, b,
                   first, seq_chunks, trace_ptr, slot, G, GP, False, False, MERGE,
                   MERGE_UNROLL, MERGE_GROUP, TRACE)


def ring_bytes(num_warps: int, stages: int) -> int:
    """Shared memory of the K and V rings."""
    return 2 * stages * num_warps * TOKENS_PER_WARP * HEAD_DIM * 2


@functools.cache
def _shared_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return props.shared_memory_per_block_optin  # type: ignore[attr-defined]  # not in torch's stubs


def supports(q, cache_k, cache_v, cfg, paged: bool) -> bool:
    """Whether this kernel runs a launch of ``cfg`` (``DecodeConfig``): on a GPU, for the
    shapes ``supports_shape`` accepts. Runs per decode call: other K/V types return
    before the device's shared-memory limit is looked up."""
    if not (q.is_cuda and cache_k.kv_type == cache_v.kv_type == "f16"):
        return False
    return supports_shape(
        cache_k.kv_type, cache_v.kv_type, q.shape[-1], q.shape[1] // cache_k.num_kv_heads,
        cache_k.block_size, cfg.block_n, cfg.num_warps, cfg.num_stages, paged,
        _shared_limit(q.device.index if q.device.index is not None
                      else torch.cuda.current_device()))


def supports_shape(k_type: str, v_type: str, head_dim: int, group: int, block_size: int,
                   block_n: int, num_warps: int, stages: int, paged: bool,
                   shared_limit: int) -> bool:
    """f16 K and V, head_dim 256, at most 8 query heads per K/V head, 16 tokens per warp,
    rings that fit ``shared_limit`` bytes, and (paged) blocks of a power of 2 >= 16
    tokens, so that each warp's tokens lie in one block."""
    return (k_type == v_type == "f16" and head_dim == HEAD_DIM and group <= MAX_GROUP
            and block_n == TOKENS_PER_WARP * num_warps
            and ring_bytes(num_warps, stages) <= shared_limit
            and (not paged or (block_size >= TOKENS_PER_WARP
                               and block_size & (block_size - 1) == 0)))


@functools.cache
def kernel_constants(num_warps: int, stages: int) -> dict:
    """This kernel's own compile-time arguments (cached; callers must not modify it)."""
    return dict(W=num_warps, STAGES=stages, **float_layouts(num_warps))


def launch(grid: tuple[int, int], args: tuple, constants: dict, num_warps: int, stages: int,
           maxnreg: int | None) -> None:
    """One launch over checked arguments, as ``quant_fragments.launch``."""
    float_fragment_kernel[grid](
        *args,
        **{k: constants[k] for k in SHARED_CONSTANTS},
        **kernel_constants(num_warps, stages),
        num_warps=num_warps, maxnreg=maxnreg,
    )
