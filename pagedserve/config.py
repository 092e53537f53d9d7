"""Frozen configuration objects, each checked once in ``__post_init__``.

``ModelConfig`` is read from a Hugging Face ``config.json`` (the text-only ``qwen3_5_text``
layout or the published ``qwen3_5`` layout with a nested ``text_config``). ``CacheConfig``
holds the K/V storage choices. Both raise ``ValueError`` naming the bad value and the
accepted range; user input is never checked with ``assert``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.kv import formats
from pagedserve.kv.state_pool import StateShapes

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
# Head dims the paged decode kernel is built and tested for.
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a dense Qwen3.5/3.6 hybrid decoder.

    Every ``layer_types`` entry is ``"full_attention"`` (gated softmax attention over paged
    K/V) or ``"linear_attention"`` (Gated DeltaNet with a per-sequence state slot).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "Qwen3_5ForCausalLM"
    # Where the language-model weights sit in the checkpoint: "model." for the text-only
    # layout, "model.language_model." for the published vision-language wrapper.
    weight_prefix: str = "model."
    # Decoder layers of the multi-token-prediction module (``mtp.*``, ``model/mtp.py``);
    # 0 when the config names none.
    mtp_num_hidden_layers: int = 0

    def __post_init__(self) -> None:
        _require(self.vocab_size > 0, f"vocab_size must be > 0, got {self.vocab_size}")
        _require(self.hidden_size > 0, f"hidden_size must be > 0, got {self.hidden_size}")
        _require(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
            f"{self.num_hidden_layers}",
        )
        bad = sorted({t for t in self.layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
        _require(
            not bad,
            f"unsupported layer type(s) {bad}; accepted: {FULL_ATTENTION!r}, {LINEAR_ATTENTION!r}",
        )
        _require(
            self.num_key_value_heads > 0
            and self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a positive multiple of "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        _require(
            self.head_dim in SUPPORTED_HEAD_DIMS,
            f"head_dim {self.head_dim} is not supported by the paged decode kernel; "
            f"accepted: {SUPPORTED_HEAD_DIMS}",
        )
        _require(
            0.0 < self.partial_rotary_factor <= 1.0,
            f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}",
        )
        rotary = self.rotary_dim
        _require(
            rotary % 2 == 0 and rotary > 0,
            f"rotary dim head_dim*partial_rotary_factor = {rotary} must be even and > 0",
        )
        _require(
            self.linear_num_key_heads > 0
            and self.linear_num_value_heads % self.linear_num_key_heads == 0,
            f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({self.linear_num_key_heads})",
        )
        _require(
            self.linear_conv_kernel_dim >= 2,
            f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}",
        )

    # ---- derived shapes -------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def num_full_attention_layers(self) -> int:
        return len(self.full_attention_layers)

    @property
    def num_linear_attention_layers(self) -> int:
        return len(self.linear_attention_layers)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal depthwise conv: q, k and v of the GDN layer together."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def state_shapes(self, conv_dtype: torch.dtype, tp_size: int = 1) -> StateShapes:
        """The per-slot shapes of the GDN layers' conv and recurrent states (of one rank's
        heads: ``1 / tp_size`` of the channels and value heads under tensor parallelism)."""
        return StateShapes(
            num_layers=self.num_linear_attention_layers,
            conv=(self.conv_dim // tp_size, self.linear_conv_kernel_dim - 1),
            recurrent=(
                self.linear_num_value_heads // tp_size,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
            ),
            conv_dtype=conv_dtype,
        )

    # ---- construction ---------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face ``config.json``.

        Raises ``ValueError`` for MoE variants, unknown architectures and model types.
        """
        model_type = raw.get("model_type")
        architectures = tuple(raw.get("architectures") or ())
        _require(
            model_type in SUPPORTED_MODEL_TYPES,
            f"unsupported model_type {model_type!r} (architectures {list(architectures)}); "
            f"pagedserve serves dense Qwen3.5/3.6 checkpoints: model_type in "
            f"{SUPPORTED_MODEL_TYPES}",
        )
        if model_type == "qwen3_5":
            text: dict[str, Any] = dict(raw.get("text_config") or {})
            _require(bool(text), "config of model_type 'qwen3_5' has no text_config")
            prefix = "model.language_model."
            eos = raw.get("eos_token_id", text.get("eos_token_id"))
            tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
            dtype = raw.get("torch_dtype") or raw.get("dtype") or text.get("dtype") or "bfloat16"
        else:
            text = dict(raw)
            prefix = "model."
            eos = raw.get("eos_token_id")
            tie = bool(raw.get("tie_word_embeddings", False))
            dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        _reject_moe(text, architectures)

        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                for i in range(num_layers)
            ]
        rope: dict[str, Any] = dict(text.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "default")
        _require(
            rope_type == "default",
            f"unsupported rope_type {rope_type!r}; accepted: 'default'",
        )
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10_000.0)))
        partial = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        )
        num_heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=num_heads,
            num_key_value_heads=int(text.get("num_key_value_heads", num_heads)),
            head_dim=int(text.get("head_dim") or hidden // num_heads),
            partial_rotary_factor=partial,
            rope_theta=rope_theta,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            tie_word_embeddings=tie,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            torch_dtype=str(dtype).replace("torch.", ""),
            eos_token_ids=as_id_tuple(eos),
            architecture=architectures[0] if architectures else "Qwen3_5ForCausalLM",
            weight_prefix=prefix,
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers") or 0),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a file path or a checkpoint directory."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"no config.json at {str(path)!r}")
        with open(p) as f:
            return cls.from_hf_dict(json.load(f))


def _reject_moe(text: dict[str, Any], architectures: tuple[str, ...]) -> None:
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    found = [k for k in moe_keys if text.get(k)]
    moe_arch = [a for a in architectures if "moe" in a.lower()]
    _require(
        not found and not moe_arch,
        f"mixture-of-experts checkpoints are not supported (found {found or moe_arch}); "
        "pagedserve serves dense Qwen3.5/3.6 models only",
    )


def as_id_tuple(value: Any) -> tuple[int, ...]:
    """An id, a list of ids or None (as config files spell token ids) -> a tuple."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class CacheConfig:
    """How K/V is stored: types of K and of V, block size, layout.

    ``kv_layout="paged"`` draws fixed ``block_size``-token blocks from one pool;
    ``"contiguous"`` pads every sequence to ``max_model_len`` (the baseline).
    """

    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    block_size: int = 16
    kv_layout: str = "paged"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("cache_type_k", "cache_type_v"):
            value = getattr(self, name)
            _require(
                value in formats.KV_TYPES,
                f"{name.replace('_', '-')} {value!r} is not a K/V storage type; "
                f"accepted: {list(formats.KV_TYPES)}",
            )
        _require(
            self.block_size in (8, 16, 32, 64),
            f"block_size must be one of 8, 16, 32, 64, got {self.block_size}",
        )
        _require(
            self.kv_layout in ("paged", "contiguous"),
            f"kv-layout {self.kv_layout!r} is not supported; accepted: 'paged', 'contiguous'",
        )

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if a quantized type cannot hold rows of ``head_dim``."""
        for kv_type in (self.cache_type_k, self.cache_type_v):
            formats.spec(kv_type).check_head_dim(head_dim)
