"""The tool-call and reasoning parsers on crafted model outputs.

Expected values are written out by hand from the format (``<tool_call><function=NAME>
<parameter=P>value</parameter></function></tool_call>`` and ``<think>...</think>``).
Streaming is checked by feeding each text one character at a time and in two pieces cut at
every character boundary: the deltas must add up to the whole-text result, which must
equal the hand-written one.
"""

from __future__ import annotations

import json

import pytest

from pagedserve.server.assistant_output import (
    AssistantMessage,
    AssistantParser,
    OutputFormat,
    parse_message,
)
from pagedserve.server.tool_parser import convert_value, parse_tool_calls

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "extra": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "unit": {"enum": ["C", "F"]},
    "level": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}
TOOLS = {"get_weather": WEATHER, "ping": None}


def call(name: str, **params: str) -> str:
    """A call laid out as Qwen3.5's chat template writes one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def streamed(text: str, fmt: OutputFormat, pieces: list[str]) -> AssistantMessage:
    parser, message = AssistantParser(fmt), AssistantMessage()
    for piece in pieces:
        message.add(parser.feed(piece))
    message.add(parser.finish())
    assert "".join(pieces) == text
    return message


def summary(m: AssistantMessage) -> tuple[str, str, list[tuple[str, dict]]]:
    return m.reasoning, m.content, [(c.name, json.loads(c.arguments)) for c in m.tool_calls]


def check_every_split(text: str, fmt: OutputFormat) -> AssistantMessage:
    whole = parse_message(text, fmt)
    expected = summary(whole)
    for m in [streamed(text, fmt, list(text))] + [
            streamed(text, fmt, [text[:i], text[i:]]) for i in range(len(text) + 1)]:
        assert summary(m) == expected
        assert [c.arguments for c in m.tool_calls] == [c.arguments for c in whole.tool_calls]
    return whole


FMT = OutputFormat(tools=TOOLS)
CASES = {
    "every type": (
        "Let me check.\n\n" + call(
            "get_weather", city="Paris\nin France", days="3", temp="-2.5", metric="True",
            extra='{"a": [1, 2]}', tags='["x", 2]', note="None", unit="F", level="7"),
        ("", "Let me check.", [("get_weather", {
            "city": "Paris\nin France", "days": 3, "temp": -2.5, "metric": True,
            "extra": {"a": [1, 2]}, "tags": ["x", 2], "note": None, "unit": "F",
            "level": 7})])),
    "two calls and no content": (
        call("get_weather", city="Oslo") + "\n" + call("ping"),
        ("", "", [("get_weather", {"city": "Oslo"}), ("ping", {})])),
    "text after a call": (
        call("ping") + "\n\nDone.", ("", "Done.", [("ping", {})])),
    "not a function": (
        "<tool_call>\n{\"name\": \"ping\"}\n</tool_call>",
        ("", "<tool_call>\n{\"name\": \"ping\"}\n</tool_call>", [])),
    "unknown function": (
        "a " + call("launch", x="1"), ("", "a " + call("launch", x="1"), [])),
    "truncated in a value": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n4",
        ("", "", [("get_weather", {"city": "Rome"})])),
    "no </parameter> before </function>": (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</function>\n</tool_call>",
        ("", "", [("get_weather", {"days": 2})])),
    "undeclared parameter and a bad integer": (
        call("get_weather", zone="42", days="many"),
        ("", "", [("get_weather", {"zone": "42", "days": "many"})])),
    "a tag that never completes": (
        "price < 5 <tool_ca", ("", "price < 5 <tool_ca", [])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tool_calls(name):
    text, expected = CASES[name]
    assert summary(check_every_split(text, FMT)) == expected


def test_parallel_tool_calls_false_keeps_the_first():
    fmt = OutputFormat(tools=TOOLS, parallel_tool_calls=False)
    text = call("ping") + "\n" + call("get_weather", city="Oslo")
    assert summary(check_every_split(text, fmt)) == ("", "", [("ping", {})])


def test_arguments_are_the_json_of_the_parameters():
    _, calls = parse_tool_calls(call("get_weather", city="Zürich", days="1"), TOOLS)
    assert calls[0].arguments == json.dumps({"city": "Zürich", "days": 1}, ensure_ascii=False)


def test_call_ids_are_distinct_and_prefixed():
    fmt = OutputFormat(tools=TOOLS, call_id_prefix="toolu_")
    m = parse_message(call("ping") + call("ping"), fmt)
    assert [c.id[:6] for c in m.tool_calls] == ["toolu_"] * 2
    assert m.tool_calls[0].id != m.tool_calls[1].id


REASONING = OutputFormat(reasoning=True, in_reasoning=True, tools=TOOLS)
THINK_CASES = {
    "closed block": (REASONING, "Thinking\nhard.\n</think>\n\nThe answer.",
                     ("Thinking\nhard.", "The answer.", [])),
    "opened by the output": (OutputFormat(reasoning=True), "<think>\nhm\n</think>\n\nok",
                             ("hm", "ok", [])),
    "no block at all": (OutputFormat(reasoning=True), "plain <think> text",
                        ("", "plain <think> text", [])),
    "never closed": (REASONING, "\nstill thinking\n", ("still thinking", "", [])),
    "call after an unclosed block": (
        REASONING, "I should look it up.\n" + call("get_weather", city="Lima") + "\n</think>",
        ("I should look it up.", "", [("get_weather", {"city": "Lima"})])),
    "call after the block": (
        REASONING, "plan\n</think>\n\n" + call("ping"), ("plan", "", [("ping", {})])),
    "empty block": (REASONING, "\n</think>\n\nhi", ("", "hi", [])),
}


@pytest.mark.parametrize("name", list(THINK_CASES))
def test_reasoning(name):
    fmt, text, expected = THINK_CASES[name]
    assert summary(check_every_split(text, fmt)) == expected


def test_reasoning_parser_off_leaves_the_text_alone():
    text = "a\n</think>\n\nb"
    assert summary(check_every_split(text, OutputFormat())) == ("", text, [])


@pytest.mark.parametrize("raw, schema, expected", [
    ("\n  spaced  \n", {"type": "string"}, "  spaced  "),
    ("\n  C \n", {"type": "string", "enum": ["C", "F"]}, "C"),
    (" 12 ", {"type": "string", "maxLength": 4}, "12"),
    ("3.0", {"type": "integer"}, 3),
    ("1e3", {"type": "number"}, 1000.0),
    ("false", {"type": "boolean"}, False),
    ("null", {"type": "null"}, None),
    ("[1]", {"type": "object"}, "[1]"),  # not an object: left as text
    ('{"k": 1}', {}, {"k": 1}),  # untyped: JSON when it parses
    ("hello", {}, "hello"),
    ("2", {"enum": ["1", 2]}, 2),
    ("x", None, "x"),
])
def test_convert_value(raw, schema, expected):
    value = convert_value(raw, schema)
    assert value == expected and type(value) is type(expected)
