"""Verify graphs' buffers, padding and choice of steps (``engine/verify_graphs.py``), on
the CPU with a stand-in graph whose replay runs a fake pass over the static batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedserve.engine.runner import ModelRunner
from pagedserve.engine.verify_graphs import (
    VerifyGraphs,
    VerifyOutput,
    is_pure_verify,
    verify_graph_sizes,
)
from pagedserve.model.forward_batch import ForwardBatch

NULL_SLOT = 9
R = 3  # rows per sequence: k = 2
VOCAB, HIDDEN = 5, 4


def batch(query_lens: list[int], num_decode: int = 0) -> ForwardBatch:
    """Sequences with ``query_lens`` new rows over 10 + i cached rows each (slot i)."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [10 + i + n for i, n in enumerate(query_lens)]
    t, b = qsl[-1], len(query_lens)
    return ForwardBatch(
        input_ids=torch.arange(100, 100 + t), positions=torch.arange(50, 50 + t),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(1, 1 + b * 2, dtype=torch.int32).view(b, 2),
        slot_mapping=torch.arange(500, 500 + t), state_slots=torch.arange(b, dtype=torch.int32),
        logits_indices=torch.tensor(qsl[1:]) - 1, num_decode_seqs=num_decode,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def fake_pass(seen: list[ForwardBatch]):
    """A verify pass whose every output row is a function of its input id, and which
    remembers the batch (and its device tensors' values) it ran on."""

    def forward(b: ForwardBatch) -> VerifyOutput:
        seen.append(b)
        ids = b.input_ids.float()[:, None]  # [T, 1]
        return VerifyOutput(ids.repeat(1, HIDDEN), ids.repeat(1, VOCAB) * 2,
                            [(ids.repeat(1, 6), ids.repeat(1, 2), -ids.repeat(1, 2))])

    return forward


def stand_in(sizes: list[int], seen: list[ForwardBatch]) -> VerifyGraphs:
    """Graphs on the CPU: each "replay" runs the fake pass over the static batch and copies
    its rows into the shared outputs, as the captured graph does."""
    forward = fake_pass(seen)
    graphs = VerifyGraphs(forward, torch.device("cpu"), sizes, R, max_blocks_per_seq=4,
                          null_slot=NULL_SLOT, max_model_len=64)
    rows = sizes[-1] * R
    graphs.output = VerifyOutput(torch.zeros(rows, HIDDEN), torch.zeros(rows, VOCAB),
                                 [(torch.zeros(rows, 6), torch.zeros(rows, 2),
                                   torch.zeros(rows, 2))])

    def replay(size: int) -> None:
        out = forward(graphs.static_batch(size))
        n = out.hidden.shape[0]
        assert graphs.output is not None
        graphs.output.hidden[:n] = out.hidden
        graphs.output.logits[:n] = out.logits
        for dst, src in zip(graphs.output.gdn_inputs, out.gdn_inputs):
            for d, s in zip(dst, src):
                d[:n] = s

    graphs.graphs = {s: SimpleNamespace(replay=lambda s=s: replay(s)) for s in sizes}
    return graphs


def test_sizes_are_the_decode_buckets_up_to_the_token_budget():
    assert verify_graph_sizes(8, 4, None) == [1, 2, 4, 8]
    assert verify_graph_sizes(64, 4, 64) == [1, 2, 4, 8, 16]  # 16 sequences fill 64 rows
    assert verify_graph_sizes(64, 4, 70) == [1, 2, 4, 8, 16, 24]  # 17 need the 24 graph
    assert verify_graph_sizes(3, 2, 2) == [1]


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_smallest_captured_size_that_holds_the_batch(n, size):
    graphs = stand_in([1, 2, 4, 8], [])
    assert graphs.load(batch([R] * n)) == size


def test_padding_rows_write_nothing_and_padding_sequences_hold_no_rows():
    graphs = stand_in([1, 2, 4, 8], [])
    graphs.buffers["block_tables"].fill_(77)  # stale tables from an earlier step
    assert graphs.load(batch([R] * 3)) == 4
    b = graphs.buffers
    live = 3 * R
    assert b["input_ids"][:4 * R].tolist() == list(range(100, 100 + live)) + [0] * R
    assert b["positions"][:4 * R].tolist() == list(range(50, 50 + live)) + [0] * R
    assert b["slot_mapping"][:4 * R].tolist() == list(range(500, 500 + live)) + [-1] * R
    assert b["row_valid"][:4 * R].tolist() == [True] * live + [False] * R
    assert b["query_start_loc"][:5].tolist() == [0, 3, 6, 9, 9]  # padding: no rows
    assert b["seq_lens"][:4].tolist() == [13, 14, 15, 0]
    assert b["state_slots"][:4].tolist() == [0, 1, 2, NULL_SLOT]
    assert b["block_tables"][:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    static = graphs.static_batch(4)
    assert static.query_start_loc_cpu == [0, 3, 6, 9, 12]  # the captured host copy
    assert static.seq_lens_cpu == [64] * 4 and static.num_decode_seqs == 0
    assert static.input_ids.shape == (4 * R,) and static.row_valid is not None


def test_a_smaller_step_after_a_larger_one_pads_over_its_rows():
    graphs = stand_in([1, 2, 4, 8], [])
    graphs.load(batch([R] * 4))
    assert graphs.load(batch([R] * 1)) == 1
    b = graphs.buffers
    assert b["query_start_loc"][:2].tolist() == [0, 3] and b["row_valid"][:R].all()
    graphs.load(batch([R] * 5))
    assert graphs.load(batch([R] * 3)) == 4
    assert b["state_slots"][3] == NULL_SLOT and b["slot_mapping"][9:12].tolist() == [-1] * 3


def test_run_returns_the_live_rows_of_the_replayed_pass():
    seen: list[ForwardBatch] = []
    graphs = stand_in([1, 2, 4], seen)
    step = batch([R] * 3)
    assert graphs.fits(step)
    out = graphs.run(step)
    assert seen[-1].num_seqs == 4  # the padded size's static batch
    ids = torch.arange(100, 109).float()
    assert out.hidden.tolist() == ids[:, None].repeat(1, HIDDEN).tolist()
    assert out.logits.tolist() == (2 * ids[:, None]).repeat(1, VOCAB).tolist()
    (mixed, b, a), = out.gdn_inputs
    assert mixed.shape == (9, 6) and b[:, 0].tolist() == ids.tolist() and (a == -b).all()
    # hidden and logits are copies; the record is a view, valid until the next replay
    assert graphs.output is not None
    assert out.hidden.data_ptr() != graphs.output.hidden.data_ptr()
    assert mixed.data_ptr() == graphs.output.gdn_inputs[0][0].data_ptr()


def test_only_pure_verify_steps_fit():
    graphs = stand_in([1, 2, 4], [])
    assert graphs.fits(batch([R])) and graphs.fits(batch([R] * 4))
    assert not graphs.fits(batch([R] * 5))  # past the largest graph
    assert not graphs.fits(batch([1, R, R], num_decode=1))  # a plain decode row beside
    assert not graphs.fits(batch([R, R - 1]))  # a request drafting fewer than k
    assert not graphs.fits(batch([R, 17]))  # a prompt chunk
    assert not graphs.fits(batch([R + 1, R - 1]))  # same rows, other split
    assert not is_pure_verify(batch([1, 1], num_decode=2), 1)  # decode is not verify


def test_runner_verify_replays_only_what_fits():
    graphs = SimpleNamespace(fits=lambda b: b.num_seqs == 2,
                             run=lambda b: f"replayed {b.num_seqs}")
    runner = SimpleNamespace(verify_graphs=graphs)
    assert ModelRunner.verify(runner, batch([R, R])) == "replayed 2"
    assert ModelRunner.verify(runner, batch([R])) is None
    assert ModelRunner.verify(SimpleNamespace(verify_graphs=None), batch([R, R])) is None
