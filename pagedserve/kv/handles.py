"""Generational handles: indices into fixed tables that detect use after free.

A handle is ``(index, generation)``. Each table entry keeps the generation of its current
owner; releasing an entry bumps it, so a handle kept past ``release`` no longer matches and
every later use raises ``StaleHandleError`` instead of touching the entry's next owner.
Sequences (rows of the block-table tensor) and recurrent-state slots both use this.
"""

from __future__ import annotations

from dataclasses import dataclass


class StaleHandleError(ValueError):
    """A handle whose entry was released (and possibly reassigned) was used."""


class OutOfCapacityError(RuntimeError):
    """No free entry or block is left; the caller decides whether to wait or preempt."""


@dataclass(frozen=True, order=True)
class Handle:
    index: int
    generation: int

    def __repr__(self) -> str:
        return f"Handle({self.index}@g{self.generation})"


class HandleTable:
    """``capacity`` entries handed out lowest-index-first, each with a generation counter."""

    def __init__(self, capacity: int, kind: str) -> None:
        if capacity <= 0:
            raise ValueError(f"{kind} capacity must be > 0, got {capacity}")
        self.kind = kind
        self.capacity = capacity
        self._generation = [0] * capacity
        self._live = [False] * capacity
        # A stack popped from the end: reversed so index 0 is handed out first.
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_live(self) -> int:
        return self.capacity - len(self._free)

    def acquire(self) -> Handle:
        if not self._free:
            raise OutOfCapacityError(f"no free {self.kind}: all {self.capacity} are in use")
        index = self._free.pop()
        self._live[index] = True
        return Handle(index, self._generation[index])

    def validate(self, handle: Handle) -> int:
        """Return the handle's index, or raise if it is not the live owner of its entry."""
        if not isinstance(handle, Handle):
            raise TypeError(f"expected a {self.kind} Handle, got {type(handle).__name__}")
        if not 0 <= handle.index < self.capacity:
            raise StaleHandleError(
                f"{self.kind} handle {handle} is out of range [0, {self.capacity})"
            )
        if not self._live[handle.index] or self._generation[handle.index] != handle.generation:
            raise StaleHandleError(
                f"stale {self.kind} handle {handle}: entry {handle.index} was released "
                f"(now generation {self._generation[handle.index]}, "
                f"{'live' if self._live[handle.index] else 'free'})"
            )
        return handle.index

    def release(self, handle: Handle) -> int:
        index = self.validate(handle)
        self._live[index] = False
        self._generation[index] += 1
        self._free.append(index)
        return index

    def live_indices(self) -> list[int]:
        return [i for i, live in enumerate(self._live) if live]

    def check_invariants(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.kind}: an index appears twice in the free list")
        for i in range(self.capacity):
            if self._live[i] == (i in free):
                raise AssertionError(
                    f"{self.kind} {i}: live={self._live[i]} but in free list={i in free}"
                )

    def snapshot(self) -> tuple:
        return (tuple(self._generation), tuple(self._live), tuple(self._free))
