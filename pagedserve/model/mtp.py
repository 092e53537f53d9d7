"""Qwen3.5's multi-token-prediction (MTP) module: the draft head of speculative decoding.

For the target's final-normed hidden state ``h_i`` at position ``i`` and the token
``x_{i+1}`` that follows it, the module predicts ``x_{i+2}``::

    e = pre_fc_norm_embedding(embed_tokens(x_{i+1}))       [T, H]
    g = pre_fc_norm_hidden(h_i)                            [T, H]
    u = fc(cat(e, g))                                      [T, 2H] -> [T, H], no bias
    u = layers.0(u)      one full-attention decoder layer (with its MLP), K/V row i
    y = norm(u)          logits(x_{i+2}) = lm_head(y); y also stands in for h_{i+1}
                         when the module drafts again from its own output

``embed_tokens`` and ``lm_head`` are the target's. Checkpoint names are the published
ones, at the top level in both layouts (``mtp.fc.weight``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*`` named as a full-attention decoder layer,
``mtp.norm``); this module's parameter names are those names, so the loader maps them
one to one (``weights.py``). ``scripts/default_model/mtp.py`` is the same module in
transformers' layers, for training; its RoPE positions are ``i + 1``, and so are these.

The layer's K/V row ``i`` sits in its own storage under the target's block table (the
runner's ``mtp_kv``), so it needs no blocks of its own: a sequence's row ``i`` exists
exactly when the target's does.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import FULL_ATTENTION, ModelConfig
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.layers import RMSNorm, RotaryEmbedding
from pagedserve.model.qwen3_5 import DecoderLayer, ModelCaches

# Decoder layers of the MTP module this engine runs (Qwen3.5/3.6 publish one).
SUPPORTED_MTP_LAYERS = 1


class MTPHead(nn.Module):
    """The ``mtp.*`` module. Holds weights only; K/V arrive in ``ModelCaches``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.mtp_num_hidden_layers != SUPPORTED_MTP_LAYERS:
            raise ValueError(
                f"mtp_num_hidden_layers {cfg.mtp_num_hidden_layers} is not supported; "
                f"accepted: {SUPPORTED_MTP_LAYERS}")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, cfg.num_hidden_layers, 0, layer_type=FULL_ATTENTION)])
        self.norm = RMSNorm(h, eps)

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, embed: nn.Embedding,
                rotary: RotaryEmbedding, caches: ModelCaches) -> torch.Tensor:
        """One pass of the module over ``batch``.

        Args:
            batch: ``input_ids`` are the tokens ``x_{i+1}``, ``positions`` the RoPE
                positions ``i + 1``, ``slot_mapping`` the K/V rows ``i``.
            hidden: ``[T, H]`` the states ``h_i`` (the target's, final-normed, or this
                module's own output when drafting further).
            embed, rotary: the target's embedding and rotary embedding.
            caches: ``kv`` holds this module's one (K, V) storage pair.

        Returns:
            ``[T, H]`` the normed output ``y`` (logits through the target's head).
        """
        e = self.pre_fc_norm_embedding(embed(batch.input_ids))  # [T, H]
        u = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [T, H]
        cos, sin = rotary(batch.positions)  # [T, rotary_dim] float32
        cos, sin = cos.to(u.dtype), sin.to(u.dtype)
        h, residual = self.layers[0](u, None, cos, sin, caches, batch)
        return self.norm.add_forward(h, residual)[1]
