"""The server as a real process: one per test module, on a free loopback port.

The servers run the tiny random checkpoint (``model/random_checkpoint.py``), written once
per session into a temporary ``PAGEDSERVE_CACHE`` that every server shares, under its own
name; a module that passes ``--model`` serves that instead. Each module's server is stopped with
SIGTERM at the end, and must then exit 0 with no traceback in its log.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.model.random_checkpoint import NAME as RANDOM_NAME
from pagedserve.model.random_checkpoint import random_model_path
from pagedserve.server.launcher import ServerProcess

sys.path.insert(0, str(Path(__file__).parent))  # server_harness, for the test modules


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("pagedserve-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE", str(cache))
    random_model_path()  # made here once, not raced by the servers
    mp.undo()
    return {"PAGEDSERVE_CACHE": str(cache)}


@pytest.fixture(scope="session")
def launch(tmp_path_factory, serve_env) -> Callable[..., ServerProcess]:
    """``launch(*flags) -> ServerProcess`` (not yet started)."""
    logs = tmp_path_factory.mktemp("server-logs")
    count = iter(range(1000))

    model = ["--model", str(Path(serve_env["PAGEDSERVE_CACHE"]) / RANDOM_NAME),
             "--served-model-name", RANDOM_NAME]

    def make(*flags: str) -> ServerProcess:
        args = list(flags) if "--model" in flags else [*model, *flags]
        return ServerProcess(args, logs / f"serve-{next(count)}.log", env=serve_env,
                             startup_timeout=120)

    return make
