"""``TensorParallel``: a rank's place in its tensor-parallel group, and the group's
collectives that the model calls.

With one rank (``SINGLE``) every collective returns its input untouched, so a model built
without tensor parallelism runs exactly the ops it ran before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` ranks; ``group`` is their process group (``None`` for one)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def share(self, total: int) -> range:
        """This rank's contiguous share of ``total`` items (heads, channels, MLP rows);
        ``total`` must be a multiple of ``size`` (``sharding.check_tensor_parallel``)."""
        n = total // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (a row-parallel output's partial sums)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, C]`` on every rank -> ``[N, size * C]``, rank 0's columns first."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value`` (pool sizes that must agree)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()


# Collectives wait this long for a rank before failing (a rank that died mid-step); the
# engine checks its workers' liveness between steps as well (``launch.WorkerGroup``).
COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def join_group(rank: int, size: int, port: int, device: torch.device,
               store: dist.TCPStore | None = None) -> TensorParallel:
    """Join the ``size``-rank group rendezvousing at ``127.0.0.1:port`` (rank 0 passes
    the store it listens on): NCCL on CUDA, gloo on the CPU. One group per process."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                              timeout=COLLECTIVE_TIMEOUT)
    cuda = device.type == "cuda"
    if cuda:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (NVLS)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if cuda else None)
    return TensorParallel(rank, size, dist.group.WORLD)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
