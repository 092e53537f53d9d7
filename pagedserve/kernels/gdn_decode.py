"""Triton decode-step kernels for the Gated DeltaNet layers, on state slots in place.

One decode step of B sequences (one token each, token row b belongs to sequence b):

* ``conv_decode_step``: SiLU(depthwise conv over ``conv_state[slot] ++ x_b``) and the
  conv-state shift, one program per (sequence, block of channels);
* ``gated_delta_rule_decode_step``: L2 norm of q/k, gated decay, delta-rule write and read
  of the recurrent state, one program per (sequence, value head, block of value columns).

Each is a single launch for all decode sequences of a layer. Neither allocates, syncs or
branches on data on the host, so both can be captured in a CUDA graph. Padding rows point
at the null slot; several padding rows may race on it, which is harmless by design.

State layout (one layer's view of ``StatePool``; slots are the outer index)::

    conv_state      [S + 1, C, K - 1]   oldest input first; column K - 2 is the newest
    recurrent_state [S + 1, Hv, Dk, Dv] float32, contiguous per slot

A program owns its (slot, channels) or (slot, head, value columns) exclusively, so reading
the old state and writing the new one in the same program is race-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import gdn_reference as ref

CONV_BLOCK_C = 256
RULE_BLOCK_V = 32


# The row step of the gated delta rule, shared by every kernel that runs it (decode here,
# the row walk of short chunks in ``gdn_recurrent``, the rollback in ``gdn_rollback``), so
# that all of them round alike: a sequence's state is the same whichever kernel advanced it.
@triton.jit
def l2_normalized(x, eps):
    """``x / sqrt(sum(x^2) + eps)`` over a 1-D float32 block (masked lanes 0)."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def delta_rule_row(s, k, v, g, beta):
    """One row of the rule on a ``[BLOCK_K, BLOCK_V]`` float32 state tile ``s``: decay by
    ``exp(g)``, then the delta write of ``v`` at key ``k`` (L2-normalized) with rate
    ``beta``. Returns the new tile."""
    s = s * tl.exp(g)
    pred = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V] S^T k: what the state recalls
    delta = (v - pred) * beta
    return s + k[:, None] * delta[None, :]


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr,
    C,
    stride_x_t, stride_w_c, stride_w_k,
    stride_s_slot, stride_s_c, stride_s_k,
    stride_y_t,
    KW: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    s_row = state_ptr + slot * stride_s_slot + offs_c * stride_s_c  # [BLOCK_C] pointers
    w_row = w_ptr + offs_c * stride_w_c

    x = tl.load(x_ptr + b * stride_x_t + offs_c, mask=mask_c, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_row + (KW - 1) * stride_w_k, mask=mask_c).to(tl.float32)
    # Shift the state left by one as we read it: column j is read before column j - 1 is
    # written, and the same thread holds the same channel in every 1-D tile, so in-place
    # is safe.
    for j in tl.static_range(KW - 1):
        s_j = tl.load(s_row + j * stride_s_k, mask=mask_c, other=0.0)
        acc += s_j.to(tl.float32) * tl.load(w_row + j * stride_w_k, mask=mask_c).to(tl.float32)
        if j > 0:
            tl.store(s_row + (j - 1) * stride_s_k, s_j, mask=mask_c)
    tl.store(s_row + (KW - 2) * stride_s_k, x.to(state_ptr.dtype.element_ty), mask=mask_c)
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + b * stride_y_t + offs_c, y.to(y_ptr.dtype.element_ty), mask=mask_c)


def conv_decode_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
    state_slots: torch.Tensor, out: torch.Tensor,
) -> None:
    """Conv of one new token per sequence, updating ``conv_state`` in place.

    Args:
        x: ``[N, C]`` the decode rows (row b is sequence b's token), model dtype; the last
            dim must be contiguous.
        weight: ``[C, K]`` depthwise taps, any strides.
        conv_state: ``[S + 1, C, K - 1]`` one layer's conv states (model dtype), any strides.
        state_slots: int32 ``[N]`` slot per row (padding rows: the null slot).
        out: ``[N, C]`` written with ``SiLU(conv)`` in its own dtype; last dim contiguous.
    """
    n, c = x.shape
    if n == 0:
        return
    _require_unit_last_stride(x=x, out=out)
    kw = weight.shape[1]
    grid = (n, triton.cdiv(c, CONV_BLOCK_C))
    _conv_decode_kernel[grid](
        x, weight, conv_state, state_slots, out,
        c,
        x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(0),
        KW=kw, BLOCK_C=CONV_BLOCK_C,
    )


@triton.jit
def _rule_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_g_h, stride_b_t, stride_b_h, stride_o_t, stride_o_h,
    stride_s_slot,
    scale, eps,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // GROUP  # GQA-like sharing: value head hv reads key head hv // (Hv // Hk)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    slot = tl.load(slots_ptr + b).to(tl.int64)

    # Every program of a head recomputes the (cheap) q/k norms instead of a second launch.
    q = tl.load(q_ptr + b * stride_q_t + hk * stride_q_h + offs_k, mask=mask_k, other=0.0)
    k = tl.load(k_ptr + b * stride_k_t + hk * stride_k_h + offs_k, mask=mask_k, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    q = l2_normalized(q, eps) * scale
    k = l2_normalized(k, eps)
    v = tl.load(v_ptr + b * stride_v_t + hv * stride_v_h + offs_v, mask=mask_v, other=0.0)
    v = v.to(tl.float32)
    g = tl.load(g_ptr + b * stride_g_t + hv * stride_g_h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_b_t + hv * stride_b_h).to(tl.float32)

    # [BLOCK_K, BLOCK_V] tile of this head's [Dk, Dv] state (contiguous within the slot).
    s_ptrs = (
        state_ptr + slot * stride_s_slot + hv * (DK * DV)
        + offs_k[:, None] * DV + offs_v[None, :]
    )
    mask_s = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=mask_s, other=0.0)
    s = delta_rule_row(s, k, v, g, beta)
    o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V]
    tl.store(s_ptrs, s, mask=mask_s)
    tl.store(
        o_ptr + b * stride_o_t + hv * stride_o_h + offs_v,
        o.to(o_ptr.dtype.element_ty), mask=mask_v,
    )


def gated_delta_rule_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    recurrent_state: torch.Tensor, state_slots: torch.Tensor, out: torch.Tensor,
) -> None:
    """One gated-delta-rule step per sequence, updating ``recurrent_state`` in place.

    Args:
        q, k: ``[N, Hk, Dk]`` decode rows, model dtype (L2-normalised in the kernel, eps
            1e-6; q scaled by ``Dk ** -0.5``); the last dim must be contiguous.
        v: ``[N, Hv, Dv]``, model dtype, last dim contiguous.
        g: float32 ``[N, Hv]`` log decay.  beta: ``[N, Hv]`` any float dtype.
        recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]``, each slot contiguous.
        state_slots: int32 ``[N]`` slot per row (padding rows: the null slot).
        out: ``[N, Hv, Dv]`` written with the outputs in its own dtype; last dim contiguous.
    """
    n, hk, dk = q.shape
    if n == 0:
        return
    hv, dv = v.shape[1:]
    check_rule_operands(q, k, v, out, recurrent_state)
    block_v = min(RULE_BLOCK_V, triton.next_power_of_2(dv))
    grid = (n, hv, triton.cdiv(dv, block_v))
    _rule_decode_kernel[grid](
        q, k, v, g, beta, out, recurrent_state, state_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        recurrent_state.stride(0),
        dk ** -0.5, ref.L2NORM_EPS,
        GROUP=hv // hk, DK=dk, DV=dv,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        num_warps=4,
    )


def check_rule_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        recurrent_state: torch.Tensor) -> None:
    """The layout the delta-rule kernels index: rows with a contiguous last dim, and each
    state slot a contiguous ``[Hv, Dk, Dv]``."""
    _require_unit_last_stride(q=q, k=k, v=v, out=out)
    dk, dv = q.shape[-1], v.shape[-1]
    if recurrent_state.stride()[1:] != (dk * dv, dv, 1):
        raise ValueError(
            f"recurrent_state slots must be contiguous [Hv, Dk, Dv], got strides "
            f"{recurrent_state.stride()}"
        )


def _require_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")
