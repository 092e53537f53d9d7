"""Qwen3.5 Gated DeltaNet (linear attention) layer over per-sequence state slots.

Per token: one fused projection yields the conv inputs (q, k, v), the output gate z, and the
per-head write strength ``b`` and decay input ``a``; q/k/v pass the causal depthwise conv
(state carried in the sequence's conv-state slot) and SiLU; the gated delta rule updates
the sequence's recurrent-state slot; a gated RMSNorm and ``out_proj`` close the layer.

Fused projection (``in_proj.weight``, rows)::

    [ in_proj_qkv: q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) ][ in_proj_z: Hv*Dv ][ b: Hv ][ a: Hv ]

Decay and write strength, as transformers computes them::

    g    = -exp(A_log) * softplus(a + dt_bias)     float32 [T, Hv], log-space decay <= 0
    beta = sigmoid(b)                              model dtype [T, Hv]
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.kernels import gdn
from pagedserve.model.elementwise import EAGER, ElementwiseOps
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.fp8_linear import split_outputs
from pagedserve.parallel.group import SINGLE, TensorParallel

# ``advance`` over sequences of at most this many rows each reads every row bound on the
# device (the varlen conv, and the row-walking delta rule), so a CUDA graph captured with
# that many rows per sequence replays for any row counts up to it.
MAX_CAPTURED_ROWS = gdn.RECURRENT_MAX_ROWS


class GatedRMSNorm(nn.Module):
    """``w * norm(x) * silu(z)`` over one value head (weight used as is, not ``1 + w``)."""

    ew: ElementwiseOps = EAGER

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x``, ``z``: ``[..., Dv]``; returns ``x``'s shape in ``x.dtype``."""
        return self.ew.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer. Its state lives in the state pool, not in the module.

    Under tensor parallelism (``tp``) it holds its rank's ``Hk / N`` key and ``Hv / N``
    value heads (their projection rows, conv channels and gates; ``parallel/sharding.py``),
    and its state slots hold only those heads; ``out_proj`` is row-parallel.
    """

    PACKED = {
        "in_proj.weight": (
            "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
        )
    }
    ew: ElementwiseOps = EAGER

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_k_heads = cfg.linear_num_key_heads // tp.size
        self.num_v_heads = cfg.linear_num_value_heads // tp.size
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.split = (conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split), bias=False)
        # Depthwise taps [conv_dim, 1, K], the checkpoint's own layout.
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        self.conv1d.weight.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """One step.

        Args:
            x: ``[T, H]``.
            conv_state: ``[S + 1, conv_dim, K - 1]``, this layer's conv states (model dtype).
            recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]``, this layer's delta-rule states.
            batch: the step; ``batch.state_slots`` picks each sequence's slot.

        Returns:
            ``[T, H]``; both states of every sequence in the batch are advanced in place.
        """
        T = x.shape[0]
        mixed, z, b, a = split_outputs(self.in_proj, x, self.split)
        record = batch.gdn_record
        if record is not None:
            rows = record.rows
            record.inputs.append((mixed, b, a) if rows is None else (mixed[rows], b[rows], a[rows]))
        o = self.advance(mixed, b, a, conv_state, recurrent_state, batch)  # [T, Hv, Dv]
        o = self.norm(o, z.view(T, self.num_v_heads, self.head_v_dim))  # [T, Hv, Dv]
        return self.tp.all_reduce(self.out_proj(o.reshape(T, self.value_dim)))

    def advance(
        self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_state: torch.Tensor,
        recurrent_state: torch.Tensor, batch: ForwardBatch,
    ) -> torch.Tensor:
        """The conv and the delta rule over the projected rows ``mixed`` ``[T, conv_dim]``,
        ``b``, ``a`` ``[T, Hv]``: advances both states of ``batch``'s sequences in place
        and returns the rule's output ``[T, Hv, Dv]``. Nothing here reads another row of
        the model, so rows recorded from one step (``ForwardBatch.gdn_record``) can
        advance a state again without the layers around it.

        On CUDA the host copy ``batch.query_start_loc_cpu`` only picks the kernels and
        sizes their grids; every row bound is read from ``batch.query_start_loc`` on the
        device. A batch with no decode rows whose host copy gives every sequence at most
        ``MAX_CAPTURED_ROWS`` rows can therefore be captured and replayed with fewer rows
        per sequence on the device (none included), its row count ``T`` unchanged.

        With state taps (``batch.gdn_rounds``) the conv and the rule advance the rows in
        rounds, each from the states the one before left (``model/state_taps.py``); the
        gates are computed once, over every row (a round's row count is never compiled
        for)."""
        g, beta = self.ew.gdn_gates(a, b, self.A_log, self.dt_bias)  # [T, Hv] each
        if batch.row_valid is not None:
            # Padding rows neither decay nor write the state (g = 0, beta = 0), so the
            # state after a padded chunk is the state after its last real row.
            keep = batch.row_valid[:, None]  # [T, 1]
            g, beta = g * keep, beta * keep
        rounds = batch.gdn_rounds
        if rounds is None:
            return self._advance_rows(
                mixed, g, beta, conv_state, recurrent_state, batch.query_start_loc,
                batch.query_start_loc_cpu, batch.state_slots, batch.num_decode_seqs)
        out = torch.empty(mixed.shape[0], self.num_v_heads, self.head_v_dim,
                          dtype=mixed.dtype, device=mixed.device)  # [T, Hv, Dv]
        for r in rounds:  # state taps (model/state_taps.py)
            if r.copy_src is not None:
                conv_state[r.copy_dst] = conv_state[r.copy_src]
                recurrent_state[r.copy_dst] = recurrent_state[r.copy_src]
            out[r.rows] = self._advance_rows(
                mixed[r.rows], g[r.rows], beta[r.rows], conv_state, recurrent_state,
                r.query_start_loc, r.query_start_loc_cpu, r.state_slots, r.num_decode_seqs)
        return out

    def _advance_rows(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        conv_state: torch.Tensor, recurrent_state: torch.Tensor,
        query_start_loc: torch.Tensor, query_start_loc_cpu: list[int],
        state_slots: torch.Tensor, num_decode_seqs: int,
    ) -> torch.Tensor:
        """The conv and the delta rule over sequences laid out as ``query_start_loc``
        (int32 ``[B + 1]``, host copy ``query_start_loc_cpu``) in the rows given
        (``mixed`` ``[T, conv_dim]``, gates ``g``, ``beta`` ``[T, Hv]``), each from and back
        to its slot in ``state_slots`` (int32 ``[B]``)."""
        T = mixed.shape[0]
        mixed = gdn.causal_conv1d_varlen(
            mixed, self.conv1d.weight[:, 0], conv_state, query_start_loc,
            query_start_loc_cpu, state_slots, num_decode_seqs,
        )  # [T, conv_dim], SiLU applied
        q, k, v = mixed.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = q.view(T, self.num_k_heads, self.head_k_dim)
        k = k.view(T, self.num_k_heads, self.head_k_dim)
        v = v.view(T, self.num_v_heads, self.head_v_dim)
        return gdn.gated_delta_rule_varlen(
            q, k, v, g, beta, recurrent_state, query_start_loc,
            query_start_loc_cpu, state_slots, num_decode_seqs,
        )  # [T, Hv, Dv]
