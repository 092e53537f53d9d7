"""What rank 0 sends its workers, one typed message per call that changes device state.

The scheduler and the K/V manager run on rank 0 alone; their decisions reach the workers
as these commands, in the order rank 0 applies them to its own device, so that every rank
holds the same block tables, state slots and K/V rows of its own heads::

    rank 0 (engine)                                 rank r (worker)
    scheduler -> K/V manager -> batch builder
      StatePool.acquire / release    -- AcquireSlot / ReleaseSlot -->  its slot zeroed / freed
      copy_blocks / copy_state_slot  -- CopyBlocks / CopyStateSlot -> the same copies
      execute(batch)                 -- Execute(batch's host form) -> the same forward pass
        all-reduces, logits all-gather  <========= collectives =========>
      sample (rank 0 only)

Host tensors travel as numpy arrays: pickled by value, not through shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.model.forward_batch import HostBatch
from pagedserve.model.state_taps import StateTap


@dataclass(frozen=True)
class Execute:
    """Run one step: the ``HostBatch`` rank 0 built (``ForwardBatch.host``)."""

    longs: np.ndarray
    ints: np.ndarray
    tables: np.ndarray
    long_offsets: list[int]
    int_offsets: list[int]
    num_decode_seqs: int
    query_start_loc: list[int]
    seq_lens: list[int]
    state_taps: list[StateTap]

    @classmethod
    def of(cls, host: HostBatch) -> Execute:
        return cls(host.longs.numpy(), host.ints.numpy(), host.tables.numpy(),
                   host.long_offsets, host.int_offsets, host.num_decode_seqs,
                   host.query_start_loc, host.seq_lens, host.state_taps)

    def host(self) -> HostBatch:
        return HostBatch(torch.from_numpy(self.longs), torch.from_numpy(self.ints),
                         torch.from_numpy(self.tables), self.long_offsets, self.int_offsets,
                         self.num_decode_seqs, self.query_start_loc, self.seq_lens,
                         self.state_taps)


@dataclass(frozen=True)
class CopyBlocks:
    """Copy-on-write copies of K/V blocks, ``src[i] -> dst[i]`` in every layer."""

    src: list[int]
    dst: list[int]


@dataclass(frozen=True)
class AcquireSlot:
    """Rank 0 assigned state slot ``index`` (zeroed); the worker assigns the same one."""

    index: int


@dataclass(frozen=True)
class ReleaseSlot:
    index: int


@dataclass(frozen=True)
class CopyStateSlot:
    src: int
    dst: int


@dataclass(frozen=True)
class Report:
    """Ask for a ``WorkerReport`` (tests, leak checks)."""


@dataclass(frozen=True)
class Stop:
    """Leave the loop and exit."""


# ---- worker -> rank 0 --------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The worker is up and about to join the process group."""

    rank: int


@dataclass(frozen=True)
class Ready:
    """The worker's shard is loaded and its runner built."""

    rank: int


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    num_used_state_slots: int
    num_steps: int


@dataclass(frozen=True)
class Failed:
    """The worker raised; it exits right after sending this."""

    rank: int
    error: str
