"""One concurrency level's numbers: throughput, and TTFT/TPOT/ITL/E2E percentiles (ms)."""

from __future__ import annotations

import math
from typing import Any

from pagedserve.bench.client import LevelRun

PERCENTILES = (50, 99)
WAVE_WINDOW_S = 0.02  # requests sent this close together arrived as one wave
LATENCIES = ("ttft", "tpot", "itl", "e2e")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); ``None`` for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 3)


def summarize(run: LevelRun) -> dict[str, Any]:
    """Everything the report shows for ``run``; latencies in milliseconds."""
    ok = [r for r in run.results if r.ok]
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    num_output = sum(r.output_len for r in ok)
    num_input = sum(r.prompt_len for r in ok)
    # With ignore_eos the server must send exactly one chunk per token it reports.
    mismatched = sum(1 for r in ok if r.usage_completion_tokens not in (None, r.output_len))
    out: dict[str, Any] = {
        "concurrency": run.concurrency,
        "num_requests": len(run.results),
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "errors": sorted({r.error for r in run.results if r.error})[:5],
        "chunk_count_mismatches": mismatched,
        "duration_s": round(run.duration, 3),
        "input_tokens": num_input,
        "output_tokens": num_output,
        "request_throughput": round(len(ok) / run.duration, 4) if run.duration else None,
        "output_throughput": round(num_output / run.duration, 2) if run.duration else None,
        "total_token_throughput": (round((num_input + num_output) / run.duration, 2)
                                   if run.duration else None),
    }
    for name in LATENCIES:
        xs = samples[name]
        out[f"mean_{name}_ms"] = _ms(sum(xs) / len(xs)) if xs else None
        for q in PERCENTILES:
            out[f"p{q}_{name}_ms"] = _ms(percentile(xs, q))
    # Each request in send order, so that a tail can be traced to when it arrived
    # (a wave of simultaneous sends, a level's first requests) and to its prompt.
    out["requests"] = [{"sent_s": round(r.sent, 4), "prompt_len": r.prompt_len,
                        "output_len": r.output_len, "ttft_ms": _ms(r.ttft),
                        "e2e_ms": _ms(r.e2e), "error": r.error}
                       for r in sorted(run.results, key=lambda r: r.sent)]
    return out


def slowest_first_tokens(requests: list[dict[str, Any]], count: int = 5,
                         window_s: float = WAVE_WINDOW_S) -> list[dict[str, Any]]:
    """The ``count`` requests of a level with the longest TTFT (``summarize``'s
    ``requests``), slowest first, each with ``sent_with``: how many other requests were
    sent within ``window_s`` of it, the size of the wave it arrived in."""
    timed = [r for r in requests if r["ttft_ms"] is not None]
    slowest = sorted(timed, key=lambda r: r["ttft_ms"], reverse=True)[:count]
    return [r | {"sent_with": sum(1 for o in requests if o is not r
                                  and abs(o["sent_s"] - r["sent_s"]) <= window_s)}
            for r in slowest]
