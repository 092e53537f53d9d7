"""``pagedserve serve``: the OpenAI-compatible HTTP server.

Start-up order, so that every mistake fails before the port is bound: check the flags
(and that the port is free), build the engine (load the model, size the K/V pool), bind
the socket, then serve. The process logs one ``pagedserve ready at http://HOST:PORT | ...``
line once it accepts connections (``--port 0`` picks a free port; the line names it).

On SIGTERM or Ctrl-C: admission closes (new requests get 503), every request in flight is
aborted (streams end with ``finish_reason: "abort"``, non-streaming requests get 503),
uvicorn drains its connections, the engine thread stops, and the process exits 0. If the
engine dies instead (``server/graceful.py``), the same stop ends with exit status 1.
Heavy modules (torch, the engine, uvicorn) are imported in ``run``, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from pagedserve.commands.engine_args import add_engine_arguments, engine_config

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
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body; larger ones get 413 (default: max-model-len "
                        "x 8 bytes + 4 MiB, room for the longest prompt that fits)")
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
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")


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


def served_names(args: argparse.Namespace) -> tuple[str, ...]:
    if args.served_model_name:
        return tuple(args.served_model_name)
    from pagedserve.model.default_model import NAME as DEFAULT_MODEL_NAME

    return (args.model or DEFAULT_MODEL_NAME,)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal (exit status 0) or the engine's death (exit status 1)."""
    check_server_args(args)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config(args)  # checks every engine flag before the model loads
    # A busy port is reported now, not after minutes of loading a large checkpoint; the
    # probe is released at once, so the port stays unbound until the engine is ready.
    bind_socket(args.host, args.port).close()
    import uvicorn

    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.api import create_app
    from pagedserve.server.context import ServingContext
    from pagedserve.server.graceful import GracefulServer

    llm = LLMEngine(config)
    ctx = ServingContext.create(llm, served_names(args), max_queue=args.max_queue,
                                api_key=args.api_key, reasoning_parser=args.reasoning_parser,
                                tool_call_parser=args.tool_call_parser)
    try:
        sock = bind_socket(args.host, args.port)
    except ValueError:
        ctx.engine.shutdown()
        raise
    app = create_app(ctx, max_request_bytes=args.max_request_bytes)
    uv_config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log,
                               timeout_graceful_shutdown=args.shutdown_timeout)
    server = GracefulServer(uv_config, ctx, url_of(sock))
    ctx.engine.on_fatal = server.on_engine_fatal
    if ctx.engine.error is not None:  # died before it could be told whom to call
        server.on_engine_fatal(ctx.engine.error)
    server.run(sockets=[sock])
    log.log(logging.CRITICAL if server.exit_code else logging.INFO,
            "pagedserve stopped (exit status %d)", server.exit_code)
    return server.exit_code
