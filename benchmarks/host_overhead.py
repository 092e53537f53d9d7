"""Host time of one eager decode-attention call, and where it goes (cProfile).

``bench_attention.py``'s eager rows time calls issued from Python; at small sizes they
measure the host, not the kernel. This times the Python side alone: ``--calls`` calls
back to back with no sync in between (the GPU queue absorbs them while the host is the
slower side), wall time per call, then the same calls under cProfile, top functions by
own time. Inputs and launches are ``bench_attention``'s (``Runner``).

    python benchmarks/host_overhead.py --kv-type q4_0 f16 --lens 4096 ragged

``--dry-run`` runs toy sizes on the CPU under ``TRITON_INTERPRET=1`` (the Triton kernel,
so a check of the script, not of the GPU path). Writes ``host_overhead.json`` to $OUT
when set.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
from probe_decode import parse_launch  # noqa: E402


def host_us_per_call(call, calls: int) -> float:
    """Wall microseconds per call of ``calls`` back-to-back calls (synced before and
    after; the sync's own cost is spread over all calls)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def profile_top(call, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-type", nargs="+", default=["q4_0", "f16"])
    ap.add_argument("--lens", nargs="+", default=["4096", "ragged"],
                    help="'ragged' or comma-separated lengths")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    sizes = ba.DRY if args.dry_run else ba.FULL
    calls = 3 if args.dry_run else args.calls
    runner = ba.Runner(device)
    rows = []
    for kv_type in args.kv_type:
        launch = parse_launch("default", kv_type)
        for spec in args.lens:
            lens = sizes.ragged if spec == "ragged" else tuple(int(n) for n in spec.split(","))
            inp = ba.paged_inputs(kv_type, lens, seed=7, device=device)
            call = functools.partial(runner.ours, inp, launch)
            for _ in range(3):  # compile and warm up
                call()
            us = host_us_per_call(call, calls)
            sdpa_us = None
            if kv_type == "f16":
                contig = ba.contiguous_of(inp, max(lens))
                ba.sdpa(contig, "full")
                sdpa_us = host_us_per_call(functools.partial(ba.sdpa, contig, "full"), calls)
            print(f"== {kv_type} {spec}: {us:.1f} us per eager call"
                  + (f" (SDPA {sdpa_us:.1f})" if sdpa_us is not None else ""))
            print(profile_top(call, calls, args.top))
            rows.append({"kv_type": kv_type, "lens": spec, "us_per_call": us,
                         "sdpa_us_per_call": sdpa_us})
    out = os.environ.get("OUT")
    if out:
        Path(out, "host_overhead.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
