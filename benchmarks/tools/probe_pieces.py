"""Memory-system probe: one K/V head's rows read as randomly placed pieces, against one run.

The decode kernel's paged f16 reads lose 3-6% to contiguous ones at short contexts, and
the loss shrinks as a randomly placed piece grows (one K/V head's rows of one block: 8 KB
for 16 f16 rows; docs/kernel-decisions.md). This probe asks what
the memory system alone costs, with no attention math: each program
reads its token range of one K/V head from two pools (K and V) in 64-row tiles and xors
the words into a checksum. Like the f16 decode launch it runs one program (here 8 warps,
173 registers) per SM with two tiles of K and V in flight (the next tile's words are
loaded before the current one is folded in). The paged sides address rows as the
decode kernel does (``[num_blocks, Hkv, block_size, 512 bytes]``, a table load per
block broadcast to its rows, or one per row); the contiguous side reads the same rows
from ``[B, Hkv, ctx, 512 bytes]`` through a one-column table, as the decode kernel's
contiguous layout does::

    program (c, h): sequence b = c // (ctx / P), tokens [lo, lo + P), K/V head h
      paged:       row = (table[b, tok // bs] * Hkv + h) * bs + tok % bs
      contiguous:  row = (table[b, 0] * Hkv + h) * ctx + tok
      checksum ^= K[row, :] ^ V[row, :]            (int32 words, 128 per row)

P splits each head's tokens into 32 chunks (the f16 launch's 33 programs per head, a
power of 2 so that chunks divide the lengths). Every side holds the same rows, so every
side's checksum must equal the contiguous one: a wrong address fails the run.

    python benchmarks/tools/probe_pieces.py [--cases 4096x2 16384x1 ...] \\
        [--block-sizes 16 32 64] [--table-read row|block] [--all-heads] [--dry-run]

``--all-heads`` adds two sides whose programs read all four K/V heads of 16 tokens per
tile (as many programs, each over a quarter of the tokens): paged, a tile is then one
16-token block's 32 KB run of the pool, read at once; contiguous, four 8 KB runs.

Per case, timed side by side (``_common.time_sides``, graph replay, rotating copies
that read >= 4x L2 per round): contiguous; paged over a shuffled pool for each block
size; 16-token blocks with each sequence's blocks in order. Prints one row per case and
writes ``probe_pieces.json`` to $OUT when set. ``--dry-run`` runs toy sizes on the CPU
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/tools/
import _common  # noqa: E402
import bench_attention as ba  # noqa: E402
from probe_decode import parse_case  # noqa: E402

HKV = 4
WORDS = 128  # int32 words per row: 256 f16 values
ROWS = 64  # rows per tile, as the f16 decode launch
CHUNKS_PER_HEAD = 32


@triton.jit
def _tile_offsets(table_ptr, b, h, ctx, stride_tb, num_kv_heads, start, BS: tl.constexpr,
                  ROWS: tl.constexpr, WORDS: tl.constexpr, PAGED: tl.constexpr,
                  BY_BLOCK: tl.constexpr, HEADS: tl.constexpr):
    """Word offsets ``[ROWS, WORDS]`` of the tile of tokens ``start + arange(ROWS)``
    (``start`` a multiple of ``ROWS``). ``BY_BLOCK``: one table load per block, broadcast
    to its rows (the decode kernel's ``table_read="block"``), else one per row.
    ``HEADS > 1``: the tile is all ``HEADS`` K/V heads of ``ROWS / HEADS`` tokens from
    ``start`` (in one block): paged, one run of the pool; contiguous, ``HEADS`` runs."""
    if HEADS > 1:
        r = tl.arange(0, ROWS)
        head = r // (ROWS // HEADS)
        tok = start + r % (ROWS // HEADS)
    else:
        head = h
        tok = start + tl.arange(0, ROWS)
    if PAGED and HEADS > 1:
        ids = tl.load(table_ptr + b * stride_tb + start // BS)
        row = (ids * num_kv_heads + head) * BS + tok % BS
    elif PAGED and BY_BLOCK:
        NB: tl.constexpr = ROWS // BS
        ids = tl.load(table_ptr + b * stride_tb + start // BS + tl.arange(0, NB))
        base = tl.reshape(tl.broadcast_to(((ids * num_kv_heads + h) * BS)[:, None], (NB, BS)),
                          (ROWS,))
        row = base + tok % BS
    elif PAGED:
        ids = tl.load(table_ptr + b * stride_tb + tok // BS)
        row = (ids * num_kv_heads + h) * BS + tok % BS
    else:
        # The sequence's slot from its one-column table, as the decode kernel's
        # contiguous layout reads it (once per tile here; an L1 hit after the first).
        slot = tl.load(table_ptr + b * stride_tb)
        row = (slot * num_kv_heads + head) * ctx + tok
    return row.to(tl.int64)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]


@triton.jit
def _read_kernel(k_ptr, v_ptr, table_ptr, sums_ptr, ctx, part, stride_tb, num_kv_heads,
                 BS: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr,
                 PAGED: tl.constexpr, BY_BLOCK: tl.constexpr, HEADS: tl.constexpr):
    TOKENS: tl.constexpr = ROWS // HEADS
    c = tl.program_id(0)
    h = tl.program_id(1)
    per_seq = ctx // part
    b = c // per_seq
    lo = (c % per_seq) * part
    acc = tl.zeros([ROWS, WORDS], tl.int32)
    # The next tile's words are loaded before the current tile is folded in (a register
    # double buffer: two tiles of K and V in flight per program, as the decode kernel's
    # three-stage copies keep).
    off = _tile_offsets(table_ptr, b, h, ctx, stride_tb, num_kv_heads, lo, BS, ROWS, WORDS,
                        PAGED, BY_BLOCK, HEADS)
    k = tl.load(k_ptr + off)
    v = tl.load(v_ptr + off)
    for start in range(lo + TOKENS, lo + part, TOKENS):
        off = _tile_offsets(table_ptr, b, h, ctx, stride_tb, num_kv_heads, start, BS, ROWS,
                            WORDS, PAGED, BY_BLOCK, HEADS)
        k_next = tl.load(k_ptr + off)
        v_next = tl.load(v_ptr + off)
        acc ^= k ^ v
        k, v = k_next, v_next
    acc ^= k ^ v
    tl.store(sums_ptr + h * tl.num_programs(0) + c,
             tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


class Side:
    """One layout's copy of a case: K and V pools, the table (``None``: contiguous, one
    slot per sequence), the checksum slots."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor | None,
                 block_size: int, n_seq: int, ctx: int, chunks: int,
                 by_block: bool = False, heads: int = 1) -> None:
        self.paged, self.by_block, self.heads = table is not None, by_block, heads
        if table is None:
            table = torch.arange(n_seq, dtype=torch.int32, device=k.device)[:, None]
        self.k, self.v, self.table, self.block_size = k, v, table, block_size
        # heads > 1: one program per token range for ``heads`` K/V heads, as many
        # programs as one per head (so each range is ``heads`` times shorter).
        self.ctx, self.part = ctx, n_seq * ctx // (chunks * heads)
        self.sums = torch.empty(chunks * HKV, dtype=torch.int32, device=k.device)
        self.grid = (chunks * heads, HKV // heads)

    def run(self) -> None:
        _read_kernel[self.grid](self.k, self.v, self.table, self.sums, self.ctx, self.part,
                                self.table.stride(0), HKV, BS=self.block_size, ROWS=ROWS,
                                WORDS=WORDS, PAGED=self.paged, BY_BLOCK=self.by_block,
                                HEADS=self.heads, num_warps=8)

    def checksum(self) -> int:
        """The xor of every program's checksum: of every word of K and V read."""
        return xor_all(self.sums)


def xor_all(x: torch.Tensor) -> int:
    """The xor of all elements of an int32 tensor."""
    out = 0
    for s in x.flatten().tolist():
        out ^= s
    return out


def block_placement(n_seq: int, ctx: int, block_size: int, in_order: bool,
                    gen: torch.Generator) -> torch.Tensor:
    """The block table ``[B, ctx / bs]`` (int32): the physical block of each sequence's
    logical blocks, the whole pool shuffled or (``in_order``) each sequence's blocks
    consecutive (``bench_attention.placement``)."""
    nb = ctx // block_size
    return ba.placement(n_seq * nb, 1 if in_order else 0, gen).view(n_seq, nb).to(torch.int32)


def paged_copy(contig: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``contig`` ``[B, Hkv, ctx, W]`` as the pool ``[num_blocks, Hkv, bs, W]`` that
    ``table`` (``block_placement``) reads back in token order."""
    B, H, ctx, W = contig.shape
    nb = table.shape[1]
    bs = ctx // nb
    logical = contig.view(B, H, nb, bs, W).permute(0, 2, 1, 3, 4).reshape(B * nb, H, bs, W)
    pool = torch.empty_like(logical)
    pool[table.flatten().to(device=contig.device, dtype=torch.long)] = logical
    return pool


def run_case(n_seq: int, ctx: int, block_sizes: list[int], chunks: int, device: str,
             method: str, l2_bytes: int, by_block: bool, all_heads: bool = False,
             seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (n_seq, HKV, ctx, WORDS)
    live = 2 * n_seq * HKV * ctx * WORDS * 4
    copies = ba.copies_for(live, l2_bytes, ba.FULL) if device == "cuda" else 1
    k, v = (torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32,
                          device=device) for _ in range(2))
    variants = [("contiguous", None, False, 1)]
    variants += [(f"bs{bs} shuffled", bs, False, 1) for bs in block_sizes]
    variants.append((f"bs{block_sizes[0]} in order", block_sizes[0], True, 1))
    if all_heads:
        variants += [("contiguous all heads", None, False, HKV),
                     ("bs16 shuffled all heads", 16, False, HKV)]
    sides = {}
    for name, bs, in_order, heads in variants:
        reps = []
        for _ in range(copies):  # distinct allocations of the same rows
            if bs is None:
                reps.append(Side(k.clone(), v.clone(), None, 1, n_seq, ctx, chunks,
                                 heads=heads))
            else:
                table = block_placement(n_seq, ctx, bs, in_order,
                                        torch.Generator().manual_seed(seed + 1)).to(device)
                reps.append(Side(paged_copy(k, table), paged_copy(v, table), table, bs, n_seq,
                                 ctx, chunks, by_block, heads))
        sides[name] = reps
    times = _common.time_sides({name: [s.run for s in reps] for name, reps in sides.items()},
                               method, min_rounds=8, min_seconds=0.05)
    want = sides["contiguous"][0].checksum()
    for name, reps in sides.items():
        got = reps[0].checksum()
        if got != want:
            raise AssertionError(f"{n_seq}x{ctx} {name}: checksum {got} != contiguous {want}")
    return {"case": f"{ctx}x{n_seq}", "live_bytes": live, "copies": copies, "us": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+",
                    default=["4096x1", "4096x2", "4096x4", "16384x1", "16384x2", "65536x1",
                             "131072x8"])
    ap.add_argument("--block-sizes", nargs="+", type=int, default=[16, 32, 64])
    ap.add_argument("--table-read", choices=("row", "block"), default="block",
                    help="paged sides: a table load per row, or one per block broadcast to "
                         "its rows (the decode kernel's table_read)")
    ap.add_argument("--all-heads", action="store_true",
                    help="also read all K/V heads of 16 tokens per tile (one 16-token "
                         "block's run of the pool when paged), contiguous and shuffled")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        device, method, chunks = "cpu", "eager", 2
        cases = [(1, 256)]
    elif torch.cuda.is_available():
        device, method, chunks = "cuda", "graph", CHUNKS_PER_HEAD
        cases = []
        for spec in args.cases:
            lens = parse_case(spec, ())
            if len(set(lens)) != 1:
                raise SystemExit(f"case {spec!r}: want uniform lengths, LENxN")
            cases.append((len(lens), lens[0]))
    else:
        raise SystemExit("needs a CUDA device (or --dry-run under TRITON_INTERPRET=1)")
    for n, ctx in cases:
        if (n * ctx) % (chunks * ROWS) or ctx % (n * ctx // chunks) or any(
                ctx % bs for bs in args.block_sizes):
            raise SystemExit(f"case {ctx}x{n}: lengths must split into {chunks} chunks per "
                             f"head of whole {ROWS}-row tiles and whole blocks")
    meta = _common.run_meta()
    l2 = meta["l2_bytes"]
    rows = []
    print(f"# {meta['gpu']} commit {meta['commit']} {meta['date']}; {chunks} programs per "
          f"head, {ROWS}-row tiles, a table load per {args.table_read}; us (contiguous / "
          "paged per variant)", flush=True)
    for n, ctx in cases:
        row = run_case(n, ctx, args.block_sizes, chunks, device, method, l2,
                       args.table_read == "block", args.all_heads)
        rows.append(row)
        base = row["us"]["contiguous"]
        parts = [f"contig {base:8.1f} us ({row['live_bytes'] / base / 1e3:5.0f} GB/s)"]
        parts += [f"{name} {us:8.1f} ({base / us:.3f})" for name, us in row["us"].items()
                  if name != "contiguous"]
        print(f"{row['case']:>10}  " + "  ".join(parts), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "probe_pieces.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
