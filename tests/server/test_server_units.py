"""The server's pure parts without a process: admission, sampling defaults, error shape,
the benchmark's workload and statistics; and the app in-process for shutdown's 503s."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
from pathlib import Path

import httpx
import pytest

from pagedserve.bench.client import LevelRun, RequestResult
from pagedserve.bench.stats import percentile, slowest_first_tokens, summarize
from pagedserve.bench.workload import LengthDistribution, Workload
from pagedserve.commands import bench
from pagedserve.engine.request import SamplingParams
from pagedserve.model.generation_defaults import GenerationDefaults
from pagedserve.model.random_checkpoint import NAME as RANDOM_NAME
from pagedserve.server.admission import Admission
from pagedserve.server.errors import APIError, validation_error
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.sampling import build_sampling_params, default_max_tokens

VOCAB = 256  # the sampling fields' checks of token ids read the vocabulary's size


def sampling_params(*args, **kw):
    return build_sampling_params(*args, vocab_size=VOCAB, **kw)


# ---- admission ---------------------------------------------------------------------------
def test_admission_bounds_in_flight_requests():
    a = Admission(max_num_seqs=2, max_queue=1)
    a.admit(2)
    a.admit(1)
    with pytest.raises(APIError) as full:
        a.admit(1)
    assert full.value.status == 429 and "3 requests in flight, at most 3" in full.value.message
    a.release(2)
    a.admit(2)
    with pytest.raises(APIError) as never:
        a.admit(4)
    assert never.value.status == 400
    a.close()
    with pytest.raises(APIError) as closed:
        a.admit(1)
    assert closed.value.status == 503
    a.release(3)
    assert a.num_in_flight == 0
    with pytest.raises(RuntimeError):
        a.release(1)


def test_admission_unbounded_and_invalid():
    a = Admission(max_num_seqs=1, max_queue=None)
    a.admit(10_000)
    with pytest.raises(ValueError, match="max-queue"):
        Admission(1, -1)


# ---- sampling defaults ---------------------------------------------------------------------
def _completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def test_checkpoint_defaults_fill_omitted_fields_only():
    gen = GenerationDefaults(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    p = sampling_params(_completion(), gen, max_tokens=5)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.8, 20, 0.0)
    p = sampling_params(_completion(temperature=0.0, top_p=1.0, top_k=0), gen,
                              max_tokens=5)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)


def test_openai_defaults_without_generation_config():
    p = sampling_params(_completion(stop="x"), GenerationDefaults(), max_tokens=3)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert p.stop == ("x",) and p.max_tokens == 3


def test_do_sample_false_means_greedy_by_default():
    gen = GenerationDefaults(do_sample=False, temperature=0.6)
    assert sampling_params(_completion(), gen, max_tokens=1).temperature == 0.0
    assert sampling_params(_completion(temperature=0.9), gen,
                                 max_tokens=1).temperature == 0.9


def test_seed_offsets_per_choice():
    body = _completion(seed=41, n=3)
    seeds = [sampling_params(body, GenerationDefaults(), max_tokens=1,
                                   choice_index=i).seed for i in range(3)]
    assert seeds == [41, 42, 43]
    assert sampling_params(_completion(), GenerationDefaults(), max_tokens=1).seed is None


def test_seeds_wrap_modulo_2_64_and_top_k_beyond_the_vocabulary_is_off():
    body = _completion(seed=2**64 - 1, top_k=2**63)
    params = [sampling_params(body, GenerationDefaults(), max_tokens=4, choice_index=i)
              for i in range(2)]
    assert [p.seed for p in params] == [2**64 - 1, 0]
    assert sampling_params(_completion(seed=-1), GenerationDefaults(),
                                 max_tokens=4).seed == 2**64 - 1
    assert params[0].top_k_within(vocab_size=1000) == 0
    assert SamplingParams(top_k=5).top_k_within(1000) == 5


def test_default_max_request_bytes_leaves_room_for_the_longest_prompt():
    from pagedserve.server.guards import default_max_request_bytes

    assert default_max_request_bytes(4096) == 4096 * 8 + 4 * 1024 * 1024
    longest_ids = json.dumps({"prompt": [248_000] * 262_143}).encode()
    assert len(longest_ids) < default_max_request_bytes(262_144)


def test_default_max_tokens():
    none = GenerationDefaults()
    assert default_max_tokens(none) == 16  # completions
    assert default_max_tokens(none, room=100) == 100  # chat: the rest of the context
    assert default_max_tokens(none, room=-5) == 1  # reported as too long later
    capped = GenerationDefaults(max_new_tokens=40)
    assert default_max_tokens(capped, room=100) == 40
    assert default_max_tokens(capped) == 16


def test_engine_refusal_becomes_400():
    with pytest.raises(APIError) as err:
        sampling_params(_completion(stop=[""]), GenerationDefaults(), max_tokens=1)
    assert err.value.status == 400 and "stop" in err.value.message


def test_max_completion_tokens_wins():
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
         "max_completion_tokens": 7})
    assert body.requested_max_tokens == 7


# ---- error shape -----------------------------------------------------------------------------
def test_validation_error_names_param_value_and_range():
    err = validation_error([{"type": "greater_than", "loc": ("body", "top_p"),
                             "msg": "Input should be greater than 0", "input": 0}])
    assert err.param == "top_p" and err.message == "top_p: Input should be greater than 0, got 0"
    nested = validation_error([{"type": "missing", "loc": ("body", "messages", 2, "role"),
                                "msg": "Field required"}])
    assert nested.param == "messages[2].role"
    assert nested.body().model_dump() == {"error": {
        "message": "missing required field 'messages[2].role'",
        "type": "invalid_request_error", "param": "messages[2].role", "code": None}}


def test_prompt_forms():
    assert _completion(prompt="a").prompts() == ["a"]
    assert _completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert _completion(prompt=[1, 2]).prompts() == [[1, 2]]
    assert _completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


# ---- benchmark pieces -----------------------------------------------------------------------
@pytest.mark.parametrize("kind,spread", [("fixed", 0.0), ("uniform", 0.5), ("lognormal", 0.8)])
def test_length_distributions(kind, spread):
    dist = LengthDistribution(kind, 100, spread)
    xs = dist.sample(random.Random(0), 2000, max_len=150)
    assert all(1 <= x <= 150 for x in xs)
    if kind == "fixed":
        assert set(xs) == {100}
    elif kind == "uniform":
        assert min(xs) >= 50 and max(xs) <= 150 and len(set(xs)) > 50
    else:
        assert sorted(xs)[1000] in range(90, 111)  # median near 100
        assert max(xs) == 150  # the tail is clamped


def test_workload_is_deterministic_per_level():
    w = Workload(LengthDistribution("uniform", 20, 0.5), 8, vocab_size=300, max_model_len=64)
    assert w.prompts(4, 10) == w.prompts(4, 10)
    assert w.prompts(4, 10) != w.prompts(8, 10)
    assert all(0 <= t < 300 for p in w.prompts(1, 10) for t in p)
    with pytest.raises(ValueError, match="output length"):
        Workload(LengthDistribution(), 64, vocab_size=10, max_model_len=64)


def test_percentile_matches_linear_interpolation():
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == 50.5
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([], 50) is None


def test_summarize_level():
    ok = RequestResult(prompt_len=10, sent=0.5, output_len=3, ttft=0.1, itls=[0.02, 0.04],
                       e2e=0.2, usage_completion_tokens=3)
    bad = RequestResult(prompt_len=5, sent=0.25, error="HTTP 500")
    s = summarize(LevelRun(concurrency=2, duration=2.0, results=[ok, bad]))
    assert (s["completed"], s["failed"], s["output_tokens"]) == (1, 1, 3)
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == 1.5
    assert s["p50_ttft_ms"] == 100.0 and s["p50_tpot_ms"] == 30.0 and s["p50_itl_ms"] == 30.0
    assert s["chunk_count_mismatches"] == 0
    # Every request, failed ones too, in the order they were sent.
    assert s["requests"] == [
        {"sent_s": 0.25, "prompt_len": 5, "output_len": 0, "ttft_ms": None, "e2e_ms": None,
         "error": "HTTP 500"},
        {"sent_s": 0.5, "prompt_len": 10, "output_len": 3, "ttft_ms": 100.0, "e2e_ms": 200.0,
         "error": None}]


def test_slowest_first_tokens_name_their_wave():
    reqs = [{"sent_s": t, "prompt_len": 100 + k, "ttft_ms": ttft}
            for k, (t, ttft) in enumerate([(0.0, 500.0), (0.01, 90.0), (0.015, 480.0),
                                           (1.0, 100.0), (2.0, None)])]
    slow = slowest_first_tokens(reqs, count=3, window_s=0.02)
    assert [r["ttft_ms"] for r in slow] == [500.0, 480.0, 100.0]
    assert [r["sent_with"] for r in slow] == [2, 2, 0]


def test_bench_forwards_only_changed_engine_flags():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["serve", "--cache-type-k", "q4_0", "--no-cuda-graphs",
                              "--max-num-seqs", "16"])
    assert bench.engine_flags(args) == ["--cache-type-k", "q4_0", "--no-cuda-graphs"]


# ---- the app in-process ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(serve_env):
    from pagedserve.model.loader import load_model

    return load_model(Path(serve_env["PAGEDSERVE_CACHE"]) / RANDOM_NAME,
                      progress=False)


def _serve_in_process(loaded, scenario):
    """Run ``scenario(http, ctx)`` against the app over an in-process transport."""
    from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
    from pagedserve.server.api import create_app
    from pagedserve.server.context import ServingContext

    llm = LLMEngine(EngineConfig(model=str(loaded.path), progress=False, max_num_seqs=2),
                    loaded=loaded)
    ctx = ServingContext.create(llm, ("tiny",), max_queue=4)

    async def run():
        transport = httpx.ASGITransport(app=create_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            return await scenario(http, ctx)

    try:
        return asyncio.run(run())
    finally:
        ctx.engine.shutdown()


def test_after_shutdown_begins_requests_get_503(loaded):
    async def scenario(http, ctx):
        before = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        ctx.begin_shutdown()
        after = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        return before, after, await http.get("/health")

    before, after, health = _serve_in_process(loaded, scenario)
    assert before.status_code == 200
    assert after.status_code == 503 and after.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503


def test_model_without_tokenizer_serves_token_ids(loaded):
    """Random-weight presets ship no tokenizer: token ids must still stream, one chunk per
    token, and text routes must say why they cannot work."""
    bare = dataclasses.replace(loaded, tokenizer=None)

    async def scenario(http, ctx):
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "stream": True,
                "logprobs": 1}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        text = await http.post("/v1/completions", json={"prompt": "words"})
        chat = await http.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "x"}]})
        return lines, text, chat

    lines, text, chat = _serve_in_process(bare, scenario)
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and len(chunks) == 4
    assert all(c["choices"][0]["text"] == "" for c in chunks)
    assert chunks[0]["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    for resp in (text, chat):
        assert resp.status_code == 400 and "tokenizer" in resp.json()["error"]["message"]


def test_metrics_count_pool_leases_and_return_to_zero(loaded):
    """/metrics gives the pools' exact counts while a request runs, and 0 once it ends."""
    from server_harness import metric

    from pagedserve.engine.async_engine import wait_idle

    names = ("kv_cache_used_blocks", "state_slots_used", "num_live_sequences",
             "num_requests_admitted")

    async def scenario(http, ctx):
        body = {"prompt": [1] * 40, "max_tokens": 200, "ignore_eos": True}
        job = asyncio.create_task(http.post("/v1/completions", json=body))
        for _ in range(2000):  # the in-process transport answers whole: poll beside it
            during = (await http.get("/metrics")).text
            if metric(during, "pagedserve:generation_tokens_total") > 0:
                break
            await asyncio.sleep(0.005)
        assert (await job).status_code == 200
        assert await asyncio.to_thread(wait_idle, ctx.engine)
        return during, (await http.get("/metrics")).text

    during, after = _serve_in_process(loaded, scenario)
    counts = {n: metric(during, f"pagedserve:{n}") for n in names}
    assert counts["kv_cache_used_blocks"] >= 3, counts  # 41+ tokens in blocks of 16
    assert counts["state_slots_used"] == counts["num_live_sequences"] == 1, counts
    assert counts["num_requests_admitted"] == 1, counts
    assert all(metric(after, f"pagedserve:{n}") == 0 for n in names), after


def test_an_event_is_one_line_for_line_readers_that_split_like_splitlines() -> None:
    # Every character ``str.splitlines`` breaks at (httpx's ``aiter_lines`` splits the
    # same way), inside a token's text: the event stays one ``data:`` line whose JSON
    # decodes to the text.
    from pydantic import BaseModel

    from pagedserve.server.streaming import sse

    class Chunk(BaseModel):
        text: str

    breaks = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
    for ch in breaks:
        text = f"a{ch}b"
        lines = sse(Chunk(text=text)).decode().splitlines()
        assert len(lines) == 2 and lines[1] == "", (hex(ord(ch)), lines)
        assert json.loads(lines[0][len("data: "):]) == {"text": text}
