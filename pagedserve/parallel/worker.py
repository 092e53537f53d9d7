"""A tensor-parallel worker: rank r >= 1, one process per device, started by the engine.

It loads its shard, builds its own ``ModelRunner`` (its K/V pool and state slots, its
CUDA graphs), then applies rank 0's commands (``commands.py``) in order until ``Stop``.
It exits when rank 0 closes its pipe or its parent process dies, and reports any
exception to rank 0 (``Failed``) before exiting.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import upload
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import BlockCopy
from pagedserve.model.loader import load_model
from pagedserve.parallel import commands as cmd
from pagedserve.parallel.group import join_group, leave_group


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds alike (from the engine's config)."""

    model: str | None
    device_type: str  # "cpu" or "cuda"; rank r uses cuda:r
    dtype: str | None
    cache_config: CacheConfig
    runner_config: RunnerConfig
    num_threads: int | None = None  # CPU: torch threads per rank


class Worker:
    """Applies rank 0's commands to this rank's runner."""

    def __init__(self, rank: int, runner: ModelRunner, conn: Connection) -> None:
        self.rank, self.runner, self.conn = rank, runner, conn
        self.slots: dict[int, Handle] = {}  # state slot index -> this rank's handle
        self.num_steps = 0

    def serve(self) -> None:
        while True:
            message = self.conn.recv()
            if isinstance(message, cmd.Stop):
                return
            self.apply(message)

    @torch.inference_mode()
    def apply(self, message: object) -> None:
        runner = self.runner
        match message:
            case cmd.Execute():
                runner.execute(upload(message.host(), runner.device))
                self.num_steps += 1
            case cmd.CopyBlocks(src=src, dst=dst):
                runner.copy_blocks([BlockCopy(s, d) for s, d in zip(src, dst)])
            case cmd.AcquireSlot(index=index):
                handle = runner.state_pool.acquire()
                if handle.index != index:
                    raise RuntimeError(f"rank {self.rank} assigned state slot {handle.index} "
                                       f"where rank 0 assigned {index}")
                self.slots[index] = handle
            case cmd.ReleaseSlot(index=index):
                runner.state_pool.release(self.slots.pop(index))
            case cmd.CopyStateSlot(src=src, dst=dst):
                runner.copy_state_slot(src, dst)
            case cmd.Report():
                self.conn.send(cmd.WorkerReport(self.rank, runner.state_pool.num_used_slots,
                                                self.num_steps))
            case _:
                raise TypeError(f"unknown tensor-parallel command {message!r}")


def _exit_with_parent() -> None:
    """End this process when the engine's process is gone, even mid-collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(rank: int, size: int, port: int, spec: WorkerSpec, conn: Connection) -> None:
    """The worker process's entry point (``multiprocessing`` spawn target)."""
    _exit_with_parent()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    device = torch.device(f"cuda:{rank}" if spec.device_type == "cuda" else "cpu")
    try:
        conn.send(cmd.Hello(rank))
        tp = join_group(rank, size, port, device)
        loaded = load_model(spec.model, device, spec.dtype, progress=False, tp=tp,
                            tokenizer=False)
        runner = ModelRunner(loaded.model, spec.cache_config, spec.runner_config)
        conn.send(cmd.Ready(rank))
        Worker(rank, runner, conn).serve()
    except EOFError:  # rank 0 closed its end: the engine is gone
        pass
    except BaseException:  # noqa: BLE001 - rank 0 must hear of it
        try:
            conn.send(cmd.Failed(rank, traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        leave_group()
