"""Server-sent events: ``data: {json}\\n\\n`` per chunk, then ``data: [DONE]``.

The routes send one chunk per generated token (its text may be empty while a multi-byte
character or a possible stop string is held back), so a client can time every token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.server.errors import APIError

DONE = b"data: [DONE]\n\n"

# Characters that JSON may carry raw inside a string but that line readers built on
# Python's ``str.splitlines`` (httpx's ``aiter_lines`` among them) take for line breaks:
# NEL and the Unicode line and paragraph separators. A generated token can decode to any
# of them (the JSON encoder already escapes CR, LF and the other controls), so each is
# written as its JSON escape, which decodes to the same string.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                              "\u2029": "\\u2029"})


def sse(payload: BaseModel) -> bytes:
    """One event: ``data: {json}`` and a blank line, with no line break inside the JSON."""
    return b"data: " + payload.model_dump_json().translate(_LINE_BREAKS).encode() + b"\n\n"


def sse_error(error: APIError) -> bytes:
    """An error after the 200 has gone out: reported in the stream, as OpenAI does."""
    return sse(error.body())


class EventStreamResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` when it ends.

    However the stream stops -- finished, client disconnected (Starlette cancels the body
    mid-``await``), or the server forcing connections shut -- the body is closed and
    ``on_close`` runs, so engine requests are aborted at once rather than whenever the
    garbage collector finalizes an abandoned generator.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache",
                                        "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            # The bodies are async generators; Starlette types them as any AsyncIterable.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
