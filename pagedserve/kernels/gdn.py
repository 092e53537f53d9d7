"""Gated DeltaNet op dispatch: Triton / fla-core on CUDA tensors, the torch reference elsewhere.

The model calls exactly these ops per linear-attention layer, on one layer's view of the
``StatePool`` tensors (``pool.conv_state[i]``, ``pool.recurrent_state[i]``)::

    y = causal_conv1d_varlen(mixed_qkv, conv_w, conv_state, qsl, qsl_cpu, slots, nd)
    q, k, v = split(y)                         # [T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]
    o = gated_delta_rule_varlen(q, k, v, g, beta, rec_state, qsl, qsl_cpu, slots, nd)
    o = gated_rms_norm(o.reshape(-1, Dv), z.reshape(-1, Dv), norm_w, eps)

Batches are ordered decode rows first (docs/ARCHITECTURE.md, the step contract). On CUDA:

* decode rows (``num_decode_seqs`` of them, one token each) go through the Triton
  decode-step kernels of ``gdn_decode``: one launch per op and layer, states updated in
  place by slot. This path reads no device data on the host and allocates only
  shape-determined outputs, so a decode-only step can be captured in a CUDA graph;
* prefill rows go through the Triton varlen conv of ``gdn_prefill``, then the delta rule:
  when every prefill sequence holds at most ``RECURRENT_MAX_ROWS`` rows (a speculative
  verify step's ``k + 1``), the row-by-row kernel of ``gdn_recurrent``, which reads its row
  bounds on the device and so can be captured over many sequences; otherwise fla-core's
  ``chunk_gated_delta_rule`` (gather initial states, ``cu_seqlens``, scatter final states).
  Without fla-core installed long chunks fall back to the torch reference (slow, with a
  warning).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch

from pagedserve.kernels import gdn_decode, gdn_prefill, gdn_recurrent
from pagedserve.kernels import gdn_reference as ref
from pagedserve.kernels.gdn_reference import gated_rms_norm

__all__ = ["causal_conv1d_varlen", "gated_delta_rule_varlen", "gated_rms_norm"]

# Chunks of at most this many rows walk the delta rule row by row (``gdn_recurrent``):
# below fla's 64-row chunk its chunked form does a whole chunk's work for a few rows.
RECURRENT_MAX_ROWS = 8


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: Sequence[int],
    state_slots: torch.Tensor,
    num_decode_seqs: int,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) per sequence, carrying each sequence's conv state.

    Per sequence the conv runs over ``conv_state[slot] ++ x_seq``; ``conv_state[slot]`` is
    overwritten in place with the last K - 1 inputs of that concatenation (a chunk shorter
    than K - 1 shifts the old state). No bias (Qwen3.5's conv has none).

    Args:
        x: ``[T, C]`` conv inputs (``in_proj_qkv`` output, C = conv_dim), model dtype.
        weight: ``[C, K]`` depthwise taps (``conv1d.weight.squeeze(1)``), model dtype.
        conv_state: ``[S + 1, C, K - 1]`` one layer's view of ``StatePool.conv_state``.
        query_start_loc: int32 ``[B + 1]`` cu_seqlens of the new tokens, on ``x.device``.
        query_start_loc_cpu: ``B + 1`` ints, the host copy (planning without a sync).
        state_slots: int32 ``[B]`` state slot per sequence (padding rows: the null slot).
        num_decode_seqs: the first ``num_decode_seqs`` sequences hold one token each.

    Returns:
        ``[T, C]`` in ``x.dtype``.
    """
    if not _on_gpu(x):
        return ref.causal_conv1d_varlen(
            x, weight, conv_state, query_start_loc, query_start_loc_cpu, state_slots,
            num_decode_seqs,
        )
    qsl = ref.check_varlen(x.shape[0], query_start_loc_cpu, state_slots, num_decode_seqs)
    ref.check_conv_shapes(x, weight, conv_state)
    y = torch.empty_like(x)
    nd = num_decode_seqs
    gdn_decode.conv_decode_step(x[:nd], weight, conv_state, state_slots[:nd], y[:nd])
    gdn_prefill.conv_prefill(x, weight, conv_state, query_start_loc, qsl, state_slots, nd, y)
    return y


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: Sequence[int],
    state_slots: torch.Tensor,
    num_decode_seqs: int,
) -> torch.Tensor:
    """The gated delta rule per sequence, from and back to the sequences' state slots.

    q and k are L2-normalised (eps 1e-6, HF's ``use_qk_l2norm_in_kernel``) and q is scaled by
    ``Dk ** -0.5``; value head h reads key head ``h // (Hv // Hk)``.

    Args:
        q, k: ``[T, Hk, Dk]`` (views into the conv output are fine; last dim contiguous),
            model dtype.
        v: ``[T, Hv, Dv]``, model dtype.
        g: float32 ``[T, Hv]`` log decay ``-exp(A_log) * softplus(a + dt_bias)``.
        beta: ``[T, Hv]`` ``sigmoid(b)``, model dtype or float32.
        recurrent_state: float32 ``[S + 1, Hv, Dk, Dv]`` one layer's view of
            ``StatePool.recurrent_state``; final states written back in place.
        query_start_loc: int32 ``[B + 1]`` on the device.
        query_start_loc_cpu: ``B + 1`` ints, the host copy.
        state_slots: int32 ``[B]`` (padding rows: the null slot).
        num_decode_seqs: the first ``num_decode_seqs`` sequences hold one token each.

    Returns:
        ``[T, Hv, Dv]`` in ``v.dtype``.
    """
    if not _on_gpu(q):
        return ref.gated_delta_rule_varlen(
            q, k, v, g, beta, recurrent_state, query_start_loc, query_start_loc_cpu,
            state_slots, num_decode_seqs,
        )
    qsl = ref.check_varlen(q.shape[0], query_start_loc_cpu, state_slots, num_decode_seqs)
    ref.check_rule_shapes(q, k, v, g, beta, recurrent_state)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    nd = num_decode_seqs
    gdn_decode.gated_delta_rule_decode_step(
        q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], recurrent_state, state_slots[:nd], o[:nd]
    )
    if len(qsl) - 1 > nd:
        if max(qsl[b + 1] - qsl[b] for b in range(nd, len(qsl) - 1)) <= RECURRENT_MAX_ROWS:
            # The rows past the device's last sequence (a graph's padding) belong to no
            # program: zeroed, so that their outputs stay finite.
            o[nd:].zero_()
            gdn_recurrent.gated_delta_rule_recurrent(
                q, k, v, g, beta, recurrent_state, query_start_loc, state_slots, nd, o)
        elif gdn_prefill.fla_available():
            gdn_prefill.gated_delta_rule_prefill_fla(
                q, k, v, g, beta, recurrent_state, query_start_loc, qsl, state_slots, nd, o
            )
        else:
            _warn_no_fla()
            t0 = qsl[nd]
            o[t0:] = ref.gated_delta_rule_varlen(
                q[t0:], k[t0:], v[t0:], g[t0:], beta[t0:], recurrent_state, None,
                [c - t0 for c in qsl[nd:]], state_slots[nd:], 0,
            )
    return o


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the Triton / fla path (tests patch this to run the GPU branch
    under the Triton interpreter on CPU tensors)."""
    return t.is_cuda


@functools.cache  # warn once per process
def _warn_no_fla() -> None:
    warnings.warn(
        "fla-core is not installed: GDN prefill on CUDA falls back to the torch reference "
        "(slow). Install fla-core==0.6.0 (pip install 'pagedserve[gpu]').",
        stacklevel=3,
    )
