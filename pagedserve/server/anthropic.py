"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The conversation goes through the same chat template and the same output parsing as
``/v1/chat/completions`` (``anthropic_protocol.py`` maps the blocks onto template
messages); the answer comes back as content blocks -- ``thinking``, ``text``, ``tool_use``
-- with ``stop_reason`` ``end_turn``, ``stop_sequence``, ``max_tokens`` or ``tool_use``.
``tool_choice`` ``any`` / ``tool`` is enforced by the grammar, as ``required`` / a named
function is for OpenAI's route. Errors have Anthropic's shape (``errors.py``).

``usage`` has Anthropic's meaning: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those resumed from the prefix cache (the two add up to the
prompt), ``cache_creation_input_tokens`` is 0 (caching needs no request to write it).

Streaming uses Anthropic's events::

    message_start -> (content_block_start, content_block_delta..., content_block_stop)...
    -> message_delta (stop_reason, usage) -> message_stop

one block per kind of output, in the order the output gives them (``thinking_delta``,
``text_delta``, ``input_json_delta`` whose ``partial_json`` pieces add up to the input).
``message_start`` goes out with the first output, once the request has been admitted, so
that its usage already splits the prompt into computed and cached tokens; the usage of
``message_delta`` is cumulative, as Anthropic's is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.engine.request import SamplingParams
from pagedserve.engine.structured import GrammarSpec
from pagedserve.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    template_kwargs,
    template_messages,
    template_tools,
    tool_input,
)
from pagedserve.server.assistant_output import (
    AssistantDelta,
    AssistantMessage,
    AssistantParser,
    OutputFormat,
)
from pagedserve.server.chat import compile_constraint, render_chat_text
from pagedserve.server.constraints import grammar, json_format, tool_call_format
from pagedserve.server.context import ServingContext
from pagedserve.server.errors import APIError, anthropic_error_body, bad_request
from pagedserve.server.generation import EngineJob, make_requests, until_disconnected
from pagedserve.server.reasoning import starts_in_reasoning
from pagedserve.server.sampling import check_context
from pagedserve.server.streaming import EventStreamResponse

router = APIRouter()


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def _prompt(ctx: ServingContext, body: MessagesRequest | CountTokensRequest,
            ) -> tuple[str, dict[str, Any] | None]:
    """The prompt text, and the tools' parameter schemas (``None``: no tools)."""
    choice = getattr(body, "tool_choice", None)
    use_tools = bool(body.tools) and (choice is None or choice.type != "none")
    if use_tools:
        ctx.require_tool_parser()
    text = render_chat_text(ctx, template_messages(body.system, body.messages), True,
                            template_kwargs(body.thinking),
                            template_tools(body.tools) if use_tools else None)
    schemas = {t.name: t.input_schema for t in body.tools or []} if use_tools else None
    return text, schemas


def first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _sampling(ctx: ServingContext, body: MessagesRequest) -> SamplingParams:
    d = ctx.generation
    greedy = 0.0 if d.do_sample is False else None
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=first(body.temperature, greedy, d.temperature, 1.0),
            top_p=first(body.top_p, d.top_p, 1.0), top_k=first(body.top_k, d.top_k, 0),
            min_p=first(d.min_p, 0.0),
            repetition_penalty=first(d.repetition_penalty, 1.0),
            stop=tuple(body.stop_sequences or ()))
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _constraint(body: MessagesRequest, tools: dict[str, Any] | None,
                fmt: OutputFormat) -> tuple[GrammarSpec, str] | None:
    """The grammar of the answer and the field it came from, or ``None``."""
    choice = body.tool_choice
    forcing = choice is not None and choice.type in ("any", "tool") and tools is not None
    schema = body.output_config.format if body.output_config is not None else None
    if forcing and schema is not None:
        raise bad_request("tool_choice and output_config.format each constrain the output; "
                          "send one", param="output_config")
    if schema is not None:
        return grammar(json_format(schema.schema_), fmt), "output_config.format"
    if not forcing:
        return None
    assert choice is not None and tools is not None
    if choice.type == "tool" and choice.name not in tools:
        raise bad_request(f"tool_choice names the tool '{choice.name}', which is not in "
                          f"tools ({list(tools)})", param="tool_choice")
    forced = choice.name if choice.type == "tool" else None
    return grammar(tool_call_format(tools, forced, not choice.disable_parallel_tool_use),
                   fmt), "tool_choice"


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    text, _ = await asyncio.to_thread(_prompt, ctx, body)
    return {"input_tokens": len(await ctx.encode_async(text, "messages"))}


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest,
                         request: Request) -> dict[str, Any] | EventStreamResponse:
    ctx: ServingContext = request.app.state.ctx
    model = body.model or ctx.model_name
    ctx.check_model(body.model)
    text, tools = await asyncio.to_thread(_prompt, ctx, body)
    prompt = await ctx.encode_async(text, "messages")
    check_context(body.max_tokens, len(prompt), ctx.max_model_len)
    parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
    fmt = OutputFormat(reasoning=ctx.reasoning_parser is not None,
                       in_reasoning=starts_in_reasoning(text), tools=tools,
                       parallel_tool_calls=parallel, call_id_prefix="toolu_")
    constraint = _constraint(body, tools, fmt)
    spec = constraint[0] if constraint else None
    if constraint is not None:
        await compile_constraint(ctx, *constraint)
    params = dataclasses.replace(_sampling(ctx, body), structured=spec)
    msg_id = f"msg_{uuid.uuid4().hex[:24]}"
    reqs = await asyncio.to_thread(make_requests, ctx, msg_id, [prompt], 1,
                                   lambda ids, i: params, "messages")
    job = EngineJob(ctx, reqs)
    head = {"id": msg_id, "type": "message", "role": "assistant", "model": model}
    if body.stream:
        return EventStreamResponse(_stream(job, head, fmt, len(prompt)), on_close=job.close)
    try:
        message, reason, stop, num_out = await until_disconnected(request, _collect(job, fmt))
    finally:
        job.close()
    return {**head, "content": content_blocks(message),
            "stop_reason": stop_reason(reason, stop, bool(message.tool_calls)),
            "stop_sequence": stop if isinstance(stop, str) else None,
            "usage": _usage(job, len(prompt), num_out)}


def _usage(job: EngineJob, num_prompt_tokens: int, num_out: int) -> dict[str, int]:
    """Anthropic's usage of ``job``'s one request (after its admission)."""
    cached = job.num_cached_tokens(1)
    return {"input_tokens": num_prompt_tokens - cached, "output_tokens": num_out,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def _collect(job: EngineJob,
                   fmt: OutputFormat) -> tuple[AssistantMessage, str | None, Any, int]:
    parser, message = AssistantParser(fmt), AssistantMessage()
    reason, stop, num_out = None, None, 0
    async for _, out in job.outputs():
        num_out += len(out.new_token_ids)
        message.add(parser.feed(out.new_text))
        if out.finished:
            message.add(parser.finish())
            reason = out.finish_reason
            stop = out.request.stop_reason if out.request is not None else None
    if reason == "abort":
        raise APIError(503, "the server is shutting down; the request was aborted",
                       code="shutting_down")
    return message, reason, stop, num_out


def stop_reason(reason: str | None, stop: Any, has_calls: bool) -> str:
    if reason == "length":
        return "max_tokens"
    if has_calls:
        return "tool_use"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def content_blocks(m: AssistantMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if m.reasoning:
        blocks.append({"type": "thinking", "thinking": m.reasoning, "signature": ""})
    if m.content:
        blocks.append({"type": "text", "text": m.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name,
                "input": tool_input(c.arguments)} for c in m.tool_calls]
    return blocks


class _BlockWriter:
    """Turns a stream of ``AssistantDelta``s into content-block events."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # "thinking", "text" or a tool call's index
        self.num_calls = 0

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self.close()
        self.index += 1
        self.kind = kind
        return events + [_event("content_block_start",
                                {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def write(self, d: AssistantDelta) -> list[bytes]:
        events: list[bytes] = []
        if d.reasoning:
            if self.kind != "thinking":
                events += self._open("thinking", {"type": "thinking", "thinking": "",
                                                  "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            if self.kind != "text":
                events += self._open("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": d.content}))
        for c in d.tool_calls:
            if c.id is not None:
                events += self._open(f"call{c.index}", {
                    "type": "tool_use", "id": c.id, "name": c.name, "input": {}})
                self.num_calls += 1
            if c.arguments:
                events.append(self._delta({"type": "input_json_delta",
                                           "partial_json": c.arguments}))
        return events


async def _stream(job: EngineJob, head: dict[str, Any], fmt: OutputFormat,
                  num_prompt_tokens: int) -> AsyncIterator[bytes]:
    parser, blocks, num_out, started = AssistantParser(fmt), _BlockWriter(), 0, False
    try:
        async for _, out in job.outputs():
            if not started:  # admitted by now: its cached tokens are known
                started = True
                yield _event("message_start", {"message": {
                    **head, "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": _usage(job, num_prompt_tokens, 0)}})
            num_out += len(out.new_token_ids)
            for event in blocks.write(parser.feed(out.new_text)):
                yield event
            if not out.finished:
                continue
            if out.finish_reason == "abort":
                raise APIError(503, "the server is shutting down; the request was aborted",
                               code="shutting_down")
            for event in blocks.write(parser.finish()) + blocks.close():
                yield event
            stop = out.request.stop_reason if out.request is not None else None
            yield _event("message_delta", {
                "delta": {"stop_reason": stop_reason(out.finish_reason, stop,
                                                     blocks.num_calls > 0),
                          "stop_sequence": stop if isinstance(stop, str) else None},
                "usage": _usage(job, num_prompt_tokens, num_out)})
        yield _event("message_stop", {})
    except APIError as exc:
        yield _event("error", {"error": anthropic_error_body(exc)["error"]})
