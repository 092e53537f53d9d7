"""What the two Gluon decode kernels share: the per-warp skeleton around their loads.

Both kernels (``quant_fragments`` for q4_0 and q8_0 K and V, ``float_fragments`` for f16)
run program ``(c, h)`` on chunk ``c`` of the partition plan (``decode_plan``) for K/V
head ``h``, split each tile among their W warps (T tokens each), and give every warp its
own online softmax over ``S^T = K . Q^T`` (K the A operand, the 8 query heads the n of
the MMA) and ``O^T += V^T . P^T``; the warps' states merge once at the end. This module
holds those pieces: the program's chunk (``locate_program``), q as the B operand,
each warp's block ids and rows, the softmax step, the scores turned into the B operand
(``movmatrix``), and the end of a program (``finish_program``: the warps merged, then
the output or a partial for the split merge).

*Labels.* The contraction index of ``K . Q^T`` and the row index of ``O^T`` may be any
permutation of head_dim, if q is loaded and the output stored through the same one:
``quant_fragments`` uses that to make each fragment register's bytes adjacent in memory
(its ``Q_PERM``, ``TO_D``); ``float_fragments`` keeps head_dim's order.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from pagedserve.kernels.decode_merge import NEG_BIG, finish_split, store_stats
from pagedserve.kernels.decode_plan import locate_chunk
from pagedserve.kernels.decode_trace import stamp

# Transposes an 8 x 8 f16 tile held in the MMA accumulator's arrangement (thread l: row
# l // 4, columns 2 (l % 4) and + 1), warp-wide, into the same arrangement.
MOVMATRIX_ASM = tl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")

HEAD_DIM = tl.constexpr(256)
MAX_GROUP = tl.constexpr(8)  # query heads per K/V head: the n of the products

# The Triton kernel's compile-time arguments (``paged_decode.launch_constants``) that the
# Gluon kernels take too: the plan's, the pool's rows, the merge's and
# ``TRACE``.
SHARED_CONSTANTS = ("G", "GP", "BS", "INTERLEAVE", "B_PAD", "MIN_PARTITION", "PAGED",
                    "MERGE_UNROLL", "MERGE_GROUP", "TRACE")


@gluon.jit
def _arange3(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """``arange(0, n)`` along ``dim`` of a rank-3 ``layout``, expanded to rank 3."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]


@gluon.jit
def relabel(x, PERM: gl.constexpr, shape: gl.constexpr):
    """``[A, B, 8 groups, GB bytes]`` -> the label order: the byte index's bits permuted
    with ``PERM`` (``Q_PERM``), reshaped to ``shape``. It only renames which
    register or lane holds which index: no data moves."""
    n: gl.constexpr = len(PERM.value) - 2
    return gl.reshape(gl.permute(gl.reshape(x, [x.shape[0], x.shape[1]] + [2] * n), PERM.value),
                      shape)


@gluon.jit
def load_q(q_base, row_stride, G: gl.constexpr, W: gl.constexpr):
    """q of the G heads, f16 ``[W, 8, 256]`` (heads >= G zero, the same in every warp),
    loaded in 16-byte vectors: each thread holds 32 consecutive values (one q4_0 / q8_0
    group) of one head."""
    QL: gl.constexpr = gl.BlockedLayout([1, 1, 32], [1, 4, 8], [W, 1, 1], [2, 1, 0])
    warp = _arange3(W, 0, QL)
    head = _arange3(MAX_GROUP, 1, QL)
    d = _arange3(HEAD_DIM, 2, QL)
    return gl.load(q_base + (warp * 0 + head * row_stride + d),
                   mask=(warp * 0 + head + d * 0) < G, other=0.0).to(gl.float32).to(gl.float16)


@gluon.jit
def q_operand(q, Q_PERM: gl.constexpr, HALVES: gl.constexpr, layout: gl.constexpr):
    """``load_q``'s q as the ``B`` operand of ``S^T = K . Q^T``: f16 ``[W, NL, 8]``; for
    q4_0 twice, lo and hi labels. Relabelled (``Q_PERM``), then one conversion into the
    operand layout."""
    W: gl.constexpr = q.shape[0]
    if HALVES:
        # d = 32 g + 16 half + j -> lo / hi halves of [W, 8, g, j], then bytes -> labels.
        lo, hi = gl.split(gl.permute(gl.reshape(q, [W, MAX_GROUP, 8, 2, 16]), [0, 1, 2, 4, 3]))
        lo = gl.permute(relabel(lo, Q_PERM, [W, MAX_GROUP, 128]), [0, 2, 1])
        hi = gl.permute(relabel(hi, Q_PERM, [W, MAX_GROUP, 128]), [0, 2, 1])
        return gl.convert_layout(lo, layout), gl.convert_layout(hi, layout)
    else:
        q = gl.permute(relabel(q, Q_PERM, [W, MAX_GROUP, HEAD_DIM]), [0, 2, 1])
        return gl.convert_layout(q, layout)


@gluon.jit
def scores_to_b_operand(p, layout: gl.constexpr):
    """``P^T`` f16 ``[W, T tokens, 8 heads]`` in the accumulator layout of ``S^T`` ->
    the same values in the B operand ``layout`` of ``O^T += V^T . P^T``: one ``movmatrix``
    per 8 x 8 tile. After it, the register that held (token t, head h) holds (token
    8 (t // 8) + h, head t % 8): swapping those index bits back is a relabel."""
    W: gl.constexpr = p.shape[0]
    T: gl.constexpr = p.shape[1]
    y = gl.inline_asm_elementwise(MOVMATRIX_ASM, "=r,r", [p], dtype=gl.float16, is_pure=True,
                                  pack=2)
    z = gl.reshape(gl.permute(gl.reshape(y, [W, T // 8, 8, MAX_GROUP]), [0, 1, 3, 2]),
                   [W, T, MAX_GROUP])
    return gl.convert_layout(z, layout, assert_trivial=True)


@gluon.jit
def warp_block_ids(table_row, start, tok_hi, W: gl.constexpr, T: gl.constexpr,
                   BS: gl.constexpr, layout: gl.constexpr):
    """The one or two block ids of each warp's T tokens of the tile at ``start``: int32
    ``[W]`` twice, in ``layout``'s warp slice; -1 past ``tok_hi``. A warp's tokens start
    at a multiple of T (chunks start at multiples of the tile) and ``BS`` is a power of
    2 >= 16 (``WARP_IDS``), so they lie in one block or two: two loads per thread (one
    address per warp each), not one per token."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, layout))
    first = start + w * T  # [W]
    blk = first // BS
    id0 = gl.load(table_row + blk, mask=first < tok_hi, other=-1)
    if BS < T:
        id1 = gl.load(table_row + blk + 1, mask=first + BS < tok_hi, other=-1)
    else:
        id1 = id0
    return id0, id1


@gluon.jit
def tile_rows(table_row, id0, id1, start, tok_hi, num_blocks, num_kv_heads, h,
              head_stride, W: gl.constexpr, T: gl.constexpr, BS: gl.constexpr,
              PAGED: gl.constexpr, WARP_IDS: gl.constexpr, layout: gl.constexpr):
    """``(row, live)`` of each row of the tile at ``start`` (warp w takes tokens
    ``start + T w ..``), int32 and bool ``[W, T]`` in ``layout``: the row's index in the
    pool's ``[num_blocks * Hkv * head_stride]`` rows (``sequence_table``), and whether it
    holds a token of a block in the pool (``row`` is meaningless where not).

    ``id0``, ``id1``: ``_warp_block_ids`` (``WARP_IDS``), or the contiguous layout's one
    block (``PAGED=False``). From warp-uniform block bases a row is a base plus a
    constant per register: the token's offset within its warp (``t``) is a register or
    lane index, so whether it is in the warp's first or second block is known per
    register. Otherwise (block sizes below 16 or not powers of 2) each row reads its own
    block id."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, layout))[:, None]
    t = gl.arange(0, T, layout=gl.SliceLayout(0, layout))[None, :]
    first = start + w * T  # [W, 1]
    live = t < tok_hi - first
    if not PAGED:
        ok = (id0 >= 0) & (id0 < num_blocks)
        row = (id0 * num_kv_heads + h) * head_stride + first + t
    elif WARP_IDS:
        warp: gl.constexpr = gl.SliceLayout(1, layout)
        id0 = gl.convert_layout(id0, warp, assert_trivial=True)[:, None]
        id1 = gl.convert_layout(id1, warp, assert_trivial=True)[:, None]
        base0 = (id0 * num_kv_heads + h) * head_stride
        ok0 = (id0 >= 0) & (id0 < num_blocks)
        if BS < T:
            second = t >= BS
            base1 = (id1 * num_kv_heads + h) * head_stride
            ok1 = (id1 >= 0) & (id1 < num_blocks)
            row = gl.where(second, base1, base0) + (t % BS)
            ok = gl.where(second, ok1, ok0)
        else:
            row = base0 + first % BS + t
            ok = ok0
    else:
        tok = first + t
        ids = gl.load(table_row + tok // BS, mask=live, other=-1)
        ok = (ids >= 0) & (ids < num_blocks)
        row = (ids * num_kv_heads + h) * head_stride + tok % BS
    return row, live & ok


@gluon.jit
def label_column(label, TO_D: gl.constexpr):
    """The column of output label ``label`` (0..255: lo labels, then q4_0's hi labels):
    itself (a partial keeps label order) or, ``TO_D``, its head_dim index
    ``32 (label % 8) + label // 8`` (``v_label_to_byte``; a hi label ``128 + r`` is
    ``d(r) + 16``)."""
    if TO_D:
        return (label % 8) * 32 + label // 8
    else:
        return label


@gluon.jit
def _warps_combined(acc, wgt, layout: gl.constexpr):
    """``sum_w wgt[w, head] * acc[w, label, head]``: the warps' ``O^T`` ``[W, NL, 8]``
    (MMA layout) -> ``[8 heads, NL labels]`` in ``SliceLayout(0, layout)``. Transposed
    (a relabel) and converted so that each thread holds every warp's copy of its
    elements, the sum stays in the thread (a reduction over warps would go through shared
    memory in rounds, each behind a barrier)."""
    x = gl.convert_layout(gl.permute(acc, [0, 2, 1]), layout)  # [W, 8, NL]
    return gl.sum(x * wgt[:, :, None], axis=0)


@gluon.jit
def _store_labels(ptr, row_stride, o_lo, o_hi, row_scale, G: gl.constexpr,
                  HALVES: gl.constexpr, TO_D: gl.constexpr):
    """Write ``o * row_scale[head]`` (``[8 heads, NL labels]``; for q4_0 (``HALVES``)
    ``o_hi`` holds labels ``NL + r``) to ``ptr + head * row_stride + label_column(label)``
    for heads < G, in ``ptr``'s dtype."""
    layout: gl.constexpr = o_lo.type.layout
    NL: gl.constexpr = o_lo.shape[1]
    head = gl.arange(0, MAX_GROUP, layout=gl.SliceLayout(1, layout))[:, None]
    r = gl.arange(0, NL, layout=gl.SliceLayout(0, layout))[None, :]
    mask = (head + r * 0) < G
    scale = gl.convert_layout(row_scale, gl.SliceLayout(1, layout))[:, None]
    base = ptr + head * row_stride
    gl.store(base + label_column(r, TO_D), (o_lo * scale).to(ptr.dtype.element_ty), mask=mask)
    if HALVES:
        gl.store(base + label_column(r + NL, TO_D), (o_hi * scale).to(ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def locate_program(lens_ptr, batch, capacity, chunk_budget, trace_ptr, W: gl.constexpr,
                   BLOCK_N: gl.constexpr, B_PAD: gl.constexpr, MIN_PARTITION: gl.constexpr,
                   UPPER_HEADS_REVERSED: gl.constexpr, ALIGNED_START: gl.constexpr,
                   TRACE: gl.constexpr):
    """This program's place in the plan (``decode_plan.locate_chunk``), its trace record
    ``slot`` stamped at entry: ``(chunk, h, slot, num_chunks, b, seq_chunks, first,
    tok_lo, tok_hi)``; ``chunk >= num_chunks`` means no work.

    ``UPPER_HEADS_REVERSED``: K/V heads ``h >= Hkv / 2`` take their chunks in reverse
    order (same chunks, another order of dispatch, so the programs sharing an SM read
    different sequences). A per-kernel choice: on the H200 it speeds up the quantized
    kernels' paged side at large sizes and slows f16's short points
    (docs/kernel-decisions.md). ``ALIGNED_START``: see ``locate_chunk``."""
    pid = gl.program_id(0)
    h = gl.program_id(1)
    slot = h * gl.num_programs(0) + pid
    stamp(trace_ptr, slot, 0, TRACE)
    PLAN: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    reverse = UPPER_HEADS_REVERSED and h >= gl.num_programs(1) // 2
    num_chunks, chunk, b, seq_chunks, first, tok_lo, tok_hi = locate_chunk(
        lens_ptr, batch, capacity, chunk_budget, pid,
        gl.arange(0, B_PAD, layout=PLAN), reverse, BLOCK_N, MIN_PARTITION, ALIGNED_START)
    return chunk, h, slot, num_chunks, b, seq_chunks, first, tok_lo, tok_hi


@gluon.jit
def sequence_table(table_ptr, b, stride_tb, capacity, BS: gl.constexpr,
                   INTERLEAVE: gl.constexpr, PAGED: gl.constexpr):
    """``(table_row, head_stride, block0)`` of sequence ``b``: its block-table row, the
    pool rows from one (block, K/V head) to the next (``INTERLEAVE`` times the rows of a
    block: ``BS``, or ``capacity`` for the contiguous layout's one block per sequence,
    padded to the longest; ``formats``' byte diagram) and, contiguous, that block's id
    (else 0)."""
    table_row = table_ptr + b * stride_tb
    if PAGED:
        head_stride = INTERLEAVE * BS  # a constant once inlined, as BS itself
        block0 = 0
    else:
        head_stride = INTERLEAVE * capacity
        block0 = gl.load(table_row)
    return table_row, head_stride, block0


@gluon.jit
def initial_state(W: gl.constexpr, HEADS: gl.constexpr):
    """Each warp's running max and sum before its first tile: ``[W, 8]`` twice."""
    return (gl.full([W, MAX_GROUP], NEG_BIG, gl.float32, HEADS),
            gl.zeros([W, MAX_GROUP], gl.float32, HEADS))


@gluon.jit
def softmax_step(st, live, qk_scale, m_i, l_i):
    """One tile of each warp's online softmax in the log2 domain: raw scores ``S^T``
    ``[W, T, 8]`` (rows not ``live`` ``[W, T]`` masked out) against the running max and
    sum ``[W, 8]`` -> ``(p, alpha, m, l)``: the numerators, the factor that rescales the
    accumulator, and the new max and sum."""
    st = gl.where(live[:, :, None], st * qk_scale, float("-inf"))  # [W, T, 8]
    m_new = gl.maximum(m_i, gl.max(st, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(st - m_new[:, None, :])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def finish_program(
    acc_lo, acc_hi, m_i, l_i, out_ptr, stride_ob, stride_oh, part_acc_ptr, part_ml_ptr,
    group_counter_ptr, seq_counter_ptr, max_chunks, num_kv_heads, chunk, h, b, first,
    seq_chunks, trace_ptr, slot, G: gl.constexpr, GP: gl.constexpr, HALVES: gl.constexpr,
    TO_D: gl.constexpr, MERGE: gl.constexpr, MERGE_UNROLL: gl.constexpr,
    MERGE_GROUP: gl.constexpr, TRACE: gl.constexpr,
):
    """The end of a program: the warps' ``O^T`` ``[W, NL, 8]`` (``acc_hi``: q4_0's hi
    labels, ``HALVES``) and softmax states merged, then written as the output (one
    chunk) or as a partial and counted for the split merge (``decode_merge``). Outputs
    map labels to head_dim with ``label_column(.., TO_D)``; partials keep label order."""
    W: gl.constexpr = acc_lo.shape[0]
    D: gl.constexpr = HEAD_DIM
    stamp(trace_ptr, slot, 3, TRACE)
    # The warps' partial states -> one (log-sum-exp weights), in RED: a thread holds
    # every warp's copy of its elements (so the sums stay in the thread), four labels
    # contiguous (16-byte stores of a partial).
    RED: gl.constexpr = gl.BlockedLayout([W, 1, 4], [1, 1, 32], [1, W, 1], [2, 1, 0])
    STATS: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, RED))  # [8 heads]
    m_w = gl.convert_layout(m_i, gl.SliceLayout(2, RED))  # [W, 8]
    l_w = gl.convert_layout(l_i, gl.SliceLayout(2, RED))
    m = gl.max(m_w, axis=0)  # [8]
    wgt = gl.exp2(m_w - m[None, :])
    l_sum = gl.sum(l_w * wgt, axis=0)
    o_lo = _warps_combined(acc_lo, wgt, RED)  # [8 heads, NL labels]
    if HALVES:
        o_hi = _warps_combined(acc_hi, wgt, RED)
    else:
        o_hi = o_lo
    if seq_chunks == 1:
        # Zero length -> zeros, never NaN; l >= 1 whenever any row was live.
        inv = gl.where(l_sum > 0.0, 1.0 / gl.maximum(l_sum, 1.0), 0.0)
        _store_labels(out_ptr + b * stride_ob + h * G * stride_oh, stride_oh, o_lo, o_hi,
                      inv, G, HALVES, TO_D)
        stamp(trace_ptr, slot, 4, TRACE)
    else:
        # A partial is [G, 256] float32 in label order (each thread's four labels one
        # 16-byte store); the merge's output store maps labels to head_dim.
        head_acc = part_acc_ptr + h * max_chunks * G * D
        head_ml = part_ml_ptr + h * max_chunks * G * 2
        _store_labels(head_acc + chunk * G * D, D, o_lo, o_hi, l_sum * 0.0 + 1.0, G, HALVES,
                      False)
        store_stats(head_ml + chunk * G * 2, m, l_sum, gl.arange(0, MAX_GROUP, layout=STATS), G)
        stamp(trace_ptr, slot, 4, TRACE)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, MERGE))
        finish_split(out_ptr + b * stride_ob + h * G * stride_oh, stride_oh, head_acc,
                     head_ml, group_counter_ptr + h * max_chunks,
                     seq_counter_ptr + b * num_kv_heads + h, chunk, first, seq_chunks,
                     gl.arange(0, GP, layout=gl.SliceLayout(1, MERGE)), cols,
                     label_column(cols, TO_D), G, D, MERGE_UNROLL, MERGE_GROUP)
    stamp(trace_ptr, slot, 5, TRACE)
