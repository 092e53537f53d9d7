"""Engine step times from a server's debug log, by what the steps held.

    pagedserve bench serve ... --server-log server.log --server-log-level debug
    python benchmarks/tools/step_log.py server.log

``AsyncEngine`` logs each ``step()`` at debug level as ``step <ms> ms; last launch: <D>
decode rows, prompt chunks [<rows>, ...]``. Steps are grouped by their prompt chunks
(none, one, two, more) and by whether they held decode rows; each group prints its count
and its p50 / p99 / max wall time, then the slowest steps. Under async scheduling a
``step()`` reads one forward pass back and launches the next, so its time is the host's
wait for the pass it reads, and "last launch" names the pass it launched. Speculative
steps log as such and are left out.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"step ([\d.]+) ms; last launch: (\d+) decode rows, prompt chunks \[([\d, ]*)\]")


def parse(text: str) -> list[tuple[float, int, list[int]]]:
    """``(ms, decode rows, prompt chunk rows)`` of every logged step, in order."""
    steps = []
    for m in STEP.finditer(text):
        chunks = [int(v) for v in m.group(3).split(",") if v.strip()]
        steps.append((float(m.group(1)), int(m.group(2)), chunks))
    return steps


def group_of(decode_rows: int, chunks: list[int]) -> str:
    count = {0: "no prompt chunk", 1: "one prompt chunk", 2: "two prompt chunks"}.get(
        len(chunks), "3+ prompt chunks")
    return f"{'decode rows' if decode_rows else 'no decode row'}, {count}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(steps: list[tuple[float, int, list[int]]], slowest: int = 10) -> str:
    groups: dict[str, list[float]] = defaultdict(list)
    for ms, decode_rows, chunks in steps:
        groups[group_of(decode_rows, chunks)].append(ms)
    lines = ["| steps | count | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
    for name, times in sorted(groups.items()):
        lines.append(f"| {name} | {len(times)} | {statistics.median(times):.1f} | "
                     f"{percentile(times, 0.99):.1f} | {max(times):.1f} |")
    lines += ["", f"Slowest {slowest}:", ""]
    for ms, decode_rows, chunks in sorted(steps, key=lambda s: -s[0])[:slowest]:
        lines.append(f"- {ms:.1f} ms: {decode_rows} decode rows, prompt chunks {chunks}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--slowest", type=int, default=10)
    args = ap.parse_args(argv)
    steps = parse(args.log.read_text(errors="replace"))
    if not steps:
        print(f"no step lines in {args.log} (was the server at --log-level debug?)")
        return 1
    print(summary(steps, args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
