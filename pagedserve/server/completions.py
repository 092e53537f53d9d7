"""``POST /v1/completions``: prompts in, text out, streamed or whole.

Choice ``p * n + i`` is choice ``i`` of prompt ``p``. Logprobs use the legacy completions
format: parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` lists
with one entry per generated token. ``response_format``, ``structured_outputs`` and
``guided_*`` constrain the output as on chat (``constraints.py``). With ``echo`` each
choice's text starts with its prompt (a text prompt as sent, token ids decoded); a stream
sends it as each choice's first chunk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.engine.request import Request as EngineRequest
from pagedserve.engine.request import TokenLogprob
from pagedserve.server.chat import compile_constraint
from pagedserve.server.constraints import completion_constraint
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError
from pagedserve.server.generation import (
    EngineJob,
    collect,
    make_requests,
    new_request_id,
    until_disconnected,
)
from pagedserve.server.prompt_logprobs import (
    echoed_logprobs,
    top_by_text,
    vllm_prompt_logprobs,
)
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
)
from pagedserve.server.sampling import (
    build_sampling_params,
    check_context,
    default_max_tokens,
)
from pagedserve.server.streaming import DONE, EventStreamResponse, sse, sse_error

router = APIRouter()


def completion_logprobs(ctx: ServingContext, logprobs: list[TokenLogprob],
                        start_offset: int) -> CompletionLogprobs:
    """``logprobs`` in the completions format; offsets count from ``start_offset``."""
    out = CompletionLogprobs()
    top_logprobs: list[dict[str, float] | None] = []  # the model's field may be None
    offset = start_offset
    for lp in logprobs:
        token = ctx.token_text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top_logprobs.append(top_by_text(ctx, lp.top))
        out.text_offset.append(offset)
        offset += len(token)
    out.top_logprobs = top_logprobs
    return out


def _prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """How many alternatives the prompt's logprobs need: vLLM's ``prompt_logprobs``, and
    ``logprobs`` when ``echo`` puts the prompt's tokens in the logprobs lists."""
    wanted = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None)
              if n is not None]
    return max(wanted) if wanted else None


@dataclasses.dataclass
class _PromptPart:
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None


def _prompt_part(ctx: ServingContext, body: CompletionRequest, req: EngineRequest,
                 prompt: list[int], generated: CompletionLogprobs) -> _PromptPart:
    """A choice's logprobs lists (``generated``'s, led by the prompt's when echoed) and its
    vLLM-format prompt logprobs, as ``body`` asks."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = (echoed_logprobs(ctx, prompt, req.prompt_logprobs, body.logprobs,
                                    generated) if body.echo else generated)
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(ctx, req.prompt_logprobs, body.prompt_logprobs)
    return _PromptPart(logprobs, prompt_logprobs)


def _prompt_ids(ctx: ServingContext, body: CompletionRequest) -> list[list[int]]:
    # Token ids are checked against the vocabulary by the engine's make_request.
    return [ctx.encode(p) if isinstance(p, str) else p for p in body.prompts()]


def _echo_texts(ctx: ServingContext, body: CompletionRequest) -> list[str]:
    """Each prompt's text, as ``echo`` puts it before the output."""
    return [p if isinstance(p, str) else
            (ctx.tokenizer.decode(p) if ctx.tokenizer is not None else "")
            for p in body.prompts()]


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest,
                            request: Request) -> CompletionResponse | Response:
    ctx: ServingContext = request.app.state.ctx
    model = ctx.check_model(body.model)
    prompts = await asyncio.to_thread(_prompt_ids, ctx, body)
    for ids in prompts:
        check_context(body.max_tokens, len(ids), ctx.max_model_len)
    echo = await asyncio.to_thread(_echo_texts, ctx, body) if body.echo else None
    constraint = completion_constraint(body)
    if constraint is not None:
        await compile_constraint(ctx, *constraint)
    spec = constraint[0] if constraint else None
    defaults = ctx.generation
    max_tokens = body.max_tokens or default_max_tokens(defaults)
    rid = new_request_id("cmpl")
    reqs = await asyncio.to_thread(
        make_requests, ctx, rid, prompts, body.n,
        lambda ids, i: dataclasses.replace(
            build_sampling_params(body, defaults, max_tokens=max_tokens,
                                  vocab_size=ctx.llm.vocab_size, choice_index=i,
                                  logprobs=body.logprobs),
            structured=spec, prompt_logprobs=_prompt_logprobs_wanted(body)),
        "prompt")
    job = EngineJob(ctx, reqs)
    num_prompt_tokens = sum(len(p) for p in prompts)
    created = int(time.time())
    if body.stream:
        events = _stream(ctx, job, CompletionResponse(id=rid, model=model, created=created,
                                                      choices=[]), body, prompts,
                         num_prompt_tokens, echo)
        return EventStreamResponse(events, on_close=job.close)
    try:
        results = await until_disconnected(request, collect(job))
    finally:
        job.close()
    choices = []
    for k, r in enumerate(results):
        head = _prompt_part(ctx, body, job.requests[k], prompts[k // body.n],
                            completion_logprobs(ctx, r.logprobs, 0))
        choices.append(CompletionChoice(
            index=k, text=(echo[k // body.n] if echo else "") + r.text,
            finish_reason=r.finish_reason, logprobs=head.logprobs,
            token_ids=r.token_ids if body.return_token_ids else None,
            prompt_logprobs=head.prompt_logprobs))
    usage = UsageInfo.of(num_prompt_tokens, sum(len(r.token_ids) for r in results),
                         job.num_cached_tokens(body.n))
    return CompletionResponse(id=rid, model=model, created=created, choices=choices,
                              usage=usage)


async def _stream(ctx: ServingContext, job: EngineJob, head: CompletionResponse,
                  body: CompletionRequest, prompts: list[list[int]], num_prompt_tokens: int,
                  echo: list[str] | None) -> AsyncIterator[bytes]:
    """One chunk per generated token; ``head`` carries the id, model and creation time.
    A choice's echoed prompt comes first; with its prompt's logprobs, once they are
    computed (with the choice's first token)."""
    offsets = [0] * len(job.requests)  # text_offset of each choice's next token
    num_generated = 0
    waits = _prompt_logprobs_wanted(body) is not None
    try:
        for k in range(len(job.requests)):
            if echo and not waits:
                yield sse(head.model_copy(update={"choices": [
                    CompletionChoice(index=k, text=echo[k // body.n])]}))
        led = set() if waits else set(range(len(job.requests)))
        async for k, out in job.outputs():
            if k not in led:
                led.add(k)
                part = _prompt_part(ctx, body, job.requests[k], prompts[k // body.n],
                                    CompletionLogprobs())
                if part.logprobs is not None:
                    offsets[k] = sum(len(t) for t in part.logprobs.tokens)
                yield sse(head.model_copy(update={"choices": [CompletionChoice(
                    index=k, text=echo[k // body.n] if echo else "",
                    logprobs=part.logprobs if echo else None,
                    prompt_logprobs=part.prompt_logprobs)]}))
            num_generated += len(out.new_token_ids)
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(ctx, out.new_logprobs, offsets[k])
                offsets[k] += sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(index=k, text=out.new_text, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      token_ids=out.new_token_ids if body.return_token_ids
                                      else None)
            yield sse(head.model_copy(update={"choices": [choice]}))
        if body.include_usage:
            usage = UsageInfo.of(num_prompt_tokens, num_generated,
                                 job.num_cached_tokens(body.n))
            yield sse(head.model_copy(update={"usage": usage}))
    except APIError as exc:
        yield sse_error(exc)
    yield DONE
