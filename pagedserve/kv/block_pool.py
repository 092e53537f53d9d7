"""The block pool: fixed-size K/V blocks, reference counts and a cache of kept contents.
Pure mechanism.

One pool serves every full-attention layer: block id ``b`` names rows
``[b * block_size, (b + 1) * block_size)`` of every layer's K storage and V storage.
The pool knows nothing of sequences; ``KVCacheManager`` turns sequences into block tables.

Every block is in exactly one of three states::

    free     refcount 0, contents meaningless          in the free queue
    owned    refcount = number of block-table entries  (in no queue)
    cached   refcount 0, contents kept for reuse       in the eviction order

A block whose owner marked its contents worth keeping (``set_name`` for a full block,
``keep`` for a partial one) becomes *cached* instead of free when its last owner lets go.
A cached block is taken back by ``incref`` (a prefix hit) or evicted, least recently
cached first, only when ``allocate`` has no free block left. ``epoch(b)`` changes whenever
``b``'s contents are given away, so a holder of ``(b, epoch)`` can tell whether the rows
it knows are still there.

Allocation is all-or-nothing: ``allocate(n)`` returns ``n`` ids or ``None`` and leaves the
pool exactly as it was. ``None`` is the only out-of-memory signal; callers queue or preempt.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolUsage:
    """A snapshot of the pool's accounting."""

    num_total_blocks: int
    num_used_blocks: int  # owned
    num_free_blocks: int  # free or cached: what an allocation can take
    utilization: float  # in [0, 1]
    bytes_per_block: int  # K and V of one block id across every full-attention layer
    used_bytes: int
    total_bytes: int
    num_cached_blocks: int = 0  # part of num_free_blocks


class BlockPool:
    """``num_blocks`` blocks, handed out least-recently-freed first, then (when none is
    free) by evicting cached blocks, least recently cached first.

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
        # Cached blocks, least recently cached first (the eviction order).
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._kept = [False] * num_blocks  # contents survive the last owner
        self._name: list[int | None] = [None] * num_blocks
        self._by_name: dict[int, int] = {}
        self._epoch = [0] * num_blocks
        self.num_evictions = 0

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Owned blocks (cached ones count as free)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def utilization(self) -> float:
        """Fraction of blocks owned, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def usage(self) -> PoolUsage:
        used = self.num_used_blocks
        return PoolUsage(self.num_blocks, used, self.num_free_blocks, self.utilization,
                         self.bytes_per_block, used * self.bytes_per_block,
                         self.num_blocks * self.bytes_per_block, self.num_cached_blocks)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcount[block_id]

    def lookup(self, name: int) -> int | None:
        """The owned or cached block registered under ``name``, if any."""
        return self._by_name.get(name)

    def epoch(self, block_id: int) -> int:
        """Changes whenever the block's contents are given away (allocated afresh)."""
        self._check_id(block_id)
        return self._epoch[block_id]

    def holds(self, block_id: int, epoch: int) -> bool:
        """Whether ``block_id`` still holds the rows it held at ``epoch`` (owned or cached)."""
        return (self._epoch[block_id] == epoch
                and (self._refcount[block_id] > 0 or block_id in self._cached))

    # ---- mechanism --------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` free blocks (refcount 1 each), or return ``None`` and change nothing."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of blocks to allocate must be an int >= 0, got {n!r}")
        if n > self.num_free_blocks:
            return None
        ids = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(ids) < n:
            b, _ = self._cached.popitem(last=False)
            self._forget(b)
            self.num_evictions += 1
            ids.append(b)
        for b in ids:
            self._refcount[b] = 1
            self._epoch[b] += 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Add one owner to each owned or cached block: sharing for forks and prefix hits."""
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] == 0 and b not in self._cached:
                raise ValueError(f"block {b} is free; only owned or cached blocks can be shared")
        for b in block_ids:
            if self._refcount[b] == 0:
                del self._cached[b]
            self._refcount[b] += 1

    def set_name(self, block_id: int, name: int) -> bool:
        """Register owned block ``block_id`` (a full block) under ``name`` and keep its
        contents when freed. False, and no change, if the name or the block already has
        one (the first block computed for a prefix stays its cached copy)."""
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise ValueError(f"block {block_id} is not owned; only owned blocks can be named")
        if name in self._by_name or self._name[block_id] is not None:
            return False
        self._name[block_id] = name
        self._by_name[name] = block_id
        self._kept[block_id] = True
        return True

    def keep(self, block_id: int) -> None:
        """Keep owned block ``block_id``'s contents (a partial block) when it is freed."""
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise ValueError(f"block {block_id} is not owned; only owned blocks can be kept")
        self._kept[block_id] = True

    def clear_cache(self) -> None:
        """Evict every cached block now (they become free)."""
        while self._cached:
            b, _ = self._cached.popitem(last=False)
            self._forget(b)
            self._free.append(b)

    def _forget(self, b: int) -> None:
        name = self._name[b]
        if name is not None:
            del self._by_name[name]
        self._name[b] = None
        self._kept[b] = False

    def decref(self, block_ids: list[int]) -> None:
        """Drop one owner from each block. A block whose count reaches 0 is free at once,
        or cached if its contents are kept; kept blocks join the eviction order last one
        first, so that a sequence's tail goes before the prefix other sequences share."""
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
        kept = []
        for b in block_ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self._kept[b]:
                    kept.append(b)
                else:
                    self._free.append(b)
        for b in reversed(kept):
            self._cached[b] = None

    def _check_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is outside the pool [0, {self.num_blocks})")

    # ---- checking ---------------------------------------------------------------------
    def check_invariants(self, owners: dict[int, int] | None = None) -> None:
        """Every block is exactly one of free, cached, owned; cached blocks keep their
        contents and free ones do not; names map both ways; with ``owners`` (block ->
        number of block-table entries naming it), each refcount equals its owner count."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block appears twice in the free queue")
        if free & set(self._cached):
            raise AssertionError("a block is both free and cached")
        owned = sum(1 for rc in self._refcount if rc > 0)
        if owned + len(free) + len(self._cached) != self.num_blocks:
            raise AssertionError(f"owned {owned} + free {len(free)} + cached "
                                 f"{len(self._cached)} != {self.num_blocks} blocks")
        for name, b in self._by_name.items():
            if self._name[b] != name:
                raise AssertionError(f"name map: block {b} is not named {name:x}")
        for b in range(self.num_blocks):
            rc = self._refcount[b]
            if rc < 0:
                raise AssertionError(f"block {b} has negative refcount {rc}")
            if (rc == 0) != (b in free or b in self._cached):
                raise AssertionError(f"block {b}: refcount {rc} but free={b in free}")
            if b in self._cached and not self._kept[b]:
                raise AssertionError(f"cached block {b} does not keep its contents")
            if b in free and (self._kept[b] or self._name[b] is not None):
                raise AssertionError(f"free block {b} still has a name or is kept")
            if owners is not None and owners.get(b, 0) != rc:
                raise AssertionError(
                    f"block {b}: refcount {rc} but {owners.get(b, 0)} table entries own it"
                )

    def snapshot(self) -> tuple:
        return (tuple(self._free), tuple(self._refcount), tuple(self._cached),
                tuple(self._name), tuple(self._epoch))
