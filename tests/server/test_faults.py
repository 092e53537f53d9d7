"""Faults patched into a real server's engine (``faulty_serve.py``): a request that fails
on its own gets a JSON error while the others finish and its blocks come back; a fatal
engine error makes the process exit 1 instead of staying up and unable to serve."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_harness import get_metrics, metric, sse_events

from pagedserve.server.launcher import ServerProcess

FAULTY = str(Path(__file__).with_name("faulty_serve.py"))
CMPL = "/v1/completions"
GOOD = {"prompt": "hello there", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def faulty_server(serve_env: dict[str, str], log: Path) -> ServerProcess:
    return ServerProcess(["--max-num-seqs", "4", "--no-access-log"], log, env=serve_env,
                         startup_timeout=120, program=[sys.executable, FAULTY])


@pytest.fixture(scope="module")
def server(serve_env, tmp_path_factory):
    s = faulty_server(serve_env, tmp_path_factory.mktemp("faults") / "serve.log")
    s.start()
    yield s
    assert s.stop(timeout=30) == 0, s.log_tail()


def post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + CMPL, json=body, timeout=60)


def wait_idle(server: ServerProcess) -> str:
    deadline = time.monotonic() + 10
    while True:
        text = get_metrics(server)
        idle = (metric(text, "pagedserve:num_requests_running") == 0
                and metric(text, "pagedserve:num_requests_waiting") == 0)
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


@pytest.mark.parametrize("mark, extra", [("FAULT_POSTPROCESS", {}),
                                         ("FAULT_SAMPLING", {"temperature": 0.7})])
def test_a_failing_request_fails_alone(server, mark, extra):
    alone = post(server, GOOD).json()["choices"][0]["text"]
    bad_body = {**GOOD, **extra, "stop": [mark]}
    with ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(post, server, GOOD) for _ in range(3)]
        bad = pool.submit(post, server, bad_body).result()
        good = [g.result() for g in goods]
    assert bad.status_code == 500, bad.text
    assert bad.headers["content-type"] == "application/json"
    error = bad.json()["error"]
    assert error["code"] == "request_failed" and "injected fault" in error["message"]
    for g in good:  # the others finish, with the tokens they get alone
        assert g.status_code == 200, g.text
        assert g.json()["choices"][0]["text"] == alone
        assert g.json()["usage"]["completion_tokens"] == 24
    text = wait_idle(server)
    assert metric(text, "pagedserve:kv_cache_usage_perc") == 0.0  # its blocks came back
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_failing_stream_ends_with_an_error_event(server):
    with httpx.stream("POST", server.url + CMPL, timeout=60,
                      json={**GOOD, "stream": True, "stop": ["FAULT_POSTPROCESS"]}) as resp:
        assert resp.status_code == 200
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_failed"
    assert post(server, GOOD).status_code == 200
    assert metric(wait_idle(server), "pagedserve:kv_cache_usage_perc") == 0.0


@pytest.mark.parametrize("route, body", [
    (CMPL, {"prompt": "x", "model": "FAULT_ROUTE"}),
    ("/tokenize", {"prompt": "x", "model": "FAULT_ROUTE"}),
    ("/v1/messages", {"model": "FAULT_ROUTE", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "x"}]}),
])
def test_an_unhandled_route_error_is_a_json_500(server, route, body):
    resp = httpx.post(server.url + route, json=body, timeout=60)
    assert resp.status_code == 500, resp.text
    assert resp.headers["content-type"] == "application/json"
    payload = resp.json()
    if route.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] == "api_error"
    else:
        assert payload["error"]["type"] == "internal_error"
        assert payload["error"]["code"] == "internal_error"
    assert "ZeroDivisionError: injected fault in a route" in payload["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_fatal_engine_error_exits_the_process_non_zero(serve_env, tmp_path):
    server = faulty_server(serve_env, tmp_path / "serve.log")
    server.start()
    try:
        try:
            resp = post(server, {**GOOD, "stop": ["FAULT_FATAL"]})
            assert resp.status_code == 500, resp.text
            assert resp.json()["error"]["code"] == "engine_dead"
        except httpx.TransportError:
            pass  # the process may close the connection first; either way it must exit
        assert server.proc is not None
        status = server.proc.wait(timeout=60)
    finally:
        server.kill()
    assert status == 1, server.log_tail()
    log = server.log_text()
    assert "engine loop crashed" in log and "illegal memory access" in log
