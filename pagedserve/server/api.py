"""The FastAPI app: routes, auth, error shape, and the engine's lifetime.

Routes::

    POST /v1/completions         completions.py    (auth)
    POST /v1/chat/completions    chat.py           (auth)
    POST /v1/messages, /v1/messages/count_tokens   anthropic.py   (auth)
    GET  /v1/models                                (auth)
    POST /tokenize, /detokenize  tokens.py         (auth)
    GET  /server_info            info.py           (auth)
    GET  /health                 200, or 503 while shutting down or if the engine died
    GET  /metrics                Prometheus text   (open: see auth.py)

The engine thread is started before the app (the model loads before any port is bound);
the app's lifespan stops it when uvicorn shuts down. Around every route (``guards.py``):
bodies over ``max_request_bytes`` get 413, and an exception no handler answers gets a
JSON 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedserve
from pagedserve.server import anthropic, chat, completions, tokens
from pagedserve.server.auth import require_api_key
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, install_error_handlers
from pagedserve.server.guards import BodyLimit, CatchAll, default_max_request_bytes
from pagedserve.server.info import server_info
from pagedserve.server.protocol import ModelCard, ModelList

_info = APIRouter()


@_info.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    ctx: ServingContext = request.app.state.ctx
    root = str(ctx.llm.loaded.path)
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=ctx.max_model_len)
                           for name in ctx.served_model_names])


@_info.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    return server_info(request.app.state.ctx)


_open = APIRouter()


@_open.get("/health")
async def health(request: Request) -> JSONResponse:
    ctx: ServingContext = request.app.state.ctx
    if ctx.engine.error is not None:
        raise APIError(503, f"the engine stopped: {ctx.engine.error!r}", code="engine_dead")
    if not ctx.admission.accepting:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return JSONResponse({"status": "ok"})


@_open.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(ctx: ServingContext, max_request_bytes: int | None = None) -> FastAPI:
    """``max_request_bytes``: the body-size limit (default ``default_max_request_bytes``)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        ctx.begin_shutdown()
        ctx.engine.shutdown()

    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    guarded = [Depends(require_api_key(ctx.api_key))]
    for router in (completions.router, chat.router, anthropic.router, tokens.router, _info):
        app.include_router(router, dependencies=guarded)
    app.include_router(_open)
    limit = max_request_bytes or default_max_request_bytes(ctx.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=limit)
    app.add_middleware(CatchAll)  # added last: outermost, so it also guards BodyLimit
    return app
