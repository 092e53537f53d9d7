"""A rollback graph's pass over a padded verify step on the GPU kernels (Triton
interpreter, CPU): every sequence's state is what the eager rollback leaves (each slot
that rejected a draft restored and advanced over its kept rows), a sequence that kept
every draft is left alone (0 rows) or, restored and advanced over all its rows, comes
out at the verify pass's state (its conv state exactly, its recurrent state to the
gates' rounding: the rollback kernel computes them with Triton's exp and log), and no
other slot, the null slot included, is written.

The graph replays exactly ``RollbackGraphs.step``; what a capture adds (no host syncs,
fixed launches) only a GPU can check (tests/engine/test_verify_graphs_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from greedy_driver import GreedyDriver
from test_verify_padding import restore, snapshot

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.rollback_graphs import RollbackGraphs
from pagedserve.engine.verify_graphs import VerifyGraphs
from pagedserve.kernels import gdn, ops

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


def eager_roll_back(runner, kv, chunks: list[SeqChunk], inputs, num_rows: list[int],
                    rows_per_seq: int) -> None:
    """``SpeculativeDecoding._roll_back``'s eager path: the sequences that rejected a
    draft, single rows first, restored and advanced over their kept rows."""
    redo = sorted((i for i, n in enumerate(num_rows) if 0 < n < rows_per_seq),
                  key=lambda i: num_rows[i] > 1)
    runner.restore_states([chunks[i].state_slot for i in redo])
    replay = [SeqChunk(chunks[i].kv_handle, chunks[i].state_slot,
                       chunks[i].token_ids[:num_rows[i]], chunks[i].start_pos) for i in redo]
    rows = [i * rows_per_seq + j for i in redo for j in range(num_rows[i])]
    runner.advance_linear_states(build_forward_batch(replay, kv), inputs, rows)


@pytest.mark.parametrize("rows, num_rows", [
    (3, [1, 3, 2]),  # one of each: a single row, every draft kept, a run
    (4, [2, 3, 1]),  # every sequence rejected one
    (3, [0, 2, 0]),  # 0: kept every draft, left as it is (what a step sends)
    (4, [0, 3, 4]),
])
def test_rollback_pass_matches_the_eager_rollback(checkpoints, monkeypatch, rows, num_rows):
    ckpt = checkpoints("d64-gqa3-untied")
    runner = ckpt.runner(CacheConfig(block_size=16), max_num_seqs=8, state_snapshots=True)
    driver = GreedyDriver(runner)
    seqs = [driver.new_sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):
        driver.prefill(seq, ckpt.prompt[: 9 + 8 * i])
    chunks = []
    for i, seq in enumerate(seqs):
        assert driver.kv.reserve(seq.kv_handle, rows)
        ids = tuple((seq.tokens[-1] + 7 * j + i) % 200 for j in range(rows))
        chunks.append(SeqChunk(seq.kv_handle, seq.slot, ids, seq.num_tokens))
    batch = build_forward_batch(chunks, driver.kv)
    # The CUDA branches of every op, on CPU tensors, under the interpreter.
    monkeypatch.setattr(ops, "_pick", lambda backend, device: "triton")
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)

    with torch.inference_mode():
        runner.save_states([c.state_slot for c in chunks])
        graphs = VerifyGraphs(runner._verify_pass, runner.device, [1, 2, 4, 8], rows,
                              runner.max_blocks_per_seq, runner.state_pool.null_slot, 128)
        size = graphs.load(batch)
        assert size == 4  # one padding sequence
        graphs.output = runner._verify_pass(graphs.static_batch(size))  # the "replay"
        graphs.last_size = size
        verified = snapshot(runner)
        record = graphs.output.rows(batch.num_tokens).gdn_inputs

        eager_roll_back(runner, driver.kv, chunks, record, num_rows, rows)
        eager = snapshot(runner)
        restore(runner, verified)

        rollback = RollbackGraphs(runner._rollback_pass, graphs)
        assert rollback.load(num_rows) == size
        rollback.step(size)  # what the graph of this size replays
        graphed = snapshot(runner)

    live = [c.state_slot for c in chunks]
    for kind, (got, want, was) in enumerate(zip(graphed[:2], eager[:2], verified[:2])):
        torch.testing.assert_close(got[:, live], want[:, live], atol=1e-5, rtol=1e-5)
        for slot, n in zip(live, num_rows):
            if n == 0 or (n == rows and kind == 0):  # left alone, or the verify pass's
                assert torch.equal(got[:, slot], was[:, slot])  # conv state (its inputs)
            elif n == rows:  # restored and advanced over every row
                torch.testing.assert_close(got[:, slot], was[:, slot], atol=1e-6, rtol=1e-5)
        others = [s for s in range(got.shape[1]) if s not in live]  # the null slot among them
        assert runner.state_pool.null_slot in others
        assert torch.equal(got[:, others], was[:, others])
    for got, was in zip(graphed[2:], verified[2:]):  # K/V: never touched
        assert torch.equal(got, was)
