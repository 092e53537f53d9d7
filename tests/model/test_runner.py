"""ModelRunner: configuration checks, layouts and their geometry, memory accounting, forks."""

from __future__ import annotations

import pytest
import torch
from greedy_driver import GreedyDriver, Sequence

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.decode_graphs import DecodeGraphs, graph_batch_sizes
from pagedserve.engine.runner import RunnerConfig
from pagedserve.kv import formats


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_model_len": 0}, "max_model_len must be > 0"),
        ({"max_num_seqs": 0}, "max_num_seqs must be > 0"),
        ({"num_blocks": -1}, "num_blocks must be > 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"max_graph_batch_size": 0}, "max_graph_batch_size must be > 0"),
    ],
)
def test_runner_config_is_validated(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**kwargs)


def test_max_model_len_beyond_the_model_is_rejected(checkpoints) -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 4096"):
        checkpoints("d64-mha-tied").runner(max_model_len=8192)


def _buffer_bytes(kv_caches) -> int:
    """Bytes of the distinct buffers under the runner's K/V storages."""
    buffers = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for pair in kv_caches for s in pair for t in (s.data, s.scales)
               if t is not None}
    return sum(buffers.values())


@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q4_0"), ("q4_0", "q4_0")])
def test_paged_geometry_and_memory(checkpoints, k_type, v_type) -> None:
    """K and V of one type share a buffer per layer, of two types have their own; either
    way the memory accounted is every byte of the K/V buffers, once."""
    ckpt = checkpoints("d256-gqa3-untied")
    cache = CacheConfig(cache_type_k=k_type, cache_type_v=v_type)
    runner = ckpt.runner(cache, max_model_len=100, max_num_seqs=3)
    cfg = ckpt.loaded.config
    assert (runner.block_size, runner.max_blocks_per_seq) == (16, 7)
    assert runner.num_blocks == 3 * 7  # CPU default: every sequence at max_model_len
    assert runner.graphs is None  # CUDA graphs are CUDA-only
    interleave = 2 if k_type == v_type else 1
    assert {(k.interleave, v.interleave) for k, v in runner.kv_caches} == {(interleave,) * 2}
    mem = runner.memory_usage()
    row = formats.bytes_per_row(k_type, 256) + formats.bytes_per_row(v_type, 256)
    rows = runner.num_blocks * 16 * cfg.num_key_value_heads
    assert mem.kv_bytes == cfg.num_full_attention_layers * rows * row
    assert mem.kv_bytes == _buffer_bytes(runner.kv_caches)
    assert mem.weights_bytes == ckpt.loaded.weights_bytes
    per_slot = runner.state_pool.shapes.bytes_per_slot
    assert mem.state_bytes == per_slot * (3 + 1)  # + the null slot
    kv = runner.create_kv_manager()
    assert (kv.pool.num_blocks, kv.block_size, kv.max_blocks_per_seq) == (21, 16, 7)
    assert ckpt.runner(num_blocks=5).num_blocks == 5


def test_contiguous_geometry(checkpoints) -> None:
    runner = checkpoints("d64-mha-tied").runner(
        CacheConfig(kv_layout="contiguous"), max_model_len=96, max_num_seqs=3
    )
    assert (runner.num_blocks, runner.block_size, runner.max_blocks_per_seq) == (3, 96, 1)
    k, v = runner.kv_caches[0]
    assert k.data.shape[:3] == v.data.shape[:3] == (3, 2, 96)
    assert k.interleave == v.interleave == 2  # f16 K and V side by side, as paged
    assert runner.memory_usage().kv_bytes == _buffer_bytes(runner.kv_caches)
    kv = runner.create_kv_manager()
    h = kv.create()
    assert kv.reserve(h, 96) and not kv.can_fit(h, 97)


@torch.no_grad()
def test_fork_copies_kv_on_write_and_state(checkpoints) -> None:
    """A fork after a prompt that ends mid-block shares the block until the first write,
    which copies it (``copy_blocks``); its GDN state is copied with ``copy_state_slot``.
    Both branches then continue exactly as the unforked sequence does."""
    ckpt = checkpoints("d64-gqa3-untied")
    runner = ckpt.runner()
    driver = GreedyDriver(runner)
    parent = driver.new_sequence()
    first = driver.prefill(parent, ckpt.prompt)  # 37 rows: the third block is partly full
    slot_handle = runner.state_pool.acquire()
    child = Sequence(driver.kv.fork(parent.kv_handle), slot_handle,
                     runner.state_pool.slot(slot_handle), num_tokens=parent.num_tokens,
                     tokens=[first])
    runner.copy_state_slot(parent.slot, child.slot)
    shared = driver.kv.block_ids(parent.kv_handle)
    assert driver.kv.block_ids(child.kv_handle) == shared

    logits = driver.step([(child, [first]), (parent, [first])])
    child_blocks = driver.kv.block_ids(child.kv_handle)
    assert child_blocks[:2] == shared[:2] and child_blocks[2] != shared[2]
    assert not driver.kv.pending_copies
    want = ckpt.reference.step_logits[1]
    for row in logits:
        assert (row - want).abs().max() <= 1e-3
    assert int(logits[0].argmax()) == int(logits[1].argmax()) == ckpt.reference.tokens[1]


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


@torch.no_grad()
def test_padded_decode_batch_matches_unpadded(checkpoints) -> None:
    """What a decode CUDA graph runs -- the batch copied into the persistent buffers and
    padded (slot -1, seq_len 0, null state slot) -- gives the live rows the same logits,
    K/V and states as the unpadded batch; padding touches only the null slot."""
    ckpt = checkpoints("d64-gqa3-untied")
    runs = []
    for padded in (False, True):
        runner = ckpt.runner(max_num_seqs=5)
        driver = GreedyDriver(runner)
        seqs = [driver.new_sequence() for _ in range(3)]
        for i, seq in enumerate(seqs):
            driver.prefill(seq, ckpt.prompt[: 20 + 7 * i])
        work = [(s, [s.tokens[-1]]) for s in seqs]
        if padded:
            graphs = DecodeGraphs(runner._forward_logits, runner.device, 5,
                                  runner.max_blocks_per_seq, runner.state_pool.null_slot)
            for seq in seqs:
                assert driver.kv.reserve(seq.kv_handle, 1)
            batch = build_forward_batch(
                [SeqChunk(s.kv_handle, s.slot, tuple(ids), s.num_tokens) for s, ids in work],
                driver.kv,
            )
            size = graphs.load(batch)
            assert size == 4
            static = graphs.static_batch(size)
            assert static.slot_mapping[3] == -1 and static.seq_lens[3] == 0
            assert static.state_slots[3] == runner.state_pool.null_slot
            logits = runner._forward_logits(static)[:3]
        else:
            logits = driver.step(work)
        runs.append((logits, runner))
    (eager, r0), (padded_logits, r1) = runs
    torch.testing.assert_close(padded_logits, eager, atol=1e-5, rtol=0)
    live = slice(0, 3)
    torch.testing.assert_close(r1.state_pool.recurrent_state[:, live],
                               r0.state_pool.recurrent_state[:, live], atol=1e-5, rtol=0)
    for (k0, v0), (k1, v1) in zip(r0.kv_caches, r1.kv_caches):  # up to an f16 rounding flip
        torch.testing.assert_close(k1.data, k0.data, atol=4e-3, rtol=1e-3)
        torch.testing.assert_close(v1.data, v0.data, atol=4e-3, rtol=1e-3)
