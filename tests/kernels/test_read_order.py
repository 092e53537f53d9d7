"""``physical_read_order`` against a plain-Python oracle, and decode attention over a
read-ordered table against the float64 oracle over the logical table (the reorder must
not change which rows are read, nor which block holds the partial tail)."""

from __future__ import annotations

import pytest
import torch
from kernel_oracle import TRITON_DEVICE, bound, build_pool, decode_oracle, needs_triton, rel_error

from pagedserve.kernels import ops
from pagedserve.kernels.decode_plan import DecodeConfig, DecodeWorkspace
from pagedserve.kernels.read_order import physical_read_order

pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def oracle(rows: list[list[int]], lens: list[int], block_size: int) -> list[list[int]]:
    out = []
    for row, n in zip(rows, lens, strict=True):
        full = n // block_size
        out.append(sorted(row[:full]) + row[full:])
    return out


@st.composite
def tables(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    cols = draw(st.integers(1, 12))
    batch = draw(st.integers(1, 5))
    ids = draw(st.permutations(range(batch * cols + 3)))
    rows, lens = [], []
    for b in range(batch):
        n = draw(st.integers(0, cols * block_size))
        used = -(-n // block_size)
        rows.append(list(ids[b * cols:b * cols + used]) + [-1] * (cols - used))
        lens.append(n)
    return rows, lens, block_size


@settings(max_examples=200, deadline=None)
@given(tables())
def test_full_blocks_sorted_tail_kept(case):
    rows, lens, block_size = case
    got = physical_read_order(torch.tensor(rows, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), block_size)
    assert got.dtype == torch.int32
    assert got.tolist() == oracle(rows, lens, block_size)


def test_rejects_bad_shapes_and_block_size():
    t = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"seq_lens \[B\].*\[2, 3\] and \[3\]"):
        physical_read_order(t, torch.zeros(3, dtype=torch.int32), 16)
    with pytest.raises(ValueError, match="block_size must be > 0, got 0"):
        physical_read_order(t, torch.zeros(2, dtype=torch.int32), 0)


def _decode(backend: str, k_type: str, v_type: str, lens: list[int]):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    hkv, group, d = 2, 3, 64
    ck, cv, table, logical = build_pool(k_type, v_type, lens, num_kv_heads=hkv, head_dim=d,
                                        seed=3, device=device, extra_blocks=40)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(4))
    q = q.to(torch.float16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    read = physical_read_order(table, seq_lens, ck.block_size)
    assert read.tolist() != table.tolist(), "the case must actually reorder blocks"
    ws = DecodeWorkspace(len(lens), hkv * group, hkv, d, device, chunks_per_head=12)
    out = ops.paged_decode_attention(q.to(device), ck, cv, read, seq_lens, d**-0.5,
                                     workspace=ws, backend=backend, validate=True,
                                     config=DecodeConfig(block_n=16, min_partition=16))
    return out, decode_oracle(q, ck, cv, logical, lens, d**-0.5)


# Tails of 1, 15 and 0 tokens, a split long sequence, a zero-length one.
LENS = [1 + 16 * 7, 15 + 16 * 5, 16 * 9, 150, 0]


@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q8_0")])
def test_reference_decode_over_read_order_matches_logical_oracle(k_type, v_type):
    out, ref = _decode("reference", k_type, v_type, LENS)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q8_0")])
def test_triton_decode_over_read_order_matches_logical_oracle(k_type, v_type):
    out, ref = _decode("triton", k_type, v_type, LENS)
    assert rel_error(out, ref) <= bound(k_type, v_type)
