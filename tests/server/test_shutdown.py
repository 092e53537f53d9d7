"""Start-up and shutdown of the real process: bad configurations fail before the port is
bound, with one clear line and a non-zero status; SIGTERM aborts what is in flight and
the process exits 0."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_harness import get_metrics, metric, sse_events

from pagedserve.server.info import READY_PREFIX

LONG = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _wait_running(server, num: int) -> None:
    deadline = time.monotonic() + 20
    while metric(get_metrics(server), "pagedserve:num_requests_running") < num:
        assert time.monotonic() < deadline, f"fewer than {num} requests started"
        time.sleep(0.05)


def test_sigterm_aborts_in_flight_requests_and_exits_0(launch):
    server = launch("--max-num-seqs", "4")
    server.start()
    try:
        whole: dict[str, httpx.Response] = {}
        blocking = threading.Thread(target=lambda: whole.setdefault("resp", httpx.post(
            server.url + "/v1/completions", json=LONG, timeout=60)))
        blocking.start()
        body = {"messages": [{"role": "user", "content": "go"}], "stream": True, **LONG}
        del body["prompt"]
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as resp:
            events = sse_events(resp.iter_lines())
            first = [next(events) for _ in range(3)]
            _wait_running(server, 2)
            server.terminate()
            rest = list(events)
        assert first[0]["choices"][0]["delta"]["role"] == "assistant"
        assert rest[-1] == "[DONE]"
        assert rest[-2]["choices"][0]["finish_reason"] == "abort"
        assert len(first) + len(rest) < 100  # cut short, not run to max_tokens
        blocking.join(30)
        assert whole["resp"].status_code == 503
        assert whole["resp"].json()["error"]["code"] == "shutting_down"
        assert server.proc.wait(30) == 0
        log = server.log_text()
        assert "received SIGTERM" in log and "Traceback" not in log
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.kill()


def _serve(flags: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", *flags],
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("flags,words", [
    (["--device", "cuda"], ["CUDA is not available"]),
    (["--max-model-len", "100000"], ["100000", "max_position_embeddings (4096)"]),
])
def test_bad_configuration_fails_at_start_up(serve_env, flags, words):
    proc = _serve(["--port", "0", *flags], serve_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("pagedserve serve: error:")
    for word in words:
        assert word in proc.stderr
    assert READY_PREFIX not in proc.stderr


def test_port_in_use_is_reported(serve_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(["--port", str(port)], serve_env)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert READY_PREFIX not in proc.stderr
