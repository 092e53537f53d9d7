"""ASGI guards around the whole app: the request-size limit and the last-resort 500.

``BodyLimit`` answers 413 to a body over ``max_bytes``: at once when ``Content-Length``
says so (nothing is read), otherwise as soon as the bytes received pass the limit, so an
oversized body is never held in memory. ``CatchAll`` turns any exception that escapes a
route into an OpenAI-style (or, under ``/v1/messages``, Anthropic-style) JSON 500 and logs
it; once a response has started, the connection is closed instead.

Default limit, ``default_max_request_bytes``: ``max_model_len x 8`` bytes (a token id in
a JSON list, or a token's text escaped, stays under 8 bytes) plus 4 MiB for everything
else a body may hold (messages' framing, tools, schemas).
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import APIError, error_response

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 8
BODY_OVERHEAD_BYTES = 4 * 1024 * 1024


def default_max_request_bytes(max_model_len: int) -> int:
    return max_model_len * BYTES_PER_TOKEN + BODY_OVERHEAD_BYTES


def too_large(max_bytes: int, seen: int | str) -> str:
    return (f"the request body is {seen} bytes, over this server's limit of {max_bytes} "
            "(--max-request-bytes)")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            exc = APIError(413, too_large(self.max_bytes, int(declared)),
                           code="request_too_large")
            await error_response(scope["path"], exc)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException from body reading as it is; the
                    # app's handler answers it in the route's error shape.
                    raise HTTPException(413, too_large(self.max_bytes,
                                                       f"more than {self.max_bytes}"))
            return message

        await self.app(scope, counted, send)


class CatchAll:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the last resort: every error is answered
            log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"),
                      exc_info=exc)
            if started:
                return  # the status has gone out; ending the response is all that is left
            error = APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                             code="internal_error")
            await error_response(scope["path"], error)(scope, receive, send)
