"""Load a Qwen3.5/3.6 checkpoint: config, weights, tokenizer, generation defaults.

``load_model`` is the one entry point: it resolves ``--model`` (a directory or a cached hub
id; ``None`` means the embedded default model), checks everything the kernels cannot serve
before touching the weights, builds the decoder on the meta device, and streams the
safetensors straight into parameters on the target device and dtype (FP8 linear weights,
see ``docs/fp8.md``, stay FP8).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from pagedserve import presets
from pagedserve.config import ModelConfig
from pagedserve.model.fp8_linear import weight_nbytes
from pagedserve.model.fp8_weights import load_fp8_weights, quantize_linears
from pagedserve.model.generation_defaults import GenerationDefaults, merge_ids
from pagedserve.model.mtp import SUPPORTED_MTP_LAYERS, MTPHead
from pagedserve.model.qwen3_5 import Qwen3_5Model
from pagedserve.model.random_weights import random_model
from pagedserve.model.resolve import resolve_checkpoint
from pagedserve.model.weights import load_weights
from pagedserve.parallel.group import SINGLE, TensorParallel
from pagedserve.parallel.sharding import FLAG, check_tensor_parallel
from pagedserve.parallel.weights import load_sharded_weights
from pagedserve.quant.config import parse_quantization

# Model dtypes each device's kernels are built and tested for.
SUPPORTED_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16),
    "cuda": (torch.bfloat16, torch.float16),
}
DEFAULT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
}
SUPPORTED_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A checkpoint ready to serve.

    Attributes:
        path: the checkpoint directory.
        config: the decoder's shape.
        model: the decoder, weights on ``device`` in ``dtype``.
        tokenizer: the transformers tokenizer (with its chat template), or ``None`` when the
            checkpoint ships none (token-id prompts still work).
        generation: sampling defaults; ``eos_token_ids`` merges generation_config.json,
            config.json and the tokenizer's EOS.
        weights_bytes: bytes of parameters on the device (FP8 weights at 1 byte per
            parameter plus their float32 block scales).
        quantization: ``"fp8"`` when linear weights are FP8 block weights, else ``None``.
    """

    path: Path
    config: ModelConfig
    model: Qwen3_5Model
    tokenizer: Any
    generation: GenerationDefaults
    weights_bytes: int
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"checkpoint {self.path} has no tokenizer; pass token ids instead of text"
            )
        return self.tokenizer


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The model dtype: ``None`` gives the device default (float32 on CPU, bf16 on CUDA)."""
    if dtype is None:
        return DEFAULT_DTYPE[device.type]
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[dtype]


def check_supported(cfg: ModelConfig, raw: dict[str, Any], device: torch.device,
                    dtype: torch.dtype) -> None:
    """Reject, before any weight is read, what pagedserve's kernels cannot run."""
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {cfg.architecture!r}; accepted: {SUPPORTED_ARCHITECTURES}"
        )
    text = raw.get("text_config") or raw
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {text['hidden_act']!r} is not supported; accepted: 'silu'")
    if text.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported by Qwen3.5 attention")
    if device.type not in SUPPORTED_DTYPES:
        raise ValueError(f"device {device} is not supported; accepted: cpu, cuda")
    if dtype not in SUPPORTED_DTYPES[device.type]:
        raise ValueError(
            f"dtype {dtype} is not supported on {device.type}; accepted: "
            f"{[str(d) for d in SUPPORTED_DTYPES[device.type]]}"
        )


def _read_raw_config(path: Path) -> dict[str, Any]:
    with open(path / "config.json") as f:
        return json.load(f)


def load_tokenizer(path: Path) -> Any:
    """The checkpoint's tokenizer (transformers ``AutoTokenizer``), or ``None`` if absent."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(
    model: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    revision: str | None = None,
    quantization: str | None = None,
    mtp: bool = False,
    tp: TensorParallel = SINGLE,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load ``model`` (directory, cached hub id, or ``None`` for the embedded default).

    ``tp``: load this rank's shard of a tensor-parallel group (``parallel/sharding.py``),
    reading only its slices of each tensor; the head counts are checked first.
    ``tokenizer=False`` skips the tokenizer (a tensor-parallel worker needs none, and
    importing transformers would double its start-up).

    ``mtp=True`` loads the MTP draft head (``mtp.*``) too, as ``model.mtp``; a checkpoint
    without it is rejected before any weight is read (``check_mtp``). A checkpoint
    with an FP8 ``quantization_config`` loads its FP8 weights as stored;
    ``quantization="fp8"`` quantizes an unquantized checkpoint's linear weights while loading
    (``quant/config.py`` says which). The model dtype is the activations' dtype either way.
    """
    device = torch.device(device)
    dtype = parse_dtype(dtype, device)
    preset = presets.preset_name(str(model)) if model is not None else None
    if preset is not None:
        return load_preset(preset, device, dtype, quantization, mtp, tp)
    path, raw, cfg = read_model_config(model, revision)
    check_supported(cfg, raw, device, dtype)
    quant = parse_quantization(raw, quantization)
    check_parallel_support(cfg, tp.size, quant is not None, mtp, str(path))
    if mtp:
        check_mtp(cfg, path)

    with torch.device("meta"):
        decoder = Qwen3_5Model(cfg, tp)
        if mtp:
            decoder.mtp = MTPHead(cfg)
    if tp.size > 1:
        with torch.device("meta"):
            whole = Qwen3_5Model(cfg)
        weights_bytes = load_sharded_weights(decoder, whole, path, cfg, tp, device, dtype,
                                             progress)
    elif quant is None:
        weights_bytes = load_weights(
            decoder, path, cfg.weight_prefix, cfg.tie_word_embeddings, device, dtype, progress
        )
    else:
        weights_bytes = load_fp8_weights(
            decoder, path, cfg.weight_prefix, cfg.tie_word_embeddings, device, dtype, quant,
            progress,
        )
    decoder.to(device)  # the buffers (RoPE frequencies); parameters are already there
    decoder.eval()

    tok = load_tokenizer(path) if tokenizer else None
    return LoadedModel(path, cfg, decoder, tok, generation_defaults(path, cfg, tok),
                       weights_bytes, device, dtype, None if quant is None else "fp8")


def generation_defaults(path: Path, cfg: ModelConfig, tok: Any) -> GenerationDefaults:
    """The checkpoint's sampling defaults, whose ``eos_token_ids`` merge
    generation_config.json's, config.json's and the tokenizer's EOS (``tok``, or ``None``)."""
    generation = GenerationDefaults.from_checkpoint(path)
    tok_eos = () if tok is None or tok.eos_token_id is None else (tok.eos_token_id,)
    eos = merge_ids(generation.eos_token_ids, cfg.eos_token_ids, tok_eos)
    return dataclasses.replace(generation, eos_token_ids=eos)


def read_model_config(model: str | Path | None,
                      revision: str | None = None) -> tuple[Path, dict[str, Any], ModelConfig]:
    """``model``'s checkpoint directory (``None``: the embedded default), raw config.json
    and ``ModelConfig``, without reading a weight. Presets: their config file's directory."""
    preset = presets.preset_name(str(model)) if model is not None else None
    if preset is not None:
        path = presets.config_path(preset)
        with open(path) as f:
            raw = json.load(f)
        return path.parent, raw, ModelConfig.from_hf_dict(raw)
    if model is None:
        from pagedserve.model.default_model import default_model_path

        path = default_model_path()
    else:
        path = resolve_checkpoint(model, revision=revision)
    raw = _read_raw_config(path)
    return path, raw, ModelConfig.from_hf_dict(raw)


def check_parallel_support(cfg: ModelConfig, size: int, fp8: bool, mtp: bool,
                           model: str) -> None:
    """Reject, before any weight is read, what a tensor-parallel load does not cover."""
    check_tensor_parallel(cfg, size, model)
    if size > 1 and fp8:
        raise ValueError(f"{FLAG} {size} does not support FP8 weights yet ({model} is FP8 or "
                         f"--quantization fp8 was given)")
    if size > 1 and mtp:
        raise ValueError(f"{FLAG} {size} does not support the MTP head "
                         f"(--speculative-config) yet")


def check_mtp(cfg: ModelConfig, path: Path) -> None:
    """Reject, before any weight is read, a checkpoint with no MTP head this engine runs."""
    from pagedserve.model.weights import MTP_PREFIX, index_tensors, safetensors_files

    if not any(k.startswith(MTP_PREFIX) for k in index_tensors(safetensors_files(path))):
        raise ValueError(f"speculative method 'mtp' needs the checkpoint's MTP module, but "
                         f"{path} has no mtp.* tensors")
    if cfg.mtp_num_hidden_layers != SUPPORTED_MTP_LAYERS:
        raise ValueError(f"speculative method 'mtp' runs a {SUPPORTED_MTP_LAYERS}-layer MTP "
                         f"module; {path}/config.json has mtp_num_hidden_layers "
                         f"{cfg.mtp_num_hidden_layers}")


def load_preset(name: str, device: torch.device, dtype: torch.dtype,
                quantization: str | None = None, mtp: bool = False,
                tp: TensorParallel = SINGLE) -> LoadedModel:
    """A preset shape with seeded random weights built on ``device``; no tokenizer, so
    prompts must be token ids. For benchmarks of real shapes without their checkpoints.
    ``quantization="fp8"`` quantizes the random linear weights as ``--quantization fp8``
    quantizes a checkpoint's; ``mtp=True`` adds a random one-layer MTP head."""
    path = presets.config_path(name)
    with open(path) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_hf_dict(raw)
    if mtp:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=SUPPORTED_MTP_LAYERS)
    check_supported(cfg, raw, device, dtype)
    quant = parse_quantization(raw, quantization)
    check_parallel_support(cfg, tp.size, quant is not None, mtp, f"preset:{name}")
    decoder = random_model(cfg, device, dtype, mtp=mtp, tp=tp)
    if quant is not None:
        quantize_linears(decoder, cfg.weight_prefix, quant)
    return LoadedModel(path.parent, cfg, decoder, None, GenerationDefaults(),
                       weight_nbytes(decoder), device, dtype, None if quant is None else "fp8")
