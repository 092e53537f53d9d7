"""Tools, reasoning and output constraints through the official ``openai`` client, against a
real server process on the embedded model (random weights: the grammar is what makes its
output well-formed). Oracles: ``jsonschema`` for arguments and JSON answers, ``re`` for
regexes, the byte-level tokenizer for rendered prompts (token ``b`` is byte ``b``).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_harness import client, running

MODEL = "qwen3.5-tiny-random-v2"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "What's the weather?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-num-seqs", "8")) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return client(server)


def chat(oai, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", USER)
    return oai.chat.completions.create(**kw)


def check_calls(calls) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed_calls(chunks) -> tuple[dict[int, dict], list[str]]:
    """Tool calls put together from stream deltas as a client does; the finish reasons."""
    calls: dict[int, dict] = {}
    reasons = []
    for ch in chunks:
        for choice in ch.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name,
                                                  "arguments": ""})
                assert d.id is None or call["id"] == d.id
                call["arguments"] += d.function.arguments or ""
    return calls, reasons


def test_required_tool_call_streams_to_the_whole_result(oai):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200,
              temperature=1.0, seed=3, extra_body=NO_THINKING)
    whole = chat(oai, **kw).choices[0]
    check_calls(whole.message.tool_calls)
    assert len(whole.message.tool_calls) == 1 and whole.finish_reason == "tool_calls"
    assert whole.message.content is None
    calls, reasons = streamed_calls(chat(oai, stream=True, **kw))
    assert reasons == ["tool_calls"]
    got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_named_tool_choice_calls_that_tool(oai):
    for seed in range(3):
        out = chat(oai, tools=TOOLS, max_tokens=200, temperature=1.0, seed=seed,
                   tool_choice={"type": "function", "function": {"name": "get_time"}},
                   extra_body=NO_THINKING).choices[0]
        check_calls(out.message.tool_calls)
        assert [c.function.name for c in out.message.tool_calls] == ["get_time"]


def test_parallel_required_calls_all_validate(oai):
    out = chat(oai, tools=TOOLS, tool_choice="required", max_tokens=400, temperature=1.0,
               seed=11, extra_body=NO_THINKING).choices[0]
    check_calls(out.message.tool_calls)
    assert len({c.id for c in out.message.tool_calls}) == len(out.message.tool_calls)


def prompt_text(server, messages, **extra) -> str:
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, **extra}).json()
    return bytes(t for t in ids["tokens"] if t < 256).decode()


def test_history_forms_render_through_the_template(server):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                     {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = prompt_text(server, messages)
    assert "user\nWeather in Paris?" in text
    assert ("assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n<function=get_weather>"
            "\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n</tool_call>") in text
    assert "user\n<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("assistant\n<think>\n")


def test_tools_are_rendered_in_the_system_turn(oai, server):
    with_tools = chat(oai, tools=TOOLS, max_tokens=1, temperature=0.0)
    plain = chat(oai, max_tokens=1, temperature=0.0)
    added = with_tools.usage.prompt_tokens - plain.usage.prompt_tokens
    assert added > len(json.dumps(TOOLS[0]))  # the tool JSON and the call instructions
    none = chat(oai, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0.0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens


def test_reasoning_fields_whole_and_streamed(oai):
    kw = dict(max_tokens=12, temperature=1.0, seed=9, extra_body={"ignore_eos": True})
    whole = chat(oai, **kw).choices[0].message
    # Thinking is on and the random model never writes </think>: all of it is reasoning.
    assert whole.reasoning_content and whole.reasoning == whole.reasoning_content
    assert whole.content is None
    deltas = [c.choices[0].delta for c in chat(oai, stream=True, **kw) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        whole.reasoning_content
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == whole.reasoning
    off = chat(oai, max_tokens=12, temperature=1.0, seed=9,
               extra_body={"ignore_eos": True, **NO_THINKING}).choices[0].message
    assert off.content and getattr(off, "reasoning_content", None) is None


def test_response_format_json_schema_parses_and_validates(oai):
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "word": {"type": "string", "maxLength": 5}}, "required": ["ok", "n", "word"]}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    kw = dict(response_format=rf, max_tokens=300, temperature=1.0, seed=5,
              extra_body=NO_THINKING)
    whole = chat(oai, **kw).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), schema)
    pieces = [c.choices[0].delta.content or "" for c in chat(oai, stream=True, **kw)
              if c.choices]
    assert "".join(pieces) == whole.message.content


def test_json_object_and_vllm_fields(oai):
    out = chat(oai, response_format={"type": "json_object"}, max_tokens=60, temperature=1.0,
               seed=2, extra_body=NO_THINKING).choices[0]
    # Any object: the random model's keys and strings may run past max_tokens.
    assert out.message.content.lstrip().startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    options = ["red", "green", "blue sky"]
    for extra in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        out = chat(oai, max_tokens=20, temperature=1.0, seed=1,
                   extra_body={**NO_THINKING, **extra}).choices[0]
        assert out.message.content in options
    pattern = r"[a-c]{2,4}-[0-9]{3}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        out = chat(oai, max_tokens=20, temperature=1.0, seed=4,
                   extra_body={**NO_THINKING, **extra}).choices[0]
        assert re.fullmatch(pattern, out.message.content)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "maxItems": 3}
    out = chat(oai, max_tokens=100, temperature=1.0, seed=7,
               extra_body={**NO_THINKING, "guided_json": schema}).choices[0]
    jsonschema.validate(json.loads(out.message.content), schema)


def test_constraint_after_reasoning_leaves_the_thinking_free(oai):
    # Thinking on: the grammar allows any reasoning up to </think>, so the random model
    # keeps thinking and the answer never starts -- but the request is constrained.
    out = chat(oai, max_tokens=10, temperature=1.0, seed=9,
               extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert out.finish_reason == "length" and out.message.reasoning_content
    assert "<think>" not in out.message.reasoning_content


BAD = {
    "unknown tool in tool_choice": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice", ["nope", "get_weather"]),
    "tools of a non-function type": (
        {"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type",
        ["function"]),
    "required without tools": ({"tool_choice": "required"}, "tool_choice", ["tools"]),
    "invalid schema": (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}, "response_format", ["objekt"]),
    "invalid regex": ({"guided_regex": "a(b"}, "guided_regex", ["parenthesis"]),
    "guided_json not JSON": ({"guided_json": "{nope"}, "guided_json", ["not valid JSON"]),
    "two constraints": ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
                        ["guided_regex", "guided_choice"]),
    "unknown structured_outputs field": (
        {"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar",
        ["grammar"]),
    "arguments not JSON in the history": (
        {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {
            "name": "get_weather", "arguments": "{city"}}]}]},
        "messages[1].tool_calls", ["not valid JSON"]),
    "bad tool name": ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
                      "tools[0].function.name", ["pattern"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_400_naming_the_field(server, name):
    extra, param, words = BAD[name]
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **extra}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param
    for word in words:
        assert word in error["message"]
    assert chat(client(server), max_tokens=1).choices  # and the server serves on
