"""Issue 32's findings against a real server: every one has a test here or in
test_bad_input.py (bounds, unknown parameters, surrogates, context), test_faults.py (the
engine-loop policy) and tests/unit/test_cli_hardening.py (the CLI). Expected outputs come
from independent runs of the same server (a request run without the parameter), not from
the code under test."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_harness import client, running, sse_events

MAX_LEN = 256
MODEL = "qwen3.5-tiny-random-v2"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LIMIT = MAX_LEN * 8 + 4 * 1024 * 1024  # the documented default --max-request-bytes


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-model-len", str(MAX_LEN), "--max-num-seqs", "4",
                        "--no-access-log")) as s:
        yield s


def post(server, route: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60, **kw)


def completion_text(server, **body) -> str:
    resp = post(server, CMPL, {"prompt": "Once upon", "max_tokens": 12, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


# ---- finding 1: top_k beyond the vocabulary, seeds ---------------------------------------
def test_top_k_beyond_the_vocabulary_means_no_top_k(server):
    sampled = dict(temperature=1.0, seed=7)
    off = completion_text(server, top_k=0, **sampled)
    assert completion_text(server, top_k=2**63, **sampled) == off
    assert completion_text(server, top_k=10**30, **sampled) == off
    assert completion_text(server, top_k=-1, **sampled) == off
    # and top_k within the vocabulary still filters: top-1 is greedy
    assert completion_text(server, top_k=1, **sampled) == completion_text(server, temperature=0)
    assert httpx.get(server.url + "/health").status_code == 200


def test_seeds_span_64_bits_and_map_modulo(server):
    sampled = dict(temperature=1.0, top_k=0)
    assert completion_text(server, seed=-1, **sampled) == \
        completion_text(server, seed=2**64 - 1, **sampled)
    assert completion_text(server, seed=-(2**63), **sampled) == \
        completion_text(server, seed=2**63, **sampled)
    # n choices with a seed at the top of the range wrap rather than overflow
    resp = post(server, CMPL, {"prompt": "x", "max_tokens": 4, "n": 2, "seed": 2**64 - 1,
                               "temperature": 1.0})
    assert resp.status_code == 200, resp.text


def test_tiny_temperature_is_greedy(server):
    assert completion_text(server, temperature=1e-30) == completion_text(server, temperature=0)


# ---- finding 2: surrogates are a 400 on every route -------------------------------------
@pytest.mark.parametrize("route, raw, param", [
    ("/v1/messages", b'{"max_tokens": 4, "messages": [{"role": "user", "content": '
                     b'"a\\ud800"}]}', "messages[0].content"),
    ("/v1/messages/count_tokens", b'{"messages": [{"role": "user", "content": '
                                  b'[{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     "messages[0].content"),
])
def test_surrogates_are_a_400_naming_the_field(server, route, raw, param):
    resp = httpx.post(server.url + route, content=raw,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    message = body["error"]["message"]
    assert param in message and "Unicode" in message
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["param"] == param


def test_anthropic_client_sees_a_bad_request_for_unknown_fields(server):
    ant = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(model=MODEL, max_tokens=4, messages=USER,
                            extra_body={"frobnicate": True})
    assert "frobnicate" in str(err.value)


# ---- finding 3: tokenizing off the event loop -------------------------------------------
def test_health_answers_while_a_huge_prompt_tokenizes(server):
    prompt = "ab " * 400_000  # 1.2 MB: seconds of tokenizing on a CPU
    result: dict = {}

    def send() -> None:
        t0 = time.monotonic()
        result["resp"] = post(server, CMPL, {"prompt": prompt, "max_tokens": 1})
        result["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.3)  # the body is in; tokenizing has begun
    latencies = []
    while worker.is_alive() and len(latencies) < 20:
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - t0)
        time.sleep(0.05)
    worker.join()
    assert result["resp"].status_code == 400  # far over the context, reported as such
    assert "tokens" in result["resp"].json()["error"]["message"]
    assert latencies, f"the huge prompt took only {result['seconds']:.2f} s"
    assert result["seconds"] > 2 * max(latencies)
    assert max(latencies) < 0.5, latencies


# ---- finding 4: the body size limit -----------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    body = json.dumps({"prompt": "a" * (LIMIT + 10)}).encode()
    try:
        resp = httpx.post(server.url + CMPL, content=body, timeout=60,
                          headers={"Content-Type": "application/json"})
    except httpx.TransportError:
        pytest.fail("the server reset the connection instead of answering 413")
    assert resp.status_code == 413, resp.text[:200]
    assert resp.json()["error"]["code"] == "request_too_large"
    assert str(LIMIT) in resp.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(LIMIT // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    resp = httpx.post(server.url + "/v1/messages", content=chunks(), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text[:200]
    assert resp.json()["error"]["type"] == "request_too_large"  # Anthropic's shape
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_body_under_the_limit_is_read(server):
    resp = post(server, "/tokenize", {"prompt": "a" * 100_000})
    assert resp.status_code == 200 and resp.json()["count"] == 100_000


# ---- finding 5: the parameters that are implemented now ---------------------------------
def test_echo_puts_the_prompt_before_the_output(server):
    plain = completion_text(server, temperature=0)
    assert completion_text(server, temperature=0, echo=True) == "Once upon" + plain
    ids = post(server, "/tokenize", {"prompt": "Once upon"}).json()["tokens"]
    resp = post(server, CMPL, {"prompt": ids, "max_tokens": 12, "temperature": 0,
                               "echo": True})
    assert resp.json()["choices"][0]["text"] == "Once upon" + plain
    with httpx.stream("POST", server.url + CMPL, timeout=60, json={
            "prompt": "Once upon", "max_tokens": 12, "temperature": 0, "echo": True,
            "stream": True}) as r:
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == "Once upon" + plain


def test_min_tokens_holds_stop_strings_back(server):
    plain = completion_text(server, temperature=0, ignore_eos=True)
    stop = plain[:2]
    stopped = post(server, CMPL, {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                                  "stop": [stop]}).json()["choices"][0]
    assert stopped["text"] == "" and stopped["finish_reason"] == "stop"
    held = post(server, CMPL, {"prompt": "Once upon", "max_tokens": 12, "temperature": 0,
                               "stop": [stop], "min_tokens": 12, "ignore_eos": True}).json()
    assert held["choices"][0]["finish_reason"] == "length"
    assert held["usage"]["completion_tokens"] == 12


def test_include_stop_str_in_output(server):
    plain = completion_text(server, temperature=0, ignore_eos=True)
    stop = plain[3:5]
    cut = plain.index(stop)
    body = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "stop": [stop]}
    assert post(server, CMPL, body).json()["choices"][0]["text"] == plain[:cut]
    kept = post(server, CMPL, {**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == plain[:cut + len(stop)]
    assert kept["choices"][0]["finish_reason"] == "stop"


def test_continue_final_message_and_add_generation_prompt(server):
    convo = USER + [{"role": "assistant", "content": "Sure, the answer"}]

    def rendered(**flags) -> str:
        ids = post(server, "/tokenize", {"messages": convo, **flags}).json()["tokens"]
        return post(server, "/detokenize", {"tokens": ids}).json()["prompt"]

    assert rendered(add_generation_prompt=False, continue_final_message=True) \
        .endswith("Sure, the answer")
    assert not rendered(add_generation_prompt=False).endswith("Sure, the answer")
    assert rendered(add_generation_prompt=True).count("<|im_start|>assistant") == 2
    out = client(server).chat.completions.create(
        model=MODEL, messages=convo, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(post(server, "/tokenize", {
        "messages": convo, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"])


def test_stream_options_without_stream_through_openai(server):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=2,
                                          stream_options={"include_usage": True})
    assert "stream_options" in str(err.value)


def test_structured_outputs_still_work_on_chat(server):
    resp = post(server, CHAT, {"messages": USER, "max_tokens": 40, "temperature": 0,
                               "structured_outputs": {"choice": ["yes", "no"]},
                               "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] in ("yes", "no")
    resp = post(server, CHAT, {"messages": USER, "max_tokens": 40, "temperature": 0,
                               "guided_choice": ["yes", "no"],
                               "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_structured_outputs_constrain_completions(server):
    for field, value in (("structured_outputs", {"choice": ["alpha", "beta"]}),
                         ("guided_choice", ["alpha", "beta"]),
                         ("guided_regex", "[0-9]{3}")):
        resp = post(server, CMPL, {"prompt": "Pick:", "max_tokens": 10, "temperature": 0,
                                   field: value})
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]
        if field == "guided_regex":
            assert len(text) == 3 and text.isdigit(), text
        else:
            assert text in ("alpha", "beta"), text
    resp = post(server, CMPL, {"prompt": "x", "guided_json": {"type": "object"},
                               "guided_regex": "a"})
    assert resp.status_code == 400 and "at most one" in resp.json()["error"]["message"]
    resp = post(server, CMPL, {"prompt": "x", "guided_regex": "("})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_regex"
