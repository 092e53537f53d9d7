"""The drafter's graphs' buffers, padding, size choice and tails (``engine/draft_graphs.py``),
on the CPU with stand-in graphs whose replay runs a fake pass over the static batch, and a
fake head over the whole vocabulary or a subset of it."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from pagedserve.engine.draft_graphs import DraftGraphs, ObserveGraphs, ProposeGraphs
from pagedserve.model.forward_batch import ForwardBatch

NULL_SLOT = 9
K = 3  # drafts: passes 1 and 2 chain
R = K + 1
HIDDEN, VOCAB = 2, 50  # VOCAB: the draft logits' columns
SIZES = [1, 2, 4, 8]


def fake_pass(seen: list[ForwardBatch]):
    """The head's output: its input state plus the row's token id, in every column."""

    def forward(b: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        seen.append(b)
        return hidden + b.input_ids.float()[:, None]

    return forward


def fake_logits(h: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, VOCAB]`` peaking at column ``h[:, 0] mod VOCAB``."""
    peak = h[:, 0].long() % VOCAB
    return -(torch.arange(VOCAB)[None, :] - peak[:, None]).abs().float()


class FakeHead:
    """``fake_logits`` over ``VOCAB`` columns; column ``c`` scores target id
    ``stride * c`` (``stride`` 1: the whole vocabulary)."""

    def __init__(self, stride: int = 1) -> None:
        self.num_rows, self.stride = VOCAB, stride

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return fake_logits(h)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        return columns * self.stride


def stand_in_propose(seen: list[ForwardBatch], stride: int = 1) -> ProposeGraphs:
    graphs = ProposeGraphs(fake_pass(seen), FakeHead(stride), torch.device("cpu"),
                           torch.float32, SIZES, K, HIDDEN, max_blocks_per_seq=4,
                           null_slot=NULL_SLOT)
    graphs.graphs = {(s, j): SimpleNamespace(replay=partial(graphs.run_pass, s, j))
                     for s in SIZES for j in range(1, K)}
    return graphs


def stand_in_observe(seen: list[ForwardBatch]) -> ObserveGraphs:
    graphs = ObserveGraphs(fake_pass(seen), FakeHead(), torch.device("cpu"), torch.float32,
                           SIZES, R, HIDDEN, max_blocks_per_seq=4, null_slot=NULL_SLOT,
                           max_model_len=64)
    graphs.graphs = {s: SimpleNamespace(replay=partial(graphs.run_pass, s)) for s in SIZES}
    return graphs


def tails(hidden: list[float], peaks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.tensor(hidden)[:, None].repeat(1, HIDDEN)  # [B, H]
    return h, fake_logits(torch.tensor(peaks, dtype=torch.float32)[:, None])


def load_three(graphs: ProposeGraphs) -> int:
    """Sequences drafting 3, 1 and 2 tokens from K/V rows 10, 30 and 20."""
    hidden, logits = tails([1.0, 2.0, 3.0], [5, 7, 9])
    return graphs.load(hidden, logits, [[10, 11], [], [20]], [[110, 111], [], [220]],
                       torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32))


def test_propose_holds_batches_up_to_the_largest_size_and_k_drafts():
    graphs = stand_in_propose([])
    assert graphs.holds(8, K) and graphs.holds(1, 2)
    assert not graphs.holds(9, K) and not graphs.holds(3, K + 1)
    with pytest.raises(ValueError, match="num_drafts >= 2"):
        ProposeGraphs(fake_pass([]), FakeHead(), torch.device("cpu"), torch.float32, SIZES, 1,
                      HIDDEN, 4, NULL_SLOT)


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8)])
def test_propose_takes_the_smallest_size_that_holds_the_batch(n, size):
    graphs = stand_in_propose([])
    hidden, logits = tails([1.0] * n, [2] * n)
    rows = [[40 + i] for i in range(n)]
    assert graphs.load(hidden, logits, rows, rows, torch.zeros(n, 2, dtype=torch.int32)) == size


def test_propose_rows_past_a_sequences_drafts_and_padding_sequences_write_nothing():
    graphs = stand_in_propose([])
    graphs.buffers["block_tables"].fill_(77)  # stale tables from an earlier step
    assert load_three(graphs) == 4
    b = graphs.buffers
    assert b["ids"][0, :3].tolist() == [5, 7, 9]  # draft 1: the tails' argmax
    assert b["hidden"][0, :3, 0].tolist() == [1.0, 2.0, 3.0]
    # pass 1 writes rows 10 and 20 (RoPE positions 11, 21); pass 2 only row 11
    assert b["positions"][:, :4].tolist() == [[11, 0, 21, 0], [12, 0, 0, 0]]
    assert b["seq_lens"][:, :4].tolist() == [[11, 0, 21, 0], [12, 0, 0, 0]]
    assert b["slot_mapping"][:, :4].tolist() == [[110, -1, 220, -1], [111, -1, -1, -1]]
    assert b["block_tables"][:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    static = graphs.static_batch(4, 2)
    assert static.num_decode_seqs == 4 and static.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert static.input_ids.data_ptr() == b["ids"][1].data_ptr()  # reads draft 2
    assert static.state_slots.tolist() == [NULL_SLOT] * 4


def test_a_smaller_propose_after_a_larger_one_pads_over_its_rows():
    graphs = stand_in_propose([])
    hidden, logits = tails([1.0] * 8, [2] * 8)
    rows = [[40 + i, 41 + i] for i in range(8)]
    graphs.load(hidden, logits, rows, rows, torch.zeros(8, 2, dtype=torch.int32))
    assert load_three(graphs) == 4
    assert graphs.buffers["slot_mapping"][:, 3].tolist() == [-1, -1]
    assert graphs.buffers["seq_lens"][:, 3].tolist() == [0, 0]


def test_each_pass_chains_on_the_previous_ones_output_and_draft():
    seen: list[ForwardBatch] = []
    graphs = stand_in_propose(seen)
    size = load_three(graphs)
    for j in range(1, K):
        graphs.replay(size, j)
    b = graphs.buffers
    assert [s.num_seqs for s in seen] == [4, 4]
    # pass 1: hidden 1 + draft 5 = 6 (draft 2 = 6); pass 2: 6 + 6 = 12 (draft 3 = 12)
    assert b["hidden"][1, :3, 0].tolist() == [6.0, 9.0, 12.0]
    assert b["ids"][1, :3].tolist() == [6, 9, 12]
    assert b["ids"][2, 0] == 12 and b["hidden"][2, 0, 0] == 12.0
    assert b["logits"][2, 0].argmax() == 12
    # a draw written between passes is what the next pass reads
    b["ids"][1, 0] = 20
    graphs.replay(size, 2)
    assert b["ids"][2, 0] == 26


def test_passes_over_a_vocabulary_subset_draft_target_ids():
    """Each pass's greedy draft is the target id of its argmax column, and the next pass
    embeds that id: the head's columns are ids 0, 3, 6, ... here."""
    seen: list[ForwardBatch] = []
    graphs = stand_in_propose(seen, stride=3)
    size = load_three(graphs)
    b = graphs.buffers
    assert b["logits"].shape == (K, SIZES[-1], VOCAB)  # [k, P, N']
    assert b["ids"][0, :3].tolist() == [15, 21, 27]  # columns 5, 7, 9
    graphs.replay(size, 1)
    assert seen[-1].input_ids[:3].tolist() == [15, 21, 27]
    # hidden 1 + id 15 = 16: column 16, id 48 (likewise 2 + 21, 3 + 27)
    assert b["ids"][1, :3].tolist() == [48, 69, 90]
    assert b["logits"][1, :3].argmax(dim=-1).tolist() == [16, 23, 30]


def observe_batch(query_lens: list[int]) -> ForwardBatch:
    """Sequences keeping ``query_lens`` rows over 10 + i cached rows each."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [10 + i + n for i, n in enumerate(query_lens)]
    t, b = qsl[-1], len(query_lens)
    return ForwardBatch(
        input_ids=torch.arange(100, 100 + t), positions=torch.arange(51, 51 + t),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(1, 1 + b * 2, dtype=torch.int32).view(b, 2),
        slot_mapping=torch.arange(500, 500 + t), state_slots=torch.arange(b, dtype=torch.int32),
        logits_indices=torch.tensor(qsl[1:]) - 1, num_decode_seqs=0,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def test_observe_fits_one_to_r_rows_per_sequence():
    graphs = stand_in_observe([])
    assert graphs.fits([1, R, 2]) and graphs.fits([R] * 8)
    assert not graphs.fits([R] * 9)  # past the largest size
    assert not graphs.fits([R + 1])  # a prompt chunk
    assert not graphs.fits([0, 1])


def test_observe_pads_rows_and_sequences():
    graphs = stand_in_observe([])
    graphs.buffers["block_tables"].fill_(77)
    batch = observe_batch([2, 4, 1])
    assert graphs.load(batch, torch.ones(7, HIDDEN)) == 4
    b, rows = graphs.buffers, 4 * R
    assert b["input_ids"][:rows].tolist() == list(range(100, 107)) + [0] * 9
    assert b["positions"][:rows].tolist() == list(range(51, 58)) + [0] * 9
    assert b["slot_mapping"][:rows].tolist() == list(range(500, 507)) + [-1] * 9
    assert b["row_valid"][:rows].tolist() == [True] * 7 + [False] * 9
    assert b["query_start_loc"][:5].tolist() == [0, 2, 6, 7, 7]  # real counts; padding: none
    assert b["seq_lens"][:4].tolist() == [12, 15, 13, 0]
    assert b["logits_indices"][:4].tolist() == [1, 5, 6, 0]
    assert b["state_slots"][:4].tolist() == [NULL_SLOT] * 4
    static = graphs.static_batch(4)
    assert static.query_start_loc_cpu == list(range(0, rows + 1, R))  # the captured copy
    assert static.seq_lens_cpu == [64] * 4 and static.num_decode_seqs == 0


def test_observe_returns_each_sequences_tail_and_its_logits():
    seen: list[ForwardBatch] = []
    graphs = stand_in_observe(seen)
    batch = observe_batch([2, 4, 1])
    hidden = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, HIDDEN)  # [T, H]
    last, logits = graphs.run(batch, hidden)
    assert seen[-1].num_seqs == 4 and seen[-1].input_ids.shape == (4 * R,)
    # output at row i = hidden i + token 100 + i; tails at rows 1, 5, 6
    assert last[:, 0].tolist() == [102.0, 110.0, 112.0] and last.shape == (3, HIDDEN)
    assert logits.argmax(dim=-1).tolist() == [102 % VOCAB, 110 % VOCAB, 112 % VOCAB]
    assert last.data_ptr() != graphs.buffers["tail_hidden"].data_ptr()  # copies


def test_replay_all_runs_every_graph_over_padding():
    seen: list[ForwardBatch] = []
    propose, observe = stand_in_propose(seen), stand_in_observe(seen)
    load_three(propose)
    observe.load(observe_batch([2, 4, 1]), torch.ones(7, HIDDEN))
    DraftGraphs(propose, observe).replay_all()
    assert len(seen) == len(SIZES) * (K - 1) + len(SIZES)
    assert all((b.slot_mapping == -1).all() for b in seen)  # nothing written
    assert all((b.seq_lens == 0).all() for b in seen)
    assert all((b.query_start_loc == 0).all() for b in seen if not b.num_decode_seqs)
