"""The OpenAI routes through the official ``openai`` client, against a real server process.

Greedy decoding on the embedded model is deterministic whatever shares the batch, so the
tests compare exact text and token counts: streamed vs whole, concurrent vs alone, one
seed vs another.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_harness import async_client, client, get_metrics, metric, running, sse_events

from pagedserve.cli import main as cli_main

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-num-seqs", "8")) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return client(server)


def test_health_and_models(server, oai):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = oai.models.list().data
    assert [m.id for m in models] == ["qwen3.5-tiny-random-v2"]
    assert models[0].max_model_len == 4096


def test_greedy_completion_is_deterministic(oai):
    runs = [oai.completions.create(model="qwen3.5-tiny-random-v2", prompt="The cat",
                                   max_tokens=12, **GREEDY) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    assert runs[0].choices[0].finish_reason == "length"
    assert runs[0].usage.completion_tokens == 12
    assert runs[0].usage.prompt_tokens == len(b"The cat")  # byte-level tokenizer


def test_completion_stream_concatenates_to_whole_text(oai):
    kwargs = dict(model="qwen3.5-tiny-random-v2", prompt="Once upon", max_tokens=10, **GREEDY)
    whole = oai.completions.create(**kwargs)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True},
                                         **kwargs))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 10  # one chunk per generated token
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 9 + ["length"]
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_stream_matches_whole_message(oai):
    # Thinking off: the random model never closes a <think> block, so its whole output
    # would be reasoning (tests/server/test_tools_api.py covers that path).
    kwargs = dict(model="qwen3.5-tiny-random-v2", max_tokens=9,
                  messages=[{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi there"}], temperature=0.0,
                  extra_body={"ignore_eos": True,
                              "chat_template_kwargs": {"enable_thinking": False}})
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = chunks[1:]
    assert len(deltas) == 9
    assert "".join(c.choices[0].delta.content for c in deltas) == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 9


def test_chat_renders_the_models_template(server, oai):
    messages = [{"role": "user", "content": "hi"}]
    tok = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    # The embedded model's template (Qwen3.5's layout), byte for byte.
    expected = [257, *b"user\nhi", 258, 10, 257, *b"assistant\n<think>\n"]
    assert tok["tokens"] == expected
    out = oai.chat.completions.create(model="qwen3.5-tiny-random-v2", messages=messages,
                                      max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == len(expected)


def test_prompt_forms_and_choice_order(server, oai):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "abc"}).json()["tokens"]
    assert ids == list(b"abc")
    by_text = oai.completions.create(model="qwen3.5-tiny-random-v2", prompt=["abc", "xyz"],
                                     n=2, max_tokens=5, **GREEDY)
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    texts = [c.text for c in by_text.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's n agree
    by_ids = oai.completions.create(model="qwen3.5-tiny-random-v2", prompt=ids, max_tokens=5,
                                    **GREEDY)
    assert by_ids.choices[0].text == texts[0]
    batch = oai.completions.create(model="qwen3.5-tiny-random-v2",
                                   prompt=[ids, list(b"xyz")], max_tokens=5, **GREEDY)
    assert [c.text for c in batch.choices] == [texts[0], texts[2]]
    assert by_text.usage.prompt_tokens == 6 and by_text.usage.completion_tokens == 20


def test_n_with_seed_gives_distinct_reproducible_choices(oai):
    kwargs = dict(model="qwen3.5-tiny-random-v2", prompt="Seeds", max_tokens=8,
                  temperature=1.0, top_p=1.0, extra_body={"top_k": 0, "ignore_eos": True})
    first = oai.completions.create(n=3, seed=7, **kwargs)
    again = oai.completions.create(n=3, seed=7, **kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1
    # Choice i samples with seed + i: the same as a lone request with that seed.
    lone = oai.completions.create(n=1, seed=8, **kwargs)
    assert lone.choices[0].text == texts[1]


def test_sixteen_concurrent_requests_match_lone_runs(oai, server):
    prompts = [f"request {i}: " + "z" * (i * 3) for i in range(16)]
    alone = [oai.completions.create(model="qwen3.5-tiny-random-v2", prompt=p, max_tokens=6,
                                    **GREEDY).choices[0].text for p in prompts]

    async def together() -> list[str]:
        aclient = async_client(server)
        outs = await asyncio.gather(*(aclient.completions.create(
            model="qwen3.5-tiny-random-v2", prompt=p, max_tokens=6, **GREEDY) for p in prompts))
        await aclient.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(together()) == alone


def test_stop_string_cuts_the_text(oai):
    kwargs = dict(model="qwen3.5-tiny-random-v2", prompt="Once upon", max_tokens=24, **GREEDY)
    full = oai.completions.create(**kwargs).choices[0].text
    stop = next(ch for ch in full if ch != "\ufffd" and full.index(ch) >= 2)
    out = oai.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop"
    streamed = oai.completions.create(stop=stop, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_completion_logprobs(oai):
    out = oai.completions.create(model="qwen3.5-tiny-random-v2", prompt="Log", max_tokens=6,
                                 logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert sampled <= 0.0
        assert 1 <= len(top) <= 3  # distinct texts of the top 3 (bytes may share "\ufffd")
        assert sampled >= max(top.values()) - 1e-4  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(oai):
    out = oai.chat.completions.create(model="qwen3.5-tiny-random-v2", max_tokens=4,
                                      messages=[{"role": "user", "content": "x"}],
                                      logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0.0 for c in content)


def test_tokenize_detokenize_round_trip(server):
    text = "héllo, wörld"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tok["count"] == len(text.encode()) and tok["max_model_len"] == 4096
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}


def test_metrics_report_requests(server, oai):
    oai.completions.create(model="qwen3.5-tiny-random-v2", prompt="m", max_tokens=3, **GREEDY)
    text = get_metrics(server)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert metric(text, f"pagedserve:{name}_count") >= 1
    assert metric(text, "pagedserve:generation_tokens_total") >= 3
    assert metric(text, "pagedserve:prompt_tokens_total") >= 1
    assert metric(text, "pagedserve:num_preemptions_total") == 0
    assert metric(text, "pagedserve:request_success_total", finished_reason="length") >= 1
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0.0
    assert metric(text, "pagedserve:num_requests_running") == 0


def test_usage_and_metrics_report_cached_prompt_tokens(server, oai):
    model = "qwen3.5-tiny-random-v2"
    prompt = "A prefix worth caching, " * 4  # byte tokens: one per character
    first = oai.completions.create(model=model, prompt=prompt, max_tokens=2, **GREEDY)
    again = oai.completions.create(model=model, prompt=prompt + "again", max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt)  # its prompt's end
    chunks = list(oai.completions.create(model=model, prompt=prompt + "third", max_tokens=2,
                                         stream=True, stream_options={"include_usage": True},
                                         **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= len(prompt)
    messages = [{"role": "user", "content": prompt}]
    kwargs = dict(model=model, max_tokens=2, temperature=0.0, extra_body={"ignore_eos": True})
    chat = [oai.chat.completions.create(messages=messages, **kwargs) for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    # The same messages again: the whole prompt is cached, the answer unchanged.
    assert chat[1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens
    assert chat[1].choices[0].message.content == chat[0].choices[0].message.content
    # A later turn shares the history up to where the template rewrites its last turn; no
    # checkpoint lies there (the history is shorter than one interval), so it leaves one
    # where it leaves the cached chain, and the same turn sent again resumes whole.
    history = messages + [{"role": "assistant", "content": "ok"},
                          {"role": "user", "content": "more"}]
    more = [oai.chat.completions.create(messages=history, **kwargs) for _ in range(2)]
    assert more[1].usage.prompt_tokens_details.cached_tokens == more[1].usage.prompt_tokens
    text = get_metrics(server)
    hits = metric(text, "pagedserve:prefix_cache_hits_total")
    assert hits >= 2 * len(prompt) + chat[1].usage.prompt_tokens + more[1].usage.prompt_tokens
    assert metric(text, "pagedserve:prefix_cache_queries_total") > hits
    assert metric(text, "pagedserve:prefix_checkpoints") > 0
    assert 0 < metric(text, "pagedserve:prefix_checkpoint_usage_perc") <= 1
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0.0  # cached blocks are free


def test_server_info(server):
    info = httpx.get(server.url + "/server_info").json()
    assert info["kv_layout"] == "paged" and info["max_num_seqs"] == 8
    assert info["vocab_size"] == 384 and info["num_blocks"] > 0


def test_bench_serve_quick(server, tmp_path, capsys):
    status = cli_main(["bench", "serve", "--url", server.url, "--quick", "--concurrency", "1,4",
                       "--warmup", "1", "--out-dir", str(tmp_path), "--name", "b"])
    assert status == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    for lv in report["levels"]:
        assert lv["failed"] == 0 and lv["chunk_count_mismatches"] == 0
        assert lv["output_tokens"] == 8 * lv["completed"]
        assert 0 < lv["p50_itl_ms"] <= lv["p99_itl_ms"]
        assert lv["p50_ttft_ms"] > 0 and lv["output_throughput"] > 0
    assert report["server"]["model"] == "qwen3.5-tiny-random-v2"
    assert "| conc |" in (tmp_path / "b.md").read_text()
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert "out tok/s" in capsys.readouterr().out


def test_raw_sse_framing(server):
    body = {"prompt": "raw", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert len({e["id"] for e in events[:-1]}) == 1
