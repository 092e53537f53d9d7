"""``--max-queue``: beyond max-num-seqs + max-queue requests in flight the server answers
429 at once, takes work again as soon as room frees up, and refuses outright (400) a
request that could never fit."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import pytest
from server_harness import get_metrics, metric, running, sse_events

# One running + one waiting: capacity 2.
FLAGS = ("--max-num-seqs", "1", "--max-queue", "1")
LONG = {"prompt": "busy", "max_tokens": 3000, "ignore_eos": True, "stream": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(launch):
    with running(launch(*FLAGS)) as s:
        yield s


def _open_stream(stack: ExitStack, http: httpx.Client) -> httpx.Response:
    resp = stack.enter_context(http.stream("POST", "/v1/completions", json=LONG))
    assert resp.status_code == 200
    return resp


def test_full_queue_answers_429_then_recovers(server):
    with httpx.Client(base_url=server.url, timeout=30) as http, ExitStack() as stack:
        events = sse_events(_open_stream(stack, http).iter_lines())
        next(events)  # it is generating (keep ``events``: dropping it closes the stream)
        waiting = ExitStack()
        _open_stream(waiting, http)  # admitted; waits for the one sequence slot
        text = get_metrics(server)
        assert metric(text, "pagedserve:num_requests_running") == 1
        assert metric(text, "pagedserve:num_requests_waiting") == 1

        resp = httpx.post(server.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 2})
        assert resp.status_code == 429
        error = resp.json()["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert "max-queue 1" in error["message"] and "2 requests in flight" in error["message"]
        assert resp.headers["retry-after"] == "1"

        waiting.close()  # the client gives up: its place is free again
        deadline = time.monotonic() + 10
        while True:
            with http.stream("POST", "/v1/completions", json=LONG) as resp:
                status = resp.status_code  # 200: admitted (it waits behind the first)
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
    _wait_idle(server)


def test_request_larger_than_capacity_is_refused(server):
    resp = httpx.post(server.url + "/v1/completions",
                      json={"prompt": "x", "max_tokens": 2, "n": 3})
    assert resp.status_code == 400
    assert "at most 2" in resp.json()["error"]["message"]


def _wait_idle(server) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = get_metrics(server)
        if (metric(text, "pagedserve:num_requests_running") == 0
                and metric(text, "pagedserve:num_requests_waiting") == 0):
            return
        time.sleep(0.05)
    raise AssertionError("requests still in the engine after their clients left")
