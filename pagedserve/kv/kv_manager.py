"""Sequences on top of the block pool: handles, growth, block tables, forks.

Each live sequence owns one row of a preallocated int32 block-table tensor. Appending a
block writes one entry of that row; nothing is rebuilt per step. A token at position
``pos`` of a sequence lives in K/V slot::

    slot = block_table[pos // block_size] * block_size + pos % block_size

    sequence positions   0 ........ 15 | 16 ....... 31 | 32 .. 37
    block_table row      [      7      ,      2        ,    9    , -1, -1, ...]
                                |              |            |
    pool slots            112 ... 127     32 ... 47    144 ... 149   (block_size = 16)

Tokens are *committed* (their K/V is in the cache) or *reserved* (room claimed, e.g. for a
prefill chunk about to run). Blocks cover exactly ``ceil(num_reserved / block_size)``:
one is allocated exactly when a block boundary is crossed, never earlier, never with gaps.
Every operation that allocates is all-or-nothing and returns ``False`` when blocks are short,
leaving the pool and the table exactly as they were.

Prefix reuse: ``create_from_prefix`` starts a sequence on cached full blocks (shared,
refcounts up) plus a private copy of the block holding a partial tail, so that the new
sequence writes its own rows past the prefix and never into a block another prefix names.
``name_full_blocks`` registers committed full blocks in the pool under their chained hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.handles import Handle, HandleTable

EMPTY = -1  # block-table entry with no block


@dataclass
class _SeqState:
    num_tokens: int = 0  # committed: K/V written
    num_reserved: int = 0  # committed + claimed; num_reserved >= num_tokens
    num_named: int = 0  # leading full blocks registered under their hash


@dataclass(frozen=True)
class BlockCopy:
    """A copy-on-write the caller must run on every layer's K/V before writing ``dst``."""

    src: int
    dst: int


class KVCacheManager:
    """Turns sequences into block tables over one ``BlockPool``.

    Args:
        pool: the block pool (mechanism).
        max_num_seqs: rows of the block-table tensor (live sequences at once).
        max_blocks_per_seq: columns of the block-table tensor; caps a sequence at
            ``max_blocks_per_seq * block_size`` tokens.
    """

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        if max_blocks_per_seq <= 0:
            raise ValueError(f"max_blocks_per_seq must be > 0, got {max_blocks_per_seq}")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self._handles = HandleTable(max_num_seqs, "sequence")
        # [max_num_seqs, max_blocks_per_seq] int32; EMPTY past each row's last block.
        self.block_tables_cpu = torch.full(
            (max_num_seqs, max_blocks_per_seq), EMPTY, dtype=torch.int32
        )
        self._blocks: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self._seqs: list[_SeqState] = [_SeqState() for _ in range(max_num_seqs)]
        self.pending_copies: list[BlockCopy] = []
        # Copy sources that might otherwise be evicted before the copy runs: one
        # reference each until ``copies_done``.
        self._copy_holds: list[int] = []

    # ---- capacity -----------------------------------------------------------------------
    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def num_live_seqs(self) -> int:
        return self._handles.num_live

    @property
    def num_free_seq_rows(self) -> int:
        return self._handles.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, handle: Handle, num_new_tokens: int) -> bool:
        """Whether ``reserve(handle, num_new_tokens)`` would succeed now."""
        s = self._seqs[self._handles.validate(handle)]
        need = max(s.num_reserved, s.num_tokens + num_new_tokens)
        if need > self.max_tokens_per_seq:
            return False
        return self._new_blocks_for(handle, need) <= self.pool.num_free_blocks

    # ---- lifecycle ------------------------------------------------------------------------
    def create(self) -> Handle:
        """A new empty sequence (no blocks). Raises ``OutOfCapacityError`` if no row is free."""
        handle = self._handles.acquire()
        self._seqs[handle.index] = _SeqState()
        self._blocks[handle.index] = []
        return handle

    def free(self, handle: Handle, keep_tail: bool = False) -> None:
        """Release the sequence; its blocks return to the pool at once (shared ones when
        their last owner goes): named ones cached, others free. ``keep_tail`` caches the
        block of the last committed token too, named or not (a state checkpoint ends in
        it)."""
        index = self._handles.validate(handle)
        blocks, s = self._blocks[index], self._seqs[index]
        if keep_tail and s.num_tokens:
            self.pool.keep(blocks[(s.num_tokens - 1) // self.block_size])
        self.pool.decref(blocks)
        self._blocks[index] = []
        self._seqs[index] = _SeqState()
        self.block_tables_cpu[index].fill_(EMPTY)
        self._handles.release(handle)

    def create_from_prefix(self, full_blocks: list[int], num_tokens: int,
                           tail_block: int | None) -> Handle | None:
        """A new sequence holding ``num_tokens`` committed tokens of a cached prefix.

        ``full_blocks`` (owned or cached) are shared; the rows past them (1 to
        ``block_size`` of them) are in ``tail_block``, which is copied into a fresh block
        (``pending_copies``), so that the sequence writes its own rows there. ``None``, and
        no change, when blocks or rows are short.
        """
        bs = self.block_size
        rest = num_tokens - len(full_blocks) * bs
        if not (0 < rest <= bs if tail_block is not None else rest == 0):
            raise ValueError(f"{len(full_blocks)} full blocks and tail {tail_block} do not "
                             f"cover {num_tokens} tokens")
        if self._handles.num_free == 0 or num_tokens > self.max_tokens_per_seq:
            return None
        held = full_blocks + ([tail_block] if tail_block is not None else [])
        self.pool.incref(held)  # out of the eviction order while the copy is allocated
        fresh: list[int] = []
        if tail_block is not None:
            got = self.pool.allocate(1)
            if got is None:
                self.pool.decref(held)
                return None
            fresh = got
            self.pending_copies.append(BlockCopy(tail_block, fresh[0]))
            self._copy_holds.append(tail_block)
        handle = self._handles.acquire()
        blocks = full_blocks + fresh
        self._blocks[handle.index] = blocks
        self._seqs[handle.index] = _SeqState(num_tokens, num_tokens, len(full_blocks))
        row = self.block_tables_cpu[handle.index]
        row.fill_(EMPTY)
        row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return handle

    def copies_done(self) -> None:
        """The pending copies have been queued on the device: drop them and their holds."""
        self.pending_copies.clear()
        holds, self._copy_holds = self._copy_holds, []
        self.pool.decref(holds)

    def name_full_blocks(self, handle: Handle, names: list[int]) -> None:
        """Register each committed full block ``i`` not yet named under ``names[i]``."""
        index = self._handles.validate(handle)
        s, blocks = self._seqs[index], self._blocks[index]
        end = min(len(names), s.num_tokens // self.block_size)
        for i in range(s.num_named, end):
            self.pool.set_name(blocks[i], names[i])
        s.num_named = max(s.num_named, end)

    def block_at(self, handle: Handle, pos: int) -> int:
        """The block holding position ``pos`` (reserved)."""
        index = self._reserved_row(handle, pos, pos + 1)
        return self._blocks[index][pos // self.block_size]

    def fork(self, handle: Handle) -> Handle:
        """A new sequence sharing every block of ``handle`` (refcounts +1).

        A later append into a shared, partly filled last block copies it first
        (``pending_copies``). Raises ``OutOfCapacityError`` if no row is free.
        """
        src = self._handles.validate(handle)
        child = self._handles.acquire()
        blocks = list(self._blocks[src])
        self.pool.incref(blocks)
        self._blocks[child.index] = blocks
        self._seqs[child.index] = _SeqState(
            self._seqs[src].num_tokens, self._seqs[src].num_tokens,
            min(self._seqs[src].num_named, self._seqs[src].num_tokens // self.block_size),
        )
        row = self.block_tables_cpu[child.index]
        row.fill_(EMPTY)
        row[: len(blocks)] = self.block_tables_cpu[src, : len(blocks)]
        # Blocks reserved by the parent beyond its committed tokens are not inherited.
        self._shrink_to_reserved(child.index)
        return child

    # ---- growth ---------------------------------------------------------------------------
    def reserve(self, handle: Handle, num_new_tokens: int) -> bool:
        """Claim room for ``num_new_tokens`` past the committed tokens. All or nothing."""
        index = self._handles.validate(handle)
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        s = self._seqs[index]
        need = max(s.num_reserved, s.num_tokens + num_new_tokens)
        if need > self.max_tokens_per_seq:
            raise ValueError(
                f"sequence would hold {need} tokens, above its capacity of "
                f"{self.max_tokens_per_seq} ({self.max_blocks_per_seq} blocks of "
                f"{self.block_size})"
            )
        blocks = self._blocks[index]
        cow = self._needs_copy_on_write(index, num_new_tokens)
        num_new = self.blocks_needed(need) - len(blocks) + (1 if cow else 0)
        new_ids = self.pool.allocate(num_new)
        if new_ids is None:
            return False
        if cow:
            shared = blocks[-1]
            fresh = new_ids.pop(0)
            blocks[-1] = fresh
            self.block_tables_cpu[index, len(blocks) - 1] = fresh
            self.pool.decref([shared])
            self.pending_copies.append(BlockCopy(shared, fresh))
        for b in new_ids:
            self.block_tables_cpu[index, len(blocks)] = b  # one entry per new block
            blocks.append(b)
        s.num_reserved = need
        return True

    def commit(self, handle: Handle, num_tokens: int) -> None:
        """Mark ``num_tokens`` reserved tokens as written."""
        index = self._handles.validate(handle)
        s = self._seqs[index]
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        if s.num_tokens + num_tokens > s.num_reserved:
            raise ValueError(
                f"cannot commit {num_tokens} tokens: only {s.num_reserved - s.num_tokens} "
                "are reserved"
            )
        s.num_tokens += num_tokens

    def unreserve(self, handle: Handle) -> None:
        """Drop the claim past the committed tokens (rejected draft rows): the blocks only
        it covered go back to the pool; the table keeps ``ceil(num_tokens / block_size)``
        entries."""
        index = self._handles.validate(handle)
        s = self._seqs[index]
        s.num_reserved = s.num_tokens
        self._shrink_to_reserved(index)

    def append(self, handle: Handle, num_new_tokens: int) -> bool:
        """Reserve and commit ``num_new_tokens``. All or nothing."""
        if not self.reserve(handle, num_new_tokens):
            return False
        self.commit(handle, num_new_tokens)
        return True

    def _needs_copy_on_write(self, index: int, num_new_tokens: int) -> bool:
        s, blocks = self._seqs[index], self._blocks[index]
        if num_new_tokens == 0 or not blocks or s.num_reserved % self.block_size == 0:
            return False
        return self.pool.refcount(blocks[-1]) > 1

    def _new_blocks_for(self, handle: Handle, need_tokens: int) -> int:
        index = handle.index
        cow = self._needs_copy_on_write(index, need_tokens - self._seqs[index].num_tokens)
        return self.blocks_needed(need_tokens) - len(self._blocks[index]) + (1 if cow else 0)

    def _shrink_to_reserved(self, index: int) -> None:
        blocks = self._blocks[index]
        keep = self.blocks_needed(self._seqs[index].num_reserved)
        extra = blocks[keep:]
        if extra:
            self.pool.decref(extra)
            del blocks[keep:]
            self.block_tables_cpu[index, keep:] = EMPTY

    # ---- views ----------------------------------------------------------------------------
    def num_tokens(self, handle: Handle) -> int:
        return self._seqs[self._handles.validate(handle)].num_tokens

    def num_reserved(self, handle: Handle) -> int:
        return self._seqs[self._handles.validate(handle)].num_reserved

    def block_ids(self, handle: Handle) -> list[int]:
        return list(self._blocks[self._handles.validate(handle)])

    def block_table(self, handle: Handle) -> torch.Tensor:
        """int32 ``[num_blocks_of_seq]``: a view into the sequence's table row."""
        index = self._handles.validate(handle)
        return self.block_tables_cpu[index, : len(self._blocks[index])]

    def batch_view(
        self, handles: list[Handle], num_cols: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' form for B sequences.

        Returns:
            block_tables: int32 ``[B, num_cols]`` (default ``max_blocks_per_seq``), EMPTY-padded.
            seq_lens: int32 ``[B]``, committed tokens per sequence.
        """
        rows = [self._handles.validate(h) for h in handles]
        cols = self.max_blocks_per_seq if num_cols is None else num_cols
        width = max((len(self._blocks[r]) for r in rows), default=0)
        if cols < width:
            raise ValueError(f"num_cols {cols} is below the widest table in the batch ({width})")
        index = torch.tensor(rows, dtype=torch.long)
        tables = self.block_tables_cpu.index_select(0, index)[:, :cols]
        lens = torch.tensor([self._seqs[r].num_tokens for r in rows], dtype=torch.int32)
        return tables, lens

    def _reserved_row(self, handle: Handle, start: int, end: int) -> int:
        """The row of ``handle``; ``ValueError`` unless ``[start, end)`` is reserved."""
        index = self._handles.validate(handle)
        if not 0 <= start <= end <= self._seqs[index].num_reserved:
            raise ValueError(
                f"positions [{start}, {end}) are outside the reserved range "
                f"[0, {self._seqs[index].num_reserved})"
            )
        return index

    def slot_of(self, handle: Handle, pos: int) -> int:
        """Pool slot of position ``pos``, which must be reserved (the decode fast path of
        ``slot_mapping``: plain ints, no tensor ops)."""
        index = self._reserved_row(handle, pos, pos + 1)
        return self._blocks[index][pos // self.block_size] * self.block_size \
            + pos % self.block_size

    def slot_mapping(self, handle: Handle, start: int, end: int) -> torch.Tensor:
        """int64 ``[end - start]``: pool slot of each position in ``[start, end)``, which
        must be reserved."""
        index = self._reserved_row(handle, start, end)
        pos = torch.arange(start, end, dtype=torch.long)
        first, last = start // self.block_size, -(-end // self.block_size)
        table = self.block_tables_cpu[index, first:last].to(torch.long)  # only the blocks used
        return table[pos // self.block_size - first] * self.block_size + pos % self.block_size

    # ---- checking -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every block free xor owned, refcounts = owners, tables match lengths."""
        self._handles.check_invariants()
        live = set(self._handles.live_indices())
        owners: dict[int, int] = {}
        for i in range(self.max_num_seqs):
            blocks, s = self._blocks[i], self._seqs[i]
            row = self.block_tables_cpu[i].tolist()
            if i not in live:
                if blocks or any(b != EMPTY for b in row) or s.num_tokens or s.num_reserved:
                    raise AssertionError(f"free sequence row {i} still holds state")
                continue
            if not 0 <= s.num_tokens <= s.num_reserved <= self.max_tokens_per_seq:
                raise AssertionError(
                    f"sequence {i}: tokens {s.num_tokens}, reserved {s.num_reserved}"
                )
            if len(blocks) != self.blocks_needed(s.num_reserved):
                raise AssertionError(
                    f"sequence {i}: {len(blocks)} blocks for {s.num_reserved} reserved tokens"
                )
            if len(set(blocks)) != len(blocks):
                raise AssertionError(f"sequence {i} names a block twice: {blocks}")
            if row[: len(blocks)] != blocks or any(b != EMPTY for b in row[len(blocks) :]):
                raise AssertionError(f"sequence {i}: table row {row} != blocks {blocks}")
            for b in blocks:
                owners[b] = owners.get(b, 0) + 1
        for b in self._copy_holds:
            owners[b] = owners.get(b, 0) + 1
        self.pool.check_invariants(owners)

    def snapshot(self) -> tuple:
        """Full state, for comparing before and after a failed operation."""
        return (
            self.pool.snapshot(),
            self._handles.snapshot(),
            tuple(tuple(b) for b in self._blocks),
            tuple((s.num_tokens, s.num_reserved) for s in self._seqs),
            tuple(map(tuple, self.block_tables_cpu.tolist())),
            tuple(self.pending_copies),
            tuple(self._copy_holds),
        )
