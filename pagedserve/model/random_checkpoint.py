"""A tiny Qwen3.5-architecture checkpoint with seeded random weights, made on first use.

The tests' model: a real hybrid in real Hugging Face format -- ``config.json``,
``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` (byte-level;
Qwen3.5's chat template, with its tool-call and thinking syntax), ``generation_config.json``
-- that goes through the same loader as any checkpoint. Its text is noise; it is small
enough that every code path runs in the CPU test suite in seconds. (The model served
without ``--model`` is the trained one in ``default_model.py``.)

Shape: 8 layers (3 Gated DeltaNet, then 1 full attention, twice), hidden 256, GQA 4:2 with
head_dim 64, GDN 2 key / 4 value heads of 64, vocab 384 (259 tokens used).

It is written once into ``$PAGEDSERVE_CACHE`` (default ``~/.cache/pagedserve``) under a
versioned name, atomically: files go to a temporary directory that is renamed into place,
so a reader never sees a half-written checkpoint, and concurrent first uses are safe.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedserve.model import byte_tokenizer as bt

NAME = "qwen3.5-tiny-random-v2"
SEED = 20251129
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "layer_types": LAYER_TYPES * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "eos_token_id": bt.IM_END_ID,
    "pad_token_id": bt.ENDOFTEXT_ID,
    "dtype": "bfloat16",
}

GENERATION_CONFIG = {
    "eos_token_id": [bt.IM_END_ID, bt.ENDOFTEXT_ID],
    "pad_token_id": bt.ENDOFTEXT_ID,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def random_model_path() -> Path:
    """The random checkpoint's directory, created on first use."""
    final = cache_root() / NAME
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=final.parent))
    try:
        write_checkpoint(tmp)
        os.rename(tmp, final)
    except OSError:
        # Another process renamed its copy into place first; theirs is identical.
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_checkpoint(directory: Path) -> None:
    """Write the whole checkpoint into ``directory`` (which must exist)."""
    with open(directory / "config.json", "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
    with open(directory / "generation_config.json", "w") as f:
        json.dump(GENERATION_CONFIG, f, indent=2, sort_keys=True)
    bt.write_tokenizer(directory, CONFIG["max_position_embeddings"])
    save_file(make_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})


def make_weights() -> dict[str, torch.Tensor]:
    """Seeded bf16 weights under the text-only names (``model.*``), in a fixed order."""
    c = CONFIG
    gen = torch.Generator().manual_seed(SEED)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_offset(dim: int) -> torch.Tensor:  # zero-centred RMSNorm weight (1 + w)
        return normal(dim, std=0.1)

    h, inter = c["hidden_size"], c["intermediate_size"]
    hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, kw = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(c["vocab_size"], h)}
    for i, layer_type in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_offset(h)
        w[p + "post_attention_layernorm.weight"] = norm_offset(h)
        if layer_type == "full_attention":
            a = p + "self_attn."
            w[a + "q_proj.weight"] = normal(2 * hq * d, h)
            w[a + "k_proj.weight"] = normal(hkv * d, h)
            w[a + "v_proj.weight"] = normal(hkv * d, h)
            w[a + "o_proj.weight"] = normal(h, hq * d)
            w[a + "q_norm.weight"] = norm_offset(d)
            w[a + "k_norm.weight"] = norm_offset(d)
        else:
            a = p + "linear_attn."
            w[a + "in_proj_qkv.weight"] = normal(conv_dim, h)
            w[a + "in_proj_z.weight"] = normal(hv * dv, h)
            w[a + "in_proj_b.weight"] = normal(hv, h)
            w[a + "in_proj_a.weight"] = normal(hv, h)
            w[a + "conv1d.weight"] = normal(conv_dim, 1, kw, std=0.3)
            w[a + "dt_bias"] = torch.ones(hv) + normal(hv, std=0.1)
            # A in [1, 16): decays exp(-A * softplus(.)) spread over fast and slow heads.
            w[a + "A_log"] = (1.0 + 15.0 * torch.rand(hv, generator=gen)).log()
            w[a + "norm.weight"] = torch.ones(dv) + normal(dv, std=0.1)
            w[a + "out_proj.weight"] = normal(h, hv * dv)
        m = p + "mlp."
        w[m + "gate_proj.weight"] = normal(inter, h)
        w[m + "up_proj.weight"] = normal(inter, h)
        w[m + "down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = norm_offset(h)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}
