"""API-key auth for ``--api-key``: ``Authorization: Bearer KEY``, or Anthropic's
``x-api-key: KEY``.

Guarded: the OpenAI routes, ``/tokenize``, ``/detokenize`` and ``/server_info``. Open:
``/health`` (load balancers and orchestrators probe it without credentials) and
``/metrics`` (Prometheus scrapes without credentials, as with vLLM; it exposes counts and
latencies, never prompts or outputs). Keep ``/metrics`` on a trusted network, or put a proxy
in front of it, if request rates themselves are sensitive.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from pagedserve.server.errors import APIError

_HINT = "send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"


def require_api_key(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that answers 401 unless the request carries ``api_key``."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization")
        x_api_key = request.headers.get("x-api-key")
        if header is None and x_api_key is None:
            raise APIError(401, f"missing API key: {_HINT}", code="invalid_api_key")
        if header is not None:
            scheme, _, token = header.partition(" ")
            ok = scheme.lower() == "bearer" and _same(token.strip(), api_key)
        else:
            ok = _same(x_api_key.strip(), api_key)  # type: ignore[union-attr]
        if not ok:
            raise APIError(401, f"invalid API key: {_HINT}", code="invalid_api_key")

    return check


def _same(token: str, api_key: str) -> bool:
    # compare_digest: the time taken does not reveal how much of a guess was right.
    return hmac.compare_digest(token.encode(), api_key.encode())
