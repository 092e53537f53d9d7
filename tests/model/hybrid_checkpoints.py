"""Tiny random Qwen3.5 checkpoints saved by transformers, and transformers' own outputs on them.

Every checkpoint is built by ``Qwen3_5ForCausalLM(config)`` and ``save_pretrained``, with the
byte-level tokenizer beside it, so the loader sees exactly the files a real checkpoint has.
Norm weights, ``dt_bias`` and ``A_log`` are perturbed away from their initial values so that a
wrong convention (``w`` vs ``1 + w``, a missing bias) cannot hide behind zeros and ones.

The reference numbers (``HFReference``) come from transformers alone: a full forward over the
prompt and a greedy ``generate`` with its own cache, in float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from pagedserve.model.byte_tokenizer import write_tokenizer

LIN, FULL = "linear_attention", "full_attention"
VOCAB = 320
PROMPT_LEN = 37  # crosses two 16-row block boundaries, not a multiple of 7 or 16
NEW_TOKENS = 48

# name -> Qwen3_5TextConfig overrides. Together: head_dim 256 and 64, GQA 3:1 and 1:1,
# three layer_types patterns, tied and untied heads, two RoPE fractions.
SHAPES: dict[str, dict] = {
    "d256-gqa3-untied": dict(
        hidden_size=96, intermediate_size=192, num_attention_heads=3, num_key_value_heads=1,
        head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=[LIN, LIN, LIN, FULL], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25},
    ),
    "d64-mha-tied": dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=[FULL, LIN, FULL, LIN], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                         "partial_rotary_factor": 0.5},
    ),
    "d64-gqa3-untied": dict(
        hidden_size=64, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=32, linear_value_head_dim=64,
        layer_types=[LIN, FULL, FULL, LIN, LIN], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.25},
    ),
}


# Shapes that tensor parallelism splits over 2 ranks (``test_tensor_parallel.py``): the
# ones above split only where every head count is even. Here one K/V head (replicated on
# both ranks), 4 GDN value heads over 2 key heads, head_dim 256, an untied head.
TP_SHAPES: dict[str, dict] = {
    "d256-gqa4-kv1-untied": dict(
        hidden_size=96, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=[LIN, FULL, LIN, FULL], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25},
    ),
}

# Shapes for FP8 block weights: hidden 200, intermediate 136, 64-row K/V projections and a
# 224-row GDN conv projection, so that blocks are partial on both axes and fused parts end
# inside a 128-row block.
FP8_SHAPES: dict[str, dict] = {
    "h200-fp8-untied": dict(
        hidden_size=200, intermediate_size=136, num_attention_heads=3, num_key_value_heads=1,
        head_dim=64, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=[LIN, FULL, LIN], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.25},
    ),
    # Every dimension a multiple of 128: the shapes transformers' FP8 dequantization reads
    # right (it takes the block size as rows // scale rows, so partial blocks come out wrong).
    "h128-fp8-tied": dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=[LIN, FULL], tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                         "partial_rotary_factor": 0.5},
    ),
}


def hf_config(shape: str) -> Qwen3_5TextConfig:
    kw = dict({**SHAPES, **TP_SHAPES, **FP8_SHAPES}[shape])
    return Qwen3_5TextConfig(
        vocab_size=VOCAB, num_hidden_layers=len(kw["layer_types"]), rms_norm_eps=1e-6,
        max_position_embeddings=4096, linear_conv_kernel_dim=4, pad_token_id=256, **kw,
    )


def build_hf_model(shape: str, seed: int = 0) -> Qwen3_5ForCausalLM:
    """A float32 random model of ``shape`` with perturbed norms and GDN gates."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(shape)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.generation_config.eos_token_id = None  # generate exactly NEW_TOKENS
    model.generation_config.pad_token_id = 256
    return model


def save_checkpoint(model: Qwen3_5ForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory)
    write_tokenizer(directory, 4096)
    return directory


def prompt_ids(seed: int = 0, length: int = PROMPT_LEN) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 256, (length,), generator=gen).tolist()


@dataclass
class HFReference:
    """transformers' outputs for one prompt.

    prompt_logits: float32 ``[P, vocab]`` from one forward over the prompt.
    tokens: the ``NEW_TOKENS`` greedy tokens of ``generate``.
    step_logits: float32 ``[NEW_TOKENS, vocab]``; row i chose ``tokens[i]``.
    """

    prompt_logits: torch.Tensor
    tokens: list[int]
    step_logits: torch.Tensor


@torch.no_grad()
def hf_reference(
    model: Qwen3_5ForCausalLM, prompt: list[int], new_tokens: int = NEW_TOKENS
) -> HFReference:
    """transformers' prompt logits and greedy generation (on the model's device; results
    on the CPU)."""
    ids = torch.tensor([prompt], device=model.device)
    prompt_logits = model(ids).logits[0].float().cpu()
    out = model.generate(
        ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    step_logits = torch.cat([x.float() for x in out.logits], dim=0).cpu()
    return HFReference(prompt_logits, tokens, step_logits)


def to_published_layout(text_dir: Path, out_dir: Path) -> Path:
    """Rewrite a text-only checkpoint as Qwen's published ``Qwen3_5ForConditionalGeneration``
    layout: nested ``text_config``, ``model.language_model.*`` names, and dummy
    ``model.visual.*`` and ``mtp.*`` tensors that a text-only server must skip."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    with open(text_dir / "config.json") as f:
        text = json.load(f)
    text["model_type"] = "qwen3_5_text"
    text.pop("architectures", None)
    tie = text.pop("tie_word_embeddings", False)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2,
                          "out_hidden_size": text["hidden_size"]},
        "tie_word_embeddings": tie,
        "dtype": "float32",
    }
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    weights = {}
    for name, t in load_file(str(text_dir / "model.safetensors")).items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model."):]
        weights[name] = t
    weights["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32)
    weights["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 16, 16)
    weights["mtp.fc.weight"] = torch.randn(text["hidden_size"], 2 * text["hidden_size"])
    weights["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(8, text["hidden_size"])
    # Two shards with an index, as published checkpoints are laid out.
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: weights[k].contiguous() for k in keys}, str(out_dir / shard))
        weight_map.update({k: shard for k in keys})
    with open(out_dir / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    write_tokenizer(out_dir, 4096)
    return out_dir


# ---- FP8 block checkpoints (the published *-FP8 layout) ------------------------------------
#
# The oracle below is written independently of pagedserve.quant.fp8: an explicit loop over
# 128x128 blocks in float64. The format divides in float32 (as the reference quantizers do),
# so the float64 quotient is rounded to float32 before e4m3; float64 holds more than twice
# float32's bits, so that rounding equals float32's own division.

FP8_BLOCK = 128
QWEN_NOT_CONVERTED = ("lm_head", "in_proj_a", "in_proj_b")


def oracle_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` -> (float8_e4m3fn ``[N, K]``, float32 ``[ceil(N/128), ceil(K/128)]``)."""
    n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    w64 = w.double()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            rows = slice(i * FP8_BLOCK, min(n, (i + 1) * FP8_BLOCK))
            cols = slice(j * FP8_BLOCK, min(k, (j + 1) * FP8_BLOCK))
            amax = w64[rows, cols].abs().max().item()
            s = torch.tensor(amax / 448.0 if amax > 0 else 1.0).float()
            scale[i, j] = s
            quotient = (w64[rows, cols] / s.double()).float().clamp(-448.0, 448.0)
            q[rows, cols] = quotient.to(torch.float8_e4m3fn)
    return q, scale


def oracle_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, K]``: every element times its block's scale."""
    out = q.double().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = (slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK),
                     slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK))
            out[block] *= scale[i, j].double()
    return out


def is_linear_weight(name: str, t: torch.Tensor) -> bool:
    return t.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name


def to_fp8_checkpoint(src_dir: Path, out_dir: Path,
                      not_convert: tuple[str, ...] = QWEN_NOT_CONVERTED,
                      scale_dtype: torch.dtype = torch.float32) -> Path:
    """Rewrite a float checkpoint (either layout) in the published FP8 layout: every linear
    weight not matched by ``not_convert`` (suffixes) becomes float8_e4m3fn plus a
    ``weight_scale_inv`` of ``scale_dtype``, and config.json gains Qwen's
    ``quantization_config``. Of an MTP head (``mtp.*``) the decoder layer's projections
    are converted and ``mtp.fc`` is kept, as in Qwen's published FP8 checkpoints."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, out_dir)
    with open(out_dir / "config.json") as f:
        config = json.load(f)
    skipped = []
    for file in sorted(out_dir.glob("*.safetensors")):
        weights = load_file(str(file))
        out = {}
        for name, t in weights.items():
            module = name.removesuffix(".weight")
            if not is_linear_weight(name, t) or name.startswith("model.visual."):
                out[name] = t
            elif module.endswith(not_convert) or module == "mtp.fc":
                skipped.append(module)
                out[name] = t
            else:
                out[name], scale = oracle_quantize(t)
                out[name + "_scale_inv"] = scale.to(scale_dtype)
        save_file(out, str(file))
        index = out_dir / "model.safetensors.index.json"
        if index.is_file():
            with open(index) as f:
                idx = json.load(f)
            for name in out:
                idx["weight_map"][name] = file.name
            with open(index, "w") as f:
                json.dump(idx, f)
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
        "activation_scheme": "dynamic", "modules_to_not_convert": sorted(skipped),
    }
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def fp8_oracle_weights(fp8_dir: Path) -> dict[str, torch.Tensor]:
    """Checkpoint name -> float64 weight, FP8 tensors dequantized by the oracle."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(fp8_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    out = {}
    for name, t in weights.items():
        if name.endswith("_scale_inv"):
            continue
        scale = weights.get(name + "_scale_inv")
        out[name] = t.double() if scale is None else oracle_dequantize(t, scale)
    return out
