"""The chaos run's workload and client (``bench_chaos.py``): request specs, the four
kinds of client behaviour, /metrics sampling, and what the client saw of each request."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("stream", "stream_cut", "whole", "whole_timeout")
# /metrics gauges that must all read 0 on an idle server (without the prefix).
LEAK_GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_admitted",
               "kv_cache_used_blocks", "state_slots_used", "num_live_sequences")
TIMELINE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
                   "num_preemptions")


# ---- the workload --------------------------------------------------------------------------
@dataclass
class Spec:
    """One request of the chaos phase."""

    index: int
    kind: str
    prompt: list[int]
    max_tokens: int
    long: bool
    cut_after: int = 0  # stream_cut: tokens read before closing
    timeout_s: float = 0.0  # whole_timeout: the client's patience


@dataclass
class Outcome:
    """What the client saw of one request; ``tokens`` etc. only when it completed."""

    index: int
    kind: str
    prompt_len: int
    max_tokens: int
    long: bool
    start_s: float = 0.0
    end_s: float = 0.0
    status: int | None = None  # HTTP status; None: no answer (cut or failed)
    # complete | cut | timed_out | refused (an HTTP error status) | error; past the chaos
    # budget: not_sent | cut_at_deadline
    result: str = ""
    error: str | None = None
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)


def make_specs(args: argparse.Namespace, vocab_size: int) -> list[Spec]:
    """The chaos phase's requests, in sending order (seeded: reruns send the same)."""
    rng = random.Random(args.seed)
    num_long = round(args.num_requests * args.long_fraction)
    specs: list[Spec] = []
    for i in range(args.num_requests):
        long = i < num_long
        if long:
            n = rng.randint(max(1, args.max_prompt_len // 4), args.max_prompt_len)
        else:
            n = round(math.exp(rng.gauss(math.log(args.short_len), 0.8)))
            n = min(args.max_prompt_len, max(1, n))
        kind = KINDS[i % len(KINDS)]
        max_tokens = rng.randint(max(2, args.output_len // 2), args.output_len)
        spec = Spec(i, kind, [rng.randrange(vocab_size) for _ in range(n)], max_tokens, long)
        if kind == "stream_cut":
            spec.cut_after = rng.randint(1, max_tokens - 1)
        if kind == "whole_timeout":
            spec.timeout_s = rng.uniform(*args.timeout_range)
        specs.append(spec)
    shorts, longs = specs[num_long:], specs[:num_long]
    rng.shuffle(shorts)
    order = list(shorts)
    for b in range(0, len(longs), args.long_burst):  # each burst at a random place
        at = rng.randint(0, len(order))
        order[at:at] = longs[b:b + args.long_burst]
    for i, s in enumerate(order):
        s.index = i
    return order


def body_of(spec: Spec, model: str, logprobs: int, stream: bool) -> dict:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "logprobs": logprobs, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# ---- the client ----------------------------------------------------------------------------
def _take_logprobs(out: Outcome, lp: dict | None) -> None:
    if lp:
        out.tokens += lp["tokens"]
        out.token_logprobs += lp["token_logprobs"]
        out.top_logprobs += lp["top_logprobs"]


async def _stream(http: httpx.AsyncClient, spec: Spec, body: dict, out: Outcome) -> None:
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            out.result, out.error = "refused", (await resp.aread()).decode(errors="replace")
            return
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                out.result = "complete"
                return
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                out.result, out.error = "error", f"in stream: {chunk['error']}"
                return
            for choice in chunk.get("choices") or []:
                _take_logprobs(out, choice.get("logprobs"))
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if spec.kind == "stream_cut" and len(out.tokens) >= spec.cut_after \
                    and out.finish_reason is None:
                out.result = "cut"
                return  # leaving the block closes the connection mid-stream
        out.result, out.error = "error", "the stream ended without data: [DONE]"


async def _whole(http: httpx.AsyncClient, body: dict, out: Outcome) -> None:
    resp = await http.post("/v1/completions", json=body)
    out.status = resp.status_code
    if resp.status_code != 200:
        out.result, out.error = "refused", resp.text
        return
    choice = resp.json()["choices"][0]
    _take_logprobs(out, choice.get("logprobs"))
    out.finish_reason = choice.get("finish_reason")
    out.result = "complete"


def outcome_of(spec: Spec) -> Outcome:
    return Outcome(spec.index, spec.kind, len(spec.prompt), spec.max_tokens, spec.long)


async def send(http: httpx.AsyncClient, spec: Spec, out: Outcome, model: str, logprobs: int,
               t0: float, stream: bool | None = None) -> Outcome:
    """Send ``spec`` as its kind says (``stream`` overrides: the solo reruns), filling
    ``out`` as it goes (a cancelled send leaves it ``in_flight``)."""
    streaming = spec.kind.startswith("stream") if stream is None else stream
    body = body_of(spec, model, logprobs, streaming)
    out.start_s = time.perf_counter() - t0
    out.result = "in_flight"
    try:
        if streaming:
            await _stream(http, spec, body, out)
        elif spec.kind == "whole_timeout" and stream is None:
            try:
                await asyncio.wait_for(_whole(http, body, out), spec.timeout_s)
            except TimeoutError:
                out.result = "timed_out"
        else:
            await _whole(http, body, out)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out.result, out.error = "error", f"{type(exc).__name__}: {exc}"
    out.end_s = time.perf_counter() - t0
    if out.result == "complete" and (out.finish_reason != "length"
                                     or len(out.tokens) != spec.max_tokens):
        out.result = "error"
        out.error = (f"finish_reason {out.finish_reason!r} after {len(out.tokens)} of "
                     f"{spec.max_tokens} tokens (ignore_eos: expected 'length')")
    return out


def scrape(url: str) -> dict[str, float]:
    """/metrics as ``{family: value}``, without the ``pagedserve:`` prefix (counters by
    family name, without ``_total``; labelled samples summed; histograms left out)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("pagedserve:")
        for sample in family.samples:
            if sample.name.removeprefix("pagedserve:") in (name, name + "_total"):
                values[name] = values.get(name, 0.0) + sample.value
    return values


async def _poll(url: str, t0: float, period: float, timeline: list[dict],
                stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            values = await asyncio.to_thread(scrape, url)
            timeline.append({"t": round(time.perf_counter() - t0, 3),
                             **{k: values.get(k) for k in TIMELINE_GAUGES}})
        except httpx.HTTPError as exc:
            timeline.append({"t": round(time.perf_counter() - t0, 3), "error": repr(exc)})
        try:
            await asyncio.wait_for(stop.wait(), period)
        except TimeoutError:
            pass


async def chaos_phase(url: str, model: str, specs: list[Spec], args: argparse.Namespace
                      ) -> tuple[list[Outcome], list[dict], float]:
    """Every spec at ``args.concurrency`` in flight, /metrics sampled alongside."""
    limits = httpx.Limits(max_connections=args.concurrency + 4,
                          max_keepalive_connections=args.concurrency)
    timeline: list[dict] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    poller = asyncio.create_task(_poll(url, t0, args.poll_s, timeline, stop))
    outcomes = [outcome_of(spec) for spec in specs]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None),
                                 limits=limits) as http:
        gate = asyncio.Semaphore(args.concurrency)

        async def gated(spec: Spec, out: Outcome) -> None:
            async with gate:
                await send(http, spec, out, model, args.logprobs, t0)

        tasks = [asyncio.create_task(gated(s, o)) for s, o in zip(specs, outcomes)]
        _, late = await asyncio.wait(tasks, timeout=args.chaos_budget_s)
        for task in late:  # past the budget: every client still waiting walks away
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    duration = time.perf_counter() - t0
    stop.set()
    await poller
    for out in outcomes:
        if out.result in ("", "in_flight"):
            out.result = "not_sent" if out.result == "" else "cut_at_deadline"
            out.end_s = duration
    return outcomes, timeline, duration


def wait_idle(url: str, timeout: float) -> dict[str, Any]:
    """/metrics once every leak gauge reads 0, or the last reading after ``timeout``
    (``{"unreachable": ...}`` if the server does not answer: the leak check fails)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            values = scrape(url)
        except httpx.HTTPError as exc:
            return {"unreachable": repr(exc)}
        if all(values.get(g) == 0 for g in LEAK_GAUGES) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)
