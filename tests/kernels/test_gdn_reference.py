"""Torch reference GDN ops (the CPU path) against transformers and the float64 oracle."""

from __future__ import annotations

import pytest
import torch
from test_gdn_oracle import (
    hf_torch,
    make_batch,
    oracle_conv,
    oracle_rule,
    oracle_varlen_conv,
    oracle_varlen_rule,
    untouched_slots,
)

from pagedserve.kernels import gdn, gdn_reference

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

TOL = {"atol": 2e-5, "rtol": 2e-5}


def run_rule(b, qsl=None, slots=None, nd=None):
    return gdn.gated_delta_rule_varlen(
        b.q, b.k, b.v, b.g, b.beta, b.rec_state, b.query_start_loc,
        b.qsl_cpu if qsl is None else qsl, b.state_slots if slots is None else slots,
        b.num_decode_seqs if nd is None else nd,
    )


def run_conv(b):
    return gdn.causal_conv1d_varlen(
        b.x, b.conv_w, b.conv_state, b.query_start_loc, b.qsl_cpu, b.state_slots,
        b.num_decode_seqs,
    )


# --- against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("hk,hv", [(2, 4), (2, 2)])
def test_rule_matches_hf_chunk_and_recurrent(length, hk, hv):
    b = make_batch([length], 0, hk=hk, hv=hv, dk=32, dv=16, seed=length)
    slot = b.state_slots[0].item()
    h0 = b.rec_state[slot].clone()
    o = run_rule(b)
    rep = hv // hk
    args = (
        b.q[None].repeat_interleave(rep, 2), b.k[None].repeat_interleave(rep, 2), b.v[None],
        b.g[None], b.beta[None],
    )
    for fn in (hf_torch("torch_chunk_gated_delta_rule"),
               hf_torch("torch_recurrent_gated_delta_rule")):
        ho, hs = fn(*args, initial_state=h0[None].clone(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o, ho[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.rec_state[slot], hs[0], atol=1e-4, rtol=1e-4)


def test_conv_matches_hf_prefill_from_zero_state_and_decode_update():
    b = make_batch([11], 0, conv_dim=24)
    slot = b.state_slots[0].item()
    b.conv_state[slot].zero_()
    y = run_conv(b)
    # A fresh prompt: HF's causal_conv1d_fn pads with zeros, our zero state is the same.
    hy = hf_torch("causal_conv1d_fn")(b.x.t()[None], b.conv_w, None, activation="silu")[0].t()
    torch.testing.assert_close(y, hy, **TOL)
    torch.testing.assert_close(b.conv_state[slot], b.x[-3:].t())
    # Then one decode step against HF's single-token update (K-wide window).
    x1 = torch.randn(1, 24)
    window = b.x[-4:].t()[None].clone()  # [1, C, K]: HF keeps the last K inputs
    hy1 = hf_torch("causal_conv1d_update")(x1[..., None], window, b.conv_w, None, "silu")[..., 0]
    y1 = gdn.causal_conv1d_varlen(
        x1, b.conv_w, b.conv_state, torch.tensor([0, 1], dtype=torch.int32), [0, 1],
        b.state_slots, 1,
    )
    torch.testing.assert_close(y1, hy1, **TOL)
    torch.testing.assert_close(b.conv_state[slot], window[0, :, 1:])


def test_gated_rms_norm_is_hf_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        norm = hf.Qwen3_5RMSNormGated(32, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(32) * 0.3 + 1)
        x, z = torch.randn(7, 32).to(dtype), torch.randn(7, 32).to(dtype)
        with torch.no_grad():
            expect = norm(x, z)
        got = gdn.gated_rms_norm(x, z, norm.weight.detach(), 1e-6)
        assert got.dtype == dtype
        assert torch.equal(got, expect)


# --- varlen batches against the float64 oracle ---------------------------------------------

# decode rows first; the prefill part mixes lengths below and above the conv window and
# the chunk size, and includes a 1-token prefill row.
LENS, NUM_DECODE = [1, 1, 1, 2, 3, 5, 1, 64, 70], 3


@pytest.mark.parametrize("dk,dv", [(16, 16), (32, 8)])
def test_rule_varlen_matches_oracle_and_writes_only_its_slots(dk, dv):
    b = make_batch(LENS, NUM_DECODE, dk=dk, dv=dv, seed=dk)
    expect_o, expect_state = oracle_varlen_rule(b)
    before = b.rec_state.clone()
    o = run_rule(b)
    assert o.shape == b.v.shape and o.dtype == b.v.dtype
    torch.testing.assert_close(o.double(), expect_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.rec_state.double(), expect_state.double(), atol=1e-4, rtol=1e-4)
    for s in untouched_slots(b):  # poisoned neighbours stay bit-identical
        assert torch.equal(b.rec_state[s], before[s])


def test_conv_varlen_matches_oracle_and_writes_only_its_slots():
    b = make_batch(LENS, NUM_DECODE, seed=3)
    expect_y, expect_state = oracle_varlen_conv(b)
    before = b.conv_state.clone()
    y = run_conv(b)
    torch.testing.assert_close(y.double(), expect_y, **TOL)
    assert torch.equal(b.conv_state, expect_state)  # states are copies of inputs: exact
    for s in untouched_slots(b):
        assert torch.equal(b.conv_state[s], before[s])


def test_bf16_inputs_return_bf16():
    b = make_batch([1, 4, 9], 1, dtype=torch.bfloat16)
    expect_o, _ = oracle_varlen_rule(b)
    o = run_rule(b)
    assert o.dtype == torch.bfloat16 and b.rec_state.dtype == torch.float32
    torch.testing.assert_close(o.double(), expect_o, atol=2e-2, rtol=2e-2)
    expect_y, _ = oracle_varlen_conv(b)
    y = run_conv(b)
    assert y.dtype == torch.bfloat16 and b.conv_state.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), expect_y, atol=2e-2, rtol=2e-2)


# --- chunk-split invariance ----------------------------------------------------------------


def run_in_pieces(b, pieces):
    """Feed sequence 0 of ``b`` through the ops in consecutive pieces; return (y, o)."""
    ys, os, start = [], [], 0
    for n in pieces:
        s = slice(start, start + n)
        qsl_cpu, qsl = [0, n], torch.tensor([0, n], dtype=torch.int32)
        nd = 1 if n == 1 else 0
        ys.append(gdn.causal_conv1d_varlen(
            b.x[s], b.conv_w, b.conv_state, qsl, qsl_cpu, b.state_slots, nd))
        os.append(gdn.gated_delta_rule_varlen(
            b.q[s], b.k[s], b.v[s], b.g[s], b.beta[s], b.rec_state, qsl, qsl_cpu,
            b.state_slots, nd))
        start += n
    return torch.cat(ys), torch.cat(os)


@pytest.mark.parametrize(
    "pieces",
    # shorter than the conv window, single tokens (decode steps), chunk-size boundaries
    [[1] * 6 + [64], [2, 1, 67], [5, 1, 64], [63, 7], [64, 6], [3, 3, 3, 61], [69, 1]],
)
def test_chunk_split_invariance(pieces):
    assert sum(pieces) == 70
    one, split = make_batch([70], 0, seed=7), make_batch([70], 0, seed=7)
    y1, o1 = run_in_pieces(one, [70])
    y2, o2 = run_in_pieces(split, pieces)
    torch.testing.assert_close(y2, y1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o2, o1, **TOL)
    torch.testing.assert_close(split.rec_state, one.rec_state, **TOL)
    assert torch.equal(split.conv_state, one.conv_state)


def test_chunked_form_matches_oracle_directly():
    # gated_delta_rule_chunked on prepared inputs with a small chunk, several chunks.
    b = make_batch([37], 0, hk=2, hv=2, dk=8, dv=4, seed=11)
    slot = b.state_slots[0].item()
    expect_o, expect_s = oracle_rule(b.q, b.k, b.v, b.g, b.beta, b.rec_state[slot])
    q = gdn_reference.l2_normalize(b.q) * 8 ** -0.5
    k = gdn_reference.l2_normalize(b.k)
    o, s = gdn_reference.gated_delta_rule_chunked(
        q.transpose(0, 1), k.transpose(0, 1), b.v.transpose(0, 1), b.g.t(), b.beta.t(),
        b.rec_state[slot], chunk_size=8,
    )
    torch.testing.assert_close(o.transpose(0, 1).double(), expect_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), expect_s, atol=1e-5, rtol=1e-5)


def test_conv_short_chunk_shifts_state():
    b = make_batch([2], 0, conv_dim=8)
    slot = b.state_slots[0].item()
    old = b.conv_state[slot].clone()
    y = run_conv(b)
    expect_y, expect_state = oracle_conv(b.x, b.conv_w, old)
    torch.testing.assert_close(y.double(), expect_y, **TOL)
    assert torch.equal(b.conv_state[slot], torch.cat([old[:, 2:], b.x.t()], dim=-1))


# --- argument checks -----------------------------------------------------------------------


def test_bad_arguments_raise_value_error():
    b = make_batch([1, 3], 1)
    with pytest.raises(ValueError, match="ends at"):
        run_rule(b, qsl=[0, 1, 3])
    with pytest.raises(ValueError, match="one token each"):
        run_rule(b, nd=2)
    with pytest.raises(ValueError, match="state_slots"):
        run_rule(b, slots=b.state_slots[:1])
    with pytest.raises(ValueError, match="multiple of Hk"):
        gdn.gated_delta_rule_varlen(
            b.q, b.k, b.v[:, :3], b.g[:, :3], b.beta[:, :3], b.rec_state[:, :3],
            b.query_start_loc, b.qsl_cpu, b.state_slots, 1)
    with pytest.raises(ValueError, match="float32"):
        gdn.gated_delta_rule_varlen(
            b.q, b.k, b.v, b.g, b.beta, b.rec_state.double(), b.query_start_loc, b.qsl_cpu,
            b.state_slots, 1)
    with pytest.raises(ValueError, match="shape mismatch"):
        gdn.causal_conv1d_varlen(
            b.x, b.conv_w[:4], b.conv_state, b.query_start_loc, b.qsl_cpu, b.state_slots, 1)
