"""Helpers for driving a ``pagedserve serve`` process: clients, SSE parsing, /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai

from pagedserve.server.launcher import ServerProcess


@contextmanager
def running(server: ServerProcess) -> Iterator[ServerProcess]:
    """Start ``server``; on exit, SIGTERM it and require a clean exit."""
    server.start()
    try:
        yield server
    finally:
        status = server.stop(timeout=30)
        log = server.log_text()
        assert status == 0, f"server exited with {status}:\n{server.log_tail()}"
        assert "Traceback" not in log, f"server logged a traceback:\n{log[-4000:]}"


def client(server: ServerProcess, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0,
                         timeout=60)


def async_client(server: ServerProcess, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0,
                              timeout=60)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (with at least ``labels``) in Prometheus text."""
    for line in text.splitlines():
        m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"no sample {name} {labels} in /metrics")


def get_metrics(server: ServerProcess) -> str:
    resp = httpx.get(server.url + "/metrics", timeout=10)
    resp.raise_for_status()
    return resp.text


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    """Parsed ``data:`` payloads of an SSE stream; ``"[DONE]"`` as a string."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)
