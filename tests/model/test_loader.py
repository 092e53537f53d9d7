"""Checkpoint loading: both published layouts, sharding, resolution, and start-up rejections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from greedy_driver import greedy
from hybrid_checkpoints import NEW_TOKENS, to_published_layout
from safetensors.torch import load_file, save_file

from pagedserve.model.generation_defaults import GenerationDefaults
from pagedserve.model.loader import load_model
from pagedserve.model.resolve import resolve_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw.update(changes)
    with open(path / "config.json", "w") as f:
        json.dump(raw, f)


def _edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    weights = load_file(str(file))
    edit(weights)
    save_file(weights, str(file))


# ---- layouts -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["d64-mha-tied", "d256-gqa3-untied"])
def test_published_vl_layout_gives_same_tokens(checkpoints, tmp_path, shape) -> None:
    ckpt = checkpoints(shape)
    vl_dir = to_published_layout(ckpt.path, tmp_path / "vl")
    vl = load_model(vl_dir, progress=False)
    assert vl.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert vl.config.weight_prefix == "model.language_model."
    text_params = dict(ckpt.loaded.model.named_parameters())
    for name, p in vl.model.named_parameters():
        assert torch.equal(p, text_params[name]), name
    runner = ckpt.runner()
    vl_runner = type(runner)(vl.model, runner.cache_config, runner.config)
    assert greedy(vl_runner, ckpt.prompt, NEW_TOKENS).tokens == ckpt.reference.tokens


def test_loaded_model_metadata(checkpoints) -> None:
    ckpt = checkpoints("d64-mha-tied")
    lm = ckpt.loaded
    assert lm.model.lm_head is None  # tied: the embedding is the head
    assert checkpoints("d256-gqa3-untied").loaded.model.lm_head is not None
    assert lm.weights_bytes == sum(p.numel() * 4 for p in ckpt.hf_model.parameters())
    assert lm.tokenizer is not None and lm.tokenizer.chat_template
    text = "héllo 🎉"
    assert lm.tokenizer.decode(lm.tokenizer.encode(text, add_special_tokens=False)) == text
    assert 258 in lm.generation.eos_token_ids  # the tokenizer's <|im_end|>


def test_bf16_weights_load_in_bf16(checkpoints) -> None:
    ckpt = checkpoints("d64-mha-tied")
    lm = load_model(ckpt.path, dtype="bfloat16", progress=False)
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    ref = ckpt.hf_model.model.embed_tokens.weight.to(torch.bfloat16)
    assert torch.equal(lm.model.embed_tokens.weight, ref)


# ---- rejections ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts": 8, "num_experts_per_tok": 2}, "mixture-of-experts"),
        ({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForCausalLM"]},
         "unsupported model_type"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
         "unsupported model_type"),
        ({"architectures": ["Qwen3_5ForSequenceClassification"]}, "unsupported architecture"),
        ({"head_dim": 96}, "head_dim 96"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq"}},
         "quantization_config.quant_method 'gptq' is not supported"),
    ],
    ids=["moe", "moe-type", "llama", "arch", "head-dim", "act", "gptq"],
)
def test_unsupported_configs_are_rejected(checkpoints, tmp_path, changes, message) -> None:
    path = _copy(checkpoints("d64-mha-tied").path, tmp_path / "ckpt")
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=_escape(message)):
        load_model(path, progress=False)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_unsupported_dtype_is_rejected(checkpoints) -> None:
    with pytest.raises(ValueError, match="dtype torch.float16 is not supported on cpu"):
        load_model(checkpoints("d64-mha-tied").path, dtype="float16", progress=False)


def test_missing_unexpected_and_misshaped_tensors_are_named(checkpoints, tmp_path) -> None:
    base = checkpoints("d256-gqa3-untied").path
    missing = _copy(base, tmp_path / "missing")
    _edit_weights(missing, lambda w: w.pop("model.layers.3.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.3\.self_attn\.k_proj"):
        load_model(missing, progress=False)

    extra = _copy(base, tmp_path / "extra")
    _edit_weights(extra, lambda w: w.update({"model.layers.0.mlp.bias": torch.zeros(4)}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.0\.mlp\.bias"):
        load_model(extra, progress=False)

    shaped = _copy(base, tmp_path / "shaped")
    _edit_weights(shaped, lambda w: w.update({"model.norm.weight": torch.zeros(7)}))
    with pytest.raises(ValueError, match=r"shape mismatch for norm\.weight \[96\]"):
        load_model(shaped, progress=False)


# ---- resolution and generation defaults ----------------------------------------------------


def test_hub_id_resolves_from_local_cache_only(checkpoints, tmp_path) -> None:
    """A hub id is looked up in the local cache layout; an absent one fails clearly."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-qwen"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(checkpoints("d64-mha-tied").path, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    assert resolve_checkpoint("acme/tiny-qwen", cache_dir=cache) == repo / "snapshots" / commit
    with pytest.raises(ValueError, match="not in the Hugging Face cache.*does not download"):
        resolve_checkpoint("acme/absent-model", cache_dir=cache)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_checkpoint(tmp_path)


def test_generation_defaults(tmp_path) -> None:
    raw = {"eos_token_id": [5, 7], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
           "top_k": 20, "bos_token_id": 1}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    gen = GenerationDefaults.from_checkpoint(tmp_path)
    assert gen.eos_token_ids == (5, 7)
    assert (gen.temperature, gen.top_p, gen.top_k, gen.do_sample) == (0.6, 0.95, 20, True)
    assert gen.min_p is None and gen.repetition_penalty is None
    assert GenerationDefaults.from_checkpoint(tmp_path / "absent") == GenerationDefaults()
    with pytest.raises(ValueError, match="top_p = 1.5 is invalid"):
        GenerationDefaults.from_dict({"top_p": 1.5})


def test_untied_checkpoint_without_lm_head_is_rejected(checkpoints, tmp_path) -> None:
    path = _copy(checkpoints("d256-gqa3-untied").path, tmp_path / "nohead")
    _edit_weights(path, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: lm_head\.weight"):
        load_model(path, progress=False)
