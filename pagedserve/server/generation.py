"""The engine requests behind one HTTP request, and the client connection around them.

One HTTP request fans out to ``n x prompts`` engine requests (choice ``k`` is engine
request ``k``). ``EngineJob`` runs them concurrently and merges their outputs in arrival
order; it is created only after admission, and ``close()`` -- called on every way out of a
route, finished, failed or disconnected -- aborts what still runs, so its blocks and state
slot are free before the engine's next step, and returns the admission.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request as HTTPRequest

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.failures import RequestFailedError
from pagedserve.engine.llm_engine import RequestOutput
from pagedserve.engine.request import Request, SamplingParams, TokenLogprob
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, ClientDisconnected, bad_request

T = TypeVar("T")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_requests(ctx: ServingContext, request_id: str, prompts: list[list[int]], n: int,
                  params_for: Callable[[list[int], int], SamplingParams],
                  param: str) -> list[Request]:
    """Validated engine requests, ``n`` per prompt: choice ``p * n + i`` is choice ``i`` of
    prompt ``p``. ``params_for(prompt_ids, i)`` gives its sampling parameters."""
    reqs = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            params = params_for(ids, i)
            try:
                reqs.append(ctx.engine.make_request(f"{request_id}-{p * n + i}", ids, params))
            except ValueError as exc:
                raise bad_request(str(exc), param=param) from None
    return reqs


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="request_failed")
    return APIError(500, f"internal error: {exc!r}", code="internal_error")


class EngineJob:
    """Engine requests run concurrently, their outputs merged as ``(choice, output)``."""

    def __init__(self, ctx: ServingContext, requests: list[Request]) -> None:
        ctx.admission.admit(len(requests))  # raises 429/503/400 before anything starts
        self.ctx = ctx
        self.requests = requests
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finished = [False] * len(requests)
        self._closed = False
        self._tasks = [asyncio.create_task(self._pump(k, r)) for k, r in enumerate(requests)]

    async def _pump(self, k: int, req: Request) -> None:
        waiting_first = True
        try:
            async for out in self.ctx.engine.generate(req):
                if waiting_first and out.new_token_ids:
                    waiting_first = False
                    self.ctx.metrics.on_first_token(req)
                if out.finished:
                    self._finished[k] = True
                    self.ctx.metrics.on_finished(req, out.finish_reason or "abort")
                self._queue.put_nowait((k, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, who reports it
            self._finished[k] = True
            self._queue.put_nowait((k, exc))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every output of every choice, in arrival order, until all have finished."""
        remaining = len(self.requests)
        while remaining:
            k, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise _as_api_error(item)
            yield k, item
            if item.finished:
                remaining -= 1

    def num_cached_tokens(self, n: int) -> int:
        """Prompt tokens found in the prefix cache, over the prompts (``n`` choices each:
        a prompt counts its best choice, as its tokens count once)."""
        reqs = self.requests
        return sum(max(r.num_cached_tokens for r in reqs[i:i + n])
                   for i in range(0, len(reqs), n))

    def close(self) -> None:
        """Abort unfinished requests and return the admission (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for k, (req, task) in enumerate(zip(self.requests, self._tasks)):
            if not self._finished[k]:
                task.cancel()
                # Directly too: takes effect before the next step even if the task has not
                # yet run its cancellation.
                self.ctx.engine.abort(req.request_id)
                self.ctx.metrics.on_finished(req, "abort")
        self.ctx.admission.release(len(self.requests))


@dataclass
class ChoiceResult:
    """One choice, complete."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


async def collect(job: EngineJob) -> list[ChoiceResult]:
    """Run ``job`` to the end (non-streaming). Text is the concatenation of the streamed
    pieces, so both response modes carry the same text by construction."""
    results = [ChoiceResult() for _ in job.requests]
    async for k, out in job.outputs():
        r = results[k]
        r.text += out.new_text
        r.token_ids.extend(out.new_token_ids)
        r.logprobs.extend(out.new_logprobs)
        if out.finished:
            r.finish_reason = out.finish_reason
    if any(r.finish_reason == "abort" for r in results):
        raise APIError(503, "the server is shutting down; the request was aborted",
                       code="shutting_down")
    return results


async def _wait_for_disconnect(request: HTTPRequest) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T:
    """Await ``work``, or raise ``ClientDisconnected`` (cancelling it) if the client leaves
    first: a non-streaming request must not keep generating for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled itself (forced shutdown)
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientDisconnected()
