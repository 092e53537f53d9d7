"""The drafter's head over a draft vocabulary (``engine/draft_vocab.DraftHead``) on tiny
checkpoints: its rows are the LM head's (tied and untied against transformers' weights, an
FP8 head against the float64 oracle's dequantization), its logits are transformers' head
at those ids, and its columns map back to target ids."""

from __future__ import annotations

import pytest
import torch
from hybrid_checkpoints import fp8_oracle_weights, to_fp8_checkpoint

from pagedserve.engine.draft_vocab import DraftHead, draft_vocab_ids, subset_bytes
from pagedserve.model.fp8_linear import Fp8Linear
from pagedserve.model.loader import load_model

IDS = draft_vocab_ids(100, 320, [256, 257, 258])


@pytest.mark.parametrize("shape", ["d64-mha-tied", "d64-gqa3-untied"])
def test_subset_head_is_the_lm_heads_rows_and_columns(checkpoints, shape) -> None:
    ckpt = checkpoints(shape)
    hf_head = ckpt.hf_model.lm_head.weight.detach()  # [V, H]; tied: the embedding
    head = DraftHead(ckpt.loaded.model, IDS)
    assert head.num_rows == len(IDS) == 103
    assert torch.equal(head.weight, hf_head[IDS])
    hidden = torch.randn(5, hf_head.shape[1], generator=torch.Generator().manual_seed(0))
    want = (hidden.double() @ hf_head.double().T)[:, IDS]  # [5, N']
    torch.testing.assert_close(head.logits(hidden).double(), want, atol=1e-5, rtol=1e-5)
    assert head.token_ids(torch.tensor([[0, 99], [100, 102]])).tolist() == [[0, 99],
                                                                              [256, 258]]
    full = head.full_logits(head.logits(hidden))  # [5, V]
    assert torch.equal(full[:, IDS], head.logits(hidden))
    outside = sorted(set(range(320)) - set(IDS))
    assert bool((full[:, outside] == float("-inf")).all())
    assert head.nbytes == subset_bytes(len(IDS), hf_head.shape[1], torch.float32)


def test_whole_vocabulary_head_is_the_shared_head(checkpoints) -> None:
    model = checkpoints("d64-gqa3-untied").loaded.model
    head = DraftHead(model)
    hidden = torch.randn(3, 64)
    assert head.num_rows == 320 and head.nbytes == 0
    assert torch.equal(head.logits(hidden), model.compute_logits(hidden))
    columns = torch.tensor([4, 300])
    assert head.token_ids(columns) is columns


@pytest.mark.parametrize("ids", [[], [3, 2], [1, 1], [0, 320]])
def test_a_malformed_draft_vocabulary_is_rejected(checkpoints, ids) -> None:
    with pytest.raises(ValueError, match=r"sorted list of distinct ids in \[0, 320\)"):
        DraftHead(checkpoints("d64-gqa3-untied").loaded.model, ids)


def test_fp8_head_rows_are_the_oracles_dequantized_rows(checkpoints, tmp_path) -> None:
    """An LM head stored in FP8 (not in ``modules_to_not_convert``): the subset's rows are
    its blocks dequantized, read row by row (320 rows end inside a 128-row block)."""
    path = to_fp8_checkpoint(checkpoints("h200-fp8-untied").path, tmp_path / "c",
                             not_convert=("in_proj_a", "in_proj_b"))
    model = load_model(path, device="cpu", dtype=torch.float32, progress=False).model
    assert isinstance(model.lm_head, Fp8Linear)
    oracle = fp8_oracle_weights(path)["lm_head.weight"]  # float64 [V, H]
    ids = [0, 5, 127, 128, 200, 255, 256, 300, 319]
    head = DraftHead(model, ids)
    assert torch.equal(head.weight, oracle[ids].float())
    hidden = torch.randn(2, 200, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(head.logits(hidden), model.compute_logits(hidden)[:, ids],
                               atol=1e-4, rtol=1e-4)
