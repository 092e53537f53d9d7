"""State taps (``model/state_taps.py``): the rounds a tapped batch's linear layers run in,
and a Gated DeltaNet layer that runs them, against the float64 token-by-token oracle: every
row's output, every sequence's final states and every tap slot's states after its rows."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_gdn_oracle import oracle_conv, oracle_rule
from test_gdn_triton import fake_fla_chunk_rule

from pagedserve.kernels import gdn, gdn_prefill, gdn_recurrent
from pagedserve.model.gated_deltanet import GatedDeltaNet
from pagedserve.model.state_taps import StateTap, gdn_rounds


def test_rounds_split_tapped_sequences_and_chain_their_slots():
    # Sequences: a decode row (slot 5), 13 rows tapped after 4 and 9 (into slots 7, 2),
    # 6 untapped rows (slot 0), 5 rows tapped after 1 (into slot 9).
    qsl, slots = [0, 1, 14, 20, 25], [5, 3, 0, 8]
    taps = [StateTap(1, 9, 2), StateTap(3, 1, 9), StateTap(1, 4, 7)]
    r0, r1, r2 = gdn_rounds(taps, qsl, slots, 1, "cpu")
    # Round 0: every sequence's first segment; not contiguous (rows 5..13 and 21..24 wait).
    assert r0.rows.tolist() == [0, 1, 2, 3, 4, *range(14, 20), 20]
    assert r0.query_start_loc_cpu == [0, 1, 5, 11, 12]
    assert r0.query_start_loc.tolist() == r0.query_start_loc_cpu
    assert r0.state_slots.tolist() == [5, 7, 0, 9] and r0.num_decode_seqs == 1
    assert r0.copy_src.tolist() == [3, 8] and r0.copy_dst.tolist() == [7, 9]
    # Round 1: the second segments of the two tapped sequences.
    assert r1.rows.tolist() == [*range(5, 10), *range(21, 25)]
    assert r1.query_start_loc_cpu == [0, 5, 9] and r1.num_decode_seqs == 0
    assert r1.state_slots.tolist() == [2, 8]
    assert r1.copy_src.tolist() == [7, 9] and r1.copy_dst.tolist() == [2, 8]
    # Round 2: the last segment of the first, contiguous.
    assert r2.rows == slice(10, 14) and r2.query_start_loc_cpu == [0, 4]
    assert r2.state_slots.tolist() == [3]
    assert r2.copy_src.tolist() == [2] and r2.copy_dst.tolist() == [3]


@pytest.mark.parametrize("tap", [StateTap(0, 1, 4), StateTap(1, 0, 4), StateTap(1, 5, 4)],
                         ids=["decode row", "at the start", "at the end"])
def test_a_tap_outside_a_prefill_chunk_is_refused(tap):
    with pytest.raises(ValueError, match="not inside a prefill chunk"):
        gdn_rounds([tap], [0, 1, 6], [0, 1], 1, "cpu")


def small_layer(seed: int, dtype: torch.dtype, device: str) -> GatedDeltaNet:
    cfg = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16, hidden_size=32,
                          linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        layer.A_log.copy_(torch.empty(4).uniform_(0.01, 4.0, generator=gen).log())
    return layer.to(device=device, dtype=dtype)


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fla_contract(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens=None, cu_seqlens_cpu=None):
    """fla-core's ``chunk_gated_delta_rule`` contract on the oracle, one sequence when no
    ``cu_seqlens`` is given (``test_gdn_triton.fake_fla_chunk_rule`` checks the rest)."""
    if cu_seqlens is None:
        cu_seqlens_cpu = torch.tensor([0, q.shape[1]])
        cu_seqlens = cu_seqlens_cpu.to(q.device)
    return fake_fla_chunk_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


@pytest.mark.parametrize("path", [
    "reference",
    pytest.param("kernels", marks=pytest.mark.skipif(
        not INTERPRET, reason="the GPU dispatch on the CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA"))])
def test_a_tapped_layer_leaves_each_tap_the_state_after_its_rows(path, monkeypatch):
    """``reference``: the CPU path. ``kernels``: the CUDA dispatch under the Triton
    interpreter (the conv kernel on each round's rows, the row-walking rule for a round of
    short segments, fla's contract on the oracle for the others). ``cuda``: the same with
    fla-core itself, in bfloat16."""
    device = "cuda" if path == "cuda" else "cpu"
    calls: list[str] = []
    if path == "kernels":
        walk = gdn_recurrent.gated_delta_rule_recurrent

        def chunked(*args, **kw):
            calls.append("chunked")
            return fla_contract(*args, **kw)

        def walking(*args, **kw):
            calls.append("walking")
            return walk(*args, **kw)

        monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
        monkeypatch.setattr(gdn_prefill, "load_fla_chunk_rule", lambda: chunked)
        monkeypatch.setattr(gdn_recurrent, "gated_delta_rule_recurrent", walking)
    dtype = torch.bfloat16 if path == "cuda" else torch.float32
    layer = small_layer(0, dtype, device)
    lens, num_decode = [1, 1, 150, 40, 20], 2
    slots = [6, 1, 3, 9, 0]
    # Sequence 2's segments: 64, 6, 73 and 7 rows (the last round walks its rows).
    taps = [StateTap(2, 64, 4), StateTap(2, 70, 8), StateTap(2, 143, 2), StateTap(4, 11, 5)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    gen = torch.Generator().manual_seed(1)
    conv_dim = sum(layer.split[:1])
    mixed = torch.randn(qsl[-1], conv_dim, generator=gen).to(device, dtype)
    b = torch.randn(qsl[-1], 4, generator=gen).to(device, dtype)
    a = torch.randn(qsl[-1], 4, generator=gen).to(device, dtype)
    conv_state = torch.randn(11, conv_dim, 3, generator=gen).to(device, dtype)
    rec_state = (torch.randn(11, 4, 16, 16, generator=gen) * 0.5).to(device)
    conv_before, rec_before = conv_state.clone(), rec_state.clone()
    batch = SimpleNamespace(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_cpu=qsl, num_decode_seqs=num_decode, row_valid=None,
        state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        gdn_rounds=gdn_rounds(taps, qsl, slots, num_decode, device))
    with torch.inference_mode():
        out = layer.advance(mixed, b, a, conv_state, rec_state, batch)  # [T, Hv, Dv]

    # float64 inputs of the oracle, gates as transformers computes them.
    g = -layer.A_log.double().exp() * F.softplus(a.double() + layer.dt_bias.double())
    beta = torch.sigmoid(b.double())
    w = layer.conv1d.weight[:, 0].double()
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    expected_slots = {}  # slot -> (conv state, recurrent state) the oracle leaves
    for i, slot in enumerate(slots):
        rows = range(qsl[i], qsl[i + 1])
        y, conv_end = oracle_conv(mixed[rows.start:rows.stop].cpu(), w.cpu(),
                                  conv_before[slot].cpu())
        q, k, v = y.split((32, 32, 64), dim=-1)
        o, rec_end = oracle_rule(q.view(-1, 2, 16), k.view(-1, 2, 16), v.view(-1, 4, 16),
                                 g[rows.start:rows.stop].cpu(), beta[rows.start:rows.stop].cpu(),
                                 rec_before[slot].cpu())
        torch.testing.assert_close(out[rows.start:rows.stop].double().cpu(), o, **tol)
        expected_slots[slot] = (conv_end, rec_end)
        for tap in (t for t in taps if t.seq == i):
            part = slice(rows.start, rows.start + tap.rows)
            y, conv_tap = oracle_conv(mixed[part].cpu(), w.cpu(), conv_before[slot].cpu())
            q, k, v = y.split((32, 32, 64), dim=-1)
            _, rec_tap = oracle_rule(q.view(-1, 2, 16), k.view(-1, 2, 16), v.view(-1, 4, 16),
                                     g[part].cpu(), beta[part].cpu(), rec_before[slot].cpu())
            expected_slots[tap.slot] = (conv_tap, rec_tap)
    for slot, (conv_end, rec_end) in expected_slots.items():
        torch.testing.assert_close(conv_state[slot].double().cpu(), conv_end, **tol)
        torch.testing.assert_close(rec_state[slot].double().cpu(), rec_end, **tol)
    if path == "kernels":  # rounds of 64/40/11, 6/9, 73 and 7 rows per prefill sequence
        assert calls == ["chunked", "chunked", "chunked", "walking"], calls
    for slot in set(range(11)) - set(expected_slots):
        assert torch.equal(conv_state[slot], conv_before[slot]), slot
        assert torch.equal(rec_state[slot], rec_before[slot]), slot
