"""Generated request bodies against a real server (hypothesis): random types, extreme
numbers, text with lone surrogates and control characters, nested junk -- as whole bodies
and as single fields of otherwise valid requests, on every route that takes a body.

After every case: no 5xx, every error is JSON, and ``/health`` still answers 200 (the
engine is alive). The server runs with a short context and a small queue, so a case that
is valid finishes in well under a second.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import running

MAX_LEN = 64
USER = [{"role": "user", "content": "hi"}]
VALID = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 4},
    "/v1/messages": {"messages": USER, "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": USER},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = [
    "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "n", "best_of", "stop", "stop_token_ids", "stream",
    "stream_options", "logprobs", "top_logprobs", "echo", "ignore_eos", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output",
    "continue_final_message", "add_generation_prompt", "chat_template_kwargs", "tools",
    "tool_choice", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "system", "stop_sequences", "thinking", "output_config", "tokens",
    "model", "suffix", "add_special_tokens", "metadata", "user", "prompt_logprobs",
]
EXTREMES = [0, -1, 1, 2, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
            -(10**30), 1e308, -1e308, 5e-324, 1e-30, 0.5, -0.0, float("nan"), float("inf"),
            -float("inf")]
ODD_CHARS = ["\ud800", "\udfff", "\ud83d", "\x00", "\u2028", "\ufeff", "\U0001f642", "\uffff"]
MARKUP = ["<|im_end|>", "<think>", "</think>", "<tool_call>", "{{", "{%", "%}"]

text = st.one_of(
    st.text(alphabet=st.one_of(st.characters(), st.sampled_from(ODD_CHARS)), max_size=12),
    st.lists(st.sampled_from(MARKUP + ODD_CHARS), max_size=4).map("".join))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(EXTREMES),
                    st.floats(), text)
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)), max_leaves=10)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system",
                                                          "tool", "bot"]),
                                 "content": st.one_of(text, junk)})
field_value = st.one_of(junk, st.lists(message, min_size=1, max_size=3),
                        st.lists(st.sampled_from(EXTREMES), max_size=3))


@st.composite
def cases(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["mutated", "mutated", "junk", "raw"]))
    if kind == "raw":
        return route, draw(st.binary(max_size=64))
    if kind == "junk":
        body = draw(junk)
    else:
        body = dict(VALID[route])
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            body[name] = draw(field_value)
    return route, json.dumps(body, allow_nan=True, ensure_ascii=True).encode()


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-model-len", str(MAX_LEN), "--max-num-seqs", "4",
                        "--max-queue", "4", "--no-access-log")) as s:
        yield s


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_generated_bodies_never_get_a_5xx(server, case):
    route, body = case
    with httpx.stream("POST", server.url + route, content=body, timeout=60,
                      headers={"Content-Type": "application/json"}) as resp:
        payload = resp.read()
    assert resp.status_code < 500, (route, body[:300], payload[:500])
    if resp.status_code >= 400:
        assert resp.headers["content-type"] == "application/json", payload[:300]
        assert "error" in json.loads(payload)
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200, health.text
