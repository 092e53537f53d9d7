"""``benchmarks/tools/pool_placement.py``: its statistics on hand-built block lists, and a
simulation that keeps the pool's invariants."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import pool_placement as pp  # noqa: E402


def test_stats_of_hand_built_tables():
    # Runs of the first list: [0..9] (10), [20, 21] (2), [5] (1); of the second: [100],
    # [3], [50] (1 each), [4..8] (5). Block-weighted, sorted: four 1s, two 2s, five 5s,
    # ten 10s (21 entries): the median (entry 10) is 5. Tiles of 8: [0..7] spans 7
    # (local); [100, 3, 50, 4, 5, 6, 7, 8] spans 97 (not).
    st = pp.placement_stats([list(range(10)) + [20, 21, 5], [100, 3, 50, 4, 5, 6, 7, 8]])
    assert st == {"median_run": 5, "local_tiles": 0.5, "tiles": 2}
    assert pp.placement_stats([]) == {"median_run": 0, "local_tiles": 0.0, "tiles": 0}


def test_simulation_leaves_disjoint_in_pool_tables():
    w = pp.Workload("tiny", 400, 6, 300, (40, 200), (10, 60))
    tables = pp.simulate(w, seed=3)
    ids = [b for t in tables for b in t]
    assert tables and len(ids) == len(set(ids)) and all(0 <= b < 400 for b in ids)
