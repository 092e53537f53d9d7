"""One decode-attention case, launched a few times, for Nsight Compute to profile.

    ncu --clock-control none --kernel-name regex:_paged_decode --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight ... \
        python3 benchmarks/ncu_decode.py --kv-type q4_0 --lens ragged

``--lens``: ``ragged`` (128K + 7 x 8K, the issue's case) or comma-separated lengths.
The inputs, shapes and default launch configuration are those of ``bench_attention.py``;
``--launch`` takes a launch as ``probe_decode.py`` writes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import RAGGED, SCALE, paged_inputs  # noqa: E402

from pagedserve.kernels import paged_decode  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-type", default="q4_0")
    ap.add_argument("--lens", default="ragged")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--launch", default=None, help="a probe_decode.py launch (default: the "
                    "library's)")
    args = ap.parse_args(argv)
    lens = RAGGED if args.lens == "ragged" else tuple(int(n) for n in args.lens.split(","))
    config = workspace = None
    if args.launch:
        from bench_attention import HKV, HQ, D  # noqa: N811
        from probe_decode import parse_launch

        from pagedserve.kernels.decode_plan import DecodeWorkspace
        launch = parse_launch(args.launch, args.kv_type)
        config = launch.config
        workspace = DecodeWorkspace(len(lens), HQ, HKV, D, "cuda", occupancy=launch.occupancy)
    inp = paged_inputs(args.kv_type, lens, seed=7, device="cuda")
    for _ in range(args.calls):
        paged_decode.paged_decode_attention(inp.q, inp.k, inp.v, inp.tables, inp.lens, SCALE,
                                            out=inp.out, validate=False, config=config,
                                            workspace=workspace)
    torch.cuda.synchronize()
    print(f"{args.kv_type} {args.lens}: {args.calls} calls done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
