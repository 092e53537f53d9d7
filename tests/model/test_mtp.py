"""The MTP head loads in both published layouts and computes what transformers' layers do
(``scripts/default_model/mtp.py``, the module the default model trains), over the paged
K/V of its own layer."""

from __future__ import annotations

import pytest
import torch
from mtp_checkpoints import build_mtp, mtp_oracle_logits, save_with_mtp

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model.loader import load_model


@pytest.mark.parametrize("layout", ["text", "vl"])
@pytest.mark.parametrize("shape", ["d64-gqa3-untied", "d64-mha-tied"])
def test_mtp_logits_match_transformers_layers(checkpoints, tmp_path, shape, layout) -> None:
    ckpt = checkpoints(shape)
    mtp = build_mtp(ckpt.hf_model)
    path = save_with_mtp(ckpt.hf_model, mtp, tmp_path, layout)
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    assert loaded.model.mtp is not None
    runner = ModelRunner(loaded.model, CacheConfig("f32", "f32"),
                         RunnerConfig(max_model_len=128, max_num_seqs=2))
    kv = runner.create_kv_manager()
    seq = kv.create()
    slot = runner.state_pool.slot(runner.state_pool.acquire())
    prompt = ckpt.prompt
    P = len(prompt)
    assert kv.reserve(seq, P)
    hidden = runner.forward_hidden(build_forward_batch(
        [SeqChunk(seq, slot, tuple(prompt), 0)], kv))  # [P, H]
    # Two MTP passes, cut inside a block: the second attends to the first's K/V rows.
    cut = 21
    outs = []
    for start, end in ((0, cut), (cut, P - 1)):
        batch = build_forward_batch(
            [SeqChunk(seq, slot, tuple(prompt[start + 1:end + 1]), start)], kv)
        batch.positions = batch.positions + 1  # RoPE position i + 1 for K/V row i
        outs.append(runner.compute_logits(runner.mtp_forward(batch, hidden[start:end])))
    got = torch.cat(outs)  # [P - 1, vocab]
    want = mtp_oracle_logits(ckpt.hf_model, mtp, prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_checkpoint_without_mtp_is_rejected_when_asked(checkpoints) -> None:
    ckpt = checkpoints("d64-mha-tied")
    with pytest.raises(ValueError, match="no mtp.\\* tensors"):
        load_model(ckpt.path, device="cpu", dtype=torch.float32, progress=False, mtp=True)


def test_mtp_tensors_are_skipped_without_speculation(checkpoints, tmp_path) -> None:
    shape = "d64-mha-tied"
    model = checkpoints(shape).hf_model
    path = save_with_mtp(model, build_mtp(model), tmp_path, "vl")
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    assert loaded.model.mtp is None
    assert not any(n.startswith("mtp.") for n, _ in loaded.model.named_parameters())


def test_weight_footprint_with_mtp_equals_loaded_bytes(checkpoints, tmp_path) -> None:
    """``pagedserve plan --speculative-config`` counts the head as the loader allocates it."""
    from pagedserve.model.weight_footprint import weight_footprint

    model = checkpoints("d64-gqa3-untied").hf_model
    path = save_with_mtp(model, build_mtp(model), tmp_path, "text")
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    assert weight_footprint(loaded.config, torch.float32, mtp=True).total_bytes \
        == loaded.weights_bytes
    assert weight_footprint(loaded.config, torch.float32).total_bytes < loaded.weights_bytes
