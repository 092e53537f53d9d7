"""Scale-out past one process: two ``pagedserve serve`` replicas behind vllm-router (PyPI's
``vllm-router``, the Rust router made for vLLM replicas), as ``docs/scale-out.md`` runs them.

With ``--policy consistent_hash`` the router pins each ``X-Session-ID`` to one replica, so
every turn of a conversation reaches the replica that holds its prefix: each turn after
the first is a prefix-cache hit (``usage.prompt_tokens_details.cached_tokens``) over at
least the previous turn's whole prompt. Answers through the router equal a replica's own.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import client, running

# The router's executable, beside this interpreter (a venv's bin/) or on PATH.
ROUTER = shutil.which("vllm-router", path=os.pathsep.join(
    [str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
SESSIONS = 6
TURNS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_router(workers: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    assert ROUTER is not None, "vllm-router is missing: it is a test dependency (pyproject)"
    port = _free_port()
    proc = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
         "--worker-urls", *workers], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"vllm-router did not start:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def replicas(launch):
    with running(launch("--max-num-seqs", "4")) as a, running(launch("--max-num-seqs", "4")) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc, url = _start_router([replicas[0].url, replicas[1].url], log)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_sessions_stick_to_the_replica_holding_their_prefix(replicas, router):
    via_router = _oai(router)
    direct = client(replicas[0])
    model = direct.models.list().data[0].id
    for s in range(SESSIONS):
        prompt = f"Session {s}: " + " ".join(f"w{s}-{i}" for i in range(40))
        previous = None
        for turn in range(TURNS):
            kw = dict(model=model, prompt=prompt, max_tokens=8, temperature=0)
            out = via_router.completions.create(
                **kw, extra_headers={"X-Session-ID": f"session-{s}"})
            assert out.choices[0].text == direct.completions.create(**kw).choices[0].text
            cached = out.usage.prompt_tokens_details.cached_tokens
            if previous is not None:
                assert cached >= previous, (s, turn, cached, previous)
            previous = out.usage.prompt_tokens
            prompt += out.choices[0].text + f" next {turn}"


def test_router_hop_costs(replicas, router, record_property):
    """Reported, not asserted: the median extra time of one small completion through the
    router against the same request sent straight to a replica."""
    body = {"prompt": "x", "max_tokens": 1, "temperature": 0}

    def median_ms(url: str) -> float:
        times = []
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(20):
                t0 = time.perf_counter()
                assert http.post("/v1/completions", json=body).status_code == 200
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    direct, routed = median_ms(replicas[0].url), median_ms(router)
    print(f"\none-token completion, median: {direct:.1f} ms direct, {routed:.1f} ms via "
          f"vllm-router ({routed - direct:+.1f} ms)")
    record_property("router_extra_ms", routed - direct)
