"""Soak: 120 requests, many of them abandoned by their clients mid-way (streams
closed after a few chunks, non-streaming requests cancelled while they wait). Afterwards
the engine must be empty -- nothing running or waiting, no K/V block in use -- the
admission bound must have been given back in full, and the server must not have crashed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import pytest
from server_harness import get_metrics, metric, running

NUM_REQUESTS = 120
CLIENT_CONCURRENCY = 16
# capacity = 8 running + 40 waiting = 48 engine requests in flight: the client's 16
# requests of up to n=2 stay below it even while abandoned ones are still being released.
FLAGS = ("--max-num-seqs", "8", "--max-queue", "40", "--no-access-log")
CAPACITY = 48


@pytest.fixture(scope="module")
def server(launch):
    with running(launch(*FLAGS)) as s:
        yield s


def _body(rng: random.Random, stream: bool) -> tuple[str, dict]:
    params = {"max_tokens": rng.randint(2, 10), "ignore_eos": rng.random() < 0.5,
              "temperature": rng.choice([0.0, 0.8]), "stream": stream,
              "n": rng.choice([1, 1, 1, 2])}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": "soak " * rng.randint(1, 30), **params}
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "q" * rng.randint(1, 60)}], **params}


async def _one(http: httpx.AsyncClient, rng: random.Random, tally: Counter) -> None:
    kind = rng.choice(["stream_full", "stream_abandoned", "whole", "whole_cancelled"])
    route, body = _body(rng, stream=kind.startswith("stream"))
    if kind == "whole_cancelled":
        try:
            await asyncio.wait_for(http.post(route, json=body), timeout=rng.uniform(0.0, 0.2))
            tally["finished_before_cancel"] += 1
        except TimeoutError:
            tally["cancelled"] += 1
        return
    if kind == "whole":
        resp = await http.post(route, json=body)
        tally[f"status_{resp.status_code}"] += 1
        return
    async with http.stream("POST", route, json=body) as resp:
        tally[f"status_{resp.status_code}"] += 1
        keep = rng.randint(0, 3) if kind == "stream_abandoned" else None
        async for i, _ in _enumerate(resp.aiter_lines()):
            if keep is not None and i >= keep:
                tally["abandoned"] += 1
                break  # leaving the block closes the connection mid-stream


async def _enumerate(lines):
    i = 0
    async for line in lines:
        if line.startswith("data: "):
            yield i, line
            i += 1


async def _soak(url: str) -> Counter:
    rng = random.Random(1234)
    tally: Counter = Counter()
    limits = httpx.Limits(max_connections=CLIENT_CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        gate = asyncio.Semaphore(CLIENT_CONCURRENCY)

        async def gated(seed: int) -> None:
            async with gate:
                await _one(http, random.Random(seed), tally)

        await asyncio.gather(*(gated(rng.randrange(2**32)) for _ in range(NUM_REQUESTS)))
    return tally


async def _fill_to_capacity(url: str) -> list[int]:
    """Open CAPACITY long streams at once: all must be admitted if nothing leaked."""
    body = {"prompt": "fill", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=CAPACITY + 1)) as http:
        async def status() -> int:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                return resp.status_code

        return await asyncio.gather(*(status() for _ in range(CAPACITY)))


def _wait_until_idle(server, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = get_metrics(server)
        if (metric(text, "pagedserve:num_requests_running") == 0
                and metric(text, "pagedserve:num_requests_waiting") == 0
                and metric(text, "pagedserve:kv_cache_usage_perc") == 0.0):
            return text
        if time.monotonic() > deadline:
            raise AssertionError("engine not idle after the soak:\n" + "\n".join(
                line for line in text.splitlines() if "num_requests" in line or "kv_cache" in line))
        time.sleep(0.1)


def test_soak_with_random_disconnects(server):
    tally = asyncio.run(_soak(server.url))
    assert tally["cancelled"] > 10 and tally["abandoned"] > 10, tally
    assert set(k for k in tally if k.startswith("status_")) == {"status_200"}, tally
    text = _wait_until_idle(server)
    assert metric(text, "pagedserve:request_success_total", finished_reason="abort") > 10
    assert metric(text, "pagedserve:request_success_total", finished_reason="length") > 10
    assert httpx.get(server.url + "/health").status_code == 200

    assert asyncio.run(_fill_to_capacity(server.url)) == [200] * CAPACITY
    _wait_until_idle(server)
    out = httpx.post(server.url + "/v1/completions",
                     json={"prompt": "still here", "max_tokens": 3}).json()
    assert out["usage"]["completion_tokens"] >= 1
