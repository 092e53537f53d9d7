"""Triton rollback of a speculative verify step's Gated DeltaNet states: every layer and
every sequence in one launch.

A verify step advances each sequence's states over its ``r = k + 1`` rows. A sequence
that keeps only its first ``c`` rows must end where a forward pass of those rows leaves
it: from the state it held before the step (its spare, ``ModelRunner.save_states``), each
GDN layer's causal conv and delta rule over the ``c`` rows' recorded inputs
(``GdnRecord``: ``mixed``, ``b``, ``a`` per layer). One program per (layer, sequence,
value head, block of value columns) does all of it for its tile of the state, reading
the spares and writing the live slot, so the restore costs no copy of its own::

    c = num_rows[seq]                 0: the program ends here (the slot is neither read
                                      nor written: a sequence that kept every draft, or
                                      padding)
    S = rec_spare[layer, slot, hv, :, cols]                 float32 [Dk, BLOCK_V]
    for t in 0 .. c - 1                                     record row seq * r + t
        k_t = SiLU(conv(conv_spare[layer, slot] ++ mixed rows))   key head hv // G
        v_t = SiLU(conv(...))                               the tile's value columns
              (both rounded to the record's dtype, as the conv writes its output)
        g    = -exp(A_log[hv]) * softplus(a_t + dt_bias[hv])       float32
        beta = sigmoid(b_t)                                 rounded to the record's dtype
        S = S exp(g);  S = S + k_t (beta (v_t - S^T k_t))^T      (k_t L2-normalised)
    recurrent_state[layer, slot, hv, :, cols] = S
    conv_state[layer, slot, channels it owns] = the last K - 1 columns of
        conv_spare[layer, slot] ++ mixed rows seq r .. seq r + c - 1

Each row is the arithmetic of the kernels a forward pass runs: the varlen conv of
``gdn_prefill`` (taps summed in the same order) and the row-walking rule of
``gdn_recurrent`` (which also reads q, for the output a rollback does not need). So a
sequence advanced over all ``r`` rows ends at the verify pass's conv state bit for bit,
and at its recurrent state up to the gates, computed here with Triton's ``exp`` and
``log`` rather than torch's.

Layouts (``L`` GDN layers, ``P`` sequences, ``S`` state slots plus the null slot)::

    layers        int64 [6, L]   per layer, the address of: mixed [T, C], b [T, Hv],
                                 a [T, Hv] (the record; T >= P r), conv weight [C, K],
                                 A_log [Hv], dt_bias [Hv]; each kind's strides and dtype
                                 are the same in every layer (``RollbackLayers``)
    num_rows      int32 [P]      c per sequence, 0 .. r
    state_slots   int32 [P]
    conv_state, conv_spare            [L, S + 1, C, K - 1]   model dtype
    recurrent_state, recurrent_spare  float32 [L, S + 1, Hv, Dk, Dv], slots contiguous

Grid ``(L P, Hv, cdiv(Dv, BLOCK_V))``; program ``(layer P + seq, hv, block)``. The conv
state's channels, ``[ q: Hk Dk | k: Hk Dk | v: Hv Dv ]``, are written once each::

    v columns of a block             that block's program
    q and k channels of key head h   the program of value head h G, block 0 (G = Hv / Hk)

Programs read only the spares and the record and write only live slots, each element by
one program, so the order they run in does not matter. The grid and every argument depend
only on the shapes, and nothing is allocated: a launch can be captured in a CUDA graph
and replayed with any counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels import gdn_reference as ref
from pagedserve.kernels.gdn_decode import RULE_BLOCK_V, delta_rule_row, l2_normalized

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float32: tl.float32}
# torch's softplus returns x itself past this (``F.softplus``'s default threshold).
SOFTPLUS_THRESHOLD = 20.0


@dataclass(frozen=True)
class RollbackLayers:
    """Every GDN layer's rollback operands as one table of addresses (the kernel's
    ``layers``), with the first layer's tensor of each kind for their strides and dtype.

    ``tensors`` holds every layer's tensors, so the addresses stay valid while this
    lives. Build it with ``rollback_layers``."""

    addresses: torch.Tensor  # int64 [6, L]
    first: tuple[torch.Tensor, ...]  # mixed, b, a, conv weight, A_log, dt_bias of layer 0
    tensors: tuple[tuple[torch.Tensor, ...], ...]  # [6][L]

    @property
    def num_layers(self) -> int:
        return self.addresses.shape[1]


def rollback_layers(
    inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    conv_weights: Sequence[torch.Tensor], a_logs: Sequence[torch.Tensor],
    dt_biases: Sequence[torch.Tensor],
) -> RollbackLayers:
    """The table of one verify record and the layers' parameters, in layer order.

    Args:
        inputs: per layer ``(mixed [T, C], b [T, Hv], a [T, Hv])`` (``GdnRecord.inputs``),
            model dtype, last dims contiguous.
        conv_weights: per layer ``[C, K]`` depthwise taps (``conv1d.weight[:, 0]``).
        a_logs, dt_biases: per layer ``[Hv]``.

    Raises ``ValueError`` when the layers' tensors of one kind differ in shape, strides,
    dtype or device (the kernel reads every layer through layer 0's), or the list lengths
    differ.
    """
    kinds = ([m for m, _, _ in inputs], [b for _, b, _ in inputs], [a for _, _, a in inputs],
             list(conv_weights), list(a_logs), list(dt_biases))
    num_layers = len(kinds[0])
    if num_layers == 0 or any(len(kind) != num_layers for kind in kinds):
        raise ValueError(f"expected the same number (> 0) of layers of each operand, got "
                         f"{[len(kind) for kind in kinds]}")
    for kind in kinds:
        t0 = kind[0]
        for t in kind:
            if (t.shape, t.stride(), t.dtype, t.device) != (t0.shape, t0.stride(), t0.dtype,
                                                             t0.device):
                raise ValueError(
                    f"every layer's operand must match layer 0's: got {tuple(t.shape)} "
                    f"{t.stride()} {t.dtype} {t.device}, layer 0 {tuple(t0.shape)} "
                    f"{t0.stride()} {t0.dtype} {t0.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"operands need a contiguous last dim, got {t.stride()}")
    addresses = torch.tensor([[t.data_ptr() for t in kind] for kind in kinds],
                             dtype=torch.int64, device=kinds[0][0].device)  # [6, L]
    return RollbackLayers(addresses, tuple(kind[0] for kind in kinds),
                          tuple(tuple(kind) for kind in kinds))


@triton.jit
def _conv_row(
    x_ptr, w_ptr, spare_ptr, ch, mask, row0, t,
    stride_x_t, stride_w_c, stride_w_k, stride_s_c, stride_s_k,
    KW: tl.constexpr, BLOCK: tl.constexpr,
):
    """SiLU(conv) of channels ``ch`` at the sequence's row ``t``, over ``spare ++ rows``
    (``_conv_prefill_kernel``'s taps, in its order), rounded to the record's dtype."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(KW):
        col = t + j  # column of ``spare ++ rows`` that tap j reads; < K - 1: the spare
        s_val = tl.load(spare_ptr + ch * stride_s_c + col * stride_s_k,
                        mask=mask & (col < KW - 1), other=0.0)
        x_row = row0 + col - (KW - 1)
        x_val = tl.load(x_ptr + x_row * stride_x_t + ch, mask=mask & (col >= KW - 1),
                        other=0.0)
        w_j = tl.load(w_ptr + ch * stride_w_c + j * stride_w_k, mask=mask, other=0.0)
        acc += (s_val.to(tl.float32) + x_val.to(tl.float32)) * w_j.to(tl.float32)
    y = acc * tl.sigmoid(acc)
    return y.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _write_conv_state(
    x_ptr, spare_ptr, live_ptr, ch, mask, row0, num_rows,
    stride_x_t, stride_s_c, stride_s_k,
    KW: tl.constexpr,
):
    """Channels ``ch`` of the live conv state: column j is column ``num_rows + j`` of
    ``spare ++ rows`` (``_conv_state_kernel``'s shift, from the spare)."""
    for j in tl.static_range(KW - 1):
        col = num_rows + j
        s_val = tl.load(spare_ptr + ch * stride_s_c + col * stride_s_k,
                        mask=mask & (col < KW - 1), other=0.0)
        x_row = row0 + col - (KW - 1)
        x_val = tl.load(x_ptr + x_row * stride_x_t + ch, mask=mask & (col >= KW - 1),
                        other=0.0)
        new = tl.where(col < KW - 1, s_val.to(tl.float32), x_val.to(tl.float32))
        tl.store(live_ptr + ch * stride_s_c + j * stride_s_k,
                 new.to(live_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softplus(x, THRESHOLD: tl.constexpr):
    """torch's ``softplus``: ``x`` past the threshold, else ``log1p(exp(x))``; log1p as
    ``log(w) u / (w - 1)``, ``w = 1 + u`` (exact to a few ulps where ``1 + u`` rounds)."""
    u = tl.exp(x)
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > THRESHOLD, x, log1p)


# The sequence count (a graph's size) and r are not specialized: one compile serves all.
@triton.jit(do_not_specialize=["num_seqs", "rows_per_seq"])
def _rollback_kernel(
    layers_ptr, num_rows_ptr, slots_ptr,
    conv_ptr, conv_spare_ptr, rec_ptr, rec_spare_ptr,
    num_seqs, num_layers, rows_per_seq,
    stride_x_t, stride_b_t, stride_a_t, stride_w_c, stride_w_k,
    stride_c_layer, stride_c_slot, stride_c_c, stride_c_k,
    stride_r_layer, stride_r_slot,
    eps,
    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    KW: tl.constexpr, THRESHOLD: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    layer = tl.program_id(0) // num_seqs
    seq = tl.program_id(0) % num_seqs
    hv = tl.program_id(1)
    block = tl.program_id(2)
    c = tl.load(num_rows_ptr + seq)
    if c > 0:
        hk = hv // GROUP  # value head hv reads key head hv // (Hv // Hk)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        row0 = seq.to(tl.int64) * rows_per_seq  # 64-bit rows: row * stride cannot overflow
        entry = layers_ptr + layer  # rows: mixed, b, a, conv weight, A_log, dt_bias
        x_ptr = tl.load(entry).to(tl.pointer_type(X_DTYPE))  # mixed
        b_ptr = tl.load(entry + 1 * num_layers).to(tl.pointer_type(X_DTYPE))
        a_ptr = tl.load(entry + 2 * num_layers).to(tl.pointer_type(X_DTYPE))
        w_ptr = tl.load(entry + 3 * num_layers).to(tl.pointer_type(W_DTYPE))
        a_log_ptr = tl.load(entry + 4 * num_layers).to(tl.pointer_type(G_DTYPE))
        dt_bias_ptr = tl.load(entry + 5 * num_layers).to(tl.pointer_type(G_DTYPE))
        conv_at = layer.to(tl.int64) * stride_c_layer + slot * stride_c_slot
        conv_spare = conv_spare_ptr + conv_at
        conv_live = conv_ptr + conv_at

        offs_k = tl.arange(0, BLOCK_K)
        offs_v = block * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_k = offs_k < DK
        mask_v = offs_v < DV
        ch_q = hk * DK + offs_k  # [BLOCK_K] conv channels of key head hk's q
        ch_k = HK * DK + ch_q  # [BLOCK_K] ... and its k
        ch_v = 2 * HK * DK + hv * DV + offs_v  # [BLOCK_V] the tile's value columns

        # [BLOCK_K, BLOCK_V] tile of this head's [Dk, Dv] state (contiguous within the slot).
        s_at = (layer.to(tl.int64) * stride_r_layer + slot * stride_r_slot + hv * (DK * DV)
                + offs_k[:, None] * DV + offs_v[None, :])
        mask_s = mask_k[:, None] & mask_v[None, :]
        s = tl.load(rec_spare_ptr + s_at, mask=mask_s, other=0.0)
        a_log = tl.load(a_log_ptr + hv).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        for t in range(0, c):
            row = row0 + t
            k = _conv_row(x_ptr, w_ptr, conv_spare, ch_k, mask_k, row0, t,
                          stride_x_t, stride_w_c, stride_w_k, stride_c_c, stride_c_k,
                          KW, BLOCK_K)
            v = _conv_row(x_ptr, w_ptr, conv_spare, ch_v, mask_v, row0, t,
                          stride_x_t, stride_w_c, stride_w_k, stride_c_c, stride_c_k,
                          KW, BLOCK_V)
            k = l2_normalized(k, eps)
            a = tl.load(a_ptr + row * stride_a_t + hv).to(tl.float32)
            g = -tl.exp(a_log) * _softplus(a + dt_bias, THRESHOLD)
            b = tl.load(b_ptr + row * stride_b_t + hv).to(tl.float32)
            beta = tl.sigmoid(b).to(X_DTYPE).to(tl.float32)
            s = delta_rule_row(s, k, v, g, beta)
        tl.store(rec_ptr + s_at, s, mask=mask_s)

        _write_conv_state(x_ptr, conv_spare, conv_live, ch_v, mask_v, row0, c,
                          stride_x_t, stride_c_c, stride_c_k, KW)
        if (hv % GROUP == 0) & (block == 0):  # one program per key head: its q and k
            _write_conv_state(x_ptr, conv_spare, conv_live, ch_q, mask_k, row0, c,
                              stride_x_t, stride_c_c, stride_c_k, KW)
            _write_conv_state(x_ptr, conv_spare, conv_live, ch_k, mask_k, row0, c,
                              stride_x_t, stride_c_c, stride_c_k, KW)


def roll_back(
    layers: RollbackLayers, num_rows: torch.Tensor, rows_per_seq: int,
    state_slots: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    conv_spare: torch.Tensor, recurrent_spare: torch.Tensor,
) -> None:
    """Each sequence's slot, in every GDN layer, set to its spare advanced over the
    sequence's first ``num_rows`` rows of the record (one launch; module docstring).

    Args:
        layers: the record and parameters of every GDN layer (``rollback_layers``); the
            record holds ``rows_per_seq`` rows per sequence, sequence ``s``'s from row
            ``s rows_per_seq``.
        num_rows: int32 ``[P]`` rows to keep per sequence, ``0 .. rows_per_seq``, on the
            device; 0 leaves the sequence's slot as it is.
        rows_per_seq: ``r``.
        state_slots: int32 ``[P]`` slot per sequence; slots of sequences with rows differ.
        conv_state: ``[L, S + 1, C, K - 1]`` the live conv states, model dtype.
        recurrent_state: float32 ``[L, S + 1, Hv, Dk, Dv]`` the live delta-rule states.
        conv_spare, recurrent_spare: their spares (``save_states``), the same shapes and
            strides; only read.
    """
    num_seqs = num_rows.shape[0]
    num_layers = layers.num_layers
    mixed, b, a, conv_w, a_log, dt_bias = layers.first
    _check(layers, num_rows, rows_per_seq, state_slots, conv_state, recurrent_state,
           conv_spare, recurrent_spare)
    if num_seqs == 0:
        return
    _, _, hv, dk, dv = recurrent_state.shape
    hk = (conv_state.shape[2] - hv * dv) // (2 * dk)
    kw = conv_w.shape[1]
    block_v = min(RULE_BLOCK_V, triton.next_power_of_2(dv))
    grid = (num_layers * num_seqs, hv, triton.cdiv(dv, block_v))
    _rollback_kernel[grid](
        layers.addresses, num_rows, state_slots,
        conv_state, conv_spare, recurrent_state, recurrent_spare,
        num_seqs, num_layers, rows_per_seq,
        mixed.stride(0), b.stride(0), a.stride(0), conv_w.stride(0), conv_w.stride(1),
        *conv_state.stride(),
        recurrent_state.stride(0), recurrent_state.stride(1),
        ref.L2NORM_EPS,
        X_DTYPE=_TL_DTYPES[mixed.dtype], W_DTYPE=_TL_DTYPES[conv_w.dtype],
        G_DTYPE=_TL_DTYPES[a_log.dtype],
        HK=hk, GROUP=hv // hk, DK=dk, DV=dv, KW=kw, THRESHOLD=SOFTPLUS_THRESHOLD,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v,
        num_warps=4,
    )


def _check(
    layers: RollbackLayers, num_rows: torch.Tensor, rows_per_seq: int,
    state_slots: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    conv_spare: torch.Tensor, recurrent_spare: torch.Tensor,
) -> None:
    """The shapes, dtypes and strides the kernel indexes (host data only: safe inside a
    CUDA graph capture)."""
    mixed, b, a, conv_w, a_log, dt_bias = layers.first
    if num_rows.dtype != torch.int32 or state_slots.dtype != torch.int32:
        raise ValueError(f"num_rows and state_slots must be int32, got {num_rows.dtype}, "
                         f"{state_slots.dtype}")
    if num_rows.dim() != 1 or state_slots.shape != num_rows.shape:
        raise ValueError(f"num_rows and state_slots must both be [P], got "
                         f"{tuple(num_rows.shape)}, {tuple(state_slots.shape)}")
    if conv_state.dim() != 4 or recurrent_state.dim() != 5:
        raise ValueError(f"expected conv_state [L, S + 1, C, K - 1] and recurrent_state "
                         f"[L, S + 1, Hv, Dk, Dv], got {tuple(conv_state.shape)}, "
                         f"{tuple(recurrent_state.shape)}")
    num_layers, _, c, _ = conv_state.shape
    _, _, hv, dk, dv = recurrent_state.shape
    key_dim, rem = divmod(c - hv * dv, 2)
    if num_layers != layers.num_layers or recurrent_state.shape[0] != num_layers:
        raise ValueError(f"{layers.num_layers} layers of operands for states of "
                         f"{num_layers} and {recurrent_state.shape[0]} layers")
    if rem or key_dim <= 0 or key_dim % dk or hv % (key_dim // dk):
        raise ValueError(f"conv_dim {c} is not 2 Hk Dk + Hv Dv with Hv={hv} a multiple of "
                         f"Hk (Dk={dk}, Dv={dv})")
    if conv_w.shape != (c, conv_state.shape[3] + 1):
        raise ValueError(f"conv weight must be [{c}, {conv_state.shape[3] + 1}], got "
                         f"{tuple(conv_w.shape)}")
    if (mixed.shape[1], b.shape[1], a.shape[1], a_log.shape, dt_bias.shape) != (
            c, hv, hv, (hv,), (hv,)):
        raise ValueError(f"record and gates must be mixed [T, {c}], b and a [T, {hv}], A_log "
                         f"and dt_bias [{hv}]; got {tuple(mixed.shape)}, {tuple(b.shape)}, "
                         f"{tuple(a.shape)}, {tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    if not (mixed.dtype == b.dtype == a.dtype) or a_log.dtype != dt_bias.dtype:
        raise ValueError(f"mixed, b, a must share a dtype, and A_log, dt_bias another; got "
                         f"{mixed.dtype}, {b.dtype}, {a.dtype}, {a_log.dtype}, {dt_bias.dtype}")
    if min(mixed.shape[0], b.shape[0], a.shape[0]) < num_rows.shape[0] * rows_per_seq:
        raise ValueError(f"the record holds {mixed.shape[0]} rows, fewer than "
                         f"{num_rows.shape[0]} sequences of {rows_per_seq}")
    if recurrent_state.dtype != torch.float32 or recurrent_state.stride()[2:] != (
            dk * dv, dv, 1):
        raise ValueError(f"recurrent_state must be float32 with contiguous slots, got "
                         f"{recurrent_state.dtype} {recurrent_state.stride()}")
    for live, spare in ((conv_state, conv_spare), (recurrent_state, recurrent_spare)):
        if (spare.shape, spare.stride(), spare.dtype) != (live.shape, live.stride(), live.dtype):
            raise ValueError(f"a spare must match its live states: {tuple(spare.shape)} "
                             f"{spare.stride()} {spare.dtype} against {tuple(live.shape)} "
                             f"{live.stride()} {live.dtype}")
