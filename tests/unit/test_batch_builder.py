"""``build_forward_batch``: what a step's tensors hold, with and without reusable staging."""

from __future__ import annotations

import torch

from pagedserve.engine.batch_builder import (
    HostStaging,
    SeqChunk,
    build_forward_batch,
    table_width,
)
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.kv_manager import KVCacheManager

FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
          "slot_mapping", "state_slots", "logits_indices")


def _manager_with(lengths: list[int]) -> tuple[KVCacheManager, list]:
    kv = KVCacheManager(BlockPool(64, 4), max_num_seqs=4, max_blocks_per_seq=16)
    handles = []
    for n in lengths:
        h = kv.create()
        assert kv.append(h, n)
        handles.append(h)
    return kv, handles


def test_decode_then_prefill_rows_are_laid_out_in_order() -> None:
    # Two decode rows (at positions 9 and 2), then a 3-token chunk at positions 5..7.
    kv, (a, b, c) = _manager_with([10, 3, 8])
    chunks = [SeqChunk(a, 0, (11,), 9), SeqChunk(b, 1, (12,), 2), SeqChunk(c, 2, (1, 2, 3), 5)]
    batch = build_forward_batch(chunks, kv)
    assert batch.input_ids.tolist() == [11, 12, 1, 2, 3]
    assert batch.positions.tolist() == [9, 2, 5, 6, 7]
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5]
    assert batch.seq_lens.tolist() == [10, 3, 8]
    assert batch.logits_indices.tolist() == [0, 1, 4]
    assert batch.state_slots.tolist() == [0, 1, 2]
    assert batch.num_decode_seqs == 2
    # Slot = block id * block size + offset, read from each sequence's own blocks.
    want = [kv.block_ids(a)[9 // 4] * 4 + 1, kv.block_ids(b)[0] * 4 + 2]
    want += [kv.block_ids(c)[p // 4] * 4 + p % 4 for p in (5, 6, 7)]
    assert batch.slot_mapping.tolist() == want
    # The widest table has 3 blocks; the width pads to 16 columns (``table_width``).
    assert batch.block_tables.shape == (3, 16)
    assert batch.block_tables[0, :3].tolist() == kv.block_ids(a)


def test_staging_gives_the_same_batches_and_bypasses_when_too_small() -> None:
    kv, (a, b, c) = _manager_with([10, 3, 8])
    staging = HostStaging("cpu", max_tokens=4, max_seqs=3, max_blocks=16)
    steps = [
        [SeqChunk(a, 0, (11,), 9), SeqChunk(b, 1, (12,), 2)],
        [SeqChunk(c, 2, (1, 2, 3), 5)],
        [SeqChunk(a, 0, (7,), 9), SeqChunk(b, 1, (8,), 2), SeqChunk(c, 2, (1, 2, 3), 5)],
    ]  # the last has 5 tokens: more than the staging holds
    for chunks in steps:
        plain = build_forward_batch(chunks, kv)
        staged = build_forward_batch(chunks, kv, staging=staging)
        for name in FIELDS:
            assert torch.equal(getattr(staged, name), getattr(plain, name)), name
        assert staged.block_tables.dtype == torch.int32


def test_table_widths_are_multiples_of_16_or_the_cap() -> None:
    """One specialization of the decode kernels' table stride for every batch: widths are
    multiples of 16 (at least 2 columns, never the contiguous layout's one), or the cap."""
    for max_blocks in (1, 2, 16, 17, 2050):
        for widest in range(1, max_blocks + 1):
            w = table_width(widest, max_blocks)
            assert widest <= w <= max_blocks
            assert w == max_blocks or (w % 16 == 0 and w - widest < 16)
            assert w >= min(2, max_blocks)


def test_every_vector_starts_on_a_16_byte_boundary() -> None:
    """Triton specializes pointers on 16-byte alignment: a section whose start moved with
    the batch's token or sequence count would compile a kernel variant mid-serving."""
    kv, handles = _manager_with([10, 3, 8, 5])
    staging = HostStaging("cpu", max_tokens=16, max_seqs=4, max_blocks=16)
    for num_decode in range(5):
        for chunk_len in range(0, 6):
            chunks = [SeqChunk(h, i, (1,), 2) for i, h in enumerate(handles[:num_decode])]
            if chunk_len and num_decode < 4:
                chunks.append(SeqChunk(handles[3], 3, tuple(range(chunk_len)), 0))
            if not chunks:
                continue
            for stage in (None, staging):
                batch = build_forward_batch(chunks, kv, staging=stage)
                for name in FIELDS:
                    assert getattr(batch, name).data_ptr() % 16 == 0, (name, len(chunks))
                assert batch.seq_lens.tolist() == [c.start_pos + len(c.token_ids)
                                                   for c in chunks]
                assert batch.state_slots.tolist() == [c.state_slot for c in chunks]
