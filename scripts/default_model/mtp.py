"""The multi-token-prediction (MTP) module in the layout Qwen publishes (``mtp.*``).

For position t it combines the main model's final hidden state h_t (after ``model.norm``)
with the embedding of token t+1 and predicts token t+2::

    e    = pre_fc_norm_embedding(embed_tokens(x[t+1]))      # [B, T-1, H]
    g    = pre_fc_norm_hidden(h[t])                         # [B, T-1, H]
    u    = fc(cat(e, g))                                    # [2H] -> [H], no bias
    u    = layers.0(u)          one full-attention decoder layer at RoPE position t+1
    logits(x[t+2]) = lm_head(norm(u))                       embed_tokens, lm_head shared

Checkpoint names (every tensor under ``mtp.``): ``fc.weight``,
``pre_fc_norm_embedding.weight``, ``pre_fc_norm_hidden.weight``, ``layers.0.*`` (the
names of a full-attention ``Qwen3_5DecoderLayer``), ``norm.weight``. The norms are
zero-centred (1 + w), like every Qwen3.5 RMSNorm.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm


class MTP(nn.Module):
    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        layer_config = copy.deepcopy(config)
        layer_config.layer_types = list(config.layer_types) + ["full_attention"]
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=eps)
        self.layers = nn.ModuleList(
            [Qwen3_5DecoderLayer(layer_config, config.num_hidden_layers)]
        )
        self.norm = Qwen3_5RMSNorm(h, eps=eps)
        std = config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)

    def forward(
        self, lm: Qwen3_5ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> torch.Tensor:
        """Logits for token t+2 at each position t.

        Args:
            lm: the main model (its embeddings, rotary embedding and head are shared).
            hidden: ``[B, T, H]`` the main model's final (normed) hidden states at 0..T-1.
            next_ids: ``[B, T]`` the tokens at positions 1..T.
        Returns:
            ``[B, T, vocab]`` logits.
        """
        e = self.pre_fc_norm_embedding(lm.model.embed_tokens(next_ids))
        u = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        b, t = next_ids.shape
        positions = torch.arange(1, t + 1, device=u.device).view(1, 1, t).expand(3, b, t)
        rope = lm.model.rotary_emb(u, positions)
        # No mask: the attention is causal by itself (sdpa's is_causal, eager's default).
        u = self.layers[0](u, position_embeddings=rope, attention_mask=None)
        return lm.lm_head(self.norm(u))
