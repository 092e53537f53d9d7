"""Partition plan: balance, coverage and bounds; the device plan equals the host mirror."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_oracle import TRITON_DEVICE, needs_triton

from pagedserve.kernels.decode_plan import (
    DecodeConfig,
    DecodeWorkspace,
    locate_chunk,
    plan_chunks,
    program_chunk,
)

RAGGED = [131072] + [8192] * 7


def check_plan(lens, capacity, budget, block_n, min_p):
    part, chunks = plan_chunks(lens, capacity, budget, block_n, min_p)
    assert part % block_n == 0 and part >= min_p
    assert len(chunks) <= max(budget, len(lens)), "more chunks than programs"
    # Every sequence is covered exactly once, in order, by chunks of at most `part` tokens.
    for b, n in enumerate(lens):
        mine = [(s, e) for (bb, s, e) in chunks if bb == b]
        assert mine, f"sequence {b} has no chunk"
        assert mine[0][0] == 0 and mine[-1][1] == min(max(n, 0), capacity)
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(mine, mine[1:]))
        assert all(0 <= e - s <= part for s, e in mine)
    return part, chunks


def test_ragged_batch_has_no_long_tail():
    part, chunks = check_plan(RAGGED, 131072, budget=66, block_n=64, min_p=256)
    # cdiv(188416, 66) = 2855 -> 2880 makes 67 chunks (a second wave); 3008 makes 65.
    assert part == 3008 and len(chunks) == 44 + 7 * 3
    # Within 6% of a perfect split of the total work over the budget.
    assert part <= 1.06 * sum(RAGGED) / 66


@pytest.mark.parametrize("n,ctx,part", [(8, 131072, 16384), (4, 65536, 4096), (2, 16384, 512),
                                        (1, 131072, 2048)])
def test_uniform_batches_fill_one_wave_exactly(n, ctx, part):
    got, chunks = check_plan([ctx] * n, ctx, budget=66, block_n=64, min_p=256)
    assert got == part and len(chunks) == 64
    assert all(e - s == part for _, s, e in chunks)


def test_short_contexts_respect_min_partition():
    part, chunks = check_plan([4096], 4096, budget=66, block_n=64, min_p=256)
    assert part == 256 and len(chunks) == 16


@pytest.mark.parametrize("lens", [[0], [0, 0, 5], [1, 15, 16, 17, 31, 32, 33], [300, 10**9],
                                  [5] * 12, [4000] + [3] * 9])
def test_edge_lengths(lens):
    check_plan(lens, capacity=4096, budget=7, block_n=16, min_p=16)


def test_config_and_workspace_reject_bad_values():
    with pytest.raises(ValueError, match="block_n must be a power of 2"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="min_partition must be a positive multiple"):
        DecodeConfig(block_n=64, min_partition=96)
    with pytest.raises(ValueError, match=r"block_n must be 64 or 128 for num_warps=4, got 32"):
        DecodeConfig(block_n=32, num_warps=4, quant_dot="fragment")
    with pytest.raises(ValueError, match=r"block_n must be 16 or 32 for num_warps=1, got 64"):
        DecodeConfig(block_n=64, num_warps=1, quant_dot="fragment")
    assert DecodeConfig(block_n=64, num_warps=2, quant_dot="fragment").block_n == 64
    assert DecodeConfig(block_n=64, num_warps=4, quant_dot="fragment").block_n == 64
    with pytest.raises(ValueError, match="quant_dot 'int8'"):
        DecodeConfig(quant_dot="int8")
    for bad in (16, 100, 256):
        with pytest.raises(ValueError, match=f"maxnreg must be None or a multiple of 8 in "
                                             rf"\[32, 248\], got {bad}"):
            DecodeConfig(maxnreg=bad)
    assert DecodeConfig(maxnreg=168).maxnreg == 168
    with pytest.raises(ValueError, match=r"table_read 'page' is not a mode; accepted: "
                                         r"\['row', 'block'\]"):
        DecodeConfig(table_read="page")
    with pytest.raises(ValueError, match="occupancy must be in"):
        DecodeWorkspace(1, 8, 2, 64, "cpu", occupancy=0.0)
    for bad in (0.0, -1.0, 65.0):
        with pytest.raises(ValueError, match=rf"occupancy must be None or in \(0, 64\], "
                                             rf"got {bad}"):
            DecodeConfig(occupancy=bad)
    with pytest.raises(ValueError, match=r"num_q_heads \(6\) must be a positive multiple"):
        DecodeWorkspace(1, 6, 4, 64, "cpu")


def test_workspace_sizes():
    ws = DecodeWorkspace(8, 24, 4, 256, "cpu", occupancy=2.0, num_sms=132)
    assert ws.chunk_budget == 66 and ws.max_chunks == 66
    assert tuple(ws.part_acc.shape) == (4, 66, 6, 256)
    assert tuple(ws.part_ml.shape) == (4, 66, 6, 2)
    assert tuple(ws.group_counters.shape) == (4, 66) and tuple(ws.seq_counters.shape) == (8, 4)
    assert ws.counters_clear()
    assert DecodeWorkspace(100, 24, 4, 256, "cpu", num_sms=132).max_chunks == 100
    with pytest.raises(ValueError, match="batch 9 exceeds"):
        ws.check_fits(9, 24, 4, 256, torch.device("cpu"))


def test_launch_budget_never_exceeds_the_workspace():
    """A config's ``occupancy`` lowers the chunk budget of its launches (larger programs,
    fewer per SM); the workspace's W sizes the buffers, so no launch plans more."""
    ws = DecodeWorkspace(8, 24, 4, 256, "cpu", occupancy=2.0, num_sms=132)
    assert ws.budget_for(DecodeConfig()) == 66
    assert ws.budget_for(DecodeConfig(occupancy=1.0)) == 33
    assert ws.budget_for(DecodeConfig(occupancy=0.5)) == 17  # ceil(66 / 4)
    assert ws.budget_for(DecodeConfig(occupancy=4.0)) == 66
    forced = DecodeWorkspace(8, 24, 4, 256, "cpu", chunks_per_head=9, num_sms=132)
    assert forced.budget_for(DecodeConfig(occupancy=1.0)) == 9


@triton.jit
def _plan_probe(lens_ptr, out_ptr, batch, capacity, budget, reverse,
                B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, MIN_P: tl.constexpr,
                ALIGNED: tl.constexpr):
    pid = tl.program_id(0)
    n, chunk, seq, seq_chunks, first, lo, hi = locate_chunk(
        lens_ptr, batch, capacity, budget, pid, tl.arange(0, B_PAD), reverse != 0, BLOCK_N,
        MIN_P, ALIGNED)
    row = out_ptr + pid * 5
    tl.store(row, n)
    tl.store(row + 1, tl.where(chunk < n, chunk, -1))
    tl.store(row + 2, tl.where(chunk < n, seq, -1))
    tl.store(row + 3, tl.where(chunk < n, lo, -1))
    tl.store(row + 4, tl.where(chunk < n, hi, -1))


@needs_triton
@pytest.mark.parametrize("reverse,aligned", [(False, False), (True, False), (False, True)],
                         ids=["program-order", "reversed", "aligned-start"])
@pytest.mark.parametrize("lens,capacity,budget", [
    ([1, 15, 16, 17, 31, 32, 33], 64, 5),
    ([0, 200, 3, 0], 256, 9),
    ([1000, -4, 5], 512, 3),
    ([4000] + [3] * 9, 4096, 12),
    ([640] * 4, 640, 10),
])
def test_device_plan_equals_host_plan(lens, capacity, budget, reverse, aligned):
    """Every program finds the host mirror's chunk: program p takes chunk p, or chunk
    n - 1 - p reversed; the aligned start computes the same token ranges."""
    block_n, min_p = 16, 16
    b_pad = max(2, triton.next_power_of_2(len(lens)))
    grid = max(budget, len(lens))
    out = torch.full((grid, 5), -9, dtype=torch.int32, device=TRITON_DEVICE)
    _plan_probe[(grid,)](torch.tensor(lens, dtype=torch.int32, device=TRITON_DEVICE), out,
                         len(lens), capacity, budget, int(reverse), B_PAD=b_pad,
                         BLOCK_N=block_n, MIN_P=min_p, ALIGNED=aligned)
    _, chunks = plan_chunks(lens, capacity, budget, block_n, min_p)
    got = out.cpu().tolist()
    assert all(row[0] == len(chunks) for row in got)
    order = list(range(len(chunks)))[::-1] if reverse else list(range(len(chunks)))
    # The host mirror that trace readers use, for a head in the upper half of two.
    assert [program_chunk(p, 1, 2, len(chunks), reverse) for p in range(grid)] == (
        order + list(range(len(chunks), grid)))
    assert [r[1] for r in got[:len(chunks)]] == order
    assert [tuple(r[2:]) for r in got[:len(chunks)]] == [chunks[c] for c in order]
    assert all(r[1:] == [-1, -1, -1, -1] for r in got[len(chunks):])
