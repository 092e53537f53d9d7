"""Anthropic's Messages API through the official ``anthropic`` client, against a real
server process started with ``--api-key`` (the client sends it as ``x-api-key``).

Oracles: the client's own parsing of responses and of its event stream (it rebuilds the
final message from the events), ``jsonschema`` for tool inputs, and the OpenAI route's
``/tokenize`` for the prompt a conversation renders to.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import running

KEY = "test-key-ant"
MODEL = "qwen3.5-tiny-random-v2"
NO_THINKING = {"type": "disabled"}
# Current clients no longer send sampling fields; the server still reads them, and greedy
# decoding makes a stream and a whole response comparable.
GREEDY = {"temperature": 0.0}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}
TOOLS = [{"name": "get_weather", "description": "Weather by city", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
             "required": ["zone"]}}]
CONVERSATION = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
                {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-num-seqs", "8", "--api-key", KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def create(ant, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", CONVERSATION)
    return ant.messages.create(**kw)


def test_message_with_system_and_turns(ant):
    out = create(ant, system="Be brief.", thinking=NO_THINKING, extra_body=GREEDY)
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert [b.type for b in out.content] == ["text"]
    assert out.stop_reason in ("max_tokens", "end_turn")
    count = ant.messages.count_tokens(model=MODEL, system="Be brief.", messages=CONVERSATION,
                                      thinking=NO_THINKING)
    # Anthropic's usage: computed and cached prompt tokens add up to the prompt.
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == count.input_tokens > 0
    assert out.usage.cache_creation_input_tokens == 0


def test_usage_splits_the_prompt_into_computed_and_cached_tokens(ant):
    kw = dict(system="Zebra facts only.", thinking=NO_THINKING, extra_body=GREEDY,
              max_tokens=6)
    count = ant.messages.count_tokens(model=MODEL, system=kw["system"],
                                      messages=CONVERSATION, thinking=NO_THINKING).input_tokens
    first, again = create(ant, **kw), create(ant, **kw)
    assert (first.usage.input_tokens, first.usage.cache_read_input_tokens) == (count, 0)
    # The same prompt again: every prompt token is read from the cache.
    assert (again.usage.input_tokens, again.usage.cache_read_input_tokens) == (0, count)
    assert [b.model_dump() for b in again.content] == [b.model_dump() for b in first.content]
    assert again.usage.output_tokens == first.usage.output_tokens
    with ant.messages.stream(model=MODEL, messages=CONVERSATION, **kw) as stream:
        starts = [e.message.usage for e in stream if e.type == "message_start"]
        final = stream.get_final_message().usage
    assert [(u.input_tokens, u.cache_read_input_tokens, u.output_tokens) for u in starts] \
        == [(0, count, 0)]
    assert (final.input_tokens, final.cache_read_input_tokens, final.output_tokens,
            final.cache_creation_input_tokens) == (0, count, again.usage.output_tokens, 0)


def test_stream_rebuilds_the_whole_message(ant):
    kw = dict(system="Be brief.", thinking=NO_THINKING, extra_body=GREEDY, max_tokens=12)
    whole = create(ant, **kw)
    with ant.messages.stream(model=MODEL, messages=CONVERSATION, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_thinking_comes_back_as_a_thinking_block(ant):
    kw = dict(extra_body={"temperature": 1.0}, max_tokens=10,
              thinking={"type": "enabled", "budget_tokens": 1024})
    out = create(ant, **kw)
    # The random model never closes its thinking: one thinking block.
    assert [b.type for b in out.content] == ["thinking"] and out.content[0].thinking
    with ant.messages.stream(model=MODEL, messages=CONVERSATION, **kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_validates_and_streams(ant, choice):
    kw = dict(tools=TOOLS, tool_choice=choice, thinking=NO_THINKING, extra_body=GREEDY,
              max_tokens=200)
    out = create(ant, **kw)
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses and out.stop_reason == "tool_use"
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    for b in uses:
        assert b.id.startswith("toolu_")
        jsonschema.validate(b.input, schemas[b.name])
    if choice["type"] == "tool":
        assert {b.name for b in uses} == {"get_time"}
    if choice.get("disable_parallel_tool_use"):
        assert len(uses) == 1
    with ant.messages.stream(model=MODEL, messages=CONVERSATION, **kw) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in uses]
    assert final.stop_reason == "tool_use"


def test_tool_result_turns_render_like_the_openai_history(ant, server):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Call it.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "cold"}]}]},
    ]
    count = ant.messages.count_tokens(model=MODEL, messages=messages)
    openai_form = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": openai_form},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert count.input_tokens == tok["count"]
    assert "<tool_response>\ncold\n</tool_response>" in bytes(
        t for t in tok["tokens"] if t < 256).decode()


def test_output_config_format_constrains_the_answer(ant):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}}, "required": ["n"]}
    out = create(ant, thinking=NO_THINKING, max_tokens=100, extra_body=GREEDY,
                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), schema)


def test_stop_sequences_end_the_text(ant):
    kw = dict(thinking=NO_THINKING, extra_body=GREEDY, max_tokens=24)
    text = create(ant, **kw).content[0].text
    stop = next(ch for ch in text[2:] if ch.strip() and ch != "\ufffd")
    out = create(ant, stop_sequences=[stop], **kw)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == text[:text.index(stop)]


def test_errors_have_anthropics_shape(server, ant):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(ant, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "nope" in bad.value.body["error"]["message"]
    missing = httpx.post(server.url + "/v1/messages", json={"messages": CONVERSATION},
                         headers={"x-api-key": KEY})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=CONVERSATION)
    assert auth.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"},
                        json={"max_tokens": 2, "messages": CONVERSATION})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
