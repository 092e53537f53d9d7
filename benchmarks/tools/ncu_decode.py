"""One decode-attention case, launched a few times, for Nsight Compute to profile.

    ncu --clock-control none --kernel-name regex:_paged_decode --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight ... \
        python3 benchmarks/tools/ncu_decode.py --kv-type q4_0 --lens ragged

``--lens``: ``ragged`` (128K + 7 x 8K, the issue's case) or comma-separated lengths.
The inputs, shapes and default launch configuration are those of ``bench_attention.py``;
``--launch`` takes a launch as ``probe_decode.py`` writes it; the calls run through the
benchmark's ``Runner`` (its workspace, so at most 8 sequences). ``--layout contiguous``
profiles the padded contiguous layout of the same values (the ratio's denominator).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/tools/
from bench_attention import RAGGED, Runner, contiguous_of, paged_inputs  # noqa: E402
from probe_decode import parse_launch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--lens", default="ragged")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--launch", default=None, help="a probe_decode.py launch (default: the "
                    "library's)")
    ap.add_argument("--layout", choices=("paged", "contiguous"), default="paged")
    ap.add_argument("--window", type=int, default=0, help="as probe_decode.py's")
    ap.add_argument("--block-size", type=int, default=None, help="as probe_decode.py's")
    args = ap.parse_args(argv)
    lens = RAGGED if args.lens == "ragged" else tuple(int(n) for n in args.lens.split(","))
    launch = parse_launch(args.launch or "default", args.kv_type)
    extra = {} if args.block_size is None else {"block_size": args.block_size}
    inp = paged_inputs(args.kv_type, lens, seed=7, device="cuda", window=args.window, **extra)
    if args.layout == "contiguous":
        inp = contiguous_of(inp, max(lens))
    runner = Runner("cuda")
    for _ in range(args.calls):
        runner.ours(inp, launch)
    torch.cuda.synchronize()
    print(f"{args.kv_type} {args.lens} {args.layout}: {args.calls} calls done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
