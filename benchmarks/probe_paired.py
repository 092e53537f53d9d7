"""Experiment: paged f16 decode with each block-head's K and V rows adjacent in one pool
(``[num_blocks, Hkv, 2, BS, D]``, so a block-head is one 16 KB piece) against the
library's two pools (two 8 KB pieces), and the contiguous layout; one process, sides
timed together (graph replay). Prints paged / contiguous for both pool layouts."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import bench_attention as ba  # noqa: E402
from probe_decode import parse_case  # noqa: E402

from pagedserve.kernels.decode_plan import DecodeConfig, DecodeWorkspace, default_occupancy  # noqa: E402
from pagedserve.kernels.paged_decode import paged_decode_attention  # noqa: E402


def main() -> int:
    cases = sys.argv[1:] or ["4096x1", "4096x2", "4096x4", "4096x8", "16384x1", "16384x2",
                             "65536x1", "131072x8", "ragged"]
    ws = DecodeWorkspace(8, ba.HQ, ba.HKV, ba.D, "cuda", occupancy=default_occupancy("f16", "f16"))
    l2 = _common.run_meta()["l2_bytes"]
    cfgs = {"64:3:block": DecodeConfig(block_n=64, num_warps=4, num_stages=3, min_partition=128,
                                       table_read="block")}
    for spec in cases:
        lens = parse_case(spec, ba.RAGGED)
        n = ba.copies_for(ba.live_bytes("f16", lens), l2, ba.FULL)
        std = [ba.paged_inputs("f16", lens, 7 + i, "cuda") for i in range(n)]
        contig = [ba.contiguous_of(p, max(lens)) for p in std]
        pools = []
        for p in std:
            nb, hkv, bs, d = p.k.data.shape
            pool = torch.empty(nb, hkv, 2, bs, d, dtype=p.k.data.dtype, device="cuda")
            pool[:, :, 0] = p.k.data
            pool[:, :, 1] = p.v.data
            pools.append(pool)
        outs = [torch.empty_like(p.q) for p in std]

        def run(inp, out=None, pool=None, cfg=None):
            return paged_decode_attention(inp.q, inp.k, inp.v, inp.tables, inp.lens, ba.SCALE,
                                          workspace=ws, out=inp.out if out is None else out,
                                          validate=False, config=cfg, paired_pool=pool)
        for name, cfg in cfgs.items():
            run(std[0], outs[0], pools[0], cfg)
            run(std[0])
            ref = std[0].out.float()
            err = (outs[0].float() - ref).abs().max().item() / ref.abs().max().item()
            sides = {"paged": [lambda i=i: run(std[i]) for i in range(n)],
                     "paired": [lambda i=i: run(std[i], outs[i], pools[i], cfg) for i in range(n)],
                     "contig": [lambda i=i: run(contig[i]) for i in range(n)]}
            us = _common.time_sides(sides, "graph", min_rounds=8, min_seconds=0.05)
            print(f"{spec:>10} paired {name}: paged {us['paged']:7.1f} us  paired "
                  f"{us['paired']:7.1f} us  contig {us['contig']:7.1f} us  paged/contig "
                  f"{us['contig'] / us['paged']:.3f}  paired/contig "
                  f"{us['contig'] / us['paired']:.3f}  (paired vs paged output: {err:.1e})",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
