"""The load generator: streaming completions at a fixed concurrency, timed per SSE chunk.

Timing is client-side, as ``vllm bench serve`` does: TTFT is send -> first token chunk,
ITL the gaps between token chunks (the server sends one chunk per generated token), TPOT
``(last - first) / (tokens - 1)`` per request, E2E send -> ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    prompt_len: int
    sent: float = 0.0  # seconds from the level's start to this request's send
    output_len: int = 0  # token chunks received
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    usage_completion_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or self.ttft is None or self.e2e is None:
            return None
        return sum(self.itls) / (self.output_len - 1)


@dataclass
class LevelRun:
    concurrency: int
    duration: float
    results: list[RequestResult]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _one(client: httpx.AsyncClient, body: dict, prompt_len: int,
               level_start: float) -> RequestResult:
    start = last = time.perf_counter()
    result = RequestResult(prompt_len=prompt_len, sent=start - level_start)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error in stream")
                    return result
                if chunk.get("usage"):
                    result.usage_completion_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                result.output_len += 1
        result.e2e = time.perf_counter() - start
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def completion_body(model: str, prompt: list[int], output_len: int,
                    temperature: float) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_level(url: str, model: str, prompts: list[list[int]], output_len: int,
                    concurrency: int, temperature: float = 0.0,
                    api_key: str | None = None) -> LevelRun:
    """Send every prompt, at most ``concurrency`` in flight; each starts when one ends."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits,
                                 headers=_headers(api_key)) as client:
        gate = asyncio.Semaphore(concurrency)
        start = time.perf_counter()

        async def gated(prompt: list[int]) -> RequestResult:
            async with gate:
                body = completion_body(model, prompt, output_len, temperature)
                return await _one(client, body, len(prompt), start)

        results = await asyncio.gather(*(gated(p) for p in prompts))
        duration = time.perf_counter() - start
    return LevelRun(concurrency, duration, list(results))


def get_json(url: str, path: str, api_key: str | None = None) -> dict:
    resp = httpx.get(url.rstrip("/") + path, headers=_headers(api_key), timeout=30)
    resp.raise_for_status()
    return resp.json()
