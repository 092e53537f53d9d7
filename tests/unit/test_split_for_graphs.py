"""Steps split for the CUDA graphs: decode rows to the decode graph, each of a few short
prefill chunks to the prefill graph (``ModelRunner._split_for_graphs``), with stand-in
graphs."""

from types import SimpleNamespace

import torch

from pagedserve.engine.runner import MAX_SPLIT_PREFILL_CHUNKS, ModelRunner
from pagedserve.model.forward_batch import ForwardBatch


def batch(query_lens: list[int], num_decode: int) -> ForwardBatch:
    """Sequences with ``query_lens`` new rows over 10 cached rows each."""
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_lens = [10 + n for n in query_lens]
    t, b = qsl[-1], len(query_lens)
    return ForwardBatch(
        input_ids=torch.arange(100, 100 + t), positions=torch.arange(t),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(b * 3, dtype=torch.int32).view(b, 3),
        slot_mapping=torch.arange(500, 500 + t), state_slots=torch.arange(b, dtype=torch.int32),
        logits_indices=torch.tensor(qsl[1:]) - 1, num_decode_seqs=num_decode,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


def stub_runner(calls: list[str]) -> SimpleNamespace:
    decode = SimpleNamespace(
        holds=lambda b: True,
        run=lambda b: calls.append(f"decode {b.num_seqs}") or torch.ones(b.num_seqs, 3))
    prefill = SimpleNamespace(  # holds one chunk of up to 8 rows
        fits=lambda b: b.num_decode_seqs == 0 and b.num_seqs == 1 and b.num_tokens <= 8,
        run=lambda b: calls.append(f"prefill {b.input_ids.tolist()}")
        or torch.full((1, 3), float(b.num_tokens)))
    return SimpleNamespace(graphs=decode, prefill_graphs=prefill)


def test_sequences_index_each_part_from_zero():
    step = batch([1, 1, 5, 2], num_decode=2)
    decode, rest = step.sequences(0, 2), step.sequences(2, 4)
    assert decode.num_seqs == 2 and decode.is_decode_only
    assert decode.input_ids.tolist() == [100, 101] and decode.logits_indices.tolist() == [0, 1]
    assert rest.num_decode_seqs == 0 and rest.query_start_loc_cpu == [0, 5, 7]
    assert rest.query_start_loc.tolist() == [0, 5, 7] and rest.logits_indices.tolist() == [4, 6]
    assert rest.input_ids.tolist() == [102, 103, 104, 105, 106, 107, 108]
    assert rest.slot_mapping.tolist() == [502, 503, 504, 505, 506, 507, 508]
    assert rest.block_tables.tolist() == [[6, 7, 8], [9, 10, 11]]
    assert rest.seq_lens_cpu == [15, 12] and rest.state_slots.tolist() == [2, 3]
    last = step.sequences(3, 4)
    assert last.input_ids.tolist() == [107, 108] and last.positions.tolist() == [7, 8]
    assert last.query_start_loc.tolist() == [0, 2] and last.logits_indices.tolist() == [1]
    assert step.sequences(1, 3).num_decode_seqs == 1


def test_mixed_step_replays_every_graph_in_row_order():
    calls: list[str] = []
    logits = ModelRunner._split_for_graphs(stub_runner(calls), batch([1, 1, 5], 2))
    assert calls == ["decode 2", "prefill [102, 103, 104, 105, 106]"]
    assert logits.tolist() == [[1.0] * 3, [1.0] * 3, [5.0] * 3]
    calls.clear()
    logits = ModelRunner._split_for_graphs(stub_runner(calls), batch([1, 5, 3], 1))
    assert calls == ["decode 1", "prefill [101, 102, 103, 104, 105]", "prefill [106, 107, 108]"]
    assert logits.tolist() == [[1.0] * 3, [5.0] * 3, [3.0] * 3]


def test_short_prompts_alone_replay_the_prefill_graph_each():
    calls: list[str] = []
    logits = ModelRunner._split_for_graphs(stub_runner(calls), batch([4, 2], 0))
    assert calls == ["prefill [100, 101, 102, 103]", "prefill [104, 105]"]
    assert logits.tolist() == [[4.0] * 3, [2.0] * 3]


def test_steps_that_do_not_split_are_left_alone():
    calls: list[str] = []
    runner = stub_runner(calls)
    assert ModelRunner._split_for_graphs(runner, batch([700], 0)) is None  # one long prompt
    assert ModelRunner._split_for_graphs(runner, batch([5], 0)) is None  # the graph runs it
    assert ModelRunner._split_for_graphs(runner, batch([1, 1], 2)) is None  # decode alone
    assert ModelRunner._split_for_graphs(runner, batch([1, 5, 9], 1)) is None  # 9 rows
    too_many = [1] + [2] * (MAX_SPLIT_PREFILL_CHUNKS + 1)
    assert ModelRunner._split_for_graphs(runner, batch(too_many, 1)) is None
    assert calls == []
