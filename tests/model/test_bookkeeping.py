"""First-token bookkeeping (the seed's fix), pinned.

The first sampled token must be forwarded and written at K/V row and RoPE position equal to
the prompt length: no row skipped, none written twice. Checked three ways: the step's
metadata, every slot ``kv_write`` actually received, and the cached K rows themselves against
transformers' own cache (a row at the wrong position would carry the wrong rotation).
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import GreedyDriver

from pagedserve.kernels import ops, reference

NUM_DECODE = 6


@pytest.fixture
def recorded_writes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every ``ops.kv_write`` call's slot mapping, in call order."""
    calls: list[list[int]] = []
    real = ops.kv_write

    def spy(cache, rows, slot_mapping):
        calls.append(slot_mapping.tolist())
        real(cache, rows, slot_mapping)

    monkeypatch.setattr(ops, "kv_write", spy)
    return calls


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "c16"])
def test_first_token_written_at_prompt_length(checkpoints, recorded_writes, chunk) -> None:
    ckpt = checkpoints("d64-gqa3-untied")
    runner = ckpt.runner()
    prompt, P = ckpt.prompt, len(ckpt.prompt)
    driver = GreedyDriver(runner)
    seq = driver.new_sequence()
    first = driver.prefill(seq, prompt, chunk)
    num_prefill_steps = len(driver.batches)
    assert seq.num_tokens == P

    # The step after prefill forwards the first sampled token at position P, slot of row P.
    driver.decode(seq)
    step = driver.batches[num_prefill_steps]
    table = driver.kv.block_table(seq.kv_handle).tolist()
    bs = runner.block_size
    slot_of = lambda pos: table[pos // bs] * bs + pos % bs
    assert step.input_ids.tolist() == [first]
    assert step.positions.tolist() == [P]
    assert step.slot_mapping.tolist() == [slot_of(P)]
    assert step.seq_lens.tolist() == [P + 1]
    assert step.num_decode_seqs == 1
    assert seq.num_tokens == P + 1

    for _ in range(NUM_DECODE - 1):
        driver.decode(seq)
    total = P + NUM_DECODE  # rows written: prompt + every forwarded sampled token

    # Positions of all steps cover 0 .. total-1 exactly once, in order.
    positions = torch.cat([b.positions for b in driver.batches]).tolist()
    assert positions == list(range(total))
    # Each full-attention layer writes K and V: every slot once per write call, no gaps.
    num_writes = 2 * ckpt.loaded.config.num_full_attention_layers
    per_step = [recorded_writes[i : i + num_writes] for i in range(0, len(recorded_writes),
                                                                   num_writes)]
    assert len(per_step) == len(driver.batches)
    for calls, batch in zip(per_step, driver.batches):
        assert all(c == batch.slot_mapping.tolist() for c in calls)
    written = [s for calls in per_step for s in calls[0]]
    assert written == [slot_of(p) for p in range(total)]
    assert len(set(written)) == total


@torch.no_grad()
def test_cached_keys_match_transformers_cache(checkpoints) -> None:
    """Row p of our K cache holds transformers' key at position p (f16-rounded), for the
    prompt and every generated token that was forwarded."""
    ckpt = checkpoints("d64-gqa3-untied")
    runner = ckpt.runner()
    driver = GreedyDriver(runner)
    seq = driver.new_sequence()
    driver.prefill(seq, ckpt.prompt, 16)
    for _ in range(NUM_DECODE):
        driver.decode(seq)
    assert seq.tokens == ckpt.reference.tokens[: NUM_DECODE + 1]

    ids = torch.tensor([ckpt.prompt])
    out = ckpt.hf_model.generate(
        ids, max_new_tokens=NUM_DECODE + 1, do_sample=False, return_dict_in_generate=True
    )
    cfg = ckpt.loaded.config
    table = driver.kv.block_table(seq.kv_handle)
    length = seq.num_tokens
    for cache_index, layer_idx in enumerate(cfg.full_attention_layers):
        hf_keys = out.past_key_values.layers[layer_idx].keys[0]  # [Hkv, L, D]
        assert hf_keys.shape[1] == length
        ours = reference.gather_kv(runner.kv_caches[cache_index][0], table, length)
        torch.testing.assert_close(ours, hf_keys.half().float(), atol=2e-3, rtol=2e-3)
