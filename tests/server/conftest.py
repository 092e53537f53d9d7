"""The server as a real process: one per test module, on a free loopback port.

The embedded default model is written once per session into a temporary
``PAGEDSERVE_CACHE`` that every server shares. Each module's server is stopped with
SIGTERM at the end, and must then exit 0 with no traceback in its log.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.model.default_model import default_model_path
from pagedserve.server.launcher import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))  # server_harness, for the test modules


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("pagedserve-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE", str(cache))
    default_model_path()  # made here once, not raced by the servers
    mp.undo()
    return {"PAGEDSERVE_CACHE": str(cache)}


@pytest.fixture(scope="session")
def launch(tmp_path_factory, serve_env) -> Callable[..., ServerProcess]:
    """``launch(*flags) -> ServerProcess`` (not yet started)."""
    logs = tmp_path_factory.mktemp("server-logs")
    count = iter(range(1000))

    def make(*flags: str) -> ServerProcess:
        return ServerProcess(list(flags), logs / f"serve-{next(count)}.log", env=serve_env,
                             startup_timeout=120)

    return make
