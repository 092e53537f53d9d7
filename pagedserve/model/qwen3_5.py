"""The Qwen3.5/3.6 dense hybrid decoder: full attention or Gated DeltaNet per ``layer_types``.

The module tree mirrors transformers' ``Qwen3_5ForCausalLM`` with the ``model.`` (or
``model.language_model.``) prefix removed, so parameter names are the checkpoint's names,
except for three fused projections that each concatenate checkpoint tensors by rows
(``PACKED`` on ``GatedAttention``, ``GatedDeltaNet`` and ``SwiGLU``; see ``weights.py``).

Modules hold weights only. What a step reads and writes -- the K/V storage of each
full-attention layer and the state slots of each linear-attention layer -- comes in with
each call (``ModelCaches``), together with the step's ``ForwardBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import FULL_ATTENTION, ModelConfig
from pagedserve.kernels.ops import DecodeWorkspace
from pagedserve.kv.formats import KVBlockStorage
from pagedserve.model.attention import GatedAttention
from pagedserve.model.elementwise import ElementwiseOps
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.fp8_linear import Fp8Linear
from pagedserve.model.gated_deltanet import GatedDeltaNet
from pagedserve.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from pagedserve.parallel.group import SINGLE, TensorParallel
from pagedserve.parallel.sharding import vocab_rows
from pagedserve.parallel.vocab import VocabParallelEmbedding
from pagedserve.quant import fp8


@dataclass
class ModelCaches:
    """The per-layer state one step works on.

    Attributes:
        kv: one ``(K, V)`` storage pair per full-attention layer, in layer order.
        conv_state: ``[L_lin, S + 1, conv_dim, K - 1]`` (model dtype), per linear layer.
        recurrent_state: float32 ``[L_lin, S + 1, Hv, Dk, Dv]``, per linear layer.
        decode_workspace: the paged decode kernel's buffers, shared by all layers (they run
            one after another on one stream); ``None`` on the CPU.
    """

    kv: list[tuple[KVBlockStorage, KVBlockStorage]]
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    decode_workspace: DecodeWorkspace | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (attention or GDN), then SwiGLU MLP.

    ``cache_index`` is the layer's index among layers of its own type, which is where its
    K/V pair or its state slots sit in ``ModelCaches``.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_index: int,
                 layer_type: str | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # ``layer_type`` overrides ``cfg.layer_types`` (the MTP module's layer sits past them).
        self.is_full_attention = (layer_type or cfg.layer_types[layer_idx]) == FULL_ATTENTION
        self.cache_index = cache_index
        if self.is_full_attention:
            self.self_attn = GatedAttention(cfg, tp)
        else:
            self.linear_attn = GatedDeltaNet(cfg, tp)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
        sin: torch.Tensor, caches: ModelCaches, batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add is deferred into the next norm (one fused pass on CUDA):
        the layer takes the previous layer's output ``h`` and the residual stream before
        it (``None`` for the first layer, whose ``h`` is the embedding) and returns its own
        pair. ``residual + h`` is the hidden state between layers. All ``[T, H]``."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            residual, h = self.input_layernorm.add_forward(h, residual)
        i = self.cache_index
        if self.is_full_attention:
            cache_k, cache_v = caches.kv[i]
            h = self.self_attn(h, cos, sin, cache_k, cache_v, batch, caches.decode_workspace)
        else:
            h = self.linear_attn(h, caches.conv_state[i], caches.recurrent_state[i], batch)
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class Qwen3_5Model(nn.Module):
    """Embeddings, the hybrid layer stack, the final norm and the LM head.

    ``tp``: this rank's place in a tensor-parallel group. Each layer then holds its rank's
    heads, the embedding and LM head a vocabulary shard (``parallel/vocab.py``), and the
    logits are gathered over the ranks, so every rank returns the whole vocabulary's.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        vocab = vocab_rows(cfg, tp.size)  # the whole vocabulary at one rank
        if tp.size == 1:
            self.embed_tokens: nn.Embedding | VocabParallelEmbedding = nn.Embedding(
                cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, vocab, cfg.hidden_size, tp)
        counts = {True: 0, False: 0}
        layers = []
        for i, layer_type in enumerate(cfg.layer_types):
            full = layer_type == FULL_ATTENTION
            layers.append(DecoderLayer(cfg, i, counts[full], tp=tp))
            counts[full] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        # Tied checkpoints have no lm_head tensor: the embedding matrix is the head.
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, vocab, bias=False)
        )
        # The MTP draft head (``model/mtp.py``), when the loader was asked for it: its
        # parameters are named ``mtp.*`` as in the checkpoint.
        self.mtp: nn.Module | None = None

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run one step; returns the final-normed hidden states ``[T, H]``."""
        h = self.embed_tokens(batch.input_ids)  # [T, H]
        cos, sin = self.rotary(batch.positions)  # [T, rotary_dim] float32
        # transformers rounds the angles to the model dtype before rotating.
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, caches, batch)
        if residual is None:
            return self.norm(h)
        return self.norm.add_forward(h, residual)[1]

    def advance_linear_states(
        self, batch: ForwardBatch, caches: ModelCaches,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], rows: torch.Tensor,
    ) -> None:
        """Advance every Gated DeltaNet layer's states of ``batch``'s sequences over rows
        ``rows`` (int64 ``[T]``, ``batch``'s rows in order) of ``inputs``, a step's
        ``GdnRecord.inputs``. The states end where a forward pass of those rows would
        leave them; attention K/V and every other layer are untouched."""
        linear = self.linear_attention_layers()
        assert len(linear) == len(inputs), (len(linear), len(inputs))
        for i, (gdn, (mixed, b, a)) in enumerate(zip(linear, inputs)):
            gdn.advance(mixed[rows], b[rows], a[rows], caches.conv_state[i],
                        caches.recurrent_state[i], batch)

    def linear_attention_layers(self) -> list[GatedDeltaNet]:
        """The Gated DeltaNet modules in layer order, which is their ``cache_index``
        order: the i-th holds layer i of the state pool and of a ``GdnRecord``."""
        return [layer.linear_attn for layer in self.layers
                if isinstance(layer, DecoderLayer) and not layer.is_full_attention]

    def use_compiled_elementwise(self, ops: ElementwiseOps) -> None:
        """Route every module's elementwise math through ``ops`` (e.g. compiled twins)."""
        for module in self.modules():
            if hasattr(module, "ew"):
                setattr(module, "ew", ops)  # noqa: B010 (nn.Module's attribute type is narrower)

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of token ids ``ids`` (int64 ``[N']``), a new ``[N', H]``
        tensor in the model dtype: ``compute_logits`` restricted to those ids is
        ``hidden @ rows.T``. The embedding's rows when tied; an FP8 head's rows
        dequantized (only those rows are read)."""
        if self.tp.size > 1:
            raise ValueError("the LM head's rows of a vocabulary subset are not gathered "
                             "under tensor parallelism")
        dtype = self.embed_tokens.weight.dtype
        head = self.lm_head
        if head is None:
            return self.embed_tokens.weight[ids]  # advanced indexing copies
        if isinstance(head, Fp8Linear):
            return fp8.dequantize_rows(head.weight, head.weight_scale_inv, ids, head.parts,
                                       dtype)
        if isinstance(head, nn.Linear):
            return head.weight[ids]
        raise ValueError(f"no rows of an LM head of type {type(head).__name__}")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden``: ``[N, H]`` -> float32 logits ``[N, vocab]``."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()  # an nn.Linear, or its FP8 form
        if self.tp.size == 1:
            return logits
        return self.tp.gather_columns(logits)[:, :self.config.vocab_size]
