"""The shared-memory ring of the q4_0 / q8_0 Gluon kernel (``quant_fragments``): its
layouts and its copies (``num_stages`` >= 2).

While a program computes tile i, each warp copies its own rows of tile i + STAGES - 1
with ``cp.async`` (``copy_tile``), one commit group per tile; after the group's wait
the kernel reads them back with ``ld.shared`` straight into its fragment layouts
(``K_WORDS`` / ``V_WORDS``, here as 3-d word rows ``K_WORDS3`` / ``V_WORDS3``)::

    ring stage s, per warp w (STAGES x W slots of each):
      K words [T rows][8 GB / 4 words]  swizzled: a row's 16-byte chunks permuted by its
      V words [T rows][8 GB / 4 words]  token, so copies (consecutive lanes on consecutive
      K scales [T rows][8 f16]          16 bytes of a row) and fragment reads are both
      V scales [T rows][8 f16]          free of bank conflicts
    id ring slot j % (2 STAGES): warp w's one or two block ids of tile j (``copy_ids``),
      copied with tile j - STAGES, read (``read_ids``) after that tile's wait

Consecutive lanes copy consecutive 16 bytes of a row, so each sector is fetched once
(a ring in which each lane copies only its own fragments' bytes fetches every sector
twice). The block ids ride the copies so that the tile loop holds no global load: a
table load there keeps a scoreboard through the whole tile, and ptxas then serializes
the dequantization chains, which made the paged loop slower than the contiguous one on
the H200 (docs/kernel-decisions.md; tests/kernels/test_quant_fragments.py checks that
the loop reads memory only through its copies).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from pagedserve.kernels.fragment_warps import tile_rows


def _flat(bases: list[list[int]], gb: int) -> list[list[int]]:
    """Bases ``[w, t, g, byte]`` of a byte tile -> ``[w, t, word]`` of its word rows
    (``word = g * GB / 4 + byte / 4``)."""
    return [[b[0], b[1], b[2] * (gb // 4) + b[3] // 4] for b in bases]


def ring_layouts(w: int, t: int, gb: int, *, k_reads: list[list[int]],
                 k_lanes: list[list[int]], v_reads: list[list[int]],
                 v_lanes: list[list[int]], warps: list[list[int]]) -> dict:
    """The ring's layouts for ``w`` warps of ``t`` tokens and groups of ``gb`` bytes:
    word tiles as ``[W, T, NW]`` rows of ``NW = 8 GB / 4`` words. ``k_reads`` /
    ``v_reads``: the register bases of ``K_WORDS`` / ``V_WORDS`` at word starts, and
    their lane and warp bases, over byte tiles ``[w, t, g, byte]``
    (``quant_fragments.fragment_layouts``)."""
    nw = 8 * gb // 4
    chunks = nw // 4
    scale_lanes = min(t, 32)
    return dict(
        K_WORDS3=gl.DistributedLinearLayout(
            reg_bases=_flat(k_reads, gb), lane_bases=_flat(k_lanes, gb),
            warp_bases=_flat(warps, gb), block_bases=[], shape=[w, t, nw]),
        V_WORDS3=gl.DistributedLinearLayout(
            reg_bases=_flat(v_reads, gb), lane_bases=_flat(v_lanes, gb),
            warp_bases=_flat(warps, gb), block_bases=[], shape=[w, t, nw]),
        # Copies: consecutive lanes on consecutive 16 bytes of a row.
        COPY_WORDS=gl.BlockedLayout([1, 1, 4], [1, 32 // chunks, chunks], [w, 1, 1],
                                    [2, 1, 0]),
        COPY_SCALES=gl.BlockedLayout([1, 1, 8 * scale_lanes // 32],
                                     [1, scale_lanes, 32 // scale_lanes], [w, 1, 1],
                                     [2, 1, 0]),
        RING_WORDS=gl.SwizzledSharedLayout(4, 1, 8, order=[2, 1, 0]),
        RING_SCALES=gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]),
        # Block ids [W, 2]: each warp copies (and reads) its own two.
        ID_COPY=gl.DistributedLinearLayout(
            reg_bases=[[0, 1]], lane_bases=[[0, 0]] * 5,
            warp_bases=[[1 << i, 0] for i in range(w.bit_length() - 1)], block_bases=[],
            shape=[w, 2]),
        ID_RING=gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]),
    )


@gluon.jit
def id_pointers(table_row, start, tok_hi, W: gl.constexpr, T: gl.constexpr,
                BS: gl.constexpr, layout: gl.constexpr):
    """Table pointers ``[W, 2]`` of each warp's one or two block ids of the tile at
    ``start`` (``warp_block_ids``; with ``BS >= T`` both columns are the one id), and
    which lie before ``tok_hi``."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, layout))[:, None]
    c = gl.arange(0, 2, layout=gl.SliceLayout(0, layout))[None, :]
    first = start + w * T
    if BS < T:
        lead = first + c * BS
    else:
        lead = first + c * 0
    return table_row + lead // BS, lead < tok_hi


@gluon.jit
def copy_ids(slot, table_row, start, tok_hi, W: gl.constexpr, T: gl.constexpr,
             BS: gl.constexpr, layout: gl.constexpr):
    """``cp.async`` of the ``id_pointers`` ids into ``slot`` ``[W, 2]``; ids past
    ``tok_hi`` are zero-filled (their rows are not live)."""
    ptrs, mask = id_pointers(table_row, start, tok_hi, W, T, BS, layout)
    async_copy.async_copy_global_to_shared(slot, ptrs, mask=mask)


@gluon.jit
def read_ids(slot, IDS: gl.constexpr, layout: gl.constexpr):
    """The ids ``copy_ids`` wrote to ``slot``, as ``[W]`` twice in ``layout``'s warp
    slice."""
    warp: gl.constexpr = gl.SliceLayout(1, layout)
    a, b = gl.split(slot.load(IDS))
    return (gl.convert_layout(a, warp, assert_trivial=True),
            gl.convert_layout(b, warp, assert_trivial=True))


@gluon.jit
def copy_tile(kw_slot, vw_slot, ks_slot, vs_slot, kd_ptr, ks_ptr, vd_ptr, vs_ptr, table_row,
              id0, id1, start, tok_hi, num_blocks, num_kv_heads, h, head_stride,
              W: gl.constexpr, T: gl.constexpr, BS: gl.constexpr, PAGED: gl.constexpr,
              WARP_IDS: gl.constexpr, NW: gl.constexpr, COPY_WORDS: gl.constexpr,
              COPY_SCALES: gl.constexpr):
    """``cp.async`` of the tile at ``start``: K and V payload rows (``[W, T, NW]`` words,
    consecutive lanes on consecutive 16 bytes) and scales (``[W, T, 8]``) into one ring
    stage (the caller commits the group); rows not live are zero-filled, not read."""
    rw: gl.constexpr = gl.SliceLayout(2, COPY_WORDS)
    row, live = tile_rows(table_row, id0, id1, start, tok_hi, num_blocks, num_kv_heads, h,
                          head_stride, W, T, BS, PAGED, WARP_IDS, rw)
    c = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_WORDS)))
    offs = gl.where(live, row, 0).to(gl.int64)[:, :, None] * NW + c[None, None, :]
    async_copy.async_copy_global_to_shared(kw_slot, kd_ptr.to(gl.pointer_type(gl.int32)) + offs,
                                           mask=live[:, :, None])
    async_copy.async_copy_global_to_shared(vw_slot, vd_ptr.to(gl.pointer_type(gl.int32)) + offs,
                                           mask=live[:, :, None])
    rs: gl.constexpr = gl.SliceLayout(2, COPY_SCALES)
    row, live = tile_rows(table_row, id0, id1, start, tok_hi, num_blocks, num_kv_heads, h,
                          head_stride, W, T, BS, PAGED, WARP_IDS, rs)
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, COPY_SCALES)))
    offs = gl.where(live, row, 0).to(gl.int64)[:, :, None] * 8 + g[None, None, :]
    async_copy.async_copy_global_to_shared(ks_slot, ks_ptr + offs, mask=live[:, :, None])
    async_copy.async_copy_global_to_shared(vs_slot, vs_ptr + offs, mask=live[:, :, None])
