"""Anthropic's Messages API wire format, and its mapping onto the chat template's messages.

Requests: ``system`` (text or text blocks), ``messages`` whose content is text or blocks
(``text``; ``tool_use`` and ``thinking`` from the assistant; ``tool_result`` from the user),
``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``), ``stop_sequences``, ``max_tokens`` (required, as Anthropic
has it), ``thinking`` (``enabled`` / ``disabled`` -> the template's ``enable_thinking``),
``output_config.format`` (a JSON schema the answer must match).
Images, documents and server tools are refused with a 400, and so is any other top-level
field (``request_body.py``). ``top_k`` at or beyond the vocabulary means no top-k.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from pagedserve.server.agent_protocol import FUNCTION_NAME, MAX_NAME_CHARS, MAX_TOOLS
from pagedserve.server.request_body import NestedBody as _Body
from pagedserve.server.request_body import RequestBody


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else \
            "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


ContentBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | \
    ToolResultBlock


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(_Body):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS, pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``format`` constrains the answer to a JSON schema; ``effort`` is a hint that has no
    counterpart here and is accepted as such."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class MessagesRequest(RequestBody):
    """``POST /v1/messages``."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(RequestBody):
    """``POST /v1/messages/count_tokens``: the request without its sampling fields."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    thinking: ThinkingConfig | None = None


def _system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "".join(b.text for b in system)


def _assistant(blocks: list[ContentBlock]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    out: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = thinking
    return out


def _user(blocks: list[ContentBlock]) -> list[dict[str, Any]]:
    """Tool results first (the template groups them into one turn), then the text."""
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
           for b in blocks if isinstance(b, ToolResultBlock)]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def template_messages(system: str | list[TextBlock] | None,
                      messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The conversation as chat-template messages (OpenAI's roles)."""
    out: list[dict[str, Any]] = []
    system_text = _system_text(system)
    if system_text:
        out.append({"role": "system", "content": system_text})
    for m in messages:
        blocks: list[ContentBlock] = [TextBlock(type="text", text=m.content)] \
            if isinstance(m.content, str) else list(m.content)
        if m.role == "assistant":
            out.append(_assistant(blocks))
        else:
            out.extend(_user(blocks))
    return out


def template_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools in OpenAI's function shape, as chat templates expect them."""
    if not tools:
        return None
    return [{"type": "function", "function": {
        k: v for k, v in (("name", t.name), ("description", t.description),
                          ("parameters", t.input_schema)) if v is not None}} for t in tools]


def template_kwargs(thinking: ThinkingConfig | None) -> dict[str, Any]:
    if thinking is None:
        return {}
    return {"enable_thinking": thinking.type != "disabled"}


def tool_input(arguments: str) -> dict[str, Any]:
    value = json.loads(arguments)
    return value if isinstance(value, dict) else {}
