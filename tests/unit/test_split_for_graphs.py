"""Mixed steps split for the CUDA graphs: decode rows to the decode graph, the one prefill
chunk to the prefill graph (``ModelRunner._split_for_graphs``), with stand-in graphs."""

from types import SimpleNamespace

import torch

from pagedserve.engine.runner import ModelRunner
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
    prefill = SimpleNamespace(
        fits=lambda b: b.num_decode_seqs == 0 and b.num_seqs == 1,
        run=lambda b: calls.append(f"prefill {b.num_tokens}") or torch.full((1, 3), 2.0))
    return SimpleNamespace(graphs=decode, prefill_graphs=prefill)


def test_split_decode_indexes_each_part_from_zero():
    decode, rest = batch([1, 1, 5], num_decode=2).split_decode()
    assert decode.num_seqs == 2 and decode.is_decode_only
    assert decode.input_ids.tolist() == [100, 101] and decode.logits_indices.tolist() == [0, 1]
    assert rest.num_decode_seqs == 0 and rest.query_start_loc_cpu == [0, 5]
    assert rest.query_start_loc.tolist() == [0, 5] and rest.logits_indices.tolist() == [4]
    assert rest.input_ids.tolist() == [102, 103, 104, 105, 106]
    assert rest.slot_mapping.tolist() == [502, 503, 504, 505, 506]
    assert rest.block_tables.tolist() == [[6, 7, 8]] and rest.seq_lens_cpu == [15]


def test_mixed_step_replays_both_graphs_in_row_order():
    calls: list[str] = []
    logits = ModelRunner._split_for_graphs(stub_runner(calls), batch([1, 1, 5], 2))
    assert calls == ["decode 2", "prefill 5"]
    assert logits.tolist() == [[1.0] * 3, [1.0] * 3, [2.0] * 3]


def test_steps_that_do_not_split_are_left_alone():
    calls: list[str] = []
    runner = stub_runner(calls)
    assert ModelRunner._split_for_graphs(runner, batch([700], 0)) is None  # prefill alone
    assert ModelRunner._split_for_graphs(runner, batch([1, 1], 2)) is None  # decode alone
    assert ModelRunner._split_for_graphs(runner, batch([1, 5, 7], 1)) is None  # two prompts
    assert calls == []
