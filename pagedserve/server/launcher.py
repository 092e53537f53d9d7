"""``pagedserve serve`` as a child process, for tests and the serving benchmark.

The child listens on a free port (``--port 0``) and reports it in its ready line; its
output goes to a log file, never to a pipe, so a chatty server cannot block on a full pipe
that nobody reads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagedserve.server.info import READY_PREFIX


class ServerProcess:
    """Start with ``start()`` (returns the base URL), stop with ``stop()`` (SIGTERM)."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 startup_timeout: float = 300.0, program: list[str] | None = None) -> None:
        """``program``: what runs ``serve`` (default ``python -m pagedserve.cli``); tests
        put a wrapper here that patches the engine first."""
        self.program = program or [sys.executable, "-m", "pagedserve.cli"]
        self.args = list(args)
        self.log_path = Path(log_path)
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self) -> str:
        cmd = [*self.program, "serve", "--port", "0", *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            url = self._ready_url()
            if url is not None:
                self.url = url
                return url
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {self.proc.returncode} "
                                   f"before it was ready:\n{self.log_tail()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"pagedserve serve was not ready within {self.startup_timeout} s:"
                           f"\n{self.log_tail()}")

    def _ready_url(self) -> str | None:
        for line in self.log_text().splitlines():
            if READY_PREFIX in line:
                return line.split(READY_PREFIX, 1)[1].split()[0]
        return None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def terminate(self) -> None:
        """Send SIGTERM (graceful stop) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait; kill if it does not exit in time. Returns the exit status."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
