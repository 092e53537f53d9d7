"""One generated assistant message, split into reasoning, content and tool calls.

``AssistantParser`` chains the reasoning parser (``reasoning.py``) and the tool-call parser
(``tool_parser.py``): the text after the reasoning is where calls are looked for. Both chat
APIs use it, OpenAI's (``chat.py``) and Anthropic's (``anthropic.py``), streamed (one
``feed`` per generated piece, ``finish`` at the end) or whole (``parse_message``); the
deltas of a stream add up to the whole message whatever the pieces were.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.reasoning import ReasoningParser
from pagedserve.server.tool_parser import (
    CallStartEvent,
    ContentEvent,
    ParserEvent,
    ToolCallParser,
)


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class AssistantDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class AssistantMessage:
    """A whole message, or the running sum of a stream's deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)

    def add(self, delta: AssistantDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                self.tool_calls.append(ToolCallOut(d.id, d.name or "", ""))
            self.tool_calls[d.index].arguments += d.arguments


@dataclass(frozen=True)
class OutputFormat:
    """How a request's output is read.

    Attributes:
        reasoning: the reasoning parser is on.
        in_reasoning: the prompt leaves the output inside an open ``<think>`` block.
        tools: name -> parameters schema of the tools whose calls are parsed (``None``: no
            call parsing).
        parallel_tool_calls: more than one call may be returned (else only the first).
        call_id_prefix: ``call_`` (OpenAI) or ``toolu_`` (Anthropic).
    """

    reasoning: bool = False
    in_reasoning: bool = False
    tools: Mapping[str, dict[str, Any] | None] | None = None
    parallel_tool_calls: bool = True
    call_id_prefix: str = "call_"


class AssistantParser:
    def __init__(self, fmt: OutputFormat) -> None:
        self.fmt = fmt
        self._reasoning = ReasoningParser(fmt.in_reasoning) if fmt.reasoning else None
        self._tools = ToolCallParser(fmt.tools) if fmt.tools is not None else None

    def feed(self, text: str) -> AssistantDelta:
        if self._reasoning is None:
            return self._split_content("", text, final=False)
        reasoning, content = self._reasoning.feed(text)
        return self._split_content(reasoning, content, final=False)

    def finish(self) -> AssistantDelta:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._split_content(reasoning, content, final=True)

    def _split_content(self, reasoning: str, content: str, final: bool) -> AssistantDelta:
        if self._tools is None:
            return AssistantDelta(reasoning=reasoning, content=content)
        events = self._tools.feed(content)
        if final:
            events += self._tools.finish()
        return self._delta(reasoning, events)

    def _delta(self, reasoning: str, events: list[ParserEvent]) -> AssistantDelta:
        delta = AssistantDelta(reasoning=reasoning)
        for e in events:
            if isinstance(e, ContentEvent):
                delta.content += e.text
                continue
            if e.index > 0 and not self.fmt.parallel_tool_calls:
                continue  # parallel_tool_calls: false returns the first call only
            if isinstance(e, CallStartEvent):
                call_id = f"{self.fmt.call_id_prefix}{uuid.uuid4().hex[:24]}"
                delta.tool_calls.append(ToolCallDelta(e.index, "", id=call_id, name=e.name))
            elif delta.tool_calls and delta.tool_calls[-1].index == e.index:
                delta.tool_calls[-1].arguments += e.fragment
            else:
                delta.tool_calls.append(ToolCallDelta(e.index, e.fragment))
        return delta


def parse_message(text: str, fmt: OutputFormat) -> AssistantMessage:
    """The whole of one generated message."""
    parser = AssistantParser(fmt)
    message = AssistantMessage()
    message.add(parser.feed(text))
    message.add(parser.finish())
    return message
