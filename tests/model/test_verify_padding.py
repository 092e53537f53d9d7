"""A verify graph's padded batch on the GPU kernels (Triton interpreter, CPU): the rows
of the live sequences, their states and their K/V rows are the unpadded eager pass's,
and padding writes nothing (no K/V row, no state slot, the null slot included).

The graph replays exactly this pass over ``VerifyGraphs.static_batch``; what a capture
adds (no host syncs, fixed launches) only a GPU can check (tests/engine/
test_verify_graphs_gpu.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from greedy_driver import GreedyDriver

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.verify_graphs import VerifyGraphs
from pagedserve.kernels import gdn, ops

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


def snapshot(runner) -> list[torch.Tensor]:
    pool = runner.state_pool
    kv = [t for pair in runner.kv_caches for s in pair for t in (s.data, s.scales)
          if t is not None]
    return [t.clone() for t in (pool.conv_state, pool.recurrent_state, *kv)]


def restore(runner, saved: list[torch.Tensor]) -> None:
    pool = runner.state_pool
    kv = [t for pair in runner.kv_caches for s in pair for t in (s.data, s.scales)
          if t is not None]
    for dst, src in zip((pool.conv_state, pool.recurrent_state, *kv), saved):
        dst.copy_(src)


@pytest.mark.parametrize("kv_type, rows", [("f16", 3), ("q8_0", 4)])
def test_padded_verify_batch_matches_the_eager_pass(checkpoints, monkeypatch, kv_type, rows):
    ckpt = checkpoints("d64-gqa3-untied")
    cache = CacheConfig(cache_type_k=kv_type, cache_type_v=kv_type, block_size=16)
    runner = ckpt.runner(cache, max_num_seqs=8)
    driver = GreedyDriver(runner)
    seqs = [driver.new_sequence() for _ in range(3)]
    for i, seq in enumerate(seqs):  # contexts 10, 17, 30: verify rows cross a block edge
        driver.prefill(seq, ckpt.prompt[: 10 + 7 * i + (6 if i == 2 else 0)])
    chunks = []
    for i, seq in enumerate(seqs):
        assert driver.kv.reserve(seq.kv_handle, rows)
        ids = tuple((seq.tokens[-1] + 11 * j + i) % 200 for j in range(rows))
        chunks.append(SeqChunk(seq.kv_handle, seq.slot, ids, seq.num_tokens))
    batch = build_forward_batch(chunks, driver.kv)
    # The CUDA branches of every op, on CPU tensors, under the interpreter.
    monkeypatch.setattr(ops, "_pick", lambda backend, device: "triton")
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)

    before = snapshot(runner)
    with torch.inference_mode():
        eager = runner._verify_pass(batch)
    after_eager = snapshot(runner)
    restore(runner, before)

    null = runner.state_pool.null_slot
    graphs = VerifyGraphs(runner._verify_pass, runner.device, [1, 2, 4, 8], rows,
                          runner.max_blocks_per_seq, null, 128)
    graphs.buffers["block_tables"].fill_(3)  # stale tables under the padding
    assert graphs.load(batch) == 4
    with torch.inference_mode():
        padded = runner._verify_pass(graphs.static_batch(4))
    t = batch.num_tokens
    assert padded.hidden.shape[0] == 4 * rows
    live = padded.rows(t)
    torch.testing.assert_close(live.hidden, eager.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(live.logits, eager.logits, atol=1e-4, rtol=1e-5)
    assert len(live.gdn_inputs) == len(eager.gdn_inputs) > 0
    for got, want in zip(live.gdn_inputs, eager.gdn_inputs):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded.hidden).all()  # padding rows stay finite
    after_padded = snapshot(runner)
    conv, rec = after_padded[:2]
    assert torch.equal(conv[:, null], before[0][:, null])  # the null slot untouched
    assert torch.equal(rec[:, null], before[1][:, null])
    for got, want in zip(after_padded[:2], after_eager[:2]):  # live slots: the eager pass's
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # K/V: the eager pass's rows, but for a stored rounding flipped by the GEMMs' row
    # count (one f16 ulp, one q8_0 step); padding rows write none.
    for got, want in zip(after_padded[2:], after_eager[2:]):
        assert (got != want).float().mean() < 1e-4
