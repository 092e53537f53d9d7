"""Rank 0's side of the worker processes: start them, send them commands, notice when one
has died, and stop them.

Workers are spawned (``multiprocessing``'s spawn start method, which CUDA needs) with one
pipe each. Rank 0 listens on a free port (a ``TCPStore`` bound to port 0) for the process
group's rendezvous, so concurrent engines and test runs do not collide. A worker that dies
or raises surfaces on rank 0 as ``WorkerFailedError`` at its next command, or when a
collective of the step it missed fails, instead of a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from pagedserve.parallel import commands as cmd
from pagedserve.parallel.group import COLLECTIVE_TIMEOUT, TensorParallel, join_group, leave_group
from pagedserve.parallel.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)

# Seconds a worker may take to import, load its shard and build its runner.
START_TIMEOUT = 600.0
STOP_TIMEOUT = 10.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or raised: the engine cannot go on."""


class WorkerGroup:
    """Ranks 1..N-1 as child processes, and rank 0's membership of their group."""

    def __init__(self, processes: list[BaseProcess], conns: list[Connection],
                 tp: TensorParallel) -> None:
        self.processes, self.conns, self.tp = processes, conns, tp
        self._closed = False
        self._threads: int | None = None  # rank 0's torch threads before ``share_cpu``
        self._finalizer = weakref.finalize(self, _stop, processes, conns)

    @classmethod
    def start(cls, size: int, spec: WorkerSpec) -> WorkerGroup:
        """Spawn ranks 1..size-1 and join their group as rank 0."""
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group (a "
                             "tensor-parallel engine is running); close it first")
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=COLLECTIVE_TIMEOUT)
        ctx = mp.get_context("spawn")
        processes: list[BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(1, size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"pagedserve-tp{rank}",
                            args=(rank, size, store.port, spec, child_end))
            p.start()
            child_end.close()
            processes.append(p)
            conns.append(parent_end)
        group = cls(processes, conns, TensorParallel())
        try:
            group._wait_for(cmd.Hello)
            device = torch.device("cuda:0" if spec.device_type == "cuda" else "cpu")
            group.tp = join_group(0, size, store.port, device, store=store)
        except BaseException:
            group.close()
            raise
        return group

    # ---- commands -----------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Send ``message`` to every worker (after checking that each is alive)."""
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError) as exc:
                raise WorkerFailedError(self._why(rank, wait=STOP_TIMEOUT)) from exc

    def wait_ready(self) -> None:
        """Wait until every worker has built its runner."""
        self._wait_for(cmd.Ready)

    def report(self) -> list[cmd.WorkerReport]:
        """Each worker's ``WorkerReport``, after every command sent before."""
        self.send(cmd.Report())
        return self._wait_for(cmd.WorkerReport)

    def check_alive(self) -> None:
        for rank, p in enumerate(self.processes, start=1):
            if not p.is_alive() or self.conns[rank - 1].poll():
                # A worker only speaks when asked, except to say it failed.
                raise WorkerFailedError(self._why(rank, wait=STOP_TIMEOUT))

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Run rank 0's share of a step; if it raises while a worker has died or failed
        (a collective lost its peer), raise ``WorkerFailedError`` saying which and why."""
        try:
            yield
        except Exception as exc:
            deadline = time.monotonic() + STOP_TIMEOUT
            while time.monotonic() < deadline:
                for rank, p in enumerate(self.processes, start=1):
                    if not p.is_alive() or self.conns[rank - 1].poll():
                        raise WorkerFailedError(self._why(rank, wait=STOP_TIMEOUT)) from exc
                if not isinstance(exc, (RuntimeError, dist.DistBackendError)):
                    break
                time.sleep(0.05)
            raise

    def _wait_for(self, kind: type) -> list:
        replies = []
        for rank, conn in enumerate(self.conns, start=1):
            deadline = time.monotonic() + START_TIMEOUT
            while not conn.poll(0.05):
                if not self.processes[rank - 1].is_alive() or time.monotonic() > deadline:
                    raise WorkerFailedError(self._why(rank, wait=1.0))
            try:
                reply = conn.recv()
            except EOFError:  # it exited without a word (killed, or failed to start)
                raise WorkerFailedError(self._why(rank, wait=STOP_TIMEOUT)) from None
            if not isinstance(reply, kind):
                raise WorkerFailedError(self._describe(rank, reply))
            replies.append(reply)
        return replies

    def _why(self, rank: int, wait: float) -> str:
        """Why worker ``rank`` stopped: its ``Failed`` message, else its exit code."""
        conn, p = self.conns[rank - 1], self.processes[rank - 1]
        try:
            if conn.poll(wait):
                return self._describe(rank, conn.recv())
        except (EOFError, OSError):
            pass
        p.join(wait)
        code = p.exitcode
        state = "is not responding" if code is None else f"exited with code {code}"
        return f"tensor-parallel worker rank {rank} (pid {p.pid}) {state}"

    def _describe(self, rank: int, reply: object) -> str:
        if isinstance(reply, cmd.Failed):
            return f"tensor-parallel worker rank {rank} failed:\n{reply.error}"
        return f"tensor-parallel worker rank {rank} sent {reply!r} out of turn"

    def share_cpu(self, threads: int) -> None:
        """Give rank 0 ``threads`` torch threads while the group runs: ranks sharing a
        CPU wait for each other at every collective, and idle OpenMP threads that spin
        take the cores the other ranks need."""
        self._threads = torch.get_num_threads()
        torch.set_num_threads(threads)

    # ---- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (waiting for it, then killing it) and leave the group."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        leave_group()
        if self._threads is not None:
            torch.set_num_threads(self._threads)


def _stop(processes: list[BaseProcess], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send(cmd.Stop())
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.warning("tensor-parallel worker %s did not stop; killing it", p.name)
            p.kill()
            p.join()
    for conn in conns:
        conn.close()


def cpu_threads_per_rank(size: int) -> int:
    """Torch threads for each of ``size`` CPU ranks sharing this machine."""
    return max(1, (os.cpu_count() or 1) // size)
