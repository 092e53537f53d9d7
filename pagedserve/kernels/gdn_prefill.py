"""GPU prefill path of the Gated DeltaNet layers: varlen causal conv (Triton) and the
chunked gated delta rule (fla-core), both reading and writing state slots.

The prefill rows of a batch are the sequences ``seq_begin .. B - 1`` (after the decode
rows), holding tokens ``query_start_loc[seq_begin] .. T - 1``. Nothing here is captured in
a CUDA graph; host metadata (``query_start_loc_cpu``) is used freely, the device is never
synchronised on.

Varlen conv: two launches, because a sequence's tokens span several programs and every one
of them may read the old conv state; the state can only be overwritten after all of them::

    _conv_prefill_kernel   y[t] = SiLU(sum_j w[:, j] * full[pos(t) + j])
                           full = conv_state[slot] ++ x[bos:eos]   (K - 1 + L columns)
    _conv_state_kernel     conv_state[slot] = full[L : L + K - 1]

fla-core (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, 0.6.0) is imported lazily:
it is a GPU-only dependency and must not be needed on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

PREFILL_BLOCK_T = 32
PREFILL_BLOCK_C = 128
STATE_BLOCK_C = 256


# Step-dependent integers are not specialized, so that a warm-up covers every launch.
@triton.jit(do_not_specialize=["t_begin", "t_end"])
def _conv_prefill_kernel(
    x_ptr, w_ptr, state_ptr, slots_ptr, qsl_ptr, tok_seq_ptr, y_ptr,
    t_begin, t_end, C,
    stride_x_t, stride_w_c, stride_w_k,
    stride_s_slot, stride_s_c, stride_s_k,
    stride_y_t,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    offs_t = t_begin + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # token rows
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < t_end
    mask_c = offs_c < C
    mask = mask_t[:, None] & mask_c[None, :]
    # A block of tokens may straddle sequences: each row looks up its own sequence.
    seq = tl.load(tok_seq_ptr + (offs_t - t_begin), mask=mask_t, other=0)
    bos = tl.load(qsl_ptr + seq, mask=mask_t, other=0)
    slot = tl.load(slots_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    pos = offs_t - bos  # [BLOCK_T] position in the chunk
    s_base = state_ptr + slot[:, None] * stride_s_slot + offs_c[None, :] * stride_s_c

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KW):
        col = pos + j  # column of ``full`` that tap j reads; < K - 1 means the old state
        from_state = (col < KW - 1)[:, None]
        from_x = (col >= KW - 1)[:, None]
        s_val = tl.load(s_base + col[:, None] * stride_s_k, mask=mask & from_state, other=0.0)
        x_row = (offs_t + j - (KW - 1)).to(tl.int64)
        x_val = tl.load(
            x_ptr + x_row[:, None] * stride_x_t + offs_c[None, :], mask=mask & from_x, other=0.0
        )
        w_j = tl.load(w_ptr + offs_c * stride_w_c + j * stride_w_k, mask=mask_c, other=0.0)
        # The two masks are disjoint, so the sum picks whichever source the tap reads.
        acc += (s_val.to(tl.float32) + x_val.to(tl.float32)) * w_j.to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + offs_t.to(tl.int64)[:, None] * stride_y_t + offs_c[None, :],
        y.to(y_ptr.dtype.element_ty), mask=mask,
    )


@triton.jit(do_not_specialize=["seq_begin"])
def _conv_state_kernel(
    x_ptr, state_ptr, slots_ptr, qsl_ptr,
    seq_begin, C,
    stride_x_t, stride_s_slot, stride_s_c, stride_s_k,
    KW: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = seq_begin + tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    bos = tl.load(qsl_ptr + seq)
    length = tl.load(qsl_ptr + seq + 1) - bos
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    s_row = state_ptr + slot * stride_s_slot + offs_c * stride_s_c
    # New column j is column length + j of ``full``. It is read from column length + j > j
    # (length >= 1) before column j is written, and later columns only read further right,
    # so no column is read after it is overwritten; one thread owns a channel throughout.
    for j in tl.static_range(KW - 1):
        col = length + j
        s_val = tl.load(s_row + col * stride_s_k, mask=mask_c & (col < KW - 1), other=0.0)
        x_row = (bos + col - (KW - 1)).to(tl.int64)
        x_val = tl.load(x_ptr + x_row * stride_x_t + offs_c, mask=mask_c & (col >= KW - 1),
                        other=0.0)
        new = tl.where(col < KW - 1, s_val.to(tl.float32), x_val.to(tl.float32))
        tl.store(s_row + j * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mask_c)


def conv_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
    query_start_loc: torch.Tensor, query_start_loc_cpu: list[int], state_slots: torch.Tensor,
    seq_begin: int, out: torch.Tensor,
) -> None:
    """Varlen causal conv of the prefill sequences ``seq_begin ..``; updates their states.

    Args:
        x: ``[T, C]`` conv inputs of the whole batch, model dtype, last dim contiguous.
        weight: ``[C, K]`` depthwise taps, any strides.
        conv_state: ``[S + 1, C, K - 1]`` one layer's conv states, any strides.
        query_start_loc: int32 ``[B + 1]`` on ``x.device``.
        query_start_loc_cpu: ``B + 1`` ints, the host copy.
        state_slots: int32 ``[B]``.
        seq_begin: first prefill sequence (= num_decode_seqs).
        out: ``[T, C]``; rows ``query_start_loc_cpu[seq_begin]:`` receive ``SiLU(conv)``.
    """
    num_seqs = len(query_start_loc_cpu) - 1 - seq_begin
    if num_seqs <= 0:
        return
    t_begin, t_end = query_start_loc_cpu[seq_begin], query_start_loc_cpu[-1]
    c, kw = weight.shape
    if x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out must have a contiguous last dim")
    # Sequence index of every prefill token, found on the device (no host round trip).
    rows = torch.arange(t_begin, t_end, dtype=query_start_loc.dtype, device=x.device)
    # Rows past the device's last offset (a prefill graph's padding) count as the last
    # sequence's: they read in-range inputs, and the state kernel uses real lengths.
    tok_seq = (torch.searchsorted(query_start_loc, rows, right=True) - 1).clamp_(
        max=len(query_start_loc_cpu) - 2)  # [T_prefill] int64
    grid = (triton.cdiv(t_end - t_begin, PREFILL_BLOCK_T), triton.cdiv(c, PREFILL_BLOCK_C))
    _conv_prefill_kernel[grid](
        x, weight, conv_state, state_slots, query_start_loc, tok_seq, out,
        t_begin, t_end, c,
        x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(0),
        KW=kw, BLOCK_T=PREFILL_BLOCK_T, BLOCK_C=PREFILL_BLOCK_C,
    )
    # Same stream: runs after every program above has read the old states.
    _conv_state_kernel[(num_seqs, triton.cdiv(c, STATE_BLOCK_C))](
        x, conv_state, state_slots, query_start_loc,
        seq_begin, c,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        KW=kw, BLOCK_C=STATE_BLOCK_C,
    )


@functools.cache
def load_fla_chunk_rule() -> Callable | None:
    """fla-core's ``chunk_gated_delta_rule``, or None when fla is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def fla_available() -> bool:
    return load_fla_chunk_rule() is not None


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when its data is not 16-byte aligned. Triton specializes
    pointer arguments on 16-byte alignment, and fla's kernels do not opt out: a slice that
    starts after an odd number of decode rows of a narrow tensor (``beta`` ``[T, Hv]`` of
    a small model) would compile a second variant of each kernel after the warm-up."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def gated_delta_rule_prefill_fla(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    recurrent_state: torch.Tensor, query_start_loc: torch.Tensor,
    query_start_loc_cpu: list[int], state_slots: torch.Tensor, seq_begin: int,
    out: torch.Tensor,
) -> None:
    """The gated delta rule over the prefill sequences ``seq_begin ..`` through fla-core.

    Gathers each sequence's initial state from its slot, runs fla's chunked kernels over
    all prefill sequences at once (``cu_seqlens``), and scatters the final states back.

    Args:
        q, k: ``[T, Hk, Dk]`` whole batch, model dtype (fla L2-normalises them, eps 1e-6).
        v: ``[T, Hv, Dv]``.  g: float32 ``[T, Hv]`` log decay.  beta: ``[T, Hv]``.
        recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]``; prefill slots updated in place.
        query_start_loc: int32 ``[B + 1]`` on the device.
        query_start_loc_cpu: ``B + 1`` ints, the host copy.
        state_slots: int32 ``[B]``.
        seq_begin: first prefill sequence (= num_decode_seqs).
        out: ``[T, Hv, Dv]``; rows ``query_start_loc_cpu[seq_begin]:`` receive the outputs.
    """
    chunk_rule = load_fla_chunk_rule()
    if chunk_rule is None:
        raise RuntimeError("fla-core is not installed; pip install fla-core==0.6.0")
    if len(query_start_loc_cpu) - 1 <= seq_begin:
        return
    t0 = query_start_loc_cpu[seq_begin]
    slots = state_slots[seq_begin:].long()
    initial = recurrent_state[slots]  # [N, Hv, Dk, Dv] float32 gather (a copy)
    varlen = {}
    if len(query_start_loc_cpu) - 1 - seq_begin > 1:
        # fla wants int64 cu_seqlens starting at 0; the host copy spares it a device sync
        # when it plans its chunk indices. One sequence runs as a batch of one instead,
        # with no chunk plan at all (a prefill graph's padded batch needs that).
        varlen = {
            "cu_seqlens": (query_start_loc[seq_begin:] - t0).long(),
            "cu_seqlens_cpu": torch.tensor([c - t0 for c in query_start_loc_cpu[seq_begin:]],
                                           dtype=torch.long),
        }
    q, k, v, g, beta = (_aligned(t[t0:]) for t in (q, k, v, g.float(), beta))
    o, final = chunk_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **varlen,
    )
    recurrent_state.index_copy_(0, slots, final.to(recurrent_state.dtype))
    out[t0:] = o[0]
