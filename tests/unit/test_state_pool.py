"""Recurrent-state slots: zeroed on assignment, stale handles, null slot, batched layout."""

import pytest
import torch

from pagedserve.kv.handles import OutOfCapacityError, StaleHandleError
from pagedserve.kv.state_pool import StatePool, StateShapes

SHAPES = StateShapes(num_layers=3, conv=(10, 3), recurrent=(2, 4, 5), conv_dtype=torch.float32)


def test_layout_is_slot_indexed_per_layer_group_with_a_null_slot():
    pool = StatePool(SHAPES, num_slots=4, device="cpu")
    assert pool.conv_state.shape == (3, 5, 10, 3)
    assert pool.recurrent_state.shape == (3, 5, 2, 4, 5)
    assert pool.recurrent_state.dtype == torch.float32
    assert pool.null_slot == 4
    assert SHAPES.bytes_per_slot == 3 * (10 * 3 * 4 + 2 * 4 * 5 * 4)


def test_slot_is_zeroed_when_assigned_and_neighbours_are_untouched():
    pool = StatePool(SHAPES, num_slots=3, device="cpu")
    a, b = pool.acquire(), pool.acquire()
    pool.conv_state[:, pool.slot(a)].fill_(7.0)
    pool.recurrent_state[:, pool.slot(b)].fill_(3.0)
    pool.release(a)
    c = pool.acquire()  # the most recently released slot is reused first
    assert pool.slot(c) == a.index and c.generation == a.generation + 1
    assert torch.count_nonzero(pool.conv_state[:, pool.slot(c)]) == 0
    assert torch.all(pool.recurrent_state[:, pool.slot(b)] == 3.0)
    assert pool.slot(pool.acquire()) == 2


def test_stale_slot_handle_raises_and_capacity_is_enforced():
    pool = StatePool(SHAPES, num_slots=2, device="cpu")
    a = pool.acquire()
    pool.release(a)
    with pytest.raises(StaleHandleError, match="stale state slot handle"):
        pool.slot(a)
    with pytest.raises(StaleHandleError):
        pool.release(a)
    pool.acquire()
    pool.acquire()
    with pytest.raises(OutOfCapacityError, match="no free state slot"):
        pool.acquire()
    pool.check_invariants()
