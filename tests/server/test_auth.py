"""``--api-key``: guarded routes answer 401 without the right bearer token; /health and
/metrics stay open."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import client, running

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(launch):
    with running(launch("--api-key", KEY, "--max-num-seqs", "2")) as s:
        yield s


GUARDED = [("GET", "/v1/models", None),
           ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
           ("POST", "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
           ("POST", "/tokenize", {"prompt": "x"}),
           ("POST", "/detokenize", {"tokens": [65]}),
           ("GET", "/server_info", None)]
BAD_HEADERS = {"missing": {}, "wrong key": {"Authorization": "Bearer nope"},
               "wrong scheme": {"Authorization": f"Basic {KEY}"},
               "key without scheme": {"Authorization": KEY}}


@pytest.mark.parametrize("headers", list(BAD_HEADERS))
@pytest.mark.parametrize("method,path,body", GUARDED)
def test_guarded_routes_need_the_key(server, method, path, body, headers):
    resp = httpx.request(method, server.url + path, json=body, headers=BAD_HEADERS[headers])
    assert resp.status_code == 401, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in error["message"]


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_guarded_routes_accept_the_key(server, method, path, body):
    resp = httpx.request(method, server.url + path, json=body,
                         headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200, resp.text


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_openai_client(server):
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").models.list()
    out = client(server, api_key=KEY).completions.create(
        model="qwen3.5-tiny-random-v2", prompt="k", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
