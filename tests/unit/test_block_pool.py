"""Block pool and sequence manager: exact ids, transactions, misuse, copy-on-write."""

import pytest
import torch

from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.handles import OutOfCapacityError, StaleHandleError
from pagedserve.kv.kv_manager import EMPTY, BlockCopy, KVCacheManager


def manager(num_blocks=8, block_size=4, max_seqs=4, max_blocks=4) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size), max_seqs, max_blocks)


def test_pool_hands_out_exact_ids_and_reuses_least_recently_freed():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.decref([1])
    pool.decref([3])
    assert pool.allocate(1) == [5]  # never-used blocks queue ahead of freed ones
    assert pool.allocate(2) == [1, 3]
    assert pool.num_free_blocks == 0 and pool.utilization == 1.0


def test_pool_failed_allocation_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool.snapshot()
    assert pool.allocate(2) is None
    assert pool.snapshot() == before


def test_growth_allocates_exactly_at_block_boundaries():
    kv = manager(block_size=4)
    h = kv.create()
    expected_blocks = []
    for n in range(1, 14):
        assert kv.append(h, 1)
        expected_blocks = kv.block_ids(h)
        assert len(expected_blocks) == -(-n // 4), n
    assert expected_blocks == [0, 1, 2, 3]
    assert kv.block_table(h).tolist() == [0, 1, 2, 3]
    assert kv.block_table(h).dtype == torch.int32


def test_exact_block_ids_for_interleaved_sequences():
    kv = manager(num_blocks=8, block_size=4)
    a, b = kv.create(), kv.create()
    assert kv.append(a, 5)  # blocks 0, 1
    assert kv.append(b, 4)  # block 2
    assert kv.append(a, 4)  # crosses into block 3 (a holds 9 tokens)
    assert kv.block_ids(a) == [0, 1, 3]
    assert kv.block_ids(b) == [2]
    kv.free(a)  # 0, 1, 3 back to the queue behind 4..7
    c = kv.create()
    with pytest.raises(ValueError, match="above its capacity of 16"):
        kv.append(c, 20)  # 5 blocks would fit the pool, but a sequence holds at most 4
    assert kv.append(c, 16)
    assert kv.block_ids(c) == [4, 5, 6, 7]
    tables, lens = kv.batch_view([b, c], num_cols=4)
    assert tables.tolist() == [[2, EMPTY, EMPTY, EMPTY], [4, 5, 6, 7]]
    assert lens.tolist() == [4, 16]
    kv.check_invariants()


def test_slot_mapping_follows_the_block_table():
    kv = manager(num_blocks=8, block_size=4)
    a, b = kv.create(), kv.create()
    kv.append(a, 3)
    kv.append(b, 4)
    kv.append(a, 3)  # a: blocks [0, 2]
    slots = kv.slot_mapping(a, 0, 6).tolist()
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert slots == [0, 1, 2, 3, 8, 9]
    with pytest.raises(ValueError, match="outside the reserved range"):
        kv.slot_mapping(a, 0, 7)


def test_failed_reserve_leaves_everything_bit_for_bit_unchanged():
    kv = manager(num_blocks=4, block_size=4, max_blocks=8)
    a, b = kv.create(), kv.create()
    kv.append(a, 6)
    kv.append(b, 3)
    kv.reserve(a, 1)
    before = kv.snapshot()
    assert kv.reserve(b, 9) is False  # needs 2 more blocks, 1 free
    assert kv.append(a, 20) is False
    assert kv.snapshot() == before
    kv.check_invariants()


def test_reserve_then_commit_and_overcommit_error():
    kv = manager(block_size=4)
    h = kv.create()
    assert kv.reserve(h, 6)
    assert kv.num_tokens(h) == 0 and kv.num_reserved(h) == 6
    assert len(kv.block_ids(h)) == 2
    kv.commit(h, 6)
    assert kv.reserve(h, 2)  # fits in block 2's free rows: no allocation
    assert len(kv.block_ids(h)) == 2
    with pytest.raises(ValueError, match="only 2 are reserved"):
        kv.commit(h, 3)


def test_stale_handle_never_touches_the_new_owner():
    kv = manager(num_blocks=4, block_size=4)
    old = kv.create()
    kv.append(old, 4)
    kv.free(old)
    new = kv.create()  # same row, next generation
    assert new.index == old.index and new.generation == old.generation + 1
    kv.append(new, 4)
    before = kv.snapshot()
    for op in (lambda: kv.append(old, 1), lambda: kv.free(old), lambda: kv.block_table(old),
               lambda: kv.fork(old), lambda: kv.num_tokens(old)):
        with pytest.raises(StaleHandleError, match="stale sequence handle"):
            op()
    assert kv.snapshot() == before


def test_double_free_and_bad_sizes_raise_named_errors():
    kv = manager(block_size=4, max_blocks=2)
    h = kv.create()
    kv.append(h, 2)
    kv.free(h)
    with pytest.raises(StaleHandleError, match="released"):
        kv.free(h)
    h = kv.create()
    with pytest.raises(ValueError, match="num_new_tokens must be an int >= 0, got -1"):
        kv.append(h, -1)
    with pytest.raises(ValueError, match="above its capacity of 8"):
        kv.append(h, 9)
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.decref([0])
    with pytest.raises(ValueError, match=r"outside the pool \[0, 2\)"):
        pool.decref([5])
    with pytest.raises(ValueError, match="num_blocks must be > 0"):
        BlockPool(0)


def test_sequence_rows_run_out_cleanly():
    kv = manager(max_seqs=2)
    kv.create()
    kv.create()
    with pytest.raises(OutOfCapacityError, match="all 2 are in use"):
        kv.create()


def test_immediate_release_returns_blocks_at_once():
    kv = manager(num_blocks=4, block_size=4)
    h = kv.create()
    kv.append(h, 16)
    assert kv.pool.num_free_blocks == 0
    kv.free(h)
    assert kv.pool.num_free_blocks == 4
    kv.check_invariants()


def test_fork_shares_blocks_and_copies_on_write():
    kv = manager(num_blocks=8, block_size=4)
    parent = kv.create()
    kv.append(parent, 6)  # blocks [0, 1]; block 1 half full
    child = kv.fork(parent)
    assert kv.block_ids(child) == [0, 1]
    assert kv.pool.refcount(0) == 2 and kv.pool.refcount(1) == 2
    kv.check_invariants()
    assert kv.append(child, 1)  # writes into shared block 1 -> copy it first
    assert kv.block_ids(child) == [0, 2]
    assert kv.pending_copies == [BlockCopy(src=1, dst=2)]
    assert kv.pool.refcount(1) == 1
    assert kv.append(parent, 1)  # block 1 is the parent's alone now: no copy
    assert kv.block_ids(parent) == [0, 1]
    assert len(kv.pending_copies) == 1
    kv.free(parent)
    assert kv.pool.refcount(0) == 1
    kv.free(child)
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_fork_of_a_block_aligned_sequence_needs_no_copy():
    kv = manager(num_blocks=8, block_size=4)
    parent = kv.create()
    kv.append(parent, 8)
    child = kv.fork(parent)
    assert kv.append(child, 1)
    assert kv.block_ids(child) == [0, 1, 2]
    assert kv.pending_copies == []


def test_accounting_reports_blocks_bytes_and_utilisation():
    from pagedserve.kv.memory import KVFootprint

    per_block = KVFootprint(16, 4, 256, "q4_0", "f16", 16).bytes_per_block
    assert per_block == 16 * 16 * 4 * (144 + 512)
    pool = BlockPool(10, 16, per_block)
    pool.allocate(4)
    u = pool.usage()
    assert (u.num_total_blocks, u.num_used_blocks, u.num_free_blocks) == (10, 4, 6)
    assert u.utilization == 0.4
    assert u.used_bytes == 4 * per_block and u.total_bytes == 10 * per_block
