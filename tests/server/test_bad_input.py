"""Bad input over raw HTTP: every case gets an OpenAI-shaped 4xx naming the problem, and the
server keeps serving. The server has a 64-token context so over-long prompts are cheap."""

from __future__ import annotations

import httpx
import pytest
from server_harness import client, running

MAX_LEN = 64
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-model-len", str(MAX_LEN), "--max-num-seqs", "4")) as s:
        yield s


# (route, body, status, param, words the message must contain)
CASES = {
    "malformed json": (CMPL, b'{"prompt": "x",', 400, None, ["not valid JSON"]),
    "body not an object": (CMPL, b"[1, 2]", 400, None, ["JSON object"]),
    "no body": (CMPL, b"", 400, None, []),
    "missing prompt": (CMPL, {"max_tokens": 3}, 400, "prompt", ["missing", "prompt"]),
    "missing messages": (CHAT, {"max_tokens": 3}, 400, "messages", ["missing", "messages"]),
    "missing role": (CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role",
                     ["role"]),
    "max_tokens string": (CMPL, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens",
                          ["integer", "'10'"]),
    "temperature string": (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature",
                           ["number", "'hot'"]),
    "prompt a number": (CMPL, {"prompt": 5}, 400, "prompt", ["string", "token ids"]),
    "prompt mixed list": (CMPL, {"prompt": [1, "a"]}, 400, "prompt", ["token ids"]),
    "messages a string": (CHAT, {"messages": "hi"}, 400, "messages", ["list"]),
    "stream not a bool": (CMPL, {"prompt": "x", "stream": "yes"}, 400, "stream", ["boolean"]),
    "n fractional": (CMPL, {"prompt": "x", "n": 1.5}, 400, "n", ["integer"]),
    "max_tokens zero": (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
                        ["greater than or equal to 1", "got 0"]),
    "max_tokens negative": (CMPL, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens",
                            ["got -5"]),
    "max_completion_tokens zero": (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens", ["got 0"]),
    "negative temperature": (CMPL, {"prompt": "x", "temperature": -0.5}, 400, "temperature",
                             ["greater than or equal to 0", "-0.5"]),
    "top_p zero": (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", ["greater than 0"]),
    "top_p above one": (CHAT, {"messages": USER, "top_p": 1.5}, 400, "top_p",
                        ["less than or equal to 1", "1.5"]),
    "n zero": (CMPL, {"prompt": "x", "n": 0}, 400, "n", ["greater than or equal to 1"]),
    "logprobs too many": (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs", ["20"]),
    "prompt too long": (CMPL, {"prompt": "x" * 100}, 400, "prompt", ["100", str(MAX_LEN)]),
    "chat too long": (CHAT, {"messages": [{"role": "user", "content": "y" * 80}]}, 400,
                      "messages", [str(MAX_LEN), "tokens"]),
    "token id out of vocab": (CMPL, {"prompt": [1, 99999]}, 400, "prompt", ["99999", "384"]),
    "empty prompt": (CMPL, {"prompt": ""}, 400, "prompt", ["empty"]),
    "empty prompt list": (CMPL, {"prompt": []}, 400, "prompt", ["empty"]),
    "empty stop string": (CMPL, {"prompt": "x", "stop": [""]}, 400, None, ["stop"]),
    # Every field bounded, nothing silently dropped (issue 32).
    "unknown field": (CMPL, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate",
                      ["'frobnicate'", "not a supported field"]),
    "unknown chat field": (CHAT, {"messages": USER, "echo": True}, 400, "echo", ["'echo'"]),
    "unknown tokenize field": ("/tokenize", {"prompt": "x", "foo": []}, 400, "foo",
                               ["'foo'"]),
    "prompt_logprobs too many": (CMPL, {"prompt": "x", "prompt_logprobs": 21}, 400,
                                 "prompt_logprobs", ["20"]),
    "chat prompt_logprobs streamed": (CHAT, {"messages": USER, "prompt_logprobs": 0,
                                             "stream": True}, 400, None,
                                      ["prompt_logprobs", "stream"]),
    "chat_template": (CHAT, {"messages": USER, "chat_template": "{{ 1 }}"}, 400, None,
                      ["chat_template", "not supported"]),
    "legacy functions": (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, None,
                         ["functions", "tools"]),
    "legacy function_call": (CHAT, {"messages": USER, "function_call": "auto"}, 400, None,
                             ["function_call", "tool_choice"]),
    "stream_options without stream": (CMPL, {"prompt": "x", "stream_options": {
        "include_usage": True}}, 400, None, ["stream_options", "stream: true"]),
    "max_tokens beyond the context": (CMPL, {"prompt": [1, 2, 3], "max_tokens": 62}, 400,
                                      "max_tokens", ["62", str(MAX_LEN), "3 input tokens"]),
    "max_completion_tokens beyond the context": (
        CHAT, {"messages": USER, "max_completion_tokens": 1000}, 400, "max_completion_tokens",
        ["1000", str(MAX_LEN)]),
    "temperature NaN": (CMPL, b'{"prompt": "x", "temperature": NaN}', 400, "temperature",
                        ["finite"]),
    "temperature Infinity": (CMPL, b'{"prompt": "x", "temperature": Infinity}', 400,
                             "temperature", ["finite"]),
    "temperature too high": (CMPL, {"prompt": "x", "temperature": 1e300}, 400, "temperature",
                             ["less than or equal to 100"]),
    "top_k below -1": (CMPL, {"prompt": "x", "top_k": -2}, 400, "top_k", ["-1", "-2"]),
    "seed beyond 64 bits": (CMPL, {"prompt": "x", "seed": 2**64}, 400, "seed",
                            [str(2**64)]),
    "seed below int64": (CMPL, {"prompt": "x", "seed": -(2**63) - 1}, 400, "seed",
                         [str(-(2**63) - 1)]),
    "presence_penalty": (CMPL, {"prompt": "x", "presence_penalty": 3}, 400,
                         "presence_penalty", ["2"]),
    "repetition_penalty zero": (CMPL, {"prompt": "x", "repetition_penalty": 0}, 400,
                                "repetition_penalty", ["greater than 0"]),
    "min_tokens negative": (CMPL, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens",
                            ["-1"]),
    "min_tokens over max_tokens": (CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
                                   400, None, ["min_tokens", "max_tokens=2"]),
    "n too large": (CMPL, {"prompt": "x", "n": 129}, 400, "n", ["128"]),
    "best_of zero": (CMPL, {"prompt": "x", "best_of": 0}, 400, "best_of", ["1"]),
    "top_logprobs too many": (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21},
                              400, "top_logprobs", ["20"]),
    "huge integer": (CMPL, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400,
                     None, []),
    "continue with generation prompt": (CHAT, {"messages": USER,
                                               "continue_final_message": True}, 400, None,
                                        ["continue_final_message", "add_generation_prompt"]),
    # Lone surrogates (issue 32): a 400 naming the field, never a text/plain 500.
    "surrogate in prompt": (CMPL, b'{"prompt": "a\\ud800b"}', 400, "prompt",
                            ["prompt", "not valid Unicode"]),
    "surrogate in a prompt list": (CMPL, b'{"prompt": ["ok", "\\udfff"]}', 400, "prompt[1]",
                                   ["prompt[1]"]),
    "surrogate in chat content": (
        CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
        "messages[0].content", ["messages[0].content", "not valid Unicode"]),
    "surrogate in a stop string": (CMPL, b'{"prompt": "x", "stop": ["\\ud800"]}', 400,
                                   "stop[0]", ["stop[0]"]),
    "surrogate in a key": (CMPL, b'{"prompt": "x", "\\ud800": 1}', 400, "body", []),
    "surrogate in model": (CMPL, b'{"prompt": "x", "model": "\\ud800"}', 400, "model", []),
    "surrogate in tokenize": ("/tokenize", b'{"prompt": "a\\ud800b"}', 400, "prompt",
                              ["not valid Unicode"]),
    "logit_bias key not an id": (CHAT, {"messages": USER, "logit_bias": {"a": 5}}, 400,
                                 "logit_bias", ["logit_bias", "'a'", "[0, "]),
    "logit_bias id past the vocabulary": (CMPL, {"prompt": "x", "logit_bias": {"999999": 1}},
                                          400, "logit_bias", ["'999999'", "[0, "]),
    "logit_bias value out of range": (CMPL, {"prompt": "x", "logit_bias": {"3": 100.5}},
                                      400, None, ["logit_bias", "100.5", "[-100, 100]"]),
    "tool without its function": (CHAT, {"messages": USER, "tools": [{"type": "function"}]},
                                  400, "tools[0].function", ["missing", "tools[0].function"]),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content",
                      ["'text'"]),
    "unknown model": (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model",
                      ["gpt-4", "qwen3.5-tiny-random-v2"]),
    "unknown model chat": (CHAT, {"messages": USER, "model": "nope"}, 404, "model", ["nope"]),
    "tokenize both inputs": ("/tokenize", {"prompt": "x", "messages": USER}, 400, None,
                             ["exactly one"]),
    "detokenize out of vocab": ("/detokenize", {"tokens": [-1]}, 400, "tokens", ["-1"]),
    # Routers' engine switches are accepted at their defaults only.
    "skip_special_tokens false": (CMPL, {"prompt": "x", "skip_special_tokens": False}, 400,
                                  "skip_special_tokens", ["skip_special_tokens", "True"]),
    "no_stop_trim true": (CMPL, {"prompt": "x", "no_stop_trim": True}, 400, "no_stop_trim",
                          ["no_stop_trim"]),
    "separate_reasoning false": (CHAT, {"messages": USER, "separate_reasoning": False}, 400,
                                 "separate_reasoning", ["separate_reasoning"]),
    "include_reasoning on completions": (CMPL, {"prompt": "x", "include_reasoning": True}, 400,
                                         "include_reasoning", ["include_reasoning"]),
}

# What vllm-router and sglang-router add to every body they forward (their engines' own
# switches, at their defaults).
ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True,
                 "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {**ROUTER_FIELDS, "separate_reasoning": True, "stream_reasoning": True,
                      "include_reasoning": True}


def test_router_fields_at_their_defaults_are_accepted(server):
    cmpl = httpx.post(server.url + CMPL, json={"prompt": "x", "max_tokens": 2,
                                               **ROUTER_FIELDS})
    chat = httpx.post(server.url + CHAT, json={"messages": USER, "max_tokens": 2,
                                               **ROUTER_CHAT_FIELDS})
    assert cmpl.status_code == 200, cmpl.text
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_an_openai_error(server, case):
    route, body, status, param, words = CASES[case]
    if isinstance(body, bytes):
        resp = httpx.post(server.url + route, content=body,
                          headers={"Content-Type": "application/json"})
    else:
        resp = httpx.post(server.url + route, json=body)
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"


def test_unknown_route_and_method(server):
    resp = httpx.get(server.url + "/v1/nothing")
    assert resp.status_code == 404 and "error" in resp.json()
    resp = httpx.get(server.url + CMPL)
    assert resp.status_code == 405 and "error" in resp.json()


def test_server_still_answers_after_bad_input(server):
    for body in (b"{", b"[]", b'{"prompt": "x", "max_tokens": 0}'):
        httpx.post(server.url + CMPL, content=body, headers={"Content-Type": "application/json"})
    assert httpx.get(server.url + "/health").status_code == 200
    out = client(server).completions.create(model="qwen3.5-tiny-random-v2", prompt="ok",
                                            max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_chat_default_max_tokens_fills_the_context(server):
    out = client(server).chat.completions.create(
        model="qwen3.5-tiny-random-v2", messages=USER, temperature=0,
        extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == MAX_LEN


def test_completions_default_max_tokens_is_16(server):
    out = client(server).completions.create(model="qwen3.5-tiny-random-v2", prompt="d",
                                            temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16


def test_max_tokens_that_fits_exactly_stops_at_the_context(server):
    out = client(server).completions.create(model="qwen3.5-tiny-random-v2", prompt=[1, 2, 3],
                                            max_tokens=MAX_LEN - 3, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == MAX_LEN


def test_max_tokens_beyond_the_context_is_refused_through_openai(server):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model="qwen3.5-tiny-random-v2", prompt=[1, 2, 3],
                                          max_tokens=MAX_LEN - 2)
    assert "maximum context length is 64" in str(err.value)


def test_logit_bias_through_openai_forces_and_bans_tokens(server):
    """OpenAI's ``logit_bias`` through the official client: +100 all but forces a token,
    -100 bans one, and other requests are untouched."""
    c = client(server)

    def token_ids(**kw) -> list[int]:
        out = c.completions.create(model="qwen3.5-tiny-random-v2", prompt=[5, 6, 7],
                                   max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True, "return_token_ids": True},
                                   **kw)
        return out.choices[0].model_extra["token_ids"]

    plain = token_ids()
    assert token_ids(logit_bias={"65": 100}) == [65] * 6
    banned = token_ids(logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned
    assert token_ids() == plain
