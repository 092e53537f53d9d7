"""Qwen3.5 gated full attention over the paged (or contiguous) K/V cache.

Per token: ``q_proj`` yields, for each query head, the query and an output gate side by
side; q and k get an RMSNorm over head_dim and partial RoPE; the new K/V rows are written
to the cache first; then decode rows read the cache through the paged decode op and
prefill rows through the paged prefill op; the result is gated by ``sigmoid(gate)``.

Fused projection (``qkv_proj.weight``, rows)::

    [ q_proj: Hq x (query D | gate D) ][ k_proj: Hkv x D ][ v_proj: Hkv x D ]
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.kernels import ops
from pagedserve.kernels.ops import DecodeWorkspace
from pagedserve.kv.formats import KVBlockStorage
from pagedserve.model.elementwise import EAGER, ElementwiseOps
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.layers import RMSNorm
from pagedserve.parallel.group import SINGLE, TensorParallel
from pagedserve.parallel.sharding import num_local_kv_heads


class GatedAttention(nn.Module):
    """One full-attention layer (GQA, ``Hq % Hkv == 0``).

    Under tensor parallelism (``tp``) it holds its rank's ``Hq / N`` query heads and the
    K/V heads they read (``parallel/sharding.py``); ``o_proj`` is row-parallel, so its
    partial outputs are summed over the ranks.
    """

    PACKED = {"qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight")}
    ew: ElementwiseOps = EAGER

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = cfg.num_attention_heads // tp.size
        self.num_kv_heads = num_local_kv_heads(cfg, tp.size)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_rows = 2 * self.num_heads * self.head_dim  # query and gate
        kv_rows = self.num_kv_heads * self.head_dim
        self.split = (q_rows, kv_rows, kv_rows)
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cache_k: KVBlockStorage, cache_v: KVBlockStorage, batch: ForwardBatch,
        workspace: DecodeWorkspace | None = None,
    ) -> torch.Tensor:
        """``x``: ``[T, H]``; ``cos``/``sin``: ``[T, rotary_dim]`` in ``x.dtype``.

        Writes this step's K/V rows at ``batch.slot_mapping`` and returns ``[T, H]``.
        ``workspace`` is the decode kernel's persistent buffer set (CUDA; one per runner).
        """
        T = x.shape[0]
        D = self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q, gate = q_gate.view(T, self.num_heads, 2 * D).chunk(2, dim=-1)  # [T, Hq, D] each
        q, k = self.ew.qk_norm_rope(
            q, k.view(T, self.num_kv_heads, D), self.q_norm.weight, self.k_norm.weight,
            cos, sin, self.q_norm.eps,
        )  # [T, Hq, D], [T, Hkv, D]
        v = v.view(T, self.num_kv_heads, D)  # [T, Hkv, D]

        ops.kv_write(cache_k, k, batch.slot_mapping)
        ops.kv_write(cache_v, v, batch.slot_mapping)
        o = self._attend(q, cache_k, cache_v, batch, workspace)  # [T, Hq, D]

        o = self.ew.sigmoid_gate(o, gate)  # [T, Hq, D]; gate is a strided view, read in place
        return self.tp.all_reduce(self.o_proj(o.reshape(T, -1)))

    def _attend(
        self, q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
        batch: ForwardBatch, workspace: DecodeWorkspace | None,
    ) -> torch.Tensor:
        """Decode rows through the paged decode op, prefill rows through the paged prefill
        op, both into one ``[T, Hq, D]`` output."""
        # Padding rows (a prefill graph's) get no attention: zeros, kept finite.
        out = torch.empty_like(q) if batch.row_valid is None else torch.zeros_like(q)  # [T, Hq, D]
        # Decode rows come first and hold one token each, so row i is sequence i.
        nd = batch.num_decode_seqs
        if nd:
            ops.paged_decode_attention(
                q[:nd], cache_k, cache_v, batch.block_tables[:nd], batch.seq_lens[:nd],
                self.scale, workspace=workspace, out=out[:nd],
            )
        if nd < batch.num_seqs:
            ops.paged_prefill_attention(
                q, cache_k, cache_v, batch.block_tables, batch.query_start_loc,
                batch.seq_lens, self.scale, out=out, seq_begin=nd,
                query_start_loc_cpu=batch.query_start_loc_cpu, seq_lens_cpu=batch.seq_lens_cpu,
            )
        return out
