"""``pagedserve serve``: the OpenAI-compatible HTTP server.

Start-up order, so that every mistake fails before the port is bound: check the flags
(and that the port is free), build the engine (load the model, size the K/V pool), bind
the socket, then serve. The process logs one ``pagedserve ready at http://HOST:PORT | ...``
line once it accepts connections (``--port 0`` picks a free port; the line names it).

On SIGTERM or Ctrl-C: admission closes (new requests get 503), every request in flight is
aborted (streams end with ``finish_reason: "abort"``, non-streaming requests get 503),
uvicorn drains its connections, the engine thread stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from types import FrameType

import uvicorn

from pagedserve.commands.engine_args import add_engine_arguments, engine_config
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.default_model import NAME as DEFAULT_MODEL_NAME
from pagedserve.server.api import create_app
from pagedserve.server.context import ServingContext
from pagedserve.server.info import ready_line

HELP = "serve the OpenAI-compatible HTTP API (default: the embedded model)"
DEFAULT_MAX_QUEUE = 1024
API_KEY_ENV = "PAGEDSERVE_API_KEY"

log = logging.getLogger("pagedserve.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; "
                        "/health and /metrics stay open)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use as 'model' (default: --model, or the embedded "
                        "model's name)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait beyond --max-num-seqs running; more get 429 "
                        f"(default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to drain connections after SIGTERM before closing them")
    p.add_argument("--reasoning-parser", default="auto", choices=("auto", "none", "qwen3"),
                   help="split <think> blocks into reasoning_content (default auto: qwen3 "
                        "when the chat template writes <think>)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=("auto", "none", "qwen3_coder"),
                   help="read tool calls out of the output (default auto: qwen3_coder when "
                        "the chat template writes <function=...> calls)")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    add_engine_arguments(p, default_max_num_seqs=16)


def check_server_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.shutdown_timeout <= 0:
        raise ValueError(f"--shutdown-timeout must be > 0, got {args.shutdown_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket for ``host:port``; ``ValueError`` if it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class GracefulServer(uvicorn.Server):
    """uvicorn, with pagedserve's shutdown: abort in-flight work first, then exit 0.

    uvicorn on its own waits for open streams to finish and then re-raises the signal, so
    a SIGTERM'd process dies with status 143; here the signal starts a graceful stop.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServingContext, url: str) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.url = url
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

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def served_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.served_model_name:
        return tuple(args.served_model_name)
    return (args.model or DEFAULT_MODEL_NAME,)


def run(args: argparse.Namespace) -> int:
    check_server_args(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)  # checks every engine flag before the model loads
    # A busy port is reported now, not after minutes of loading a large checkpoint; the
    # probe is released at once, so the port stays unbound until the engine is ready.
    bind_socket(args.host, args.port).close()
    llm = LLMEngine(config)
    ctx = ServingContext.create(llm, served_names(args), max_queue=args.max_queue,
                                api_key=args.api_key, reasoning_parser=args.reasoning_parser,
                                tool_call_parser=args.tool_call_parser)
    try:
        sock = bind_socket(args.host, args.port)
    except ValueError:
        ctx.engine.shutdown()
        raise
    app = create_app(ctx)
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout)
    server = GracefulServer(uv_config, ctx, url_of(sock))
    server.run(sockets=[sock])
    log.info("pagedserve stopped")
    return 0
