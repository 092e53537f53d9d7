"""Bearer-token auth for ``--api-key``.

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

_HINT = "send the header 'Authorization: Bearer <key>'"


def require_api_key(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that answers 401 unless the request carries ``api_key``."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization")
        if header is None:
            raise APIError(401, f"missing API key: {_HINT}", code="invalid_api_key")
        scheme, _, token = header.partition(" ")
        # compare_digest: the time taken does not reveal how much of a guess was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), api_key.encode()):
            raise APIError(401, f"invalid API key: {_HINT}", code="invalid_api_key")

    return check
