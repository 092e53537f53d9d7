"""Float64 token-by-token oracle for the Gated DeltaNet ops, and its own checks against HF.

The other ``test_gdn_*`` files import the oracle and the batch builder from here. The oracle
is written straight from the recurrence (no chunking, no shared code with pagedserve) and is
itself checked against transformers' torch fallbacks below.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# oracle
# ---------------------------------------------------------------------------------------------


def oracle_conv(
    x: torch.Tensor, w: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x ``[L, C]``, w ``[C, K]``, state ``[C, K-1]`` -> (y ``[L, C]``, state)."""
    x, w, state = x.double(), w.double(), state.double()
    kw = w.shape[1]
    window = [state[:, j] for j in range(kw - 1)]  # oldest first
    ys = []
    for t in range(x.shape[0]):
        window.append(x[t])
        acc = sum(w[:, j] * window[-kw + j] for j in range(kw))
        ys.append(acc * torch.sigmoid(acc))
    return torch.stack(ys), torch.stack(window[-(kw - 1):], dim=1)


def oracle_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float64: q, k ``[L, Hk, Dk]``, v ``[L, Hv, Dv]``, g, beta ``[L, Hv]``,
    state ``[Hv, Dk, Dv]`` -> (o ``[L, Hv, Dv]``, final state)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    hv, hk = v.shape[1], q.shape[1]
    heads = torch.arange(hv) // (hv // hk)  # key head of each value head
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = []
    for t in range(q.shape[0]):
        qt, kt = q[t, heads], k[t, heads]  # [Hv, Dk]
        s = s * torch.exp(g[t])[:, None, None]
        err = v[t] - torch.einsum("hkv,hk->hv", s, kt)
        s = s + kt[:, :, None] * (beta[t][:, None] * err)[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, qt))
    return torch.stack(out), s


@dataclass
class GdnBatch:
    """A varlen GDN batch with state pools whose unused slots hold poison."""

    lens: list[int]
    num_decode_seqs: int
    qsl_cpu: list[int]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    state_slots: torch.Tensor  # int32 [B]
    x: torch.Tensor  # [T, C] conv input
    conv_w: torch.Tensor  # [C, K]
    conv_state: torch.Tensor  # [S + 1, C, K - 1]
    q: torch.Tensor  # [T, Hk, Dk]
    k: torch.Tensor  # [T, Hk, Dk]
    v: torch.Tensor  # [T, Hv, Dv]
    g: torch.Tensor  # [T, Hv] float32
    beta: torch.Tensor  # [T, Hv]
    rec_state: torch.Tensor  # [S + 1, Hv, Dk, Dv] float32


def make_batch(
    lens: list[int], num_decode_seqs: int, *, hk: int = 2, hv: int = 4, dk: int = 16,
    dv: int = 16, conv_dim: int = 40, kw: int = 4, num_slots: int = 12,
    dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
    padding_rows: int = 0,
) -> GdnBatch:
    """Random batch; slots are shuffled; ``padding_rows`` extra one-token decode rows point
    at the null slot (they are appended after the real decode rows)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    lens = lens[:num_decode_seqs] + [1] * padding_rows + lens[num_decode_seqs:]
    nd = num_decode_seqs + padding_rows
    t = sum(lens)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    live = torch.randperm(num_slots, generator=gen)[: len(lens) - padding_rows].tolist()
    slots = live[:num_decode_seqs] + [num_slots] * padding_rows + live[num_decode_seqs:]
    # Log decay as the model makes it: -exp(A_log) * softplus(a + dt_bias), A in [0.01, 4].
    a_log = torch.empty(hv).uniform_(0.01, 4.0, generator=gen).log().to(device)
    g = -a_log.exp() * F.softplus(rnd(t, hv) + 1.0)
    return GdnBatch(
        lens=lens, num_decode_seqs=nd, qsl_cpu=qsl,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int32, device=device),
        x=rnd(t, conv_dim).to(dtype),
        conv_w=rnd(conv_dim, kw, scale=0.5).to(dtype),
        conv_state=rnd(num_slots + 1, conv_dim, kw - 1).to(dtype),
        q=rnd(t, hk, dk).to(dtype),
        k=rnd(t, hk, dk).to(dtype),
        v=rnd(t, hv, dv).to(dtype),
        g=g.float(),
        beta=torch.sigmoid(rnd(t, hv)).to(dtype),
        rec_state=rnd(num_slots + 1, hv, dk, dv, scale=0.5).float(),
    )


def oracle_varlen_conv(b: GdnBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(y ``[T, C]`` float64, expected conv_state after the call)."""
    ys, state = [], b.conv_state.clone()
    for i, slot in enumerate(b.state_slots.tolist()):
        s, e = b.qsl_cpu[i], b.qsl_cpu[i + 1]
        y, new = oracle_conv(b.x[s:e].cpu(), b.conv_w.cpu(), b.conv_state[slot].cpu())
        ys.append(y)
        state[slot] = new.to(state)
    return torch.cat(ys), state


def oracle_varlen_rule(b: GdnBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(o ``[T, Hv, Dv]`` float64, expected recurrent_state after the call)."""
    outs, state = [], b.rec_state.clone()
    for i, slot in enumerate(b.state_slots.tolist()):
        s, e = b.qsl_cpu[i], b.qsl_cpu[i + 1]
        o, new = oracle_rule(
            *(t[s:e].cpu() for t in (b.q, b.k, b.v, b.g, b.beta)), b.rec_state[slot].cpu()
        )
        outs.append(o)
        state[slot] = new.to(state)
    return torch.cat(outs), state


def live_slots(b: GdnBatch) -> list[int]:
    null = b.rec_state.shape[0] - 1
    return [s for s in b.state_slots.tolist() if s != null]


def untouched_slots(b: GdnBatch) -> list[int]:
    used = set(b.state_slots.tolist())
    return [s for s in range(b.rec_state.shape[0]) if s not in used]


# ---------------------------------------------------------------------------------------------
# the oracle against transformers
# ---------------------------------------------------------------------------------------------


def hf_qwen3_5():
    """transformers' Qwen3.5 module (imported lazily: the GPU machine may not have it)."""
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def hf_torch(name: str):
    """transformers' own torch implementation of a Qwen3.5 GDN helper, by name. Where
    fla-core (or causal-conv1d) is installed, transformers routes these names to that
    package's kernels, which take CUDA tensors only and are not the reference meant here;
    ``functools.wraps`` keeps the torch function as ``__wrapped__``."""
    return inspect.unwrap(getattr(hf_qwen3_5(), name))


def test_oracle_rule_matches_hf_recurrent():
    b = make_batch([9], 0, hk=2, hv=4, dk=16, dv=8)
    slot = b.state_slots[0].item()
    o, state = oracle_rule(b.q, b.k, b.v, b.g, b.beta, b.rec_state[slot])
    rep = 2
    ho, hs = hf_torch("torch_recurrent_gated_delta_rule")(
        b.q[None].repeat_interleave(rep, 2), b.k[None].repeat_interleave(rep, 2), b.v[None],
        b.g[None], b.beta[None], initial_state=b.rec_state[slot][None].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o.float(), ho[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.float(), hs[0], atol=1e-5, rtol=1e-5)


def test_oracle_conv_matches_hf_update():
    conv1d_update = hf_torch("causal_conv1d_update")
    b = make_batch([6], 0)
    slot = b.state_slots[0].item()
    y, state = oracle_conv(b.x, b.conv_w, b.conv_state[slot])
    # HF's decode helper keeps a K-wide window; feed the same tokens one at a time.
    hf_state = torch.cat([torch.zeros(b.x.shape[1], 1), b.conv_state[slot]], dim=-1)[None]
    ys = [
        conv1d_update(b.x[t][None, :, None], hf_state, b.conv_w, None, "silu")[0, :, 0]
        for t in range(b.x.shape[0])
    ]
    torch.testing.assert_close(y.float(), torch.stack(ys), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.float(), hf_state[0, :, 1:], atol=0, rtol=0)
