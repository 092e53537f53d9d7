"""Shared pieces of the benchmark scripts: timing, run metadata, result files.

Timing is the same for every side of a comparison. A *call* is one op invocation; a
timed *round* runs a list of calls, each on its own copy of the inputs (rotating copies
so that K/V of a small case is not still in L2 when it is read again), and the time per
call is the round's CUDA-event time divided by the number of calls. Two methods:

- ``graph``: the round is captured once in a CUDA graph and replayed (no Python or
  launch overhead on the host; what a decode step under CUDA graphs pays).
- ``eager``: the round is issued from Python (host launch overhead included when the
  GPU outruns the host).

Reported values are medians over rounds. The sides of a comparison (paged, contiguous,
SDPA) are timed together, their rounds interleaved (``time_sides``), so that a drift of
the GPU's clocks over the seconds of a measurement does not land on one side only.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

METHODS = ("graph", "eager")


def run_meta() -> dict:
    """Date, GPU, commit and library versions of this run."""
    import triton

    commit = os.environ.get("PAGEDSERVE_COMMIT")
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=True,
                                    capture_output=True, text=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain"], check=True,
                                   capture_output=True, text=True).stdout.strip()
            commit += "+uncommitted" if dirty else ""
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown (no git; set PAGEDSERVE_COMMIT)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (props.name, props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20))
    else:
        gpu = ("cpu (dry run: Triton interpreter, numbers meaningless)", 0, 1 << 20)
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": gpu[0],
        "sm_count": gpu[1],
        "l2_bytes": gpu[2],
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def time_calls(calls: list[Callable[[], object]], method: str, min_rounds: int = 15,
               min_seconds: float = 0.15) -> float:
    """Median microseconds per call of ``calls`` run back to back (see module doc)."""
    return time_sides({"calls": calls}, method, min_rounds, min_seconds)["calls"]


def _round(calls: list[Callable[[], object]], method: str) -> Callable[[], object]:
    """One round of ``calls``: a captured CUDA graph's replay, or the calls in Python."""
    for call in calls:  # compile, allocate, warm up
        call()
    torch.cuda.synchronize()
    if method == "eager":
        return lambda: [call() for call in calls]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def time_sides(sides: dict[str, list[Callable[[], object]]], method: str,
               min_rounds: int = 15, min_seconds: float = 0.15) -> dict[str, float]:
    """Median microseconds per call of each side's calls, measured side by side: the
    sides' rounds alternate (in an order that rotates every round), so that a drift of
    the GPU's clocks or memory over the measurement moves every side alike and their
    ratio stays fair. ``min_seconds`` is per side."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} not in {METHODS}")
    if not torch.cuda.is_available():
        return {name: _time_calls_cpu(calls) for name, calls in sides.items()}
    rounds_of = {name: _round(calls, method) for name, calls in sides.items()}
    # Size the number of rounds from one measured round of the slowest side.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one = 1e-6
    for round_fn in rounds_of.values():
        round_fn()
        torch.cuda.synchronize()
        start.record()
        round_fn()
        end.record()
        torch.cuda.synchronize()
        one = max(one, start.elapsed_time(end) / 1e3)
    rounds = max(min_rounds, min(2000, int(min_seconds / one)))
    names = list(sides)
    events = {name: [] for name in names}
    for r in range(rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            rounds_of[name]()
            e.record()
            events[name].append((s, e))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1e3 / len(sides[name])
                                    for s, e in events[name]) for name in names}


def _time_calls_cpu(calls: list[Callable[[], object]]) -> float:
    """Dry runs only: one wall-clock round after a warm-up round."""
    for call in calls:
        call()
    t = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - t) * 1e6 / len(calls)


def free_device_memory() -> None:
    """Give a dropped engine's device memory back before the next engine sizes its K/V
    pool from what is free: its graphs and pools go only once the reference cycles
    through it are collected, and the allocator's cache is emptied."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"  in use after an engine's release: "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)


def copy_bandwidth_gbs(nbytes: int = 1 << 31) -> float:
    """Device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_(),
            torch.empty(nbytes, dtype=torch.uint8, device=device)]
    us = time_calls([lambda: bufs[1].copy_(bufs[0])], "eager", min_rounds=20, min_seconds=0.3)
    bufs.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / (us * 1e-6) / 1e9


def model_parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    """The arguments of the model-level benchmarks: ``--model`` (the 27B preset),
    ``--quick`` (a CPU smoke run), ``--kv-type`` (q4_0) and ``--out`` (docs/benchmarks)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3.5-27b")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parents[1] / "docs" / "benchmarks")
    return ap


def meta_line(meta: dict) -> str:
    """The header line every report carries: date, GPU, commit, torch and Triton."""
    return (f"{meta['date']} · {meta['gpu']} · commit {meta['commit']} · "
            f"torch {meta['torch']} · triton {meta['triton']}")


def report(out_dir: Path, stem: str, results: dict, markdown: str,
           figure_fn: Callable[[Path], None] | None) -> int:
    """``write_outputs``, then the report and the paths on stdout; a script's exit status."""
    paths = write_outputs(out_dir, stem, results, markdown, figure_fn)
    print(markdown)
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


def write_outputs(out_dir: Path, stem: str, results: dict, markdown: str,
                  figure_fn: Callable[[Path], None] | None) -> list[Path]:
    """Write ``stem``.json/.md/.png to ``out_dir``, and copies to ``$OUT`` when set."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    paths[0].write_text(json.dumps(results, indent=2, default=str) + "\n")
    paths[1].write_text(markdown)
    if figure_fn is not None:
        try:
            png = out_dir / f"{stem}.png"
            figure_fn(png)
            compact_png(png)
            paths.append(png)
        except Exception as exc:  # a plotting failure must not lose the numbers
            print(f"plot not written: {exc!r}")
    extra = os.environ.get("OUT")
    if extra and Path(extra).resolve() != out_dir.resolve():
        Path(extra).mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copy(p, Path(extra) / p.name)
    return paths


def compact_png(path: Path) -> None:
    """Rewrite ``path`` with a palette of at most 256 colours: a plot has a few dozen, and
    the palette image is several times smaller (``docs/benchmarks/`` stays under 1 MB)."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def table_read_fields(text: str) -> dict:
    """A launch spec's table-read field as ``DecodeConfig`` fields: ``row`` or ``block``,
    with a ``-now`` suffix for ``table_ahead=False`` (probe_decode.py, decode_sass.py)."""
    return {"table_read": text.removesuffix("-now"), "table_ahead": not text.endswith("-now")}


def md_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
