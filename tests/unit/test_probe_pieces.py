"""``benchmarks/tools/probe_pieces.py``: every layout's reader covers exactly the rows it should
(its checksum against the xor of all K and V words, computed by torch), in the Triton
interpreter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
import probe_pieces as pp  # noqa: E402


def _xor_reduce(x: torch.Tensor) -> int:
    # Independent of the probe's own fold: halve the tensor with bitwise xor until one word.
    x = x.flatten()
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, torch.zeros(1, dtype=x.dtype)])
        x = x[0::2] ^ x[1::2]
    return int(x[0])


@pytest.mark.parametrize("block_size,in_order,by_block", [
    (None, False, False), (16, False, False), (32, False, True), (16, True, True)])
def test_reader_checksums_every_row_once(block_size, in_order, by_block):
    n_seq, ctx, chunks = 2, 64, 2  # one 64-row tile per program
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randint(-2**31, 2**31 - 1, (n_seq, pp.HKV, ctx, pp.WORDS), generator=gen,
                          dtype=torch.int32) for _ in range(2))
    if block_size is None:
        side = pp.Side(k, v, None, 1, n_seq, ctx, chunks)
    else:
        table = pp.block_placement(n_seq, ctx, block_size, in_order,
                                   torch.Generator().manual_seed(1))
        side = pp.Side(pp.paged_copy(k, table), pp.paged_copy(v, table), table, block_size,
                       n_seq, ctx, chunks, by_block)
        if not in_order:
            assert not torch.equal(table.flatten(), torch.arange(table.numel(),
                                                                 dtype=torch.int32))
    side.run()
    assert side.checksum() == _xor_reduce(k ^ v)
    # Each program's own sum is the xor of its rows alone (sequence b, head h, chunk c).
    part = n_seq * ctx // chunks
    for c in range(chunks):
        b, lo = divmod(c * part, ctx)
        for h in range(pp.HKV):
            rows = k[b, h, lo:lo + part] ^ v[b, h, lo:lo + part]
            assert int(side.sums[h * chunks + c]) == _xor_reduce(rows)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_all_heads_reader_checksums_every_row_once(paged):
    """``--all-heads``: program c reads tokens [c P, c P + P) of every K/V head (P a
    quarter of the one-head chunk), 16 tokens per tile."""
    n_seq, ctx, chunks = 2, 64, 2
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randint(-2**31, 2**31 - 1, (n_seq, pp.HKV, ctx, pp.WORDS), generator=gen,
                          dtype=torch.int32) for _ in range(2))
    if paged:
        table = pp.block_placement(n_seq, ctx, 16, False, torch.Generator().manual_seed(3))
        side = pp.Side(pp.paged_copy(k, table), pp.paged_copy(v, table), table, 16, n_seq,
                       ctx, chunks, heads=pp.HKV)
    else:
        side = pp.Side(k, v, None, 1, n_seq, ctx, chunks, heads=pp.HKV)
    side.run()
    assert side.checksum() == _xor_reduce(k ^ v)
    part = n_seq * ctx // (chunks * pp.HKV)
    for c in range(chunks * pp.HKV):
        b, lo = divmod(c * part, ctx)
        rows = k[b, :, lo:lo + part] ^ v[b, :, lo:lo + part]
        assert int(side.sums[c]) == _xor_reduce(rows)
