"""Gluon paged decode for q4_0 or q8_0 K and V, dequantized straight into MMA fragments.

The Triton kernel (``paged_decode``) dequantizes a whole ``[block_n, D]`` tile in a
layout of Triton's choosing, then Triton stages it through shared memory into the
tensor cores' operand layout; for q4_0 that staging and the shuffles around it cost more
instructions than the dequantization itself. This kernel, written in Gluon (explicit
layouts), never converts a dequantized value: each thread reads exactly the payload
bytes whose values its ``mma.sync`` fragments hold, and turns them into those fragments
in place with a few lines of PTX (``Q4_GROUP_ASM``, ``Q8_GROUP_ASM`` and the pair forms
below), one to two instructions per value.

Shape: head_dim 256, K and V both q4_0 or both q8_0, at most 8 query heads per K/V head,
a ring of at least two stages, on a GPU; ``paged_decode.select_kernel`` sends everything
else to the Triton kernel (the interpreter runs no Gluon). One kernel serves both types;
``Geometry`` holds what differs: a q4_0 row is 8 groups of 16 bytes, each byte two values
(a "lo" and a "hi" label row, so every product runs twice); a q8_0 row is 8 groups of 32
bytes, one value each (its K products also run in two halves of 128 labels, its V
products over all 256).

Work split. Program ``(c, h)`` takes chunk ``c`` of the partition plan (``decode_plan``)
for K/V head ``h``, as the Triton kernel does. Each of its W warps walks its own T
tokens (32 for q4_0, 16 for q8_0, whose rows are twice the bytes) of every ``T W``-token
tile with its own online softmax (no cross-warp traffic in the loop); the warps' states
merge once at the end. The next tiles' bytes are in flight in a shared-memory ring while
the current tile is computed ("The ring" below)::

    per warp, per T-token tile (NL = 128 labels x2 halves; q8_0's V: 256 labels)
    S^T  = K . Q^T   mma m16n8k16: A = K [T tokens, NL],
                                   B = q^T [NL, 8 heads (G, then zeros)]
    P^T  = softmax of S^T over tokens, in registers; one movmatrix per 8 x 8 tile turns
           the accumulator's arrangement into the B operand's
    O^T += V^T . P^T mma m16n8k16: A = V^T [NL, T tokens], B = P^T [T, 8]

With K as the A operand no MMA row is padding: q fills the n = 8 of the B operand,
where ``S = Q . K^T`` would pad the heads to 16 rows. The contraction index of
``K . Q^T`` and the row index of ``O^T`` are *labels*: any permutation of head_dim works
if q is loaded (and the output stored) through the same permutation. Labels are chosen
so that each fragment register's bytes sit next to each other in memory
(``k_group_label_to_byte``, ``v_label_to_byte``). A q4_0 row's 128 payload bytes are
``[group g (8)][byte j (16)]`` (``kv.formats``); byte j of group g holds values
``32 g + j`` (low nibble, the "lo" half) and ``32 g + 16 + j`` (high nibble, "hi"). A
q8_0 row's 256 bytes are ``[group g (8)][byte j (32)]``, one value each; K takes its
first and second 16 bytes of a group as the "lo" and "hi" halves, so that both types' K
products run over the same labels::

    K, per thread: word ``lane % 4`` of every group's 16 bytes (q8_0: of both halves)
       of each of its 4 (q4_0) or 2 (q8_0) token rows; label c of a half <- byte
       (c3, c0, c1, c2) as bits j0..j3 of the half's 16 bytes, group c4..c6, so each
       k-step of 16 labels is one group (``k_group_label_to_byte``; "Grouped scores")
    V, per thread: one group (16 or 32 bytes) of each of 8 or 4 token rows;
       label r <- byte (r3, r4, .., r0, r1, r2) as bits b0.. (``v_label_to_byte``)

so that a thread's bytes, read in memory order, are already the registers of its
fragments (K's words as the A operand's: a word is one row's four labels c, c + 1,
c + 8, c + 9 of a k-step). V's fragments pair two tokens in a register: its rows split
into tokens t and t + 1 (a register bit, so no data moves) and ``Q4_PAIRS_ASM``
(``Q8_PAIRS_ROWS_ASM``) interleaves a word of each with one ``prmt`` as it dequantizes
(``_pair_fragments``), so no byte is repacked. Each token slice (K's, V's, the scores')
computes its own rows, since moving them between layouts goes through shared memory
behind a barrier of all warps.

Grouped scores (K, ``_tile_scores_grouped``). A q4_0 value is ``(nibble - 8) d`` with d
per row and group, so ``S^T = sum_g d_g (sum over group g of (nibble - 8) q)``: the
products run on the raw nibbles (``Q4_GROUP_ASM``: one ``lop3`` per pair, f16 1024 +
nibble or 64 + nibble, exact), one accumulator per group, and the offsets
(``_q_group_offsets``, from q once per program) and the scale are applied to each
group's partial scores in f32, where per-value dequantization would take a subtraction
and a multiplication per pair (and round each value to f16). q8_0 the same way
(``Q8_GROUP_ASM``: f16 1152 + qs, one ``lop3`` per pair). q's load goes out first; its
conversions, which wait at barriers, come after the ring's first copies. V keeps the
per-value form: folding its scale into P would need group-pure m-tiles of ``V^T``,
another label layout.

The ring (``quant_ring`` owns its layouts and copies). Each warp copies its own rows of
tile i + STAGES - 1 with ``cp.async`` while tile i is computed, and reads tile i back
with ``ld.shared`` straight into ``K_WORDS`` / ``V_WORDS``; block ids ride the copies,
so the loop holds no global load. About 200-240 registers and 68-72 KB of shared memory
at 4 warps: two programs per SM. Gluon's barrier analysis puts three CTA barriers in a
paged tile (one orders the id reads before their slot's next copy) and two in a
contiguous one.

End of a program (``fragment_warps.finish_program``, shared with ``float_fragments``):
the warps' states combine after one layout conversion that gives each thread every
warp's copy of its elements; a split chunk stores its partial ``[G, 256]`` in label order
as 16-byte vectors (the merge is elementwise, so any order serves;
``fragment_warps.label_column`` maps labels to head_dim for the output), and the merge
takes a whole group of partials per trip. With ``trace=`` every program records the
global timer at six points (``decode_trace``; ``benchmarks/tools/trace_decode.py``), a
separately compiled variant.

The choices above that rest on measurements (the ring against a register double buffer,
grouped K, the wide launches) are in docs/kernel-decisions.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from pagedserve.kernels.decode_plan import DecodeConfig
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
)
from pagedserve.kernels.kv_tiles import q4_dequant_asm
from pagedserve.kernels.quant_ring import copy_ids, copy_tile, id_pointers, read_ids, ring_layouts
from pagedserve.kv.formats import KVBlockStorage

# V's A-operand registers pair tokens t and t + 1 of one label. Each invocation takes a
# word of 4 bytes of row t ($8), the same 4 bytes of row t + 1 ($9) and the pair of their
# group scales (d_t, d_t1) ($10; $11 repeats it). t = [t.b0 t.b1 t1.b0 t1.b1] (one prmt
# interleaves the rows), so that ``q4_dequant_asm`` picks (t, t1) pairs straight into f16
# halves; the second prmt does bytes 2 and 3. Outputs, two f16x2 registers each: low
# nibbles of bytes 0, 1; low nibbles of bytes 2, 3; high nibbles of bytes 0, 1; high
# nibbles of bytes 2, 3 (``_pair_fragments`` relabels them). Exact as Q4_HALVES_ASM.
Q4_PAIRS_ASM = tl.constexpr(q4_dequant_asm([("$8", "$9", "0x5410"), ("$8", "$9", "0x7632")],
                                           ("$10", "$10")))

# The q8_0 form of Q4_PAIRS_ASM: a word of row t ($4), the same 4 bytes of row t + 1 ($5),
# the pair of their group scales (d_t, d_t1) ($6; $7 repeats it). u = [t.b0 t.b1 t1.b0
# t1.b1] (prmt); (u & 0x00ff00ff) ^ 0x64806480 (one lop3) is the f16 pair 1152 + qs of
# byte 0 of both rows (the low byte ^ 0x80 is qs + 128), u >> 8 the same for byte 1; the
# second prmt does bytes 2 and 3. Minus 1152 -> qs (exact), times d. Outputs, two f16x2
# registers each: bytes 0, 1 and bytes 2, 3, each register (row t, row t + 1).
Q8_PAIRS_ROWS_ASM = tl.constexpr("""
{
.reg .b32 t, u, lowb, magic, off;
mov.b32 lowb, 0x00ff00ff;
mov.b32 magic, 0x64806480;
mov.b32 off, 0x64806480;
prmt.b32 t, $4, $5, 0x5410;
lop3.b32 $0, t, lowb, magic, 0x6a;
shr.b32 u, t, 8;
lop3.b32 $1, u, lowb, magic, 0x6a;
prmt.b32 t, $4, $5, 0x7632;
lop3.b32 $2, t, lowb, magic, 0x6a;
shr.b32 u, t, 8;
lop3.b32 $3, u, lowb, magic, 0x6a;
sub.f16x2 $0, $0, off;
sub.f16x2 $1, $1, off;
sub.f16x2 $2, $2, off;
sub.f16x2 $3, $3, off;
mul.f16x2 $0, $0, $6;
mul.f16x2 $1, $1, $6;
mul.f16x2 $2, $2, $6;
mul.f16x2 $3, $3, $6;
}
""")

# q4_0's K for ``_tile_scores_grouped``: a word's bytes b0..b3 ($4) -> their low nibbles as
# f16 1024 + nibble and their high nibbles as f16 64 + nibble (at exponent 6 the mantissa's
# bits 4..7 step by 1, so the high nibble needs no shift), with neither the offset 8 nor
# the scale applied: both act on a group's partial scores, in f32. A register pairs
# bytes 0 and 2 (1 and 3), so no prmt: outputs lo (b0, b2), lo (b1, b3), hi (b0, b2),
# hi (b1, b3), i.e. output element j holds byte j with bits j0 and j1 swapped.
Q4_GROUP_ASM = tl.constexpr("""
{
.reg .b32 u, nib, hinib, lomagic, himagic;
mov.b32 nib, 0x000f000f;
mov.b32 hinib, 0x00f000f0;
mov.b32 lomagic, 0x64006400;
mov.b32 himagic, 0x54005400;
shr.b32 u, $4, 8;
lop3.b32 $0, $4, nib, lomagic, 0xea;
lop3.b32 $1, u, nib, lomagic, 0xea;
lop3.b32 $2, $4, hinib, himagic, 0xea;
lop3.b32 $3, u, hinib, himagic, 0xea;
}
""")
# What Q4_GROUP_ASM's values exceed nibble - 8 by: 1024 + 8 (low) and 64 + 8 (high).
LO_EXCESS = tl.constexpr(1032.0)
HI_EXCESS = tl.constexpr(72.0)

# The plan's options for this kernel (``fragment_warps.locate_program``): the upper half
# of the K/V heads take their chunks in reverse; chunk starts as the plan computes them.
UPPER_HEADS_REVERSED = tl.constexpr(True)
ALIGNED_START = tl.constexpr(False)

# q8_0's K for ``_tile_scores_grouped``: a word's bytes b0..b3 ($2) -> f16 1152 + qs, with
# no offset and no scale applied (``Q8_EXCESS`` and the scale act on a group's partial
# scores, in f32). (b & 0x00ff00ff) ^ 0x64806480 (one lop3) is the f16 pair 1024 + (qs +
# 128) of bytes 0 and 2; b >> 8 does bytes 1 and 3. Outputs (b0, b2), (b1, b3): element
# j holds byte j with bits j0 and j1 swapped, as Q4_GROUP_ASM's.
Q8_GROUP_ASM = tl.constexpr("""
{
.reg .b32 u, lowb, magic;
mov.b32 lowb, 0x00ff00ff;
mov.b32 magic, 0x64806480;
shr.b32 u, $2, 8;
lop3.b32 $0, $2, lowb, magic, 0x6a;
lop3.b32 $1, u, lowb, magic, 0x6a;
}
""")
# What Q8_GROUP_ASM's values exceed qs by.
Q8_EXCESS = tl.constexpr(1152.0)


@dataclass(frozen=True)
class Geometry:
    """The byte geometry of one storage type's rows (``kv.formats``), as the kernel reads
    them: a row is 8 groups of ``group_bytes`` bytes, and the bytes of one "label row"
    (a half, for q4_0's two nibbles) are ``label_bits`` bits."""

    kv_type: str
    group_bytes: int  # 16 (q4_0) or 32 (q8_0)
    label_bits: int  # 7 (128 labels per nibble half) or 8 (256 labels)
    halves: bool  # q4_0: each byte feeds a lo and a hi label row
    # What K's raw values (the group asm's) exceed the stored value by, in its first and
    # second product half (``_q_group_offsets``).
    k_excess: tuple[float, float]

    @property
    def labels(self) -> int:
        return 1 << self.label_bits


GEOMETRY = {
    "q4_0": Geometry("q4_0", 16, 7, True, (LO_EXCESS.value, HI_EXCESS.value)),
    "q8_0": Geometry("q8_0", 32, 8, False, (Q8_EXCESS.value, Q8_EXCESS.value)),
}
TYPES = tuple(GEOMETRY)


def v_label_to_byte(r: int, label_bits: int = 7) -> int:
    """Byte of a V row whose values (q8_0) or nibbles (q4_0) hold output row label ``r``:
    its group is ``r & 7``, its byte in the group ``r >> 3``."""
    return ((r & 7) << (label_bits - 3)) | (r >> 3)


# K's labels (``_tile_scores_grouped``): the 256 values of a row are products of two
# halves of 128 labels, and label ``16 g + c`` of a half is byte ``j`` of that half of
# group g, ``j0 = c3, j1 = c0, j2 = c1, j3 = c2``. A half is q4_0's low or high nibbles of
# the group's 16 bytes, or q8_0's first or second 16 of its 32 bytes. So each k-step (16
# labels) is one group's, and a thread's four labels of it (c, c + 1, c + 8, c + 9) are
# one word, bytes 0 and 2 paired in a register (``Q4_GROUP_ASM``, ``Q8_GROUP_ASM``).
K_GROUP_LABEL_SOURCES = (1, 2, 3, 0, 4, 5, 6)
# ``_k_group_operand``'s relabel of one group's asm output, ``[W, T, j3, j2, j1', j0']``
# (output element j' holds byte j with bits j0, j1 swapped) -> ``[W, T, c3, c2, c1, c0]``.
K_GROUP_PERM = tl.constexpr((0, 1, 4, 2, 3, 5))


def k_group_label_to_byte(c: int, half: int = 0, group_bytes: int = 16) -> int:
    """Byte of a K row whose value holds label ``c`` (0..127) of product half ``half``:
    ``16 g + j`` for q4_0 (``group_bytes`` 16; its halves are one byte's two nibbles),
    ``32 g + 16 half + j`` for q8_0 (32)."""
    j = sum(((c >> i) & 1) << src for i, src in enumerate(K_GROUP_LABEL_SOURCES[:4]))
    return group_bytes * (c >> 4) + (16 * half if group_bytes > 16 else 0) + j


def k_perm(label_bits: int, lead: int, sources: tuple[int, ...]) -> list[int]:
    """``permute`` order taking ``[lead dims..., b_{n-1} .. b_0]`` to the labels
    ``[lead dims..., c_{n-1} .. c_0]``: label bit i is byte bit ``sources[i]``."""
    n = label_bits
    return list(range(lead)) + [lead + n - 1 - sources[i] for i in reversed(range(n))]


def v_pair_perm(label_bits: int, tokens: int) -> list[int]:
    """``permute`` order of V's joined pair tiles (``_pair_fragments``):
    ``[W, a (token // 2) bits, g2 g1 g0, j (byte in group as loaded) bits, x]`` ->
    ``[W, r_{n-1} .. r_0, t_{m-1} .. t_0]``, all bits most significant first. The asm pairs
    rows t and t + 1 at positions ``j0 = 0, 1``, so ``t0 = j0``; the byte within the group
    is ``(j1, x, j2, j3, ..)`` as bits 0, 1, 2, ..; a label's group is ``r2..r0`` and its
    byte ``r_{n-1}..r3`` (``v_label_to_byte``)."""
    tb = tokens.bit_length() - 1
    jb = label_bits - 3
    a = {k: 1 + (tb - 2 - k) for k in range(tb - 1)}
    g = {k: tb + (2 - k) for k in range(3)}
    j = {k: tb + 3 + (jb - 1 - k) for k in range(jb)}
    x = tb + 3 + jb
    byte = [j[1], x] + [j[k] for k in range(2, jb)]  # byte-in-group bits 0, 1, 2, ..
    label = [g[0], g[1], g[2]] + byte  # r0, r1, ..
    token = [j[0]] + [a[k] for k in range(tb - 1)]  # t0, t1, ..
    return [0] + label[::-1] + token[::-1]


def _warp_bases(num_warps: int, rank: int) -> list[list[int]]:
    return [[1 << i] + [0] * (rank - 1) for i in range(num_warps.bit_length() - 1)]


def _bits(n: int, dim: int, rank: int = 4, start: int = 0) -> list[list[int]]:
    """Bases of index bits ``start..log2(n)-1`` of dim ``dim``."""
    out = []
    for i in range(start, n.bit_length() - 1):
        basis = [0] * rank
        basis[dim] = 1 << i
        out.append(basis)
    return out


def _word_bases(bases: list[list[int]]) -> list[list[int]]:
    """Bases ``[w, t, g, byte]`` of a byte tile -> ``[w, t, g, word]`` of its word tile."""
    return [[b[0], b[1], b[2], b[3] // 4] for b in bases]


@functools.cache
def fragment_layouts(kv_type: str, num_warps: int, tokens: int) -> dict:
    """The kernel's layouts (compile-time arguments) for one storage type, ``num_warps``
    warps and ``tokens`` (16 or 32) tokens per warp.

    Byte tiles are ``[W, T tokens, 8 groups, GB bytes]``, word tiles ``[W, T, 8, GB / 4]``;
    a basis ``[w, t, g, j]`` names the element one register / lane / warp bit moves to.
    """
    geo = GEOMETRY[kv_type]
    w, gb, t = num_warps, geo.group_bytes, tokens
    warps = _warp_bases(w, 4)
    tok_hi = _bits(t, 1, start=3)  # tokens +8, (+16)
    # K (``_tile_scores_grouped``): a thread holds word ``lane % 4`` of each 16 bytes of
    # every group of its token rows (lanes take the byte bits 2, 3 and tokens +1, +2, +4;
    # the A operand's arrangement); registers walk q8_0's second 16 bytes, the groups,
    # then tokens +8 (+16).
    k_lanes = [[0, 0, 0, 4], [0, 0, 0, 8]] + _bits(8, 1)
    k_reads = _bits(gb, 3, start=4) + _bits(8, 2) + tok_hi
    # ``k_reads``: the register bases at word starts; a word's 4 bytes are registers too.
    k_bytes = gl.DistributedLinearLayout(
        reg_bases=_bits(4, 3) + k_reads, lane_bases=k_lanes, warp_bases=warps,
        block_bases=[], shape=[w, t, 8, gb])
    k_words = gl.DistributedLinearLayout(
        reg_bases=_word_bases(k_reads), lane_bases=_word_bases(k_lanes), warp_bases=warps,
        block_bases=[], shape=[w, t, 8, gb // 4])
    # V: one group (GB contiguous bytes) of each of its rows; registers then take tokens
    # +1, +8 (+16), lanes tokens +2, +4 and the three group bits.
    v_lanes = [[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]]
    v_words = gl.DistributedLinearLayout(
        reg_bases=_bits(gb // 4, 3) + [[0, 1, 0, 0]] + tok_hi, lane_bases=v_lanes,
        warp_bases=warps, block_bases=[], shape=[w, t, 8, gb // 4])
    v_load = gl.DistributedLinearLayout(
        reg_bases=_bits(gb, 3) + [[0, 1, 0, 0]] + tok_hi, lane_bases=v_lanes,
        warp_bases=warps, block_bases=[], shape=[w, t, 8, gb])
    # V_LOAD split into rows t and t + 1 (even and odd tokens): [W, T / 2 pairs, 8, GB].
    v_pair = gl.DistributedLinearLayout(
        reg_bases=_bits(gb, 3) + _bits(t // 2, 1, start=2),
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=warps, block_bases=[], shape=[w, t // 2, 8, gb])
    # The shared-memory ring's layouts (``quant_ring``): its reads take
    # K_WORDS / V_WORDS, whose word-start bases these are.
    ring = ring_layouts(
        w, t, gb, k_reads=k_reads, k_lanes=k_lanes,
        v_reads=_bits(gb, 3, start=2) + [[0, 1, 0, 0]] + tok_hi, v_lanes=v_lanes, warps=warps)
    return dict(
        **ring,
        K_WORDS=k_words, K_BYTES=k_bytes, V_WORDS=v_words, V_LOAD=v_load, V_PAIR=v_pair,
        MMA=gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1],
                                      instr_shape=[1, 16, 8]),
        # Partials [8 heads, 256 labels]: 16 elements per thread, four contiguous.
        MERGE=gl.BlockedLayout([1, 4], [1, 32], [w, 1], [1, 0]),
        # Tuples: the launcher's compile-time arguments are hashed.
        Q_PERM=tuple(k_perm(7, 2, K_GROUP_LABEL_SOURCES)),
        # q's per-group offsets [W, 8 heads, 8 groups] (``_q_group_offsets``): heads as
        # in the MMA accumulator, groups in registers (one picked per k-step group).
        CORR=gl.DistributedLinearLayout(
            reg_bases=[[0, 1, 0]] + _bits(8, 2, rank=3),
            lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
            warp_bases=_warp_bases(w, 3), block_bases=[], shape=[w, 8, 8]),
        V_PAIR_PERM=tuple(v_pair_perm(geo.label_bits, t)),
    )


@gluon.jit
def _bytes(words):
    """int32 words ``[W, T, 8, n]`` -> their bytes ``[W, T, 8, 4 n]`` (uint8), little
    endian; each word's bytes become the thread's next four registers."""
    b0 = (words & 0xFF).to(gl.uint8)
    b1 = ((words >> 8) & 0xFF).to(gl.uint8)
    b2 = ((words >> 16) & 0xFF).to(gl.uint8)
    b3 = ((words >> 24) & 0xFF).to(gl.uint8)
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [W, T, 8, n, 2 (byte + 2), 2 (+ 1)]
    return gl.reshape(x, [words.shape[0], words.shape[1], 8, 4 * words.shape[3]])


@gluon.jit
def _pair_relabel(x, PERM: gl.constexpr, NL: gl.constexpr):
    """``[W, T / 2, 8, GB, 2]`` (an asm output pair joined) -> ``[W, NL labels, T
    tokens]`` (``V_PAIR_PERM``). It only renames which register holds which index."""
    W: gl.constexpr = x.shape[0]
    T: gl.constexpr = 2 * x.shape[1]
    return gl.reshape(gl.permute(gl.reshape(x, [W] + [2] * (len(PERM.value) - 1)), PERM.value),
                      [W, NL, T])


@gluon.jit
def _pair_fragments(x, sc, PERM: gl.constexpr, HALVES: gl.constexpr, PAIR: gl.constexpr,
                    layout: gl.constexpr):
    """V payload ``[W, T, 8, GB]`` (``V_LOAD``) and scales ``[W, T, 8]`` -> ``V^T`` as
    the A operand ``[W, NL labels, T tokens]`` in ``layout``, f16: ``(lo, hi)`` of
    ``(nibble - 8) * d`` (q4_0), or ``qs * d`` (q8_0). The rows split into tokens t and
    t + 1 (a register basis: no data moves) and the asm (``Q4_PAIRS_ASM``,
    ``Q8_PAIRS_ROWS_ASM``) interleaves them as it dequantizes, so every output register
    is already an operand register (t, t + 1)."""
    W: gl.constexpr = x.shape[0]
    T: gl.constexpr = x.shape[1]
    GB: gl.constexpr = x.shape[3]
    even, odd = gl.split(gl.permute(gl.reshape(x, [W, T // 2, 2, 8, GB]), [0, 1, 3, 4, 2]))
    even = gl.convert_layout(even, PAIR, assert_trivial=True)
    odd = gl.convert_layout(odd, PAIR, assert_trivial=True)
    # The asm's scale operand: (d_t, d_t1) at its positions (j0 = 0, 1).
    d_even, d_odd = gl.split(gl.permute(gl.reshape(sc, [W, T // 2, 2, 8]), [0, 1, 3, 2]))
    d_even = gl.convert_layout(d_even, gl.SliceLayout(3, PAIR), assert_trivial=True)
    d_odd = gl.convert_layout(d_odd, gl.SliceLayout(3, PAIR), assert_trivial=True)
    j = gl.arange(0, GB, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, PAIR))))
    d = gl.where((j % 2 == 0)[None, None, None, :], d_even[:, :, :, None],
                 d_odd[:, :, :, None])  # [W, T / 2, 8, GB]
    if HALVES:
        lo0, lo1, hi0, hi1 = gl.inline_asm_elementwise(
            Q4_PAIRS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [even, odd, d],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=4,
        )
        lo = _pair_relabel(gl.join(lo0, lo1), PERM, 8 * GB)
        hi = _pair_relabel(gl.join(hi0, hi1), PERM, 8 * GB)
        return gl.convert_layout(lo, layout), gl.convert_layout(hi, layout)
    else:
        v0, v1 = gl.inline_asm_elementwise(
            Q8_PAIRS_ROWS_ASM, "=r,=r,=r,=r,r,r,r,r", [even, odd, d],
            dtype=(gl.float16, gl.float16), is_pure=True, pack=4,
        )
        return gl.convert_layout(_pair_relabel(gl.join(v0, v1), PERM, 8 * GB), layout)


@gluon.jit
def _pick_group(x, g: gl.constexpr):
    """``x[..., g]`` of a rank-3 ``x`` whose last axis (8 groups) is in registers: three
    splits, a renaming."""
    y = gl.reshape(x, [x.shape[0], x.shape[1], 2, 2, 2])
    a, b = gl.split(y)  # g0
    if g % 2 == 1:
        y = b
    else:
        y = a
    a, b = gl.split(y)  # g1
    if (g // 2) % 2 == 1:
        y = b
    else:
        y = a
    a, b = gl.split(y)  # g2
    if g // 4 == 1:
        y = b
    else:
        y = a
    return y


@gluon.jit
def _q_group_offsets(q, LO_EX: gl.constexpr, HI_EX: gl.constexpr, layout: gl.constexpr):
    """``-(LO_EX * sum of q over group g's first product half + HI_EX * sum over its
    second)`` for each head: f32 ``[W, 8 heads, 8 groups]`` in ``layout``, from
    ``load_q``'s f16 q (as the products see it; a thread's 32 values are one group, so
    the sums stay in the thread). Added to a group's partial scores of the group asm's
    values (``LO_EXCESS``, ``HI_EXCESS`` for q4_0, ``Q8_EXCESS`` twice for q8_0) it
    leaves ``sum (nibble - 8) q`` or ``sum qs q``. The sums of up to 32 f16 values and
    their products by these excesses are exact in f32."""
    W: gl.constexpr = q.shape[0]
    q = gl.reshape(q.to(gl.float32), [W, MAX_GROUP, 8, 32])
    J: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, q.type.layout)))
    j = gl.arange(0, 32, layout=J)
    excess = gl.where(j < 16, -LO_EX, -HI_EX)[None, None, None, :]
    return gl.convert_layout(gl.sum(q * excess, axis=3), layout)


@gluon.jit
def _q_state(q, Q_PERM: gl.constexpr, K_LO_EXCESS: gl.constexpr, K_HI_EXCESS: gl.constexpr,
             B_OP: gl.constexpr, CORR: gl.constexpr):
    """``load_q``'s q as the loop needs it: ``(q_lo, q_hi, offsets)``, the two product
    halves' operands (``q_operand``) and the group offsets (``_q_group_offsets``, with
    the type's ``Geometry.k_excess``) of ``_tile_scores_grouped``."""
    q_lo, q_hi = q_operand(q, Q_PERM, True, B_OP)
    return q_lo, q_hi, _q_group_offsets(q, K_LO_EXCESS, K_HI_EXCESS, CORR)


@gluon.jit
def _tile_scores_grouped(kx, ks, q_lo, q_hi, offsets, HALVES: gl.constexpr,
                         K_BYTES: gl.constexpr, MMA: gl.constexpr):
    """``S^T = K . Q^T`` of one tile, ``[W, T, 8]`` (MMA), a group at a time: the
    products of K's raw values (``Q4_GROUP_ASM``, ``Q8_GROUP_ASM``: no offset, no scale)
    with q's labels of group g give the group's partial scores, exact in f32; adding q's
    group ``offsets`` (``_q_group_offsets``) and multiplying by the rows' scale of group
    g (``ks`` ``[W, T, 8]``) is then two f32 operations per score and group, where the
    per-value dequantization took two f16 operations per pair of values (and rounded
    each value to f16). ``kx``: K's words ``[W, T, 8, GB / 4]`` (``K_WORDS``: word
    ``lane % 4`` of each 16 bytes of every group); ``q_lo``, ``q_hi``: ``[W, 128, 8]``
    (labels ``16 g + c`` of each half, ``K_GROUP_LABEL_SOURCES``)."""
    W: gl.constexpr = kx.shape[0]
    T: gl.constexpr = kx.shape[1]
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    kb = gl.convert_layout(_bytes(kx), K_BYTES, assert_trivial=True)  # [W, T, 8, GB]
    if HALVES:
        lo, hi = gl.inline_asm_elementwise(Q4_GROUP_ASM, "=r,=r,=r,=r,r", [kb],
                                           dtype=(gl.float16, gl.float16), is_pure=True,
                                           pack=4)
    else:
        # A group's first and second 16 bytes (a register bit): [W, T, 8, 16] each.
        first, second = gl.split(gl.permute(gl.reshape(kb, [W, T, 8, 2, 16]), [0, 1, 2, 4, 3]))
        lo = gl.inline_asm_elementwise(Q8_GROUP_ASM, "=r,=r,r", [first], dtype=gl.float16,
                                       is_pure=True, pack=4)
        hi = gl.inline_asm_elementwise(Q8_GROUP_ASM, "=r,=r,r", [second], dtype=gl.float16,
                                       is_pure=True, pack=4)
    d = ks.to(gl.float32)  # [W, T, 8 groups]
    zeros = gl.zeros([W, T, MAX_GROUP], gl.float32, MMA)
    st = zeros
    for g in gl.static_range(8):
        c = mma_v2(_k_group_operand(lo, g, A_OP), _q_group_operand(q_lo, g, B_OP), zeros)
        c = mma_v2(_k_group_operand(hi, g, A_OP), _q_group_operand(q_hi, g, B_OP), c)
        dg = gl.convert_layout(_pick_group(d, g), gl.SliceLayout(2, MMA))
        og = gl.convert_layout(_pick_group(offsets, g), gl.SliceLayout(1, MMA))
        st = st + dg[:, :, None] * (c + og[:, None, :])
    return st


@gluon.jit
def _k_group_operand(x, g: gl.constexpr, layout: gl.constexpr):
    """Group g of ``Q4_GROUP_ASM``'s output ``[W, T, 8, 16]`` as the A operand ``[W, T,
    16 labels]``: output element j' (byte j with bits j0, j1 swapped) -> label ``c =
    j0' + 2 j2 + 4 j3 + 8 j1'`` (``K_GROUP_LABEL_SOURCES``). Renamings only."""
    W: gl.constexpr = x.shape[0]
    T: gl.constexpr = x.shape[1]
    y = gl.reshape(gl.permute(x, [0, 1, 3, 2]), [W, T * 16, 8])
    y = gl.reshape(_pick_group(y, g), [W, T, 2, 2, 2, 2])  # [W, T, j3, j2, j1', j0']
    y = gl.permute(y, K_GROUP_PERM.value)
    return gl.convert_layout(gl.reshape(y, [W, T, 16]), layout)


@gluon.jit
def _q_group_operand(q, g: gl.constexpr, layout: gl.constexpr):
    """Labels ``16 g .. 16 g + 15`` of q's operand ``[W, 128, 8]``: ``[W, 16, 8]`` in the
    B operand ``layout`` of one k-step."""
    W: gl.constexpr = q.shape[0]
    y = gl.permute(gl.reshape(q, [W, 8, 16, MAX_GROUP]), [0, 2, 3, 1])  # [W, 16, 8, 8 g]
    y = gl.reshape(y, [W, 16 * MAX_GROUP, 8])
    y = gl.reshape(_pick_group(y, g), [W, 16, MAX_GROUP])
    return gl.convert_layout(y, layout)


@gluon.jit
def _accumulate(vx, vs, p16, alpha_o, acc_lo, acc_hi, V_PAIR_PERM: gl.constexpr,
                HALVES: gl.constexpr, V_LOAD: gl.constexpr, V_PAIR: gl.constexpr,
                MMA: gl.constexpr):
    """``O^T = alpha O^T + V^T . P^T`` over one tile: V's payload words and scales
    (``V_WORDS``), the scores as the B operand ``p16``, the rescale ``alpha_o``
    ``[W, 1, 8]``; the lo and hi label rows for q4_0. q8_0 has one accumulator,
    ``acc_lo``; its ``acc_hi`` is passed through unchanged (a loop-carried value the
    compiler then drops)."""
    A_OP: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    vb = gl.convert_layout(_bytes(vx), V_LOAD, assert_trivial=True)
    if HALVES:
        v_lo, v_hi = _pair_fragments(vb, vs, V_PAIR_PERM, True, V_PAIR, A_OP)
        return mma_v2(v_lo, p16, acc_lo * alpha_o), mma_v2(v_hi, p16, acc_hi * alpha_o)
    else:
        return mma_v2(_pair_fragments(vb, vs, V_PAIR_PERM, False, V_PAIR, A_OP), p16,
                      acc_lo * alpha_o), acc_hi


@gluon.jit(do_not_specialize=["batch", "num_blocks", "capacity", "chunk_budget",
                              "max_chunks", "num_kv_heads"])
def fragment_decode_kernel(
    q_ptr, out_ptr,  # [B, Hq, D]
    kd_ptr, ks_ptr, vd_ptr, vs_ptr,  # payload and scales of K and V
    table_ptr, lens_ptr,  # int32 [B, max_blocks], int32 [B]
    part_acc_ptr, part_ml_ptr, group_counter_ptr, seq_counter_ptr,  # workspace
    batch, num_blocks, capacity, chunk_budget, max_chunks, num_kv_heads,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb,
    qk_scale,  # softmax scale * log2(e)
    trace_ptr,  # int64 [Hkv * programs per head, 8] (decode_trace) when TRACE
    G: gl.constexpr, GP: gl.constexpr, BS: gl.constexpr, INTERLEAVE: gl.constexpr,
    B_PAD: gl.constexpr, MIN_PARTITION: gl.constexpr, PAGED: gl.constexpr,
    MERGE_UNROLL: gl.constexpr, MERGE_GROUP: gl.constexpr,
    W: gl.constexpr, T: gl.constexpr, GB: gl.constexpr, HALVES: gl.constexpr,
    K_LO_EXCESS: gl.constexpr, K_HI_EXCESS: gl.constexpr,
    K_WORDS: gl.constexpr, K_BYTES: gl.constexpr, V_WORDS: gl.constexpr,
    V_LOAD: gl.constexpr, V_PAIR: gl.constexpr,
    MMA: gl.constexpr, MERGE: gl.constexpr,
    Q_PERM: gl.constexpr, V_PAIR_PERM: gl.constexpr,
    TRACE: gl.constexpr, STAGES: gl.constexpr,
    K_WORDS3: gl.constexpr, V_WORDS3: gl.constexpr, COPY_WORDS: gl.constexpr,
    COPY_SCALES: gl.constexpr, RING_WORDS: gl.constexpr, RING_SCALES: gl.constexpr,
    ID_COPY: gl.constexpr, ID_RING: gl.constexpr, CORR: gl.constexpr,
):
    BLOCK_N: gl.constexpr = W * T
    NL: gl.constexpr = 8 * GB  # labels per product: one per byte (per nibble half)
    WPG: gl.constexpr = GB // 4
    B_OP: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, 8] per-head state, as S^T's n
    TOKENS: gl.constexpr = gl.SliceLayout(2, MMA)  # [W, T], as S^T's m
    chunk, h, slot, num_chunks, b, seq_chunks, first, tok_lo, tok_hi = locate_program(
        lens_ptr, batch, capacity, chunk_budget, trace_ptr, W, BLOCK_N, B_PAD, MIN_PARTITION,
        UPPER_HEADS_REVERSED, ALIGNED_START, TRACE)
    if chunk >= num_chunks:
        return
    stamp(trace_ptr, slot, 1, TRACE)
    record_program(trace_ptr, slot, chunk, gl.cdiv(tok_hi - tok_lo, BLOCK_N), TRACE)

    # q's load goes out first (beside the table's); its conversions, which wait at
    # barriers, come after the first tiles' copies are issued (``_q_state``).
    q = load_q(q_ptr + b * stride_qb + h * G * stride_qh, stride_qh, G, W)
    acc_lo = gl.zeros([W, NL, MAX_GROUP], gl.float32, MMA)  # O^T, rows = V labels
    if HALVES:
        acc_hi = gl.zeros([W, NL, MAX_GROUP], gl.float32, MMA)
    else:
        acc_hi = acc_lo  # unused in the loop (``_accumulate``)
    m_i, l_i = initial_state(W, HEADS)

    table_row, head_stride, block0 = sequence_table(table_ptr, b, stride_tb, capacity, BS,
                                                    INTERLEAVE, PAGED)
    # K's and V's token slices, and the scores' (the softmax mask), each compute their
    # rows: converting one set between layouts would go through shared memory, behind a
    # barrier of all warps, every tile.
    KT: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, K_WORDS))
    WARP_IDS: gl.constexpr = PAGED and BS >= 16 and BS & (BS - 1) == 0
    # The shared-memory ring: tile i + STAGES - 1 is copied while tile i is computed.
    # Each warp copies, and reads back, only its own rows.
    NW: gl.constexpr = 8 * WPG
    kw_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, T, NW], RING_WORDS)
    vw_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, T, NW], RING_WORDS)
    ks_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, T, 8], RING_SCALES)
    vs_ring = gl.allocate_shared_memory(gl.float16, [STAGES, W, T, 8], RING_SCALES)
    # Block ids ride the copy groups too (``quant_ring.copy_ids``): the ids of tile j are
    # copied with tile j - STAGES and read from ``id_ring`` slot j % (2 STAGES) after that
    # group's wait, so that no global load is in flight across the loop (a table load
    # there holds a scoreboard through the whole tile, and ptxas then serializes the
    # dequantization chains: slower on the H200, docs/kernel-decisions.md). The first
    # STAGES tiles' ids are loaded and stored here.
    IDR: gl.constexpr = 2 * STAGES
    if WARP_IDS:
        id_ring = gl.allocate_shared_memory(gl.int32, [IDR, W, 2], ID_RING)
        for j in gl.static_range(STAGES):
            ptrs, mask = id_pointers(table_row, tok_lo + j * BLOCK_N, tok_hi, W, T, BS,
                                     ID_COPY)
            id_ring.index(j).store(gl.load(ptrs, mask=mask, other=0))
    for j in gl.static_range(STAGES - 1):
        if WARP_IDS:
            id0, id1 = read_ids(id_ring.index(j), ID_COPY, KT)
        else:
            id0 = block0
            id1 = block0
        copy_tile(kw_ring.index(j), vw_ring.index(j), ks_ring.index(j), vs_ring.index(j),
                  kd_ptr, ks_ptr, vd_ptr, vs_ptr, table_row, id0, id1, tok_lo + j * BLOCK_N,
                  tok_hi, num_blocks, num_kv_heads, h, head_stride, W, T, BS, PAGED,
                  WARP_IDS, NW, COPY_WORDS, COPY_SCALES)
        if WARP_IDS:
            copy_ids(id_ring.index(j + STAGES), table_row,
                     tok_lo + (j + STAGES) * BLOCK_N, tok_hi, W, T, BS, ID_COPY)
        async_copy.commit_group()
    # (id0, id1): the ids of the next tile to copy; (mid0, mid1): this tile's, for
    # its mask.
    if WARP_IDS:
        id0, id1 = read_ids(id_ring.index(STAGES - 1), ID_COPY, KT)
        mid0, mid1 = read_ids(id_ring.index(0), ID_COPY, KT)
    else:
        id0 = block0
        id1 = block0
        mid0 = block0
        mid1 = block0
    q_lo, q_hi, offsets = _q_state(q, Q_PERM, K_LO_EXCESS, K_HI_EXCESS, B_OP, CORR)
    stamp(trace_ptr, slot, 2, TRACE)
    for it in range(gl.cdiv(tok_hi - tok_lo, BLOCK_N)):
        ahead = tok_lo + (it + STAGES - 1) * BLOCK_N
        fill = (it + STAGES - 1) % STAGES
        copy_tile(kw_ring.index(fill), vw_ring.index(fill), ks_ring.index(fill),
                  vs_ring.index(fill), kd_ptr, ks_ptr, vd_ptr, vs_ptr, table_row, id0, id1,
                  ahead, tok_hi, num_blocks, num_kv_heads, h, head_stride, W, T, BS,
                  PAGED, WARP_IDS, NW, COPY_WORDS, COPY_SCALES)
        if WARP_IDS:
            copy_ids(id_ring.index((it + 2 * STAGES - 1) % IDR), table_row,
                     ahead + STAGES * BLOCK_N, tok_hi, W, T, BS, ID_COPY)
        async_copy.commit_group()
        live = tile_rows(table_row, mid0, mid1, tok_lo + it * BLOCK_N, tok_hi, num_blocks,
                         num_kv_heads, h, head_stride, W, T, BS, PAGED, WARP_IDS,
                         TOKENS)[1]
        async_copy.wait_group(STAGES - 1)
        use = it % STAGES
        kx = gl.convert_layout(gl.reshape(kw_ring.index(use).load(K_WORDS3),
                                          [W, T, 8, WPG]), K_WORDS, assert_trivial=True)
        ks = ks_ring.index(use).load(gl.SliceLayout(3, K_WORDS))
        st = _tile_scores_grouped(kx, ks, q_lo, q_hi, offsets, HALVES, K_BYTES, MMA)
        p, alpha, m_i, l_i = softmax_step(st, live, qk_scale, m_i, l_i)
        p16 = scores_to_b_operand(p.to(gl.float16), B_OP)
        # V is read from the ring only now: its words are not held through S^T.
        vx = gl.convert_layout(gl.reshape(vw_ring.index(use).load(V_WORDS3),
                                          [W, T, 8, WPG]), V_WORDS, assert_trivial=True)
        vs = vs_ring.index(use).load(gl.SliceLayout(3, V_WORDS))
        acc_lo, acc_hi = _accumulate(vx, vs, p16, alpha[:, None, :], acc_lo, acc_hi,
                                     V_PAIR_PERM, HALVES, V_LOAD, V_PAIR, MMA)
        if WARP_IDS:
            # Read after this tile's wait (the group that brought them was this
            # tile's) and before the next tile's first barrier, which orders these
            # reads before their slots are copied into again.
            if STAGES == 2:
                mid0, mid1 = id0, id1  # this iteration copied the next tile
            else:
                mid0, mid1 = read_ids(id_ring.index((it + 1) % IDR), ID_COPY, KT)
            id0, id1 = read_ids(id_ring.index((it + STAGES) % IDR), ID_COPY, KT)
    async_copy.wait_group(0)

    if not HALVES:
        acc_hi = acc_lo
    finish_program(acc_lo, acc_hi, m_i, l_i, out_ptr, stride_ob, stride_oh, part_acc_ptr,
                   part_ml_ptr, group_counter_ptr, seq_counter_ptr, max_chunks, num_kv_heads,
                   chunk, h, b, first, seq_chunks, trace_ptr, slot, G, GP, HALVES, True, MERGE,
                   MERGE_UNROLL, MERGE_GROUP, TRACE)


def supports(q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
             cfg: DecodeConfig) -> bool:
    """Whether this kernel runs a launch: K and V both q4_0 or both q8_0, head_dim 256, at
    most 8 query heads per K/V head, a ring of at least two stages, on a GPU."""
    return (q.is_cuda and cache_k.kv_type == cache_v.kv_type and cache_k.kv_type in TYPES
            and q.shape[-1] == HEAD_DIM and q.shape[1] // cache_k.num_kv_heads <= MAX_GROUP
            and cfg.num_stages >= 2)


@functools.cache
def kernel_constants(kv_type: str, num_warps: int, tokens_per_warp: int,
                     stages: int) -> dict:
    """This kernel's own compile-time arguments for a storage type and warp shape (cached:
    eager decode launches per layer per step; callers must not modify the dict)."""
    geo = GEOMETRY[kv_type]
    return dict(W=num_warps, T=tokens_per_warp, GB=geo.group_bytes, HALVES=geo.halves,
                K_LO_EXCESS=geo.k_excess[0], K_HI_EXCESS=geo.k_excess[1], STAGES=stages,
                **fragment_layouts(kv_type, num_warps, tokens_per_warp))


def launch(grid: tuple[int, int], args: tuple, constants: dict, kv_type: str,
           num_warps: int, tokens_per_warp: int, maxnreg: int | None,
           stages: int) -> None:
    """One launch over checked arguments: ``paged_decode.paged_decode_attention``'s grid
    and run-time arguments (the two kernels share them, the trace pointer last) and the
    Triton kernel's compile-time arguments (``paged_decode.launch_constants``), of which
    this kernel takes ``fragment_warps.SHARED_CONSTANTS`` (``TRACE``: a separately
    compiled variant whose programs fill their ``decode_trace`` records)."""
    fragment_decode_kernel[grid](
        *args,
        **{k: constants[k] for k in SHARED_CONSTANTS},
        **kernel_constants(kv_type, num_warps, tokens_per_warp, stages),
        num_warps=num_warps, maxnreg=maxnreg,
    )
