"""Triton GDN kernels (decode step, varlen prefill conv, the row-by-row rule of short
chunks) and the CUDA dispatch.

On a CPU machine the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``) on
small shapes; the ``gpu`` tests run the real sizes of Qwen3.5-27B (Hk=16, Hv=48,
Dk=Dv=128) on CUDA, including fla-core's chunked prefill and a CUDA-graph capture of the
decode step. Every result is checked against the float64 oracle of ``test_gdn_oracle``.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from test_gdn_oracle import (
    live_slots,
    make_batch,
    oracle_rule,
    oracle_varlen_conv,
    oracle_varlen_rule,
    untouched_slots,
)

from pagedserve.kernels import gdn, gdn_decode, gdn_prefill, gdn_recurrent

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"

needs_triton = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"
)
needs_fla = pytest.mark.skipif(not gdn_prefill.fla_available(), reason="needs fla-core")


def run_decode_kernels(b):
    """Both decode-step kernels over the decode rows of ``b``; returns (y, o)."""
    nd = b.num_decode_seqs
    y = torch.empty_like(b.x[:nd])
    gdn_decode.conv_decode_step(b.x[:nd], b.conv_w, b.conv_state, b.state_slots[:nd], y)
    o = torch.empty_like(b.v[:nd])
    gdn_decode.gated_delta_rule_decode_step(
        b.q[:nd], b.k[:nd], b.v[:nd], b.g[:nd], b.beta[:nd], b.rec_state,
        b.state_slots[:nd], o,
    )
    return y, o


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def check_states(b, conv_before, rec_before, expect_conv, expect_rec, rec_tol):
    """Live slots match the oracle; slots outside the batch are bit-identical."""
    for s in live_slots(b):
        assert torch.equal(b.conv_state[s].cpu(), expect_conv[s].cpu()), s
        torch.testing.assert_close(
            b.rec_state[s].double().cpu(), expect_rec[s].double().cpu(), **rec_tol
        )
    for s in untouched_slots(b):
        assert torch.equal(b.conv_state[s], conv_before[s]), s
        assert torch.equal(b.rec_state[s], rec_before[s]), s


# --- interpreter-sized ---------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dk,dv,conv_dim", [(16, 16, 40), (32, 32, 300), (24, 40, 40)])
def test_decode_kernels_match_oracle(dk, dv, conv_dim):
    # 5 live rows on shuffled slots plus 2 padding rows on the null slot.
    b = make_batch([1] * 5, 5, dk=dk, dv=dv, conv_dim=conv_dim, padding_rows=2,
                   device=DEVICE, seed=dk + dv)
    conv_before, rec_before = b.conv_state.clone(), b.rec_state.clone()
    expect_y, expect_conv = oracle_varlen_conv(b)
    expect_o, expect_rec = oracle_varlen_rule(b)
    y, o = run_decode_kernels(b)
    live = [i for i, s in enumerate(b.state_slots.tolist()) if s in live_slots(b)]
    torch.testing.assert_close(y[live].double().cpu(), expect_y[live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o[live].double().cpu(), expect_o[live], atol=1e-5, rtol=1e-5)
    check_states(b, conv_before, rec_before, expect_conv, expect_rec,
                 {"atol": 1e-5, "rtol": 1e-5})


@needs_triton
def test_prefill_conv_kernels_match_oracle():
    # Token blocks of 32 straddle sequences; lengths 1 and 2 are shorter than the window.
    b = make_batch([1, 1, 2, 1, 3, 5, 40, 33], 2, conv_dim=136, device=DEVICE, seed=5)
    conv_before = b.conv_state.clone()
    expect_y, expect_conv = oracle_varlen_conv(b)
    y = torch.zeros_like(b.x)
    gdn_prefill.conv_prefill(b.x, b.conv_w, b.conv_state, b.query_start_loc, b.qsl_cpu,
                             b.state_slots, 2, y)
    t0 = b.qsl_cpu[2]
    torch.testing.assert_close(y[t0:].double().cpu(), expect_y[t0:], atol=1e-5, rtol=1e-5)
    assert not y[:t0].any()  # decode rows are not its business
    for s in b.state_slots.tolist()[2:]:
        assert torch.equal(b.conv_state[s].cpu(), expect_conv[s].cpu()), s
    for s in b.state_slots.tolist()[:2] + untouched_slots(b):
        assert torch.equal(b.conv_state[s], conv_before[s]), s


@needs_triton
def test_dispatch_mixed_batch_through_triton(monkeypatch):
    """The CUDA branch of ``gdn`` end to end (prefill rule via fla, or the reference)."""
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
    if not HAS_CUDA:  # fla's kernels do not run under the interpreter: use the fallback
        monkeypatch.setattr(gdn_prefill, "load_fla_chunk_rule", lambda: None)
    # On CUDA: the model's dtype and a head dim fla is tuned for; in the interpreter: tiny.
    dim, dtype = (64, torch.bfloat16) if HAS_CUDA else (16, torch.float32)
    b = make_batch([1, 1, 1, 2, 5, 70], 3, padding_rows=1, dk=dim, dv=dim, dtype=dtype,
                   device=DEVICE, seed=9)
    conv_before, rec_before = b.conv_state.clone(), b.rec_state.clone()
    expect_y, expect_conv = oracle_varlen_conv(b)
    expect_o, expect_rec = oracle_varlen_rule(b)
    y = gdn.causal_conv1d_varlen(b.x, b.conv_w, b.conv_state, b.query_start_loc, b.qsl_cpu,
                                 b.state_slots, b.num_decode_seqs)
    with warnings.catch_warnings():  # the no-fla fallback warns
        warnings.simplefilter("ignore")
        o = gdn.gated_delta_rule_varlen(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                        b.query_start_loc, b.qsl_cpu, b.state_slots,
                                        b.num_decode_seqs)
    pad = b.num_decode_seqs - 1  # the padding row's output is garbage by design
    keep = [i for i in range(b.x.shape[0]) if i != pad]
    for s in live_slots(b):  # conv states are copies of inputs: exact
        assert torch.equal(b.conv_state[s].cpu(), expect_conv[s].cpu()), s
    if dtype == torch.bfloat16:
        # bf16 outputs, and fla's chunk kernels keep bf16 intermediates: compare in norm.
        assert rel_err(y[keep], expect_y[keep]) < 1e-2
        assert rel_err(o[keep], expect_o[keep]) < 2e-2
        for s in live_slots(b):
            assert rel_err(b.rec_state[s], expect_rec[s]) < 2e-2, s
    else:
        torch.testing.assert_close(y[keep].double().cpu(), expect_y[keep], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o[keep].double().cpu(), expect_o[keep], atol=1e-4, rtol=1e-4)
        check_states(b, conv_before, rec_before, expect_conv, expect_rec,
                     {"atol": 1e-4, "rtol": 1e-4})
    for s in untouched_slots(b):
        assert torch.equal(b.conv_state[s], conv_before[s]), s
        assert torch.equal(b.rec_state[s], rec_before[s]), s


@needs_triton
@pytest.mark.parametrize("dk,dv", [(16, 16), (24, 40)])
def test_recurrent_rule_matches_oracle(dk, dv):
    # Two decode rows (not its business), then verify-shaped chunks and one chunk of 1.
    b = make_batch([1, 1, 4, 4, 1, 5, 2], 2, dk=dk, dv=dv, device=DEVICE, seed=dk + 3 * dv)
    rec_before = b.rec_state.clone()
    expect_o, expect_rec = oracle_varlen_rule(b)
    o = torch.zeros_like(b.v)
    gdn_recurrent.gated_delta_rule_recurrent(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                             b.query_start_loc, b.state_slots, 2, o)
    t0 = b.qsl_cpu[2]
    torch.testing.assert_close(o[t0:].double().cpu(), expect_o[t0:], atol=1e-5, rtol=1e-5)
    assert not o[:t0].any()
    for s in b.state_slots.tolist()[2:]:
        torch.testing.assert_close(b.rec_state[s].double().cpu(), expect_rec[s].double().cpu(),
                                   atol=1e-5, rtol=1e-5)
    for s in b.state_slots.tolist()[:2] + untouched_slots(b):
        assert torch.equal(b.rec_state[s], rec_before[s]), s


@needs_triton
def test_recurrent_rule_skips_empty_sequences():
    """A CUDA graph's padding sequences hold no rows on the device (the host copy says
    otherwise): their states and the rows past the real ones are left as they are."""
    b = make_batch([3, 3, 3, 3], 0, device=DEVICE, seed=21)
    null = b.rec_state.shape[0] - 1
    b.state_slots[2:] = null
    qsl = torch.tensor([0, 3, 6, 6, 6], dtype=torch.int32, device=DEVICE)  # 2 real, 2 padding
    rec_before = b.rec_state.clone()
    o = torch.full_like(b.v, 7.0)
    gdn_recurrent.gated_delta_rule_recurrent(b.q, b.k, b.v, b.g, b.beta, b.rec_state, qsl,
                                             b.state_slots, 0, o)
    assert (o[6:] == 7.0).all()
    for i, slot in enumerate(b.state_slots.tolist()[:2]):
        rows = slice(3 * i, 3 * i + 3)
        expect_o, expect_rec = oracle_rule(*(t[rows].cpu() for t in (b.q, b.k, b.v, b.g, b.beta)),
                                           rec_before[slot].cpu())
        torch.testing.assert_close(o[rows].double().cpu(), expect_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.rec_state[slot].double().cpu(), expect_rec, atol=1e-5,
                                   rtol=1e-5)
    assert torch.equal(b.rec_state[null], rec_before[null])


@needs_triton
def test_dispatch_short_chunks_take_the_recurrent_rule(monkeypatch):
    """Every prefill sequence within ``RECURRENT_MAX_ROWS`` rows: no fla (none is loaded
    here), no reference fallback, the oracle's result."""
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
    monkeypatch.setattr(gdn_prefill, "load_fla_chunk_rule", lambda: None)
    lens = [1, 1, 4, 4, gdn.RECURRENT_MAX_ROWS, 2]
    b = make_batch(lens, 2, padding_rows=1, device=DEVICE, seed=17)
    expect_o, expect_rec = oracle_varlen_rule(b)

    def no_fallback() -> None:
        raise AssertionError("short chunks took the reference fallback")

    monkeypatch.setattr(gdn, "_warn_no_fla", no_fallback)
    o = gdn.gated_delta_rule_varlen(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                    b.query_start_loc, b.qsl_cpu, b.state_slots,
                                    b.num_decode_seqs)
    keep = [i for i in range(b.q.shape[0]) if i != b.num_decode_seqs - 1]
    torch.testing.assert_close(o[keep].double().cpu(), expect_o[keep], atol=1e-5, rtol=1e-5)
    for s in live_slots(b):
        torch.testing.assert_close(b.rec_state[s].cpu(), expect_rec[s].cpu(), atol=1e-5,
                                   rtol=1e-5)


def fake_fla_chunk_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu):
    """fla-core 0.6's documented contract for ``chunk_gated_delta_rule``, on the oracle:
    ``[1, T, H, K]`` varlen inputs, int64 ``cu_seqlens`` from 0, states ``[N, HV, K, V]``."""
    assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
    assert cu_seqlens.dtype == torch.long and cu_seqlens_cpu.dtype == torch.long
    assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    cu = cu_seqlens_cpu.tolist()
    assert cu[0] == 0 and cu[-1] == q.shape[1] and initial_state.shape[0] == len(cu) - 1
    assert scale == q.shape[-1] ** -0.5
    outs, finals = [], []
    for n in range(len(cu) - 1):
        s = slice(cu[n], cu[n + 1])
        o, h = oracle_rule(q[0, s], k[0, s], v[0, s], g[0, s], beta[0, s], initial_state[n])
        outs.append(o)
        finals.append(h)
    return torch.cat(outs)[None].to(q.dtype), torch.stack(finals).float()


@needs_triton
def test_fla_wrapper_plumbing_against_the_fla_contract(monkeypatch):
    """Slicing, cu_seqlens, state gather/scatter and output placement around fla."""
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
    monkeypatch.setattr(gdn_prefill, "load_fla_chunk_rule", lambda: fake_fla_chunk_rule)
    b = make_batch([1, 1, 3, 1, 9, 66], 2, padding_rows=1, device=DEVICE, seed=13)
    rec_before = b.rec_state.clone()
    expect_o, expect_rec = oracle_varlen_rule(b)
    o = gdn.gated_delta_rule_varlen(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                    b.query_start_loc, b.qsl_cpu, b.state_slots,
                                    b.num_decode_seqs)
    keep = [i for i in range(b.q.shape[0]) if i != b.num_decode_seqs - 1]
    torch.testing.assert_close(o[keep].double().cpu(), expect_o[keep], atol=1e-5, rtol=1e-5)
    for s in live_slots(b):
        torch.testing.assert_close(b.rec_state[s].cpu(), expect_rec[s].cpu(), atol=1e-5,
                                   rtol=1e-5)
    for s in untouched_slots(b):
        assert torch.equal(b.rec_state[s], rec_before[s]), s


# --- real sizes on the GPU -----------------------------------------------------------------

REAL = {"hk": 16, "hv": 48, "dk": 128, "dv": 128, "conv_dim": 2 * 16 * 128 + 48 * 128}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_decode_kernels_real_size(dtype):
    b = make_batch([1] * 8, 8, padding_rows=3, num_slots=32, dtype=dtype, device="cuda",
                   seed=1, **REAL)
    conv_before, rec_before = b.conv_state.clone(), b.rec_state.clone()
    expect_y, expect_conv = oracle_varlen_conv(b)
    expect_o, expect_rec = oracle_varlen_rule(b)
    y, o = run_decode_kernels(b)
    live = [i for i, s in enumerate(b.state_slots.tolist()) if s in live_slots(b)]
    bound = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 output rounding
    assert rel_err(y[live], expect_y[live]) < bound
    assert rel_err(o[live], expect_o[live]) < bound
    check_states(b, conv_before, rec_before, expect_conv, expect_rec,
                 {"atol": 1e-4, "rtol": 1e-4})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@needs_fla
def test_gpu_fla_prefill_mixed_batch_real_size():
    lens = [1, 1, 1, 17, 64, 300, 2]
    b = make_batch(lens, 3, padding_rows=1, num_slots=32, dtype=torch.bfloat16,
                   device="cuda", seed=2, **REAL)
    conv_before, rec_before = b.conv_state.clone(), b.rec_state.clone()
    expect_y, expect_conv = oracle_varlen_conv(b)
    expect_o, expect_rec = oracle_varlen_rule(b)
    y = gdn.causal_conv1d_varlen(b.x, b.conv_w, b.conv_state, b.query_start_loc, b.qsl_cpu,
                                 b.state_slots, b.num_decode_seqs)
    o = gdn.gated_delta_rule_varlen(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                    b.query_start_loc, b.qsl_cpu, b.state_slots,
                                    b.num_decode_seqs)
    keep = [i for i in range(b.x.shape[0]) if i != b.num_decode_seqs - 1]
    assert rel_err(y[keep], expect_y[keep]) < 1e-2
    assert rel_err(o[keep], expect_o[keep]) < 2e-2
    for s in live_slots(b):
        assert torch.equal(b.conv_state[s], expect_conv[s].to(b.conv_state)), s
        assert rel_err(b.rec_state[s], expect_rec[s]) < 2e-2, s
    for s in untouched_slots(b):
        assert torch.equal(b.conv_state[s], conv_before[s]), s
        assert torch.equal(b.rec_state[s], rec_before[s]), s


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_decode_cuda_graph_capture_and_replay():
    """Capture conv + rule for a padded decode batch once; replay on new inputs.

    Each replay must equal, bit for bit, the same ops run eagerly on a mirror of the states
    (the kernels are deterministic), and the CPU reference to bf16 accuracy.
    """
    nd, num_slots = 6, 16
    b = make_batch([1] * nd, nd, padding_rows=2, num_slots=num_slots, dtype=torch.bfloat16,
                   device="cuda", seed=3, **REAL)
    n = b.num_decode_seqs
    hk, dk, hv, dv = REAL["hk"], REAL["dk"], REAL["hv"], REAL["dv"]
    key_dim = hk * dk
    qsl, qsl_cpu, slots = b.query_start_loc, b.qsl_cpu, b.state_slots

    def step(x, g, beta, conv_state, rec_state):
        y = gdn.causal_conv1d_varlen(x, b.conv_w, conv_state, qsl, qsl_cpu, slots, n)
        q = y[:, :key_dim].view(n, hk, dk)
        k = y[:, key_dim:2 * key_dim].view(n, hk, dk)
        v = y[:, 2 * key_dim:].view(n, hv, dv)
        return gdn.gated_delta_rule_varlen(q, k, v, g, beta, rec_state, qsl, qsl_cpu, slots, n)

    # Static inputs the graph reads; each step copies fresh data into them.
    x_in, g_in, beta_in = b.x.clone(), b.g.clone(), b.beta.clone()
    conv0, rec0 = b.conv_state.clone(), b.rec_state.clone()
    # Warm up (compiles the kernels) on a side stream, as torch's CUDA-graph notes advise,
    # then restore the states: the graph starts from the batch's states.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x_in, g_in, beta_in, b.conv_state, b.rec_state)
    torch.cuda.current_stream().wait_stream(side)
    b.conv_state.copy_(conv0)
    b.rec_state.copy_(rec0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x_in, g_in, beta_in, b.conv_state, b.rec_state)

    eager_conv, eager_rec = conv0.clone(), rec0.clone()  # GPU mirror, run eagerly
    cpu_conv, cpu_rec = conv0.cpu(), rec0.cpu()  # reference mirror
    gen = torch.Generator().manual_seed(4)
    live = [i for i, s in enumerate(slots.tolist()) if s < num_slots]
    for _ in range(3):
        x_new = torch.randn(n, x_in.shape[1], generator=gen).to(x_in.dtype)
        g_new = -torch.rand(n, hv, generator=gen) * 2
        beta_new = torch.rand(n, hv, generator=gen).to(beta_in.dtype)
        x_in.copy_(x_new)
        g_in.copy_(g_new)
        beta_in.copy_(beta_new)
        graph.replay()
        eager = step(x_new.cuda(), g_new.cuda(), beta_new.cuda(), eager_conv, eager_rec)
        torch.cuda.synchronize()
        assert torch.equal(out[live], eager[live])
        for s in live_slots(b):
            assert torch.equal(b.conv_state[s], eager_conv[s]), s
            assert torch.equal(b.rec_state[s], eager_rec[s]), s

        y_ref = gdn.causal_conv1d_varlen(x_new, b.conv_w.cpu(), cpu_conv, qsl.cpu(), qsl_cpu,
                                         slots.cpu(), n)
        o_ref = gdn.gated_delta_rule_varlen(
            y_ref[:, :key_dim].reshape(n, hk, dk),
            y_ref[:, key_dim:2 * key_dim].reshape(n, hk, dk),
            y_ref[:, 2 * key_dim:].reshape(n, hv, dv),
            g_new, beta_new, cpu_rec, qsl.cpu(), qsl_cpu, slots.cpu(), n,
        )
        assert rel_err(out[live], o_ref[live]) < 2e-2
        for s in live_slots(b):
            assert torch.equal(b.conv_state[s].cpu(), cpu_conv[s]), s
            assert rel_err(b.rec_state[s], cpu_rec[s]) < 1e-2, s


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_recurrent_rule_real_size_and_capture():
    """Verify-shaped chunks (4 rows each) at the real sizes: the oracle to bf16 accuracy,
    fla's chunked form to the same (where installed), and a captured launch over padded
    sequences replays to the eager launch's bits."""
    lens = [4] * 6
    b = make_batch(lens, 0, num_slots=32, dtype=torch.bfloat16, device="cuda", seed=6, **REAL)
    rec0 = b.rec_state.clone()
    expect_o, expect_rec = oracle_varlen_rule(b)
    o = torch.empty_like(b.v)
    gdn_recurrent.gated_delta_rule_recurrent(b.q, b.k, b.v, b.g, b.beta, b.rec_state,
                                             b.query_start_loc, b.state_slots, 0, o)
    assert rel_err(o, expect_o) < 1e-2
    for s in live_slots(b):
        assert rel_err(b.rec_state[s], expect_rec[s]) < 1e-3, s
    if gdn_prefill.fla_available():
        fla_state, fla_o = rec0.clone(), torch.empty_like(b.v)
        gdn_prefill.gated_delta_rule_prefill_fla(b.q, b.k, b.v, b.g, b.beta, fla_state,
                                                 b.query_start_loc, b.qsl_cpu, b.state_slots,
                                                 0, fla_o)
        assert rel_err(o, fla_o) < 2e-2
        for s in live_slots(b):
            assert rel_err(b.rec_state[s], fla_state[s]) < 2e-2, s

    # Capture: 4 real sequences, 2 padding ones (no rows on the device, the null slot).
    null = b.rec_state.shape[0] - 1
    slots = b.state_slots.clone()
    slots[4:] = null
    qsl = torch.tensor([0, 4, 8, 12, 16, 16, 16], dtype=torch.int32, device="cuda")
    b.rec_state.copy_(rec0)
    graph_o = torch.zeros_like(b.v)

    def launch(state):
        gdn_recurrent.gated_delta_rule_recurrent(b.q, b.k, b.v, b.g, b.beta, state, qsl, slots,
                                                 0, graph_o)

    launch(rec0.clone())  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(b.rec_state)
    eager_state, eager_o = rec0.clone(), torch.zeros_like(b.v)
    gdn_recurrent.gated_delta_rule_recurrent(b.q, b.k, b.v, b.g, b.beta, eager_state, qsl,
                                             slots, 0, eager_o)
    graph_o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_o, eager_o) and not graph_o[16:].any()
    assert torch.equal(b.rec_state, eager_state)
