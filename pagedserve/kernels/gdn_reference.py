"""Torch reference ops for the Gated DeltaNet (GDN) layers: the CPU path.

Shapes use: T new tokens in the batch, B sequences (decode rows first), C conv channels
(``conv_dim = 2 * Hk * Dk + Hv * Dv``), K conv taps, S state slots (+ the null slot S),
Hk key heads, Hv value heads (``Hv % Hk == 0``; value head h reads key head ``h // (Hv//Hk)``),
Dk / Dv key / value head dims.

The gated delta rule, per value head, with state ``S`` ``[Dk, Dv]`` and per token t::

    S   <- exp(g_t) * S                          # gated decay, g_t <= 0 (log space)
    S   <- S + k_t (beta_t * (v_t - S^T k_t))^T  # delta-rule write of the prediction error
    o_t  = S^T q_t

with q and k L2-normalised (eps 1e-6) and q scaled by ``Dk ** -0.5``. It matches
transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule`` with
``use_qk_l2norm_in_kernel=True``. Everything is computed in float32; the state pool is float32.

Batches follow the step contract (docs/ARCHITECTURE.md): the first ``num_decode_seqs``
sequences hold exactly one new token each, the rest are prefill chunks of any length.
Decode rows run vectorised as one recurrence step; prefill rows loop over sequences and use
the chunked (WY / UT-transform) form, which turns a chunk of 64 steps into a few matmuls and a
triangular solve, so a prompt of a few hundred tokens stays fast on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32 (the fla / HF convention)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of ``x`` gated by ``silu(z)``, bit-for-bit HF's ``Qwen3_5RMSNormGated``.

    Args:
        x: ``[N, Dv]`` core attention output, model dtype.
        z: ``[N, Dv]`` gate (the ``in_proj_z`` projection), any float dtype.
        weight: ``[Dv]`` norm weight (used as is: no ``1 + weight`` offset here, unlike
            the decoder's RMSNorm), model dtype.
        eps: variance epsilon (``rms_norm_eps``).

    Returns:
        ``[N, Dv]`` in ``x.dtype``.
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # HF rounds to the input dtype before the weight multiply and multiplies the gate in
    # float32; reproduce both roundings so bf16 outputs match exactly.
    h = weight * h.to(dtype)
    h = h * F.silu(z.float())
    return h.to(dtype)


def _host_lens(query_start_loc_cpu: Sequence[int] | torch.Tensor) -> list[int]:
    qsl = [int(v) for v in query_start_loc_cpu]
    if len(qsl) < 2 or qsl[0] != 0:
        raise ValueError(f"query_start_loc must start at 0 and hold B + 1 >= 2 entries, got {qsl}")
    return qsl


def check_varlen(
    num_tokens: int, query_start_loc_cpu: Sequence[int] | torch.Tensor,
    state_slots: torch.Tensor, num_decode_seqs: int,
) -> list[int]:
    """Validate the host-side batch layout; return ``query_start_loc`` as a list of ints.

    Only host data is read, so this is safe inside CUDA-graph capture.
    """
    qsl = _host_lens(query_start_loc_cpu)
    num_seqs = len(qsl) - 1
    if state_slots.dim() != 1 or state_slots.shape[0] != num_seqs:
        raise ValueError(
            f"state_slots must be [B={num_seqs}], got {tuple(state_slots.shape)}"
        )
    if qsl[-1] != num_tokens:
        raise ValueError(f"query_start_loc ends at {qsl[-1]} but the batch has {num_tokens} tokens")
    if not 0 <= num_decode_seqs <= num_seqs:
        raise ValueError(f"num_decode_seqs={num_decode_seqs} not in [0, {num_seqs}]")
    if qsl[num_decode_seqs] != num_decode_seqs:
        raise ValueError(
            f"the first {num_decode_seqs} sequences must hold one token each; "
            f"query_start_loc={qsl}"
        )
    if any(qsl[i + 1] <= qsl[i] for i in range(num_seqs)):
        raise ValueError(f"every sequence needs at least one token; query_start_loc={qsl}")
    return qsl


# ---------------------------------------------------------------------------------------------
# causal depthwise conv
# ---------------------------------------------------------------------------------------------


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    query_start_loc_cpu: Sequence[int] | torch.Tensor,
    state_slots: torch.Tensor,
    num_decode_seqs: int,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) per sequence, carrying each sequence's conv state.

    Per sequence, the conv runs over ``conv_state[slot] ++ x_seq`` (the K - 1 inputs before
    the chunk, then the chunk) and ``conv_state[slot]`` is overwritten with the last K - 1
    inputs of that concatenation, so a chunk shorter than K - 1 shifts the old state.

    Args:
        x: ``[T, C]`` conv inputs (``in_proj_qkv`` output), model dtype.
        weight: ``[C, K]`` depthwise taps (``conv1d.weight.squeeze(1)``); tap ``K - 1``
            multiplies the current token.
        conv_state: ``[S + 1, C, K - 1]`` one layer's conv states, oldest input first;
            updated in place.
        query_start_loc: int32 ``[B + 1]`` device copy (unused here; kept for the dispatch
            signature).
        query_start_loc_cpu: ``B + 1`` ints, the host copy.
        state_slots: int32 ``[B]`` state slot per sequence.
        num_decode_seqs: the first ``num_decode_seqs`` sequences hold one token each.

    Returns:
        ``[T, C]`` in ``x.dtype``.
    """
    del query_start_loc
    qsl = check_varlen(x.shape[0], query_start_loc_cpu, state_slots, num_decode_seqs)
    check_conv_shapes(x, weight, conv_state)
    w = weight.float()  # [C, K]
    y = torch.empty_like(x)
    nd = num_decode_seqs
    if nd:
        slots = state_slots[:nd].long()
        full = torch.cat([conv_state[slots], x[:nd, :, None]], dim=-1).float()  # [nd, C, K]
        y[:nd] = F.silu((full * w).sum(-1)).to(x.dtype)
        conv_state[slots] = full[:, :, 1:].to(conv_state.dtype)
    slot_list = state_slots.tolist()
    for i in range(nd, len(qsl) - 1):
        s, e, slot = qsl[i], qsl[i + 1], slot_list[i]
        full = torch.cat([conv_state[slot].float(), x[s:e].t().float()], dim=-1)  # [C, K-1+L]
        # Depthwise conv as one grouped conv1d over the state-prefixed sequence.
        out = F.conv1d(full[None], w[:, None, :], groups=w.shape[0])[0]  # [C, L]
        y[s:e] = F.silu(out).t().to(x.dtype)
        conv_state[slot] = full[:, full.shape[1] - (w.shape[1] - 1):].to(conv_state.dtype)
    return y


def check_conv_shapes(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"expected x [T, C], weight [C, K], conv_state [S + 1, C, K - 1]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(conv_state.shape)}"
        )
    c, k = weight.shape
    if k < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {k}")
    if x.shape[1] != c or conv_state.shape[1:] != (c, k - 1):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)} (want [T, {c}], [{c}, {k}], [S+1, {c}, {k - 1}])"
        )


# ---------------------------------------------------------------------------------------------
# gated delta rule
# ---------------------------------------------------------------------------------------------


def check_rule_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(
            f"q and k must both be [T, Hk, Dk]; got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    t, hk, dk = q.shape
    if v.dim() != 3 or v.shape[0] != t:
        raise ValueError(f"v must be [T={t}, Hv, Dv], got {tuple(v.shape)}")
    hv, dv = v.shape[1:]
    if hv % hk != 0:
        raise ValueError(f"Hv ({hv}) must be a multiple of Hk ({hk})")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(
            f"g and beta must be [T={t}, Hv={hv}]; got {tuple(g.shape)}, {tuple(beta.shape)}"
        )
    if recurrent_state.dim() != 4 or recurrent_state.shape[1:] != (hv, dk, dv):
        raise ValueError(
            f"recurrent_state must be [S + 1, {hv}, {dk}, {dv}], got {tuple(recurrent_state.shape)}"
        )
    if recurrent_state.dtype != torch.float32:
        raise ValueError(f"recurrent_state must be float32, got {recurrent_state.dtype}")


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalise q and k in float32, scale q, and expand key heads to value heads."""
    rep = hv // q.shape[-2]
    qn = l2_normalize(q) * q.shape[-1] ** -0.5
    kn = l2_normalize(k)
    if rep > 1:
        qn = qn.repeat_interleave(rep, dim=-2)
        kn = kn.repeat_interleave(rep, dim=-2)
    return qn, kn


def gated_delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step for a batch of sequences (prepared inputs, float32).

    Args:
        q, k: ``[N, Hv, Dk]`` normalised (q also scaled) and head-expanded.
        v: ``[N, Hv, Dv]``.  g, beta: ``[N, Hv]``.
        state: ``[N, Hv, Dk, Dv]``.

    Returns:
        ``(o [N, Hv, Dv], new_state [N, Hv, Dk, Dv])``.
    """
    state = state * g.exp()[..., None, None]
    pred = torch.einsum("nhkv,nhk->nhv", state, k)  # what the state recalls for k
    delta = (v - pred) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", state, q), state


def gated_delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, a chunk at a time (prepared inputs, float32).

    Within a chunk, with ``G_i = g_1 + ... + g_i`` and S0 the state at the chunk start,
    the decayed state just before token i writes is
    ``exp(G_i) S0 + sum_{j<i} exp(G_i - G_j) k_j d_j^T``, so the writes ``d_i`` solve the
    unit-lower-triangular system (the UT transform of DeltaNet / WY representation)

        d_i + beta_i sum_{j<i} exp(G_i - G_j) (k_i . k_j) d_j = beta_i (v_i - exp(G_i) S0^T k_i)

    and then ``o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) d_j`` and
    ``S_end = exp(G_n) S0 + sum_j exp(G_n - G_j) k_j d_j^T``. All exponents are <= 0
    (future pairs are masked before the exp), so nothing overflows.

    Args:
        q, k: ``[Hv, L, Dk]`` normalised (q also scaled) and head-expanded.
        v: ``[Hv, L, Dv]``.  g, beta: ``[Hv, L]``.
        state: ``[Hv, Dk, Dv]`` initial state.

    Returns:
        ``(o [Hv, L, Dv], final_state [Hv, Dk, Dv])``.
    """
    length = q.shape[1]
    out = torch.empty_like(v)
    dv = v.shape[-1]
    for s in range(0, length, chunk_size):
        e = min(s + chunk_size, length)
        n = e - s
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        cum = g[:, s:e].cumsum(-1)  # [Hv, n]  G_i
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        # [Hv, n, n] strictly lower part of the UT system; the unit diagonal is implicit.
        system = (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = torch.cat([bc[..., None] * vc, (bc * cum.exp())[..., None] * kc], dim=-1)
        sol = torch.linalg.solve_triangular(
            system, rhs, upper=False, unitriangular=True
        )  # [Hv, n, Dv + Dk]
        d = sol[..., :dv] - sol[..., dv:] @ state  # [Hv, n, Dv] the writes d_i
        attn = (qc @ kc.transpose(-1, -2)) * decay  # [Hv, n, n] includes the diagonal
        out[:, s:e] = (qc * cum.exp()[..., None]) @ state + attn @ d
        tail = (cum[:, -1:] - cum).exp()  # [Hv, n] decay from token j to the chunk end
        state = state * cum[:, -1].exp()[:, None, None] + (kc * tail[..., None]).transpose(
            -1, -2
        ) @ d
    return out, state


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    query_start_loc_cpu: Sequence[int] | torch.Tensor,
    state_slots: torch.Tensor,
    num_decode_seqs: int,
) -> torch.Tensor:
    """The gated delta rule per sequence, from and back to the sequences' state slots.

    Args:
        q, k: ``[T, Hk, Dk]`` conv outputs, model dtype (L2-normalised here).
        v: ``[T, Hv, Dv]``, model dtype.
        g: float32 ``[T, Hv]`` log decay ``-exp(A_log) * softplus(a + dt_bias)``.
        beta: ``[T, Hv]`` write strength ``sigmoid(b)``, any float dtype.
        recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]`` one layer's states; the final
            state of each sequence is written back in place.
        query_start_loc: int32 ``[B + 1]`` device copy (unused here).
        query_start_loc_cpu: ``B + 1`` ints, the host copy.
        state_slots: int32 ``[B]``.
        num_decode_seqs: the first ``num_decode_seqs`` sequences hold one token each.

    Returns:
        ``[T, Hv, Dv]`` in ``v.dtype``.
    """
    del query_start_loc
    qsl = check_varlen(q.shape[0], query_start_loc_cpu, state_slots, num_decode_seqs)
    check_rule_shapes(q, k, v, g, beta, recurrent_state)
    hv = v.shape[1]
    qn, kn = _prepare_qk(q, k, hv)  # [T, Hv, Dk] float32
    vf, gf, bf = v.float(), g.float(), beta.float()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    nd = num_decode_seqs
    if nd:
        slots = state_slots[:nd].long()
        o_d, new = gated_delta_rule_step(
            qn[:nd], kn[:nd], vf[:nd], gf[:nd], bf[:nd], recurrent_state[slots]
        )
        o[:nd] = o_d.to(v.dtype)
        recurrent_state[slots] = new
    slot_list = state_slots.tolist()
    for i in range(nd, len(qsl) - 1):
        s, e, slot = qsl[i], qsl[i + 1], slot_list[i]
        # Head-major contiguous copies, so every chunk's matmuls read dense blocks.
        q_s, k_s, v_s, g_s, b_s = (t[s:e].transpose(0, 1).contiguous()
                                   for t in (qn, kn, vf, gf, bf))
        o_s, new = gated_delta_rule_chunked(q_s, k_s, v_s, g_s, b_s, recurrent_state[slot])
        o[s:e] = o_s.transpose(0, 1).to(v.dtype)
        recurrent_state[slot] = new
    return o
