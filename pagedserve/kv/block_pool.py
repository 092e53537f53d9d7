"""The block pool: fixed-size K/V blocks, a free queue and reference counts. Pure mechanism.

One pool serves every full-attention layer: block id ``b`` names rows
``[b * block_size, (b + 1) * block_size)`` of every layer's K storage and V storage.
The pool knows nothing of sequences; ``KVCacheManager`` turns sequences into block tables.

Allocation is all-or-nothing: ``allocate(n)`` returns ``n`` ids or ``None`` and leaves the
pool exactly as it was. ``None`` is the only out-of-memory signal; callers queue or preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolUsage:
    """A snapshot of the pool's accounting."""

    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    utilization: float  # in [0, 1]
    bytes_per_block: int  # K and V of one block id across every full-attention layer
    used_bytes: int
    total_bytes: int


class BlockPool:
    """``num_blocks`` blocks, handed out least-recently-freed first.

    ``bytes_per_block`` (from ``KVFootprint.bytes_per_block``: the configured K and V types
    times the full-attention layers) only feeds the accounting; 0 when unknown.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, bytes_per_block: int = 0) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if bytes_per_block < 0:
            raise ValueError(f"bytes_per_block must be >= 0, got {bytes_per_block}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def utilization(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def usage(self) -> PoolUsage:
        used = self.num_used_blocks
        return PoolUsage(self.num_blocks, used, self.num_free_blocks, self.utilization,
                         self.bytes_per_block, used * self.bytes_per_block,
                         self.num_blocks * self.bytes_per_block)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    # ---- mechanism --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (refcount 1 each), or return ``None`` and change nothing."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of blocks to allocate must be an int >= 0, got {n!r}")
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refcount[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one owner to each (already owned) block: sharing for forks and prefixes."""
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise ValueError(f"block {b} is free; only owned blocks can be shared")
        for b in block_ids:
            self._refcount[b] += 1

    def decref(self, block_ids: list[int]) -> None:
        """Drop one owner from each block; a block whose count reaches 0 is free at once."""
        for b in block_ids:
            self._check_id(b)
        seen: dict[int, int] = {}
        for b in block_ids:
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self._refcount[b]:
                raise ValueError(
                    f"double free of block {b}: refcount {self._refcount[b]}, "
                    f"released {seen[b]} time(s)"
                )
        for b in block_ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is outside the pool [0, {self.num_blocks})")

    # ---- checking ---------------------------------------------------------------------
    def check_invariants(self, owners: dict[int, int] | None = None) -> None:
        """Every block is free xor referenced; with ``owners`` (block -> number of
        block-table entries naming it), each refcount equals its owner count."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        for b in range(self.num_blocks):
            rc = self._refcount[b]
            if rc < 0:
                raise AssertionError(f"block {b} has negative refcount {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: refcount {rc} but free={b in free}")
            if owners is not None and owners.get(b, 0) != rc:
                raise AssertionError(
                    f"block {b}: refcount {rc} but {owners.get(b, 0)} table entries own it"
                )

    def snapshot(self) -> tuple:
        return (tuple(self._free), tuple(self._refcount))
