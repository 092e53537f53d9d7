"""uvicorn with pagedserve's two ways to stop: graceful on a signal, non-zero on engine death.

On SIGTERM / SIGINT: admission closes, every request in flight is aborted, uvicorn drains
its connections, and ``run`` returns with ``exit_code`` 0 (uvicorn on its own re-raises the
signal, so the process would die with 143).

When the engine dies (``AsyncEngine.on_fatal``): the same stop, but ``exit_code`` is 1, so
a supervisor restarts the process instead of leaving it up and unable to serve. A watchdog
ends the process with status 1 if the stop has not finished within the drain timeout plus
``FATAL_EXIT_GRACE_S`` (a wedged device may never let it finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

from pagedserve.server.context import ServingContext
from pagedserve.server.info import ready_line

FATAL_EXIT_CODE = 1
FATAL_EXIT_GRACE_S = 5.0

log = logging.getLogger("pagedserve.serve")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServingContext, url: str) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.url = url
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            log.info(ready_line(self.ctx, self.url))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            log.info("received %s: refusing new requests, aborting those in flight",
                     signal.Signals(sig).name)
            # The handler runs between two bytecodes of the loop thread: defer the work
            # to the loop rather than touching its state from here.
            self._loop.call_soon_threadsafe(self.ctx.begin_shutdown)
        super().handle_exit(sig, frame)

    def on_engine_fatal(self, exc: BaseException) -> None:
        """The engine died (called from its thread): stop serving and exit non-zero."""
        log.critical("the engine died (%s: %s); stopping the server with exit status %d",
                     type(exc).__name__, exc, FATAL_EXIT_CODE)
        self.exit_code = FATAL_EXIT_CODE
        timeout = (self.config.timeout_graceful_shutdown or 0) + FATAL_EXIT_GRACE_S
        threading.Thread(target=_exit_after, args=(timeout,), name="pagedserve-fatal-exit",
                         daemon=True).start()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop)
        else:
            self.should_exit = True

    def _stop(self) -> None:
        self.ctx.begin_shutdown()
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    log.critical("the server did not stop within %.0f s of the engine's death; exiting",
                 seconds)
    logging.shutdown()
    os._exit(FATAL_EXIT_CODE)
