"""Triton gated delta rule walked row by row, for steps whose chunks are all short.

A speculative verify step gives every sequence ``k + 1 <= 5`` rows. fla-core's chunked
kernels plan their 64-row chunks on the host from ``cu_seqlens`` (so they cannot be
captured in a CUDA graph over several sequences) and pay a whole chunk's work for a few
rows. Here one program owns one (sequence, value head, block of value columns), keeps
that tile of the state in registers and walks the sequence's rows in order::

    for t in rows of sequence b (from query_start_loc on the device):
        S = S * exp(g_t)                    decay
        S = S + k_t (beta_t (v_t - S^T k_t))^T   delta-rule write
        o_t = S^T q_t                       read
    state[slot_b] = S                       once, after the last row

Each row is the decode step's math (``gdn_decode``), so a sequence of one row gives the
decode kernel's result. The grid depends only on the sequence count and the heads, the
row bounds are read on the device, and nothing is allocated: a launch can be captured in
a CUDA graph, and a sequence with no rows (a graph's padding) leaves its state as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import gdn_reference as ref
from pagedserve.kernels.gdn_decode import (
    RULE_BLOCK_V,
    check_rule_operands,
    delta_rule_row,
    l2_normalized,
)


@triton.jit(do_not_specialize=["seq_begin"])
def _rule_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, qsl_ptr,
    seq_begin,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_g_h, stride_b_t, stride_b_h, stride_o_t, stride_o_h,
    stride_s_slot,
    scale, eps,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = seq_begin + tl.program_id(0)
    hv = tl.program_id(1)
    hk = hv // GROUP  # value head hv reads key head hv // (Hv // Hk)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    bos = tl.load(qsl_ptr + seq).to(tl.int64)  # 64-bit rows: row * stride cannot overflow
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int64)

    # [BLOCK_K, BLOCK_V] tile of this head's [Dk, Dv] state (contiguous within the slot).
    s_ptrs = (
        state_ptr + slot * stride_s_slot + hv * (DK * DV)
        + offs_k[:, None] * DV + offs_v[None, :]
    )
    mask_s = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)
    for row in range(bos, eos):
        q = tl.load(q_ptr + row * stride_q_t + hk * stride_q_h + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k_t + hk * stride_k_h + offs_k, mask=mask_k,
                    other=0.0).to(tl.float32)
        q = l2_normalized(q, eps) * scale
        k = l2_normalized(k, eps)
        v = tl.load(v_ptr + row * stride_v_t + hv * stride_v_h + offs_v, mask=mask_v,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g_t + hv * stride_g_h).to(tl.float32)
        beta = tl.load(beta_ptr + row * stride_b_t + hv * stride_b_h).to(tl.float32)
        s = delta_rule_row(s, k, v, g, beta)
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V]
        tl.store(o_ptr + row * stride_o_t + hv * stride_o_h + offs_v,
                 o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(s_ptrs, s, mask=mask_s)


def gated_delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    recurrent_state: torch.Tensor, query_start_loc: torch.Tensor, state_slots: torch.Tensor,
    seq_begin: int, out: torch.Tensor,
) -> None:
    """The gated delta rule over the rows of sequences ``seq_begin ..``, state in place.

    Args:
        q, k: ``[T, Hk, Dk]`` the whole step, model dtype (L2-normalised in the kernel,
            eps 1e-6; q scaled by ``Dk ** -0.5``); the last dim must be contiguous.
        v: ``[T, Hv, Dv]``, model dtype, last dim contiguous.
        g: float32 ``[T, Hv]`` log decay.  beta: ``[T, Hv]`` any float dtype.
        recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]``, each slot contiguous.
        query_start_loc: int32 ``[B + 1]`` on the device; sequence b holds rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` (possibly none).
        state_slots: int32 ``[B]`` slot per sequence.
        seq_begin: first sequence to run (the step's decode rows come before it).
        out: ``[T, Hv, Dv]``; the rows of sequences ``seq_begin ..`` are written in its
            own dtype, the others are left as they are. Last dim contiguous.
    """
    num_seqs = state_slots.shape[0] - seq_begin
    if num_seqs <= 0:
        return
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    check_rule_operands(q, k, v, out, recurrent_state)
    block_v = min(RULE_BLOCK_V, triton.next_power_of_2(dv))
    grid = (num_seqs, hv, triton.cdiv(dv, block_v))
    _rule_recurrent_kernel[grid](
        q, k, v, g, beta, out, recurrent_state, state_slots, query_start_loc,
        seq_begin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        recurrent_state.stride(0),
        dk ** -0.5, ref.L2NORM_EPS,
        GROUP=hv // hk, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        num_warps=4,
    )
