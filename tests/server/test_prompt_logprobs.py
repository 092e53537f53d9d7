"""Prompt logprobs through the server, against transformers' log-probabilities: OpenAI's
legacy ``echo`` with ``logprobs`` (what lm-evaluation-harness sends for loglikelihood
tasks) and vLLM's ``prompt_logprobs``, with the official client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from server_harness import client, running, sse_events
from transformers import Qwen3_5ForCausalLM

from pagedserve.model.random_checkpoint import NAME

PROMPT = [5, 17, 99, 3, 64, 200, 31, 8, 150, 77, 12, 240]
TOLERANCE = 1e-3  # f16 K/V storage moves logits by up to ~1e-3 (tests/model/test_parity.py)


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--max-model-len", "64", "--max-num-seqs", "4")) as s:
        yield s


@pytest.fixture(scope="module")
def want(serve_env) -> torch.Tensor:
    """float64 ``[P - 1, V]``: transformers' log-probabilities after each prompt prefix."""
    model = Qwen3_5ForCausalLM.from_pretrained(Path(serve_env["PAGEDSERVE_CACHE"]) / NAME,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def test_echo_with_logprobs_leads_with_the_prompts_tokens(server, want):
    out = client(server).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2,
        extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(PROMPT) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(PROMPT)):
        assert abs(lp.token_logprobs[i] - want[i - 1, PROMPT[i]].item()) < TOLERANCE
        top = max(lp.top_logprobs[i].values())  # keyed by text: byte tokens may share one
        assert abs(top - want[i - 1].max().item()) < TOLERANCE
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.choices[0].text.startswith("".join(lp.tokens[:len(PROMPT)]))


def test_vllm_prompt_logprobs_carry_rank_and_top_tokens(server, want):
    out = client(server).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    for i in range(1, len(PROMPT)):
        row, token = want[i - 1], PROMPT[i]
        entry = got[i][str(token)]
        assert abs(entry["logprob"] - row[token].item()) < TOLERANCE
        assert entry["rank"] == 1 + int((row > row[token]).sum())
        top = row.topk(2).indices.tolist()
        assert {got[i][str(t)]["rank"] for t in top} == {1, 2}
    assert out.choices[0].logprobs is None


def test_streamed_echo_with_logprobs_is_the_whole_responses(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "echo": True, "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={**body, "stream": True}) as resp:
        chunks = [e for e in sse_events(resp.iter_lines()) if isinstance(e, dict)]
    tokens, offsets, text = [], [], ""
    for chunk in chunks:
        choice = chunk["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            tokens += choice["logprobs"]["tokens"]
            offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server):
    c = client(server)
    out = c.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        temperature=0, extra_body={"prompt_logprobs": 0})
    got = out.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == out.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in got[1:])  # the prompt's own token only
    resp = httpx.post(server.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "prompt_logprobs": 1})
    assert resp.status_code == 400 and "prompt_logprobs" in resp.json()["error"]["message"]
