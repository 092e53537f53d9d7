"""``POST /v1/chat/completions``: messages rendered with the model's own chat template.

Streaming sends, per choice, a role chunk first (``{"role": "assistant", "content": ""}``),
then one content delta per generated token, the last carrying ``finish_reason``; then an
optional usage chunk and ``data: [DONE]``. The deltas concatenate to the non-streamed
``message.content``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.engine.request import TokenLogprob
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.generation import (
    EngineJob,
    collect,
    make_requests,
    new_request_id,
    until_disconnected,
)
from pagedserve.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprobEntry,
    TopLogprob,
    UsageInfo,
)
from pagedserve.server.sampling import build_sampling_params, default_max_tokens
from pagedserve.server.streaming import DONE, EventStreamResponse, sse, sse_error

router = APIRouter()

# apply_chat_template's own arguments: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors"})


def render_chat(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None) -> list[int]:
    """The prompt token ids of ``messages`` under the model's chat template."""
    tokenizer = ctx.require_tokenizer("chat")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}",
                          param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            [m.as_template_input() for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all are the input's
        raise bad_request(f"the chat template cannot render these messages: {exc}",
                          param="messages") from None
    return ctx.encode(text)


def chat_logprobs(ctx: ServingContext, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for lp in logprobs:
        head = top(lp.token_id, lp.logprob)
        content.append(TokenLogprobEntry(**head.model_dump(),
                                         top_logprobs=[top(t, v) for t, v in lp.top]))
    return ChatChoiceLogprobs(content=content)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest,
                                 request: Request) -> ChatCompletionResponse | Response:
    ctx: ServingContext = request.app.state.ctx
    model = ctx.check_model(body.model)
    prompt = render_chat(ctx, body.messages, body.add_generation_prompt,
                         body.chat_template_kwargs)
    defaults = ctx.generation
    max_tokens = body.requested_max_tokens or default_max_tokens(
        defaults, room=ctx.context_limit - len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = new_request_id("chatcmpl")
    reqs = make_requests(
        ctx, rid, [prompt], body.n,
        lambda ids, i: build_sampling_params(body, defaults, max_tokens=max_tokens,
                                             choice_index=i, logprobs=logprobs),
        param="messages")
    job = EngineJob(ctx, reqs)
    created = int(time.time())
    if body.stream:
        head = ChatCompletionChunk(id=rid, model=model, created=created, choices=[])
        return EventStreamResponse(_stream(ctx, job, head, body, len(prompt)),
                                   on_close=job.close)
    try:
        results = await until_disconnected(request, collect(job))
    finally:
        job.close()
    choices = [
        ChatChoice(index=k, message=ChatResponseMessage(content=r.text),
                   finish_reason=r.finish_reason,
                   logprobs=chat_logprobs(ctx, r.logprobs) if body.logprobs else None)
        for k, r in enumerate(results)]
    usage = UsageInfo.of(len(prompt), sum(len(r.token_ids) for r in results))
    return ChatCompletionResponse(id=rid, model=model, created=created, choices=choices,
                                  usage=usage)


async def _stream(ctx: ServingContext, job: EngineJob, head: ChatCompletionChunk,
                  body: ChatCompletionRequest, num_prompt_tokens: int) -> AsyncIterator[bytes]:
    def chunk(choice: ChatStreamChoice) -> bytes:
        return sse(head.model_copy(update={"choices": [choice]}))

    num_generated = 0
    try:
        for k in range(len(job.requests)):
            yield chunk(ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant",
                                                                      content="")))
        async for k, out in job.outputs():
            num_generated += len(out.new_token_ids)
            yield chunk(ChatStreamChoice(
                index=k, delta=DeltaMessage(content=out.new_text),
                logprobs=chat_logprobs(ctx, out.new_logprobs) if body.logprobs else None,
                finish_reason=out.finish_reason if out.finished else None))
        if body.include_usage:
            yield sse(head.model_copy(
                update={"usage": UsageInfo.of(num_prompt_tokens, num_generated)}))
    except APIError as exc:
        yield sse_error(exc)
    yield DONE
