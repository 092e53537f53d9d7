"""Partition plan of the paged decode kernel: which program reads which tokens.

Decode attention is one pass over every live K/V row. The plan cuts that pass into
*chunks* of at most ``P`` tokens of one sequence (a chunk is one partition of split-K);
one program handles one chunk of one K/V head. Nothing of the plan is decided on the
host from the lengths: every program derives it from ``seq_lens`` on the device, so the
launch needs no host sync and a CUDA graph replays it for any lengths.

::

    host, once per workspace                 device, in every program (identical result)
    -------------------------                -------------------------------------------
    W = ceil(occupancy * num_SMs / Hkv)      len_b = clamp(seq_lens[b], 0, capacity)
        chunks per K/V head to aim for       budget = max(W, B)   (each sequence >= 1)
    grid = (max(W, B), Hkv)                  P = the smallest candidate size whose chunk
                                                 count sum_b max(1, cdiv(len_b, P)) fits
                                                 the budget; candidates (multiples of
                                                 block_n, >= min_partition):
                                                   S / (budget - j * ceil(B / 3)), j=0..3
                                                   max_len / floor(budget / live seqs)
                                                   max_len (one chunk each: always fits)
                                             program p -> chunk c = p (or n - 1 - p for
                                                 the quantized kernels' upper K/V heads)
                                             chunk c -> sequence b by prefix sums of n_b
                                             programs with c >= sum_b n_b exit at once

    ragged 128K + 7 x 8K, W = 66, block_n = 64:  S = 188416, P = 3008
      seq 0  |c0 |c1 |c2 | ........ |c42|c43|       44 chunks of <= 3008 tokens
      seq 1  |c44|c45|c46|                           3 chunks
      ...
      seq 7  |c62|c63|c64|                           65 chunks per head <= W: one wave
    uniform 8 x 128K: P = 16384, exactly 8 chunks per sequence, 64 per head

Why an exact fit: chunks are equal work, so a count just above the number of resident
programs leaves a nearly empty second wave that costs as much as the first. Sizing by the
*total* work ``S`` (not the longest sequence) cuts a 128K sequence next to short ones
into many chunks, so no program carries its tail, and one long sequence alone still
yields about W chunks per head (it fills the GPU).

Merging. Chunks of one (sequence, K/V head) finish in any order. Each writes its
unnormalized partial output, running max and sum to the workspace, and counts itself in
its *group* of up to ``MERGE_GROUP`` consecutive chunks; the last of a group merges the
group (log-sum-exp weights, numerically stable) into one partial, and the last group
merged combines the groups into the output. Two levels keep the serial tail short (8 + 8
partials instead of 64 for one long sequence). The last one in resets each counter for
the next call. A sequence with one chunk writes its output directly.

::

    chunks  c0 .. c7 | c8 .. c15 | ... | c40 .. c43        (one sequence, one K/V head)
              |          |                  |      last of each group: merge -> slot g0
              +----------+------ ... -------+      last group: merge slots -> output
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kv import formats

QUANT_DOT_MODES = ("element", "packed", "fragment")
TABLE_READS = ("row", "block")
# Chunks per first-level merge group (see "Merging" above).
MERGE_GROUP = 8
# Programs per SM the chunk budget aims for; benchmarks/bench_attention.py sweeps it.
DEFAULT_OCCUPANCY = 2.0
# Size (tokens a launch's tables can address: batch x table columns x block size) from
# which contiguous f16/bf16 decode changes launch (``default_config``).
CONTIGUOUS_TILE_TOKENS = 1 << 19
# Small, short batches of q8_0 or q4_0 K and V take wide programs, 8 warps at one program
# per SM (``default_config``): at most this many sequences, whose tables address at most
# this many tokens per type.
WIDE_MAX_BATCH = 4
WIDE_MAX_TOKENS = {"q8_0": 1 << 17, "q4_0": 1 << 15}
# SM count assumed for CPU tensors (the Triton interpreter): small, so that plans split.
INTERPRETER_NUM_SMS = 4


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the decode kernel (tuned by ``benchmarks/bench_attention.py``).

    Attributes:
        block_n: tokens per tile of the inner loop (power of 2, 16..256); decoupled from
            the K/V block size.
        num_warps: warps per program (1, 2, 4, 8 or 16).
        num_stages: software-pipelining depth of the tile loop (1..6).
        min_partition: fewest tokens per chunk (a multiple of ``block_n``), so that short
            contexts are not cut into chunks too small to pay for their merge.
        quant_dot: how q8_0/q4_0 meet the tensor cores (f16 reads only ``"fragment"``).
            ``"element"``: dequantize each element to f16 (one multiply) and run one
            full-width dot. ``"packed"``: the same values
            as ``element``, from 16-byte row loads, two per instruction (f16x2 PTX) on a
            GPU (``kv_tiles``). ``"fragment"``: a Gluon kernel whose warps each take
            ``block_n / num_warps`` tokens of a tile (16 or 32) with their own softmax:
            for K and V both q4_0 or both q8_0 it dequantizes into the tensor cores'
            operand registers (``quant_fragments``), for f16 K and V it copies the rows
            into a ring of ``num_stages`` shared-memory stages with block ids read ahead
            (``float_fragments``, 16 tokens per warp). Other types and shapes and the
            interpreter fall back to the Triton kernel: ``packed`` for quantized types,
            the Triton f16/bf16 launch (``triton_float_config``) for float ones.
        table_read: how a paged tile finds its rows' blocks. ``"row"``: one block-table
            load per row; ``"block"``: one per K/V block, broadcast to its rows (fewer
            loads and address computations; used when ``block_n`` is a multiple of the
            pool's block size, else ``"row"``).
        table_ahead: load the next tile's block ids while the current tile is read (hides
            the table lookup's latency; holds the ids in registers meanwhile).
        maxnreg: registers per thread the compiler may use (``None``: its own choice,
            up to 255). Fewer registers let more programs share an SM; a quantized tile
            loop is latency-bound, so more resident warps can pay for a few spills.
        occupancy: programs per SM this launch's chunk budget aims for, when fewer fit
            on an SM than the workspace was sized for (``DecodeWorkspace.budget_for``);
            ``None``: the workspace's budget.

    The workspace owns the largest chunk budget W: it sizes the buffers. A launch whose
    programs are larger (more warps, more shared memory) asks for fewer chunks through
    ``occupancy``, never for more.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    min_partition: int = 256
    quant_dot: str = "element"
    maxnreg: int | None = None
    table_read: str = "row"
    table_ahead: bool = True
    occupancy: float | None = None

    def __post_init__(self) -> None:
        if self.occupancy is not None and not 0.0 < self.occupancy <= 64.0:
            raise ValueError(f"occupancy must be None or in (0, 64], got {self.occupancy}")
        if not (_is_pow2(self.block_n) and 16 <= self.block_n <= 256):
            raise ValueError(f"block_n must be a power of 2 in [16, 256], got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [1, 6], got {self.num_stages}")
        if self.min_partition <= 0 or self.min_partition % self.block_n:
            raise ValueError(
                f"min_partition must be a positive multiple of block_n={self.block_n}, "
                f"got {self.min_partition}"
            )
        if self.maxnreg is not None and not (self.maxnreg % 8 == 0 and 32 <= self.maxnreg <= 248):
            raise ValueError(
                f"maxnreg must be None or a multiple of 8 in [32, 248], got {self.maxnreg}"
            )
        if self.table_read not in TABLE_READS:
            raise ValueError(
                f"table_read {self.table_read!r} is not a mode; accepted: {list(TABLE_READS)}"
            )
        if self.quant_dot not in QUANT_DOT_MODES:
            raise ValueError(
                f"quant_dot {self.quant_dot!r} is not a mode; accepted: {list(QUANT_DOT_MODES)}"
            )
        if self.quant_dot == "fragment" and self.block_n not in (16 * self.num_warps,
                                                                 32 * self.num_warps):
            raise ValueError(
                f"quant_dot 'fragment' takes 16 or 32 tokens per warp: block_n must be "
                f"{16 * self.num_warps} or {32 * self.num_warps} for num_warps="
                f"{self.num_warps}, got {self.block_n}"
            )


def default_config(k_type: str, v_type: str, tokens: int = 0, paged: bool = True,
                   batch: int = 0) -> DecodeConfig:
    """The library's launch for a K/V type pair, layout and size.

    ``tokens``: how many tokens the launch's tables can address (batch x table columns x
    block size), which the host knows without a sync; it bounds the live tokens from
    above. ``paged``: the paged layout (else the contiguous one, whose launch is chosen for
    its own speed, so that it stays an honest baseline). ``batch``: sequences in the launch
    (0: unknown). Each rule is the fastest launch measured side by side on the H200
    (docs/kernel-decisions.md has the figures and the alternatives that lost)::

        K, V          when                                  kernel, launch
        ------------  ------------------------------------  ---------------------------------
        q8_0, q8_0    <= WIDE_MAX_BATCH seqs, <= 128K tokens  Gluon ring, 8 warps x 16 tokens,
                                                            2 stages, one program per SM
        q8_0, q8_0    otherwise                             Gluon ring, 4 warps x 16 tokens,
                                                            2 stages
        q4_0, q4_0    <= WIDE_MAX_BATCH seqs, <= 32K tokens   Gluon ring, 8 warps x 32 tokens,
                                                            2 stages, one program per SM
        q4_0, q4_0    otherwise                             Gluon ring, 4 warps x 32 tokens,
                                                            2 stages
        q8_0 + other  always                                Triton ``element``, 64-row tiles,
                                                            1 stage, <= 168 registers
        q4_0 + float  always                                Triton ``packed``, 128-row tiles,
                                                            1 stage, table read just in time
        f16, f16      always                                Gluon f16 ring, 4 warps x 16
                                                            tokens, 2 stages
        other float   ``triton_float_config``               Triton, by layout and size

    The Gluon launches (``quant_dot="fragment"``) fall back to the Triton kernel where
    their shape does not apply (``paged_decode.select_kernel``). Every launch reads one
    table entry per K/V block where its tiles hold whole blocks, and takes chunks of at
    least 128 tokens (256 for the wide q4_0 tiles).
    """
    wide = _WIDE.get(k_type) if k_type == v_type else None
    if wide is not None and 0 < batch <= WIDE_MAX_BATCH and tokens <= WIDE_MAX_TOKENS[k_type]:
        return wide
    if formats.spec(k_type).quantized or formats.spec(v_type).quantized:
        return _quantized_config(k_type, v_type)
    if k_type == v_type == "f16":
        return _F16_RING
    return triton_float_config(tokens, paged)


def triton_float_config(tokens: int, paged: bool) -> DecodeConfig:
    """The Triton kernel's f16/bf16 launch by layout and size (``default_config``): paged,
    64-row tiles in three stages at any size; contiguous, 64-row tiles in three stages
    below ``CONTIGUOUS_TILE_TOKENS`` and 128-row tiles in two from there on (each the
    faster for its layout and size on the H200: docs/kernel-decisions.md)."""
    if paged:
        return _FLOAT_PAGED_64
    if tokens < CONTIGUOUS_TILE_TOKENS:
        return _FLOAT_CONTIGUOUS_64
    return _FLOAT_128


# The float launches ``default_config`` picks between (built once: it runs per layer per
# decode step when no config is given).
_F16_RING = DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=128,
                         quant_dot="fragment", table_read="block")
_FLOAT_128 = DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_partition=128)
_FLOAT_PAGED_64 = DecodeConfig(block_n=64, num_warps=4, num_stages=3, min_partition=128,
                               table_read="block")
_FLOAT_CONTIGUOUS_64 = DecodeConfig(block_n=64, num_warps=4, num_stages=3, min_partition=128)
# q8_0 and q4_0 K and V in 8-warp programs, one per SM, for small short batches
# (``default_config``).
_WIDE = {
    "q8_0": DecodeConfig(block_n=128, num_warps=8, num_stages=2, min_partition=128,
                         quant_dot="fragment", table_read="block", occupancy=1.0),
    "q4_0": DecodeConfig(block_n=256, num_warps=8, num_stages=2, min_partition=256,
                         quant_dot="fragment", table_read="block", occupancy=1.0),
}


@functools.cache
def _quantized_config(k_type: str, v_type: str) -> DecodeConfig:
    if k_type == v_type == "q8_0":
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=128,
                            quant_dot="fragment", table_read="block")
    if "q8_0" in (k_type, v_type):
        return DecodeConfig(block_n=64, num_warps=4, num_stages=1, min_partition=128,
                            quant_dot="element", maxnreg=168, table_read="block")
    if k_type == v_type == "q4_0":
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_partition=128,
                            quant_dot="fragment", table_read="block")
    # q4_0 with a float type.
    return DecodeConfig(block_n=128, num_warps=4, num_stages=1, min_partition=128,
                        quant_dot="packed", table_read="block", table_ahead=False)


@functools.cache
def default_occupancy(k_type: str, v_type: str) -> float:
    """Programs per SM that a ``DecodeWorkspace`` should aim for with these K/V types: as
    many as ``default_config``'s launch fits on an SM, since a chunk count above that
    leaves a second wave.

    q8_0 or q4_0 K and V (the Gluon ring, about 200-240 registers and 68-72 KB of shared
    memory): two; the wide small-batch launches plan one per SM within that workspace
    (``DecodeConfig.occupancy``). Other q8_0: three (168 registers x 128 threads). Other
    q4_0: two (255 registers). f16 and bf16: one (the f16 ring takes 128 KB of shared
    memory, the Triton launches about 141 KB; a plan for two made two waves, slower on
    the H200: docs/kernel-decisions.md).
    """
    if k_type == v_type == "q8_0":
        return DEFAULT_OCCUPANCY
    if "q8_0" in (k_type, v_type):
        return 3.0
    if "q4_0" in (k_type, v_type):
        return DEFAULT_OCCUPANCY
    return 1.0


def device_num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_NUM_SMS


class DecodeWorkspace:
    """Preallocated device buffers of the decode kernel; the caller keeps one per stream.

    Every field is fixed at construction, so a CUDA graph that captured a launch with this
    workspace stays valid for any lengths. Two launches must not share a workspace
    concurrently (the counters would mix); layers of one forward pass run one after the
    other on one stream, so one workspace serves them all.

    Args:
        max_batch: most sequences per launch.
        num_q_heads, num_kv_heads, head_dim: attention shape (Hq a multiple of Hkv).
        device: where the buffers live.
        occupancy: programs per SM to aim for, in (0, 64]; sets the chunk budget
            ``W = ceil(occupancy * num_sms / Hkv)``.
        chunks_per_head: W itself, overriding ``occupancy`` (tests force splits with it).
        num_sms: SM count; default: the device's (``INTERPRETER_NUM_SMS`` on the CPU).

    Attributes:
        part_acc: float32 ``[Hkv, C, G, D]``: unnormalized partial outputs, one slot per
            chunk (``C = max(W, max_batch)``, the most chunks a plan makes per head).
        part_ml: float32 ``[Hkv, C, G, 2]``: running max (log2 domain) and sum per slot.
        group_counters: int32 ``[Hkv, C]``: chunks finished per merge group, indexed by
            the group's first slot; zero between launches.
        seq_counters: int32 ``[max_batch, Hkv]``: groups merged per (sequence, K/V
            head); zero between launches.
        chunk_budget: W.
    """

    def __init__(
        self, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
        device: str | torch.device, occupancy: float = DEFAULT_OCCUPANCY,
        chunks_per_head: int | None = None, num_sms: int | None = None,
    ) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch must be > 0, got {max_batch}")
        if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if not 0.0 < occupancy <= 64.0:
            raise ValueError(f"occupancy must be in (0, 64], got {occupancy}")
        if chunks_per_head is not None and not 1 <= chunks_per_head <= 1 << 16:
            raise ValueError(
                f"chunks_per_head must be in [1, 65536] or None, got {chunks_per_head}"
            )
        self.device = _with_index(torch.device(device))
        self.num_sms = num_sms if num_sms is not None else device_num_sms(self.device)
        if chunks_per_head is None:
            chunks_per_head = max(1, math.ceil(occupancy * self.num_sms / num_kv_heads))
        self.chunk_budget = chunks_per_head
        self.max_batch = max_batch
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        group = num_q_heads // num_kv_heads
        self.max_chunks = max(self.chunk_budget, max_batch)
        shape = (num_kv_heads, self.max_chunks, group)
        self.part_acc = torch.empty((*shape, head_dim), dtype=torch.float32, device=self.device)
        self.part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=self.device)
        self.group_counters = torch.zeros(shape[:2], dtype=torch.int32, device=self.device)
        self.seq_counters = torch.zeros(
            (max_batch, num_kv_heads), dtype=torch.int32, device=self.device
        )

    def budget_for(self, config: DecodeConfig) -> int:
        """Chunks per K/V head a launch of ``config`` plans: the workspace's W, or fewer
        when ``config.occupancy`` asks for fewer programs per SM (never more: W sizes
        the buffers)."""
        if config.occupancy is None:
            return self.chunk_budget
        own = max(1, math.ceil(config.occupancy * self.num_sms / self.num_kv_heads))
        return min(self.chunk_budget, own)

    def counters_clear(self) -> bool:
        """Whether every merge counter is back to zero (true between launches)."""
        return not (bool(self.group_counters.any()) or bool(self.seq_counters.any()))

    def check_fits(
        self, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
        device: torch.device,
    ) -> None:
        """Raise ``ValueError`` naming the first mismatch with a launch's shape."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {self.max_batch}")
        got = (num_q_heads, num_kv_heads, head_dim)
        want = (self.num_q_heads, self.num_kv_heads, self.head_dim)
        if got != want:
            raise ValueError(f"(Hq, Hkv, D) = {got} does not match the workspace's {want}")
        if _with_index(torch.device(device)) != self.device:
            raise ValueError(f"tensors on {device}, workspace on {self.device}")


def _round_part(x: int, block_n: int, min_partition: int) -> int:
    return max(min_partition, -(-max(x, 1) // block_n) * block_n)


def plan_chunks(
    seq_lens: list[int], capacity: int, chunk_budget: int, block_n: int, min_partition: int,
) -> tuple[int, list[tuple[int, int, int]]]:
    """Host mirror of the device plan (for tests and reports; the kernel never calls it).

    Returns:
        ``(P, chunks)``: tokens per chunk and one ``(sequence, start, end)`` per chunk in
        program order.
    """
    lens = [min(max(n, 0), capacity) for n in seq_lens]
    batch, total = len(lens), sum(lens)
    budget = max(chunk_budget, batch)
    step = -(-batch // 3)
    live = sum(1 for n in lens if n > 0)
    cands = [_round_part(-(-total // max(budget - j * step, 1)), block_n, min_partition)
             for j in range(4)]
    cands.append(_round_part(-(-max(lens) // max(budget // max(live, 1), 1)), block_n,
                             min_partition))
    cands.append(_round_part(max(lens), block_n, min_partition))
    fits = [p for p in cands if sum(max(1, -(-n // p)) for n in lens) <= budget]
    part = min(fits)
    chunks = []
    for b, n in enumerate(lens):
        for j in range(max(1, -(-n // part))):
            chunks.append((b, j * part, min((j + 1) * part, n)))
    return part, chunks


def program_chunk(pid: int, head: int, num_kv_heads: int, num_chunks: int,
                  upper_heads_reversed: bool) -> int:
    """Host mirror of the chunk that program ``(pid, head)`` takes (``locate_chunk``'s
    ``reverse``, as ``fragment_warps.locate_program`` sets it for a kernel whose
    ``UPPER_HEADS_REVERSED`` is on); ``>= num_chunks`` means no work."""
    if upper_heads_reversed and head >= num_kv_heads // 2 and pid < num_chunks:
        return num_chunks - 1 - pid
    return pid


@triton.jit
def _round_part_dev(x, BLOCK_N: tl.constexpr, MIN_PARTITION: tl.constexpr):
    return tl.maximum(tl.cdiv(tl.maximum(x, 1), BLOCK_N) * BLOCK_N, MIN_PARTITION)


@triton.jit
def locate_chunk(
    lens_ptr, batch, capacity, chunk_budget, pid, idx, reverse,
    BLOCK_N: tl.constexpr, MIN_PARTITION: tl.constexpr, ALIGNED_START: tl.constexpr,
):
    """The device plan: program ``pid`` -> its chunk, that chunk's sequence and tokens.

    Every program runs this on the same ``seq_lens`` and gets the same plan. Lengths are
    clamped to ``[0, capacity]`` so that no program reads past its block table.

    Args:
        idx: ``arange(0, B_PAD)``, ``B_PAD >= batch`` a power of 2 (sequence slots). The
            caller makes it, so that Triton and Gluon kernels (whose aranges carry a
            layout) share this plan; only 1-D operations touch it.
        reverse: program ``p`` takes chunk ``num_chunks - 1 - p`` (else chunk ``p``).
            Same chunks, another order of dispatch; ``fragment_warps.locate_program``
            says who uses it.
        ALIGNED_START: compute ``tok_lo`` so that the compiler sees a multiple of
            ``BLOCK_N`` (the same value, as ``P`` is a multiple of ``BLOCK_N``): the
            paged tile loops' block addressing is then a few instructions shorter, which
            only some kernels gain from.

    Returns:
        ``(num_chunks, chunk, seq, seq_chunks, first_chunk, tok_lo, tok_hi)``, int32
        scalars; ``chunk >= num_chunks`` means the program has no work.
    """
    live = idx < batch
    lens = tl.load(lens_ptr + idx, mask=live, other=0)
    lens = tl.minimum(tl.maximum(lens, 0), capacity)
    total = tl.sum(lens, axis=0)
    longest = tl.max(lens, axis=0)
    nonzero = tl.sum((lens > 0).to(tl.int32), axis=0)
    budget = tl.maximum(chunk_budget, batch)
    per_seq = tl.maximum(budget // tl.maximum(nonzero, 1), 1)
    # The smallest candidate partition size (see the module docstring) whose chunk count
    # fits the budget; the last candidate always fits.
    part = 2147483647
    for j in tl.static_range(6):
        if j < 4:
            want = tl.cdiv(total, tl.maximum(budget - j * tl.cdiv(batch, 3), 1))
        elif j == 4:
            want = tl.cdiv(longest, per_seq)
        else:
            want = longest
        cand = _round_part_dev(want, BLOCK_N, MIN_PARTITION)
        count = tl.sum(tl.where(live, tl.maximum(tl.cdiv(lens, cand), 1), 0), axis=0)
        part = tl.where(count <= budget, tl.minimum(part, cand), part)
    n = tl.where(live, tl.maximum(tl.cdiv(lens, part), 1), 0)
    cum = tl.cumsum(n, axis=0)  # inclusive
    num_chunks = tl.sum(n, axis=0)
    chunk = tl.where(reverse & (pid < num_chunks), num_chunks - 1 - pid, pid)
    # Entries past the batch hold cum == num_chunks > chunk, so they never count here.
    seq = tl.sum((cum <= chunk).to(tl.int32), axis=0)
    mine = idx == seq
    seq_len = tl.sum(tl.where(mine, lens, 0), axis=0)
    seq_chunks = tl.sum(tl.where(mine, n, 0), axis=0)
    first_chunk = tl.sum(tl.where(mine, cum - n, 0), axis=0)
    if ALIGNED_START:
        tok_lo = (chunk - first_chunk) * (part // BLOCK_N) * BLOCK_N
    else:
        tok_lo = (chunk - first_chunk) * part
    tok_hi = tl.minimum(tok_lo + part, seq_len)
    return num_chunks, chunk, seq, seq_chunks, first_chunk, tok_lo, tok_hi


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the current device), so equal devices compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
