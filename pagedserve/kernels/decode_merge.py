"""The end of a split sequence in the decode kernels: count chunks, merge partials (LSE).

A chunk of a split sequence writes its unnormalized output, running max and sum to the
workspace and counts itself in its merge group (``decode_plan``, "Merging"); the last
chunk of a group merges it, the last group merged writes the output.

Every decode kernel calls these functions: the Triton one (``paged_decode``) and the
Gluon ones (``quant_fragments``, ``float_fragments``). Gluon's tensors carry a layout, so
the callers pass the index vectors (``rows = arange(0, GP)``, ``cols = arange(0, D)``,
laid out as the slices of one 2-D layout) and everything here derives its shapes from
them.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity" for running maxima, so that exp2 of their differences is 0 or 1
# and never NaN (-inf - -inf) when a whole tile is masked.
NEG_BIG = tl.constexpr(-1.0e30)
# Partials per trip of the merge loop (their loads in flight together): 4 x [8, 256]
# float32 over 128 threads is 64 registers per thread. The Gluon kernel takes a whole
# merge group (``decode_plan.MERGE_GROUP``), so each merge level is one round of loads. In the
# Triton kernel the merge's registers move the tile loop's allocation: a wider unroll made
# the packed q4_0 loop spill and f16 slower (docs/kernel-decisions.md).
MERGE_UNROLL = 4


@triton.jit
def merge_partials(
    part_acc_ptr, part_ml_ptr, first, count, stride, rows, cols,
    G: tl.constexpr, D: tl.constexpr, MERGE_UNROLL: tl.constexpr,
):
    """Log-sum-exp merge of ``count`` partials in slots ``first + i * stride``.

    ``part_acc_ptr`` / ``part_ml_ptr`` point at slot 0 of one K/V head. Loads bypass L1
    (``.cg``): the partials were written by other programs.

    One partial at a time, ``MERGE_UNROLL`` per loop trip: every thread owns the same
    ``[GP, D]`` elements of each partial, so the merge is elementwise, with no reduction
    across threads (no shared memory, no barrier), and the unrolled trip's loads are
    independent of its arithmetic, so they are all in flight together. The merges are
    the serial tail of every split sequence.

    Returns:
        ``(o, m, l)``: float32 ``[GP, D]`` unnormalized output, ``[GP]`` max and sum.
    """
    row_ok = rows < G
    l_run = rows.to(tl.float32) * 0.0  # [GP]
    m_run = l_run + NEG_BIG
    o_run = (rows[:, None] + cols[None, :]).to(tl.float32) * 0.0  # [GP, D]
    for c0 in range(0, count, MERGE_UNROLL):
        for i in tl.static_range(MERGE_UNROLL):
            ok = row_ok & (c0 + i < count)  # [GP]
            slot = first + (c0 + i) * stride
            ml = part_ml_ptr + (slot * G + rows) * 2
            m = tl.load(ml, mask=ok, other=NEG_BIG, cache_modifier=".cg")
            l = tl.load(ml + 1, mask=ok, other=0.0, cache_modifier=".cg")
            o = tl.load(part_acc_ptr + (slot * G + rows[:, None]) * D + cols[None, :],
                        mask=ok[:, None], other=0.0, cache_modifier=".cg")  # [GP, D]
            m_new = tl.maximum(m_run, m)
            a = tl.exp2(m_run - m_new)  # [GP], <= 1
            w = tl.exp2(m - m_new)
            l_run = l_run * a + l * w
            o_run = o_run * a[:, None] + o * w[:, None]
            m_run = m_new
    return o_run, m_run, l_run


@triton.jit
def store_merged(out_ptr, row_stride, o, l, rows, out_cols, G: tl.constexpr):
    """The normalized output ``o / l`` (0 where nothing was live); column ``j`` of ``o``
    goes to output column ``out_cols[j]``."""
    # l >= 1 whenever any row was live (the running max contributes exp2(0) = 1).
    inv = tl.where(l > 0.0, 1.0 / tl.maximum(l, 1.0), 0.0)
    tl.store(out_ptr + rows[:, None] * row_stride + out_cols[None, :],
             (o * inv[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])


@triton.jit
def store_stats(ml_ptr, m, l, rows, G: tl.constexpr):
    """A partial's running max and sum (``[GP]`` each, rows ``rows``) into its slot's
    ``[G, 2]`` pair array."""
    tl.store(ml_ptr + rows * 2, m, mask=rows < G)
    tl.store(ml_ptr + rows * 2 + 1, l, mask=rows < G)


@triton.jit
def store_partial(acc_ptr, ml_ptr, o, m, l, rows, cols, G: tl.constexpr, D: tl.constexpr):
    """One partial (``[GP, D]`` output, ``[GP]`` max and sum) into its slot's pointers."""
    tl.store(acc_ptr + rows[:, None] * D + cols[None, :], o, mask=(rows < G)[:, None])
    store_stats(ml_ptr, m, l, rows, G)


@triton.jit
def finish_split(
    out_ptr, out_row_stride, head_acc, head_ml, group_counter_ptr, seq_counter_ptr,
    pid, first, seq_chunks, rows, cols, out_cols,
    G: tl.constexpr, D: tl.constexpr, MERGE_UNROLL: tl.constexpr,
    MERGE_GROUP: tl.constexpr,
):
    """After this chunk's partial is stored: count it, and merge if it is the last.

    Partials are ``[G, D]`` float32 per slot; their column ``j`` is output column
    ``out_cols[j]`` (``cols`` itself, or a kernel's own order of head_dim).

    Publication order: a barrier orders every thread's stores before the one thread that
    performs the (release) atomic; its (acquire) result then orders the merge's loads.
    """
    g_first = first + ((pid - first) // MERGE_GROUP) * MERGE_GROUP
    g_size = tl.minimum(MERGE_GROUP, first + seq_chunks - g_first)
    num_groups = tl.cdiv(seq_chunks, MERGE_GROUP)
    tl.debug_barrier()
    done = tl.atomic_add(group_counter_ptr + g_first, 1, sem="acq_rel", scope="gpu")
    if done == g_size - 1:
        o, m, l = merge_partials(head_acc, head_ml, g_first, g_size, 1, rows, cols, G, D,
                                 MERGE_UNROLL)
        tl.atomic_xchg(group_counter_ptr + g_first, 0, sem="relaxed", scope="gpu")
        if num_groups == 1:
            store_merged(out_ptr, out_row_stride, o, l, rows, out_cols, G)
        else:
            store_partial(head_acc + g_first * G * D, head_ml + g_first * G * 2, o, m, l,
                          rows, cols, G, D)
            tl.debug_barrier()
            groups_done = tl.atomic_add(seq_counter_ptr, 1, sem="acq_rel", scope="gpu")
            if groups_done == num_groups - 1:
                o, m, l = merge_partials(head_acc, head_ml, first, num_groups,
                                         MERGE_GROUP, rows, cols, G, D, MERGE_UNROLL)
                store_merged(out_ptr, out_row_stride, o, l, rows, out_cols, G)
                tl.atomic_xchg(seq_counter_ptr, 0, sem="relaxed", scope="gpu")
