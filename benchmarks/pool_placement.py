"""Where the engine's allocator puts a sequence's blocks after many requests (CPU only).

The attention benchmark shuffles physical blocks over the whole pool, and on the H200
that costs paged f16 decode 3-4% against the contiguous layout at large footprints,
while a tile whose 8 blocks lie within 8 consecutive block ids (256 KB of K at f16 for
Qwen3.5) reads like the in-order layout (docs/benchmarks/README.md, "Where the placement
cost comes from"). This drives the engine's own ``KVCacheManager`` and ``BlockPool``
through a continuous-batching workload shaped like the scheduler's defaults
(``engine.scheduler``): per step 2048 tokens, decodes first (one token each), then
prompts in chunks of at most 512, oldest first; requests admitted while rows and blocks
last; finished sequences freed. It reports how the live sequences' blocks lie at the
end:

- **median run**: block-weighted median length of runs of consecutive ascending ids;
- **local tiles**: the fraction of 8-block tiles whose ids span fewer than 8.

    python benchmarks/pool_placement.py [--seed N]

Prints a markdown table. No GPU, no model: placement only.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import md_table  # noqa: E402

from pagedserve.kv.block_pool import BlockPool  # noqa: E402
from pagedserve.kv.kv_manager import KVCacheManager  # noqa: E402

TILE_BLOCKS = 8  # a 128-token tile of 16-token blocks
STEP_TOKENS, PREFILL_CHUNK = 2048, 512  # SchedulerConfig's defaults


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
    """The block lists of the sequences live after ``w.steps`` steps."""
    rng = random.Random(seed)
    mgr = KVCacheManager(BlockPool(w.num_blocks), w.max_seqs, w.num_blocks)
    prompt_left, output_left = {}, {}  # handle -> tokens, in admission order
    for _ in range(w.steps):
        while len(output_left) < w.max_seqs:
            handle = mgr.create()
            prompt_left[handle] = rng.randint(*w.prompt)
            output_left[handle] = rng.randint(*w.output)
        budget = STEP_TOKENS
        decoding = [h for h in output_left if not prompt_left[h]]
        prefilling = [h for h in output_left if prompt_left[h]]
        for handle in decoding + prefilling:
            n = 1 if not prompt_left[handle] else min(PREFILL_CHUNK, prompt_left[handle], budget)
            if n <= 0 or not mgr.reserve(handle, n):  # it waits a step
                continue
            mgr.commit(handle, n)
            budget -= n
            if prompt_left[handle]:
                prompt_left[handle] -= n
                continue
            output_left[handle] -= 1
            if not output_left[handle]:
                mgr.free(handle)
                del output_left[handle], prompt_left[handle]
    return [mgr.block_ids(h) for h in output_left if not prompt_left[h]]


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
