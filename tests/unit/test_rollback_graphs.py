"""Rollback graphs' counts, packing and padding (``engine/rollback_graphs.py``), on the
CPU with stand-in graphs: a verify "replay" runs a fake pass over the static batch, and a
rollback "replay" runs the captured step with a fake restore-and-advance pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_verify_graphs import NULL_SLOT, R, batch, stand_in

from pagedserve.engine.rollback_graphs import RollbackGraphs, pack_rows
from pagedserve.engine.runner import ModelRunner


def packed(num_rows: list[int], r: int) -> tuple[list[int], list[int]]:
    p = len(num_rows)
    qsl = torch.full((p + 1,), -7, dtype=torch.int32)
    rows = torch.full((p * r,), -7, dtype=torch.long)
    pack_rows(torch.tensor(num_rows, dtype=torch.int32), r, qsl, rows)
    return qsl.tolist(), rows.tolist()


def test_pack_rows_lays_each_sequences_first_rows_end_to_end():
    assert packed([2, 3, 0], 3) == ([0, 2, 5, 5], [0, 1, 3, 4, 5, 0, 0, 0, 0])
    assert packed([1, 1, 1, 1], 2) == ([0, 1, 2, 3, 4], [0, 2, 4, 6, 0, 0, 0, 0])
    assert packed([4, 4], 4) == ([0, 4, 8], list(range(8)))  # kept everything: in place
    assert packed([0, 0], 3) == ([0, 0, 0], [0] * 6)  # no rows: nothing to walk
    assert packed([3], 5) == ([0, 3], [0, 1, 2, 0, 0])


def test_pack_rows_matches_a_host_reference_for_random_counts():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        r = int(torch.randint(2, 9, (1,), generator=gen))
        p = int(torch.randint(1, 9, (1,), generator=gen))
        live = int(torch.randint(1, p + 1, (1,), generator=gen))
        counts = torch.randint(1, r + 1, (live,), generator=gen).tolist() + [0] * (p - live)
        want = [s * r + j for s, c in enumerate(counts) for j in range(c)]
        qsl, rows = packed(counts, r)
        assert qsl == [0] + torch.tensor(counts).cumsum(0).tolist()
        assert rows == want + [0] * (p * r - len(want))


def stand_in_rollback(sizes: list[int], calls: list[dict]) -> RollbackGraphs:
    """Rollback graphs over stand-in verify graphs, whose fake pass logs what it restores
    and the record rows it advances over."""
    verify = stand_in(sizes, [])

    def rollback(restore, fb, inputs, rows):
        mixed, b, _ = inputs[0]
        calls.append({"restore": restore.tolist(), "slots": fb.state_slots.tolist(),
                      "qsl": fb.query_start_loc.tolist(), "qsl_cpu": fb.query_start_loc_cpu,
                      "row_valid": fb.row_valid, "ids": b[rows, 0].long().tolist(),
                      "num_rows": rows.shape[0]})

    graphs = RollbackGraphs(rollback, verify)
    graphs.graphs = {s: SimpleNamespace(replay=lambda s=s: graphs.step(s)) for s in sizes}
    return graphs


def test_a_replay_restores_the_steps_slots_and_packs_their_kept_rows():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 3))  # ids 100 .. 108, slots 0, 1, 2; padded to 4
    graphs.run([2, 3, 1])
    call, = calls
    assert call["slots"] == [0, 1, 2, NULL_SLOT]  # the verify replay's, padding null
    assert call["restore"] == [0, 1, 2, 0]  # padding: sequence 0's slot again
    assert call["qsl"] == [0, 2, 5, 6, 6] and call["qsl_cpu"] == [0, 3, 6, 9, 12]
    assert call["row_valid"] is None and call["num_rows"] == 4 * R
    kept = [100, 101, 103, 104, 105, 106]
    assert call["ids"] == kept + [100] * (4 * R - len(kept))  # the rest: row 0, walked by none
    assert graphs.buffers["num_rows"].tolist()[:4] == [2, 3, 1, 0]


def test_sequences_with_no_rows_are_left_alone():
    """Sequences that kept every draft count 0 rows, like padding: their places in the
    restore go to the first sequence that walks rows, and they walk none."""
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 3))
    graphs.run([0, 2, 0])
    call, = calls
    assert call["restore"] == [1, 1, 1, 1] and call["qsl"] == [0, 0, 2, 2, 2]
    assert call["ids"] == [103, 104] + [100] * (4 * R - 2)


def test_a_smaller_step_replays_its_own_size_with_zeros_past_its_sequences():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 5))
    graphs.run([3, 3, 3, 3, 1])
    graphs.verify.run(batch([R] * 2))
    assert graphs.load([1, 2]) == 2
    assert graphs.buffers["num_rows"][:2].tolist() == [1, 2]
    graphs.run([1, 2])
    assert calls[-1]["qsl"] == [0, 1, 3] and calls[-1]["restore"] == [0, 1]
    assert calls[-1]["ids"] == [100, 103, 104, 100, 100, 100]
    graphs.verify.run(batch([R] * 3))
    graphs.run([1, 1, 1])
    assert calls[-1]["qsl"] == [0, 1, 2, 3, 3]  # the fourth, padding, holds no rows


def test_counts_are_checked_against_the_last_replay():
    graphs = stand_in_rollback([1, 2, 4], [])
    with pytest.raises(AssertionError):  # no verify replay yet
        graphs.load([1])
    graphs.verify.run(batch([R] * 2))
    for bad in ([], [1, 1, 1], [-1, 1], [R + 1, 1]):
        with pytest.raises(AssertionError):
            graphs.load(bad)


def test_an_idle_replay_keeps_no_rows_at_every_size():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4], calls)
    graphs.verify.run(batch([R] * 3))
    graphs.replay_idle()
    assert [c["qsl"] for c in calls] == [[0] * 2, [0] * 3, [0] * 5]
    assert [c["restore"] for c in calls] == [[0], [0, 0], [0, 0, 0, 0]]  # slot 0 only


def test_runner_rolls_back_by_graph_only_when_captured():
    runs: list[list[int]] = []
    runner = SimpleNamespace(rollback_graphs=SimpleNamespace(run=runs.append))
    assert ModelRunner.roll_back_verify(runner, [1, 2]) is True and runs == [[1, 2]]
    assert ModelRunner.roll_back_verify(SimpleNamespace(rollback_graphs=None), [1]) is False


def test_rows_past_the_graphs_limit_roll_back_eagerly(monkeypatch):
    from pagedserve.engine import rollback_graphs

    verify = stand_in([1, 2], [])
    monkeypatch.setattr(rollback_graphs, "MAX_CAPTURED_ROWS", R - 1)
    assert RollbackGraphs.try_capture(lambda *a: None, verify) is None
