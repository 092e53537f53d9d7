"""Rollback graphs' counts and padding (``engine/rollback_graphs.py``), on the CPU with
stand-in graphs: a verify "replay" runs a fake pass over the static batch, and a
rollback "replay" runs the captured step with a fake rollback pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_verify_graphs import NULL_SLOT, R, batch, stand_in

from pagedserve.engine.rollback_graphs import RollbackGraphs
from pagedserve.engine.runner import ModelRunner


def stand_in_rollback(sizes: list[int], calls: list[dict]) -> RollbackGraphs:
    """Rollback graphs over stand-in verify graphs, whose fake pass logs the counts, the
    slots and the record it is given."""
    verify = stand_in(sizes, [])

    def rollback(num_rows, slots, rows_per_seq, inputs):
        assert inputs is verify.output.gdn_inputs  # the shared record buffers
        _, b, _ = inputs[0]
        calls.append({"num_rows": num_rows.tolist(), "slots": slots.tolist(),
                      "rows_per_seq": rows_per_seq,
                      "ids": [[int(b[s * rows_per_seq + j, 0]) for j in range(n)]
                              for s, n in enumerate(num_rows.tolist())]})

    graphs = RollbackGraphs(rollback, verify)
    graphs.graphs = {s: SimpleNamespace(replay=lambda s=s: graphs.step(s)) for s in sizes}
    return graphs


def test_a_replay_passes_the_steps_counts_slots_and_record():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 3))  # ids 100 .. 108, slots 0, 1, 2; padded to 4
    graphs.run([2, 3, 1])
    call, = calls
    assert call["slots"] == [0, 1, 2, NULL_SLOT]  # the verify replay's, padding null
    assert call["num_rows"] == [2, 3, 1, 0] and call["rows_per_seq"] == R
    assert call["ids"] == [[100, 101], [103, 104, 105], [106], []]  # each one's first rows
    assert graphs.buffers["num_rows"].tolist()[:4] == [2, 3, 1, 0]


def test_sequences_that_kept_every_draft_count_no_rows():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 3))
    graphs.run([0, 2, 0])
    call, = calls
    assert call["num_rows"] == [0, 2, 0, 0] and call["ids"] == [[], [103, 104], [], []]


def test_a_smaller_step_replays_its_own_size_with_zeros_past_its_sequences():
    calls: list[dict] = []
    graphs = stand_in_rollback([1, 2, 4, 8], calls)
    graphs.verify.run(batch([R] * 5))
    graphs.run([3, 3, 3, 3, 1])
    assert calls[-1]["num_rows"] == [3, 3, 3, 3, 1, 0, 0, 0]
    graphs.verify.run(batch([R] * 2))
    assert graphs.load([1, 2]) == 2
    assert graphs.buffers["num_rows"][:2].tolist() == [1, 2]
    graphs.run([1, 2])
    assert calls[-1]["num_rows"] == [1, 2] and calls[-1]["slots"] == [0, 1]
    assert calls[-1]["ids"] == [[100], [103, 104]]
    graphs.verify.run(batch([R] * 3))
    graphs.run([1, 1, 1])
    assert calls[-1]["num_rows"] == [1, 1, 1, 0]  # the fourth, padding, holds no rows


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
    assert [c["num_rows"] for c in calls] == [[0], [0, 0], [0, 0, 0, 0]]


def test_runner_rolls_back_by_graph_only_when_captured():
    runs: list[list[int]] = []
    runner = SimpleNamespace(rollback_graphs=SimpleNamespace(run=runs.append))
    assert ModelRunner.roll_back_verify(runner, [1, 2]) is True and runs == [[1, 2]]
    assert ModelRunner.roll_back_verify(SimpleNamespace(rollback_graphs=None), [1]) is False
