"""Where the engine's allocator puts a sequence's blocks after many requests (CPU only).

The attention benchmark shuffles physical blocks over the whole pool, and on the H200
that costs paged f16 decode 3-4% against the contiguous layout at large footprints,
while a tile whose 8 blocks lie within 8 consecutive block ids (256 KB of K at f16 for
Qwen3.5) reads like the in-order layout (docs/kernel-decisions.md, "What the paged layout
costs"). This runs the engine's own ``Scheduler`` (default budget: 2048
tokens per step, prompts in chunks of 512, decodes first, preemption and admission
watermark included) over its ``KVCacheManager`` and ``BlockPool``, with the forward pass
simulated by committing the scheduled tokens, and a fixed number of requests kept in
the system (a finished one is replaced at once). It reports how the running sequences'
blocks lie at the end:

- **median run**: block-weighted median length of runs of consecutive ascending ids;
- **local tiles**: the fraction of 8-block tiles whose ids span fewer than 8.

    python benchmarks/tools/pool_placement.py [--seed N]

Prints a markdown table. No GPU, no model: placement only.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from _common import md_table  # noqa: E402

from pagedserve.engine.request import Request, RequestStatus, SamplingParams  # noqa: E402
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pagedserve.kv.block_pool import BlockPool  # noqa: E402
from pagedserve.kv.kv_manager import KVCacheManager  # noqa: E402
from pagedserve.kv.state_pool import StatePool, StateShapes  # noqa: E402

TILE_BLOCKS = 8  # a 128-token tile of 16-token blocks
# The recurrent states are not under study: the smallest the pool takes.
TINY_STATES = StateShapes(num_layers=1, conv=(1, 1), recurrent=(1, 1, 1),
                          conv_dtype=torch.float32)


@dataclass(frozen=True)
class Workload:
    name: str
    num_blocks: int
    max_seqs: int
    steps: int
    prompt: tuple[int, int]  # tokens, uniform in [lo, hi]
    output: tuple[int, int]


WORKLOADS = (
    Workload("8 seqs, 4K-8K prompts, 2K-6K outputs", 40_000, 8, 20_000, (4096, 8192),
             (2048, 6144)),
    Workload("16 seqs, 16K-64K prompts, 1K-4K outputs", 80_000, 16, 12_000, (16384, 65536),
             (1024, 4096)),
    Workload("64 seqs, 512-4K prompts, 256-2K outputs", 40_000, 64, 6_000, (512, 4096),
             (256, 2048)),
)


def simulate(w: Workload, seed: int) -> list[list[int]]:
    """The block lists of the requests running after ``w.steps`` scheduler steps."""
    rng = random.Random(seed)
    max_len = w.prompt[1] + w.output[1] + 1
    kv = KVCacheManager(BlockPool(w.num_blocks), w.max_seqs, -(-max_len // 16))
    sched = Scheduler(SchedulerConfig(max_num_seqs=w.max_seqs, max_model_len=max_len), kv,
                      StatePool(TINY_STATES, w.max_seqs, "cpu"))
    for i in range(w.steps):
        while sched.num_unfinished < w.max_seqs:
            sched.add(Request(f"{i}-{sched.num_unfinished}",
                              [1] * rng.randint(*w.prompt),
                              SamplingParams(max_tokens=rng.randint(*w.output))))
        for c in sched.schedule().chunks:  # the forward pass, simulated
            req = c.request
            kv.commit(req.kv_handle, c.num_tokens)
            req.num_computed_tokens += c.num_tokens
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(1)
                if len(req.output_token_ids) == req.params.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return [kv.block_ids(r.kv_handle) for r in sched.running]


def placement_stats(tables: list[list[int]]) -> dict:
    """``median_run`` (block-weighted, in blocks) and ``local_tiles`` (see the module
    docstring) of block lists."""
    runs, tiles, local = [], 0, 0
    for ids in tables:
        run = 1
        for a, b in zip(ids, ids[1:]):
            if b == a + 1:
                run += 1
            else:
                runs.append(run)
                run = 1
        if ids:
            runs.append(run)
        for i in range(0, len(ids) - TILE_BLOCKS + 1, TILE_BLOCKS):
            tile = ids[i:i + TILE_BLOCKS]
            tiles += 1
            local += max(tile) - min(tile) < TILE_BLOCKS
    weighted = sorted(r for r in runs for _ in range(r))
    return {"median_run": weighted[len(weighted) // 2] if weighted else 0,
            "local_tiles": local / tiles if tiles else 0.0, "tiles": tiles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = []
    for w in WORKLOADS:
        st = placement_stats(simulate(w, args.seed))
        rows.append([w.name, st["median_run"], f"{st['local_tiles']:.2f}", st["tiles"]])
    print(md_table(["workload", "median run (blocks)", "local tiles", "tiles"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
