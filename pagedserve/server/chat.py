"""``POST /v1/chat/completions``: messages rendered with the model's own chat template.

Tools are rendered by the template too (``apply_chat_template(tools=...)``), and the output
is read back by ``assistant_output.py``: ``<think>`` blocks become ``reasoning_content``
(and ``reasoning``, vLLM's newer name), Qwen3.5's XML calls become ``tool_calls`` with
``finish_reason: "tool_calls"``. ``response_format``, ``structured_outputs``, ``guided_*``
and ``tool_choice`` required/named constrain the output by a grammar (``constraints.py``).

Streaming sends, per choice, a role chunk first (``{"role": "assistant", "content": ""}``),
then one delta per generated token -- content, reasoning and ``tool_calls`` pieces (a call's
first piece has its ``id`` and name, later ones ``arguments`` fragments), ``content: ""``
when the token settled nothing yet -- the last carrying ``finish_reason``; then an optional
usage chunk and ``data: [DONE]``. The deltas add up to the non-streamed message.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedserve.engine.request import SamplingParams, TokenLogprob
from pagedserve.engine.structured import GrammarSpec
from pagedserve.server.agent_protocol import (
    DeltaFunction,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
)
from pagedserve.server.assistant_output import (
    AssistantDelta,
    AssistantMessage,
    AssistantParser,
    OutputFormat,
    parse_message,
)
from pagedserve.server.constraints import (
    chat_constraint,
    check_tool_choice,
    tool_schemas,
    tools_enabled,
)
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.generation import (
    EngineJob,
    collect,
    make_requests,
    new_request_id,
    until_disconnected,
)
from pagedserve.server.prompt_logprobs import vllm_prompt_logprobs
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
from pagedserve.server.reasoning import starts_in_reasoning
from pagedserve.server.sampling import (
    build_sampling_params,
    check_context,
    default_max_tokens,
)
from pagedserve.server.streaming import DONE, EventStreamResponse, sse, sse_error

router = APIRouter()

# apply_chat_template's own arguments: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
     "tools", "continue_final_message", "chat_template"})


def render_chat_text(ctx: ServingContext, messages: list[dict[str, Any]],
                     add_generation_prompt: bool, template_kwargs: dict[str, Any] | None,
                     tools: list[dict[str, Any]] | None = None,
                     continue_final_message: bool = False) -> str:
    """The prompt text of ``messages`` (chat-template dicts) under the model's template.
    With ``continue_final_message`` the text ends inside the last message, which the
    output then continues. Pure Python work that may be long: call it off the loop."""
    tokenizer = ctx.require_tokenizer("chat")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved}",
                          param="chat_template_kwargs")
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return str(tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs))
    except Exception as exc:  # noqa: BLE001 - jinja raises many kinds; all are the input's
        raise bad_request(f"the chat template cannot render these messages: {exc}",
                          param="messages") from None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(m.as_template_input())
        except ValueError as exc:
            raise bad_request(str(exc), param=f"messages[{i}].tool_calls") from None
    return out


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


def output_format(ctx: ServingContext, body: ChatCompletionRequest,
                  prompt_text: str) -> OutputFormat:
    tools = tool_schemas(body) if tools_enabled(body) else None
    return OutputFormat(reasoning=ctx.reasoning_parser is not None,
                        in_reasoning=starts_in_reasoning(prompt_text), tools=tools,
                        parallel_tool_calls=body.parallel_tool_calls)


async def compile_constraint(ctx: ServingContext, spec: GrammarSpec, param: str) -> None:
    """Compile (or find cached) ``spec`` off the event loop -- the first use also builds
    the compiler's view of the vocabulary -- and 400 if it is invalid."""
    try:
        await asyncio.to_thread(lambda: ctx.llm.structured.compile(spec))
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(body: ChatCompletionRequest,
                                 request: Request) -> ChatCompletionResponse | Response:
    ctx: ServingContext = request.app.state.ctx
    model = ctx.check_model(body.model)
    check_tool_choice(body)
    tools = None
    if tools_enabled(body):
        ctx.require_tool_parser()
        tools = [t.as_template_input() for t in body.tools or []]
    text = await asyncio.to_thread(
        render_chat_text, ctx, template_messages(body.messages), body.add_generation_prompt,
        body.chat_template_kwargs, tools, body.continue_final_message)
    prompt = await ctx.encode_async(text, "messages")
    check_context(body.requested_max_tokens, len(prompt), ctx.max_model_len,
                  body.max_tokens_param)
    fmt = output_format(ctx, body, text)
    constraint = chat_constraint(body, fmt)
    if constraint is not None:
        await compile_constraint(ctx, *constraint)
    spec = constraint[0] if constraint else None
    defaults = ctx.generation
    max_tokens = body.requested_max_tokens or default_max_tokens(
        defaults, room=ctx.context_limit - len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None

    def params_for(ids: list[int], i: int) -> SamplingParams:
        params = build_sampling_params(body, defaults, max_tokens=max_tokens,
                                       vocab_size=ctx.llm.vocab_size, choice_index=i,
                                       logprobs=logprobs)
        return dataclasses.replace(params, structured=spec)

    rid = new_request_id("chatcmpl")
    reqs = await asyncio.to_thread(make_requests, ctx, rid, [prompt], body.n, params_for,
                                   "messages")
    job = EngineJob(ctx, reqs)
    created = int(time.time())
    if body.stream:
        head = ChatCompletionChunk(id=rid, model=model, created=created, choices=[])
        return EventStreamResponse(_stream(ctx, job, head, body, fmt, len(prompt)),
                                   on_close=job.close)
    try:
        results = await until_disconnected(request, collect(job))
    finally:
        job.close()
    choices = []
    for k, r in enumerate(results):
        message = parse_message(r.text, fmt)
        choices.append(ChatChoice(
            index=k, message=response_message(message),
            finish_reason=finish_reason(r.finish_reason, bool(message.tool_calls)),
            logprobs=chat_logprobs(ctx, r.logprobs) if body.logprobs else None))
    usage = UsageInfo.of(len(prompt), sum(len(r.token_ids) for r in results),
                         job.num_cached_tokens(body.n))
    prompt_logprobs = None
    if body.prompt_logprobs is not None:  # the choices share one prompt
        prompt_logprobs = vllm_prompt_logprobs(ctx, job.requests[0].prompt_logprobs,
                                               body.prompt_logprobs)
    return ChatCompletionResponse(id=rid, model=model, created=created, choices=choices,
                                  usage=usage, prompt_logprobs=prompt_logprobs)


def response_message(m: AssistantMessage) -> ChatResponseMessage:
    reasoning = m.reasoning or None
    content: str | None = m.content
    if not content and (m.tool_calls or reasoning):
        content = None
    return ChatResponseMessage(
        content=content, reasoning_content=reasoning, reasoning=reasoning,
        tool_calls=[ToolCall(id=c.id, function=ToolCallFunction(name=c.name,
                                                                arguments=c.arguments))
                    for c in m.tool_calls])


def delta_message(d: AssistantDelta) -> DeltaMessage:
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                           function=DeltaFunction(name=c.name, arguments=c.arguments))
             for c in d.tool_calls]
    return DeltaMessage(content=d.content if d.content or d.empty else None,
                        reasoning_content=d.reasoning or None, reasoning=d.reasoning or None,
                        tool_calls=calls or None)


async def _stream(ctx: ServingContext, job: EngineJob, head: ChatCompletionChunk,
                  body: ChatCompletionRequest, fmt: OutputFormat,
                  num_prompt_tokens: int) -> AsyncIterator[bytes]:
    def chunk(choice: ChatStreamChoice) -> bytes:
        return sse(head.model_copy(update={"choices": [choice]}))

    parsers = [AssistantParser(fmt) for _ in job.requests]
    has_calls = [False] * len(job.requests)
    num_generated = 0
    try:
        for k in range(len(job.requests)):
            yield chunk(ChatStreamChoice(index=k, delta=DeltaMessage(role="assistant",
                                                                      content="")))
        async for k, out in job.outputs():
            num_generated += len(out.new_token_ids)
            delta = parsers[k].feed(out.new_text)
            if out.finished:
                rest = parsers[k].finish()
                delta = AssistantDelta(delta.reasoning + rest.reasoning,
                                       delta.content + rest.content,
                                       delta.tool_calls + rest.tool_calls)
            has_calls[k] = has_calls[k] or bool(delta.tool_calls)
            yield chunk(ChatStreamChoice(
                index=k, delta=delta_message(delta),
                logprobs=chat_logprobs(ctx, out.new_logprobs) if body.logprobs else None,
                finish_reason=finish_reason(out.finish_reason, has_calls[k])
                if out.finished else None))
        if body.include_usage:
            yield sse(head.model_copy(
                update={"usage": UsageInfo.of(num_prompt_tokens, num_generated,
                                              job.num_cached_tokens(body.n))}))
    except APIError as exc:
        yield sse_error(exc)
    yield DONE
