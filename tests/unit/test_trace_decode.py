"""``benchmarks/tools/trace_decode.py``'s per-SM statistic on hand-built trace records."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import trace_decode as td  # noqa: E402


def _record(sm: int, tiles: int, ns_per_tile: int, planned: int = 1) -> list[int]:
    # TRACE_FIELDS: entry, planned, loop, looped, stored, merged, sm, tiles.
    loop = 500
    looped = loop + tiles * ns_per_tile
    return [0, planned, loop, looped, looped + 10, looped + 20, sm, tiles]


def test_same_slow_sms_correlate_fully():
    # Call A: SM s takes 1000 + 100 s ns per tile; call B: twice that, plus 50 (an exact
    # linear function of A, so the correlation is 1); call C: the order reversed (-1).
    a = [_record(s, 8, 1000 + 100 * s) for s in range(5)]
    b = [_record(s, 8, 2050 + 200 * s) for s in range(5)]
    c = [_record(s, 8, 3000 - 100 * s) for s in range(5)]
    assert math.isclose(td.sm_tile_correlation(a, b), 1.0)
    assert math.isclose(td.sm_tile_correlation(a, c), -1.0)


def test_short_and_idle_programs_do_not_count():
    # A second program on SM 0 with 2 tiles (under min_tiles) and one without work
    # (planned 0) would reverse SM 0's mean if they counted.
    a = [_record(s, 8, 1000 + 100 * s) for s in range(4)]
    extra = [_record(0, 2, 90000), _record(0, 8, 90000, planned=0)]
    b = [_record(s, 8, 1000 + 100 * s) for s in range(4)] + extra
    assert math.isclose(td.sm_tile_correlation(a, b), 1.0)
    # Two SMs in common are too few for a correlation.
    assert math.isnan(td.sm_tile_correlation(a[:2], b[:2]))


def test_each_sm_counts_its_last_loop_end():
    # SM 0 runs two programs whose loops end at 1000 and 9000 ns, SMs 1 and 2 one each
    # (4000, 6000); a program without work is left out. Per SM: 9000, 4000, 6000 ns.
    rows = [[0, 1, 500, end, end + 10, end + 20, sm, 4]
            for sm, end in ((0, 1000), (0, 9000), (1, 4000), (2, 6000))]
    rows.append([0, 0, 0, 0, 0, 0, 3, 0])
    st = td.summarize(torch.tensor(rows))
    assert st["programs"] == 4 and st["looped_max_us"] == 9.0
    per_sm = (st["sm_looped_p10_us"], st["sm_looped_p50_us"], st["sm_looped_max_us"])
    assert per_sm == (4.0, 6.0, 9.0)
