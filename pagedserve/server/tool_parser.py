"""Qwen3.5's tool calls (vLLM's ``qwen3_coder`` format) read out of generated text.

The format, as Qwen3.5's chat template renders a call::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

``ToolCallParser`` reads text as it streams, in pieces of any size, and reports events:
content text, a call's start (its name) and fragments of its arguments as JSON text. A
parameter is reported once its ``</parameter>`` arrives, converted by the tool's JSON schema
(``convert_value``); the fragments of one call concatenate to ``json.dumps(arguments)``.
Whatever it cannot read as a call -- a ``<tool_call>`` not followed by ``<function=NAME>``,
or a name that is not one of the tools -- stays content. Since every decision waits until
the text settles it, the events do not depend on where the pieces were cut: streaming and
whole-text parsing give the same result (``parse_tool_calls`` is ``feed`` + ``finish``).

Layout rules (the template's own): whitespace just before a call and just after one is not
content; a value loses one leading and one trailing newline. At the end of the text, an
open call is closed with the parameters that were complete, except that a parameter whose
``</parameter>`` never came ends at ``</function>`` if that is in it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
MAX_NAME_CHARS = 256  # a function or parameter name longer than this is not one

_TEXT, _HEADER, _PARAMS, _VALUE, _AFTER_CALL = range(5)


@dataclass(frozen=True)
class ContentEvent:
    text: str


@dataclass(frozen=True)
class CallStartEvent:
    index: int
    name: str


@dataclass(frozen=True)
class CallArgumentsEvent:
    index: int
    fragment: str  # JSON text; a call's fragments concatenate to its arguments object


ParserEvent = ContentEvent | CallStartEvent | CallArgumentsEvent


def template_calls_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes calls in this format (the parser's default is on)."""
    return bool(chat_template) and FUNC_OPEN in str(chat_template)


def _holdback(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Incremental parser of one generated message. ``tools``: name -> JSON schema of the
    parameters (``None`` when the tool gives none)."""

    def __init__(self, tools: Mapping[str, dict[str, Any] | None]) -> None:
        self.tools = dict(tools)
        self._buf = ""
        self._state = _TEXT
        self._after_call = False  # drop whitespace at the start of content after a call
        self._held = ""  # raw text of a call being recognized, content if it is not one
        self._num_calls = 0
        self._num_params = 0  # of the open call
        self._name = ""  # the open call's function
        self._param = ""  # the parameter whose value is being read
        self._events: list[ParserEvent] = []

    # ---- public ---------------------------------------------------------------------
    def feed(self, text: str) -> list[ParserEvent]:
        self._buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[ParserEvent]:
        """The end of the text: settle what was waiting for more."""
        while self._step() or self._settle():
            pass
        return self._take()

    def _settle(self) -> bool:
        """One end-of-text decision; False once nothing is left."""
        state, buf = self._state, self._buf
        if state == _VALUE and FUNC_CLOSE in buf:  # a value whose </parameter> never came
            self._end_param(buf[:buf.index(FUNC_CLOSE)])
            self._buf = buf[buf.index(FUNC_CLOSE) + len(FUNC_CLOSE):]
            self._end_call()
            self._state = _AFTER_CALL
            return True
        if state == _HEADER:
            self._content(self._held)
            self._held, self._state = "", _TEXT
            return True
        if state in (_PARAMS, _VALUE):
            self._end_call()
        elif state == _TEXT and not self._after_call:
            self._content(buf)
        self._buf, self._state, self._after_call = "", _TEXT, False
        return False

    # ---- the machine ------------------------------------------------------------------
    def _take(self) -> list[ParserEvent]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if text:
            self._events.append(ContentEvent(text))

    def _step(self) -> bool:
        """Consume what can be decided; False when more text is needed."""
        if self._state == _TEXT:
            return self._step_text()
        if self._state == _HEADER:
            return self._step_header()
        if self._state == _PARAMS:
            return self._step_params()
        if self._state == _VALUE:
            return self._step_value()
        return self._step_after_call()

    def _step_text(self) -> bool:
        buf = self._buf
        if self._after_call:
            stripped = buf.lstrip()
            if not stripped:
                self._buf = ""
                return False
            self._buf, buf, self._after_call = stripped, stripped, False
        i = buf.find(CALL_OPEN)
        if i < 0:
            # Keep back a possible start of a call and the whitespace that would precede it.
            keep = _holdback(buf, CALL_OPEN)
            head = buf[:len(buf) - keep]
            body = head.rstrip()
            self._content(body)
            self._buf = buf[len(body):]
            return False
        before = buf[:i]
        body = before.rstrip()
        self._content(body)
        self._held = before[len(body):] + CALL_OPEN
        self._buf = buf[i + len(CALL_OPEN):]
        self._state = _HEADER
        return True

    def _step_header(self) -> bool:
        rest = self._buf.lstrip()
        if len(rest) < len(FUNC_OPEN) and FUNC_OPEN.startswith(rest):
            return False  # could still become "<function="
        end = rest.find(">") if rest.startswith(FUNC_OPEN) else -1
        if rest.startswith(FUNC_OPEN) and end < 0 and len(rest) <= MAX_NAME_CHARS:
            return False  # the name is still arriving
        name = rest[len(FUNC_OPEN):end].strip() if end >= 0 else ""
        if end < 0 or name not in self.tools:
            # Not a call: its "<tool_call>" is content, and the text after it is read anew.
            self._content(self._held)
            self._held, self._state = "", _TEXT
            return True
        self._held = ""
        self._buf = rest[end + 1:]
        self._events.append(CallStartEvent(self._num_calls, name))
        self._name, self._num_params = name, 0
        self._state = _PARAMS
        return True

    def _step_params(self) -> bool:
        rest = self._buf.lstrip()
        self._buf = rest
        for tag in (PARAM_OPEN, FUNC_CLOSE):
            if rest.startswith(tag):
                break
        else:
            i = min((j for j in (rest.find(PARAM_OPEN), rest.find(FUNC_CLOSE)) if j >= 0),
                    default=-1)
            if i > 0:  # stray text inside the function: not part of any parameter
                self._buf = rest[i:]
                return True
            return False
        if rest.startswith(FUNC_CLOSE):
            self._buf = rest[len(FUNC_CLOSE):]
            self._end_call()
            self._state = _AFTER_CALL
            return True
        end = rest.find(">")
        if end < 0:
            return False
        self._param = rest[len(PARAM_OPEN):end].strip()
        self._buf = rest[end + 1:]
        self._state = _VALUE
        return True

    def _step_value(self) -> bool:
        i = self._buf.find(PARAM_CLOSE)
        if i < 0:
            return False
        self._end_param(self._buf[:i])
        self._buf = self._buf[i + len(PARAM_CLOSE):]
        self._state = _PARAMS
        return True

    def _step_after_call(self) -> bool:
        rest = self._buf.lstrip()
        if len(rest) < len(CALL_CLOSE) and CALL_CLOSE.startswith(rest):
            self._buf = rest
            return False
        self._buf = rest[len(CALL_CLOSE):] if rest.startswith(CALL_CLOSE) else rest
        self._state, self._after_call = _TEXT, True
        return True

    def _end_param(self, raw: str) -> None:
        call = self._num_calls
        schema = self.tools.get(self._name) or {}
        props = schema.get("properties") if isinstance(schema, dict) else None
        value = convert_value(raw, (props or {}).get(self._param))
        lead = "{" if self._num_params == 0 else ", "
        fragment = f"{lead}{json.dumps(self._param, ensure_ascii=False)}: " \
                   f"{json.dumps(value, ensure_ascii=False)}"
        self._events.append(CallArgumentsEvent(call, fragment))
        self._num_params += 1

    def _end_call(self) -> None:
        self._events.append(CallArgumentsEvent(self._num_calls,
                                               "}" if self._num_params else "{}"))
        self._num_calls += 1
        self._num_params = 0


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


def parse_tool_calls(text: str, tools: Mapping[str, dict[str, Any] | None],
                     ) -> tuple[str, list[ParsedCall]]:
    """The content and the calls of a whole message."""
    parser = ToolCallParser(tools)
    content, calls = "", []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ContentEvent):
            content += event.text
        elif isinstance(event, CallStartEvent):
            calls.append(ParsedCall(event.name, ""))
        else:
            calls[event.index].arguments += event.fragment
    return content, calls


# ---- parameter values -----------------------------------------------------------------
_RESTRICTING = ("enum", "const", "pattern", "minLength", "maxLength", "format")
_NO_VALUE = object()


def _types(schema: dict[str, Any]) -> list[str]:
    """The JSON types ``schema`` allows, in its order (``anyOf``/``oneOf`` members too)."""
    kind = schema.get("type")
    types = [kind] if isinstance(kind, str) else [t for t in kind or [] if isinstance(t, str)]
    for key in ("anyOf", "oneOf"):
        for member in schema.get(key) or []:
            if isinstance(member, dict):
                types += [t for t in _types(member) if t not in types]
    return types


def _as_type(text: str, kind: str) -> Any:
    """``text`` read as JSON type ``kind``, or ``_NO_VALUE``."""
    lowered = text.lower()
    if kind == "null":
        return None if lowered in ("null", "none") else _NO_VALUE
    if kind == "boolean":  # "True" too: the template writes Python's str() of a bool
        return {"true": True, "false": False}.get(lowered, _NO_VALUE)
    try:
        value = json.loads(text)
    except ValueError:
        return _NO_VALUE
    if kind == "integer":
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_VALUE
    if kind == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return value if ok else _NO_VALUE
    wanted = {"object": dict, "array": list, "string": str}.get(kind)
    return value if wanted is not None and isinstance(value, wanted) else _NO_VALUE


def _unframe(raw: str) -> str:
    """The template writes ``<parameter=P>``, newline, the value, newline, ``</parameter>``:
    those two newlines are layout."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its JSON schema describes.

    A parameter the tool does not declare stays a string. A string the schema restricts
    (enum, const, pattern, length, format) is read without surrounding whitespace, as
    xgrammar reads it; other strings keep everything but the template's framing newlines.
    Non-string types are tried in the schema's order; text that fits none stays a string.
    """
    text = _unframe(raw)
    if not isinstance(schema, dict):
        return text
    stripped = text.strip()
    options = schema["enum"] if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else None)
    if options is not None:
        if stripped in [o for o in options if isinstance(o, str)]:
            return stripped
        try:
            loaded = json.loads(stripped)
        except ValueError:
            loaded = _NO_VALUE
        for option in options:
            # True == 1 in Python, not in JSON: a bool matches only a bool.
            if not isinstance(option, str) and isinstance(option, bool) == isinstance(
                    loaded, bool) and loaded == option:
                return loaded
    types = _types(schema)
    for kind in types:
        if kind != "string":
            value = _as_type(stripped, kind)
            if value is not _NO_VALUE:
                return value
    if not types and stripped:
        try:
            return json.loads(stripped)
        except ValueError:
            pass
    return stripped if any(k in schema for k in _RESTRICTING) else text
