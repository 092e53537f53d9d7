"""``AsyncEngine``: the engine on a background thread, streaming outputs to asyncio tasks.

The step loop owns the ``LLMEngine`` outright; other threads talk to it only through a
command queue (add, abort) that the loop drains between steps, and receive outputs
through per-request ``asyncio.Queue``s fed with ``call_soon_threadsafe``. An abort
therefore takes effect before the next forward pass: its blocks and slot are free within
one step.

Failures (``failures.py``): a request that fails alone gets ``RequestFailedError`` on its
stream while the loop goes on. An exception that escapes a step is fatal: every open stream
gets ``EngineDeadError``, ``error`` is set, and ``on_fatal`` (if given) is called once from
the loop's thread -- the server exits non-zero from there rather than stay up unable to
serve.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.failures import RequestFailedError, describe
from pagedserve.engine.llm_engine import LLMEngine, RequestOutput
from pagedserve.engine.request import Request, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSnapshot:
    """Gauges and counters published after every step (read by /metrics).

    ``num_used_blocks``, ``num_used_state_slots`` and ``num_live_seqs`` are the pools'
    own accounting: with nothing running or waiting each is 0, or something leaked.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_used_state_slots: int = 0
    num_live_seqs: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which resumed from it
    num_prefix_checkpoints: int = 0  # state checkpoints held
    prefix_checkpoint_capacity: int = 0
    spec_decode_num_drafts: int = 0  # speculative decoding (``engine/spec_step.py``)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class EngineDeadError(RuntimeError):
    """The step loop crashed; no request can make progress."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_fatal = on_fatal
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedserve-engine",
                                        daemon=True)
        self._thread.start()

    # ---- client side (any thread with an event loop) ----------------------------------
    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def make_request(self, request_id: str, prompt: str | list[int],
                     params: SamplingParams) -> Request:
        """Validate now, in the caller's thread: bad input fails before it is queued."""
        return self.engine.make_request(request_id, prompt, params)

    async def generate(self, req: Request) -> AsyncIterator[RequestOutput]:
        """Stream ``req``'s outputs; leaving the iterator early aborts the request."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if req.request_id in self._streams:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            self._streams[req.request_id] = (asyncio.get_running_loop(), stream)
        self._send(("add", req))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(req.request_id, None)
            if not finished:
                self._send(("abort", req.request_id))

    def abort(self, request_id: str) -> None:
        """Abort one request silently (its client has gone: nobody reads its stream)."""
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in the engine; each open stream ends with ``abort``."""
        self._send(("abort_all", None))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort everything in flight, stop the loop, then the engine's workers (if any)."""
        self.abort_all()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.close()

    # ---- engine side (the background thread) ------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("step %.1f ms; last launch: %s",
                              1e3 * (time.perf_counter() - started), self.engine.last_launch)
                for out in outputs:
                    self._deliver(out.request_id, out if out.error is None else
                                  RequestFailedError(f"the request failed: {out.error}"))
                self._publish()
            self._drain_commands()
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            log.critical("engine loop crashed; no request can make progress", exc_info=exc)
            self.error = exc
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(f"the engine stopped: {describe(exc)}"))
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.enqueue(arg)
                except ValueError as exc:
                    self._deliver(arg.request_id, exc)
                except Exception as exc:  # noqa: BLE001 - this request's own set-up
                    out = self.engine.fail_request(arg, exc)
                    self._deliver(arg.request_id, RequestFailedError(
                        f"the request failed: {out.error}"))
            elif kind == "abort":
                self.engine.abort_request(arg)
            elif kind == "abort_all":
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
                    self._deliver(rid, _aborted(rid))
            self._publish()

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the client's loop is closed
                pass

    def _publish(self) -> None:
        e = self.engine
        counts: dict[str, Any] = {**e.prefix_cache_counts(), **e.spec_decode_counts()}
        self.snapshot = EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting,
            kv_cache_usage=e.kv_cache_usage(),
            num_used_blocks=e.kv.pool.num_used_blocks,
            num_used_state_slots=e.runner.state_pool.num_used_slots,
            num_live_seqs=e.kv.num_live_seqs,
            num_preemptions=e.scheduler.num_preemptions,
            num_prompt_tokens=e.stats.num_prompt_tokens,
            num_generation_tokens=e.stats.num_generation_tokens,
            **counts,
        )


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", True, "abort")


def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> bool:
    """Block until nothing runs or waits (tests and shutdown)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.snapshot
        if s.num_running == 0 and s.num_waiting == 0 and engine.num_in_flight == 0:
            return True
        time.sleep(0.01)
    return False
