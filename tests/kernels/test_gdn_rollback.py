"""The one-launch rollback of every GDN layer (``kernels/gdn_rollback.py``), under the
Triton interpreter on the CPU (or on CUDA where present), on small shapes: several layers,
GQA, value heads of more than one value block, sequences keeping 0 .. r rows in slots out
of order, padding on the null slot.

Each case is checked against the float64 oracle of ``test_gdn_oracle`` (conv, gates, L2
norm and delta rule written from the recurrence, from the spares) and against the path
it replaces (restore, then each layer's varlen conv, ``gdn_gates`` and row-walking rule),
and every element the rollback must not write (sequences keeping 0 rows, every other
slot, the spares, the record) is compared bit for bit.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from test_gdn_oracle import oracle_conv, oracle_rule

from pagedserve.kernels import gdn, gdn_rollback
from pagedserve.model.elementwise import gdn_gates

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

needs_triton = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs CUDA or TRITON_INTERPRET=1"
)

SMALL = {"hk": 2, "hv": 6, "dk": 16, "dv": 48}  # GQA 3; Dv: a full and a partial block


@dataclass
class RollbackCase:
    """Live and spare states of ``L`` layers, one verify record per layer (views into a
    wider projection, as the eager verify pass records them) and the layers' gates."""

    num_rows: list[int]  # [P] rows kept per sequence
    rows_per_seq: int
    slots: list[int]  # [P]
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # L x (mixed, b, a)
    conv_w: list[torch.Tensor]  # L x [C, K]
    a_log: list[torch.Tensor]  # L x [Hv]
    dt_bias: list[torch.Tensor]  # L x [Hv]
    conv_state: torch.Tensor  # [L, S + 1, C, K - 1]
    rec_state: torch.Tensor  # float32 [L, S + 1, Hv, Dk, Dv]
    conv_spare: torch.Tensor
    rec_spare: torch.Tensor
    hk: int

    @property
    def num_layers(self) -> int:
        return len(self.inputs)

    def layers(self) -> gdn_rollback.RollbackLayers:
        return gdn_rollback.rollback_layers(self.inputs, self.conv_w, self.a_log, self.dt_bias)

    def device_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.conv_state.device
        return (torch.tensor(self.num_rows, dtype=torch.int32, device=dev),
                torch.tensor(self.slots, dtype=torch.int32, device=dev))

    def run_kernel(self) -> None:
        num_rows, slots = self.device_counts()
        gdn_rollback.roll_back(self.layers(), num_rows, self.rows_per_seq, slots,
                               self.conv_state, self.rec_state, self.conv_spare,
                               self.rec_spare)

    def snapshot(self) -> list[torch.Tensor]:
        """Every tensor the rollback reads or writes, copied."""
        record = [t.clone() for x in self.inputs for t in x]
        return [t.clone() for t in (self.conv_state, self.rec_state, self.conv_spare,
                                    self.rec_spare)] + record


def make_case(num_rows: list[int], rows_per_seq: int, slots: list[int], *, num_layers: int = 2,
              hk: int, hv: int, dk: int, dv: int, kw: int = 4, num_slots: int = 10,
              extra_rows: int = 3, dtype: torch.dtype = torch.float32, device: str = DEVICE,
              seed: int = 0) -> RollbackCase:
    """A random case; the record holds ``extra_rows`` rows past the sequences' (the verify
    graphs' buffers are sized for their largest batch)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    c = 2 * hk * dk + hv * dv
    t = len(num_rows) * rows_per_seq + extra_rows
    inputs, conv_w, a_log, dt_bias = [], [], [], []
    for _ in range(num_layers):
        # [T, C + 2 Hv + 5]: mixed, b, a and a tail, like the projection's columns
        proj = rnd(t, c + 2 * hv + 5).to(dtype)
        inputs.append((proj[:, :c], proj[:, c:c + hv], proj[:, c + hv:c + 2 * hv]))
        conv_w.append(rnd(c, 1, kw, scale=0.5).to(dtype)[:, 0])
        a_log.append(torch.empty(hv).uniform_(1.0, 16.0, generator=gen).log().to(device)
                     .to(dtype))
        dt_bias.append((1.0 + rnd(hv, scale=0.5)).to(dtype))
    conv_shape = (num_layers, num_slots + 1, c, kw - 1)
    rec_shape = (num_layers, num_slots + 1, hv, dk, dv)
    return RollbackCase(
        num_rows, rows_per_seq, slots, inputs, conv_w, a_log, dt_bias,
        conv_state=rnd(*conv_shape).to(dtype), rec_state=rnd(*rec_shape, scale=0.5),
        conv_spare=rnd(*conv_shape).to(dtype), rec_spare=rnd(*rec_shape, scale=0.5), hk=hk)


def oracle_rollback(case: RollbackCase) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: the expected live states. A sequence with rows: each layer's conv and delta
    rule over its rows from its spares; every other slot as it was."""
    conv, rec = case.conv_state.cpu().double(), case.rec_state.cpu().double()
    r, hk = case.rows_per_seq, case.hk
    hv, dk, dv = rec.shape[2:]
    for layer, (mixed, b, a) in enumerate(case.inputs):
        w = case.conv_w[layer].cpu()
        a_log, dt_bias = case.a_log[layer].cpu().double(), case.dt_bias[layer].cpu().double()
        for seq, (n, slot) in enumerate(zip(case.num_rows, case.slots)):
            if n == 0:
                continue
            rows = slice(seq * r, seq * r + n)
            y, conv[layer, slot] = oracle_conv(mixed[rows].cpu(), w,
                                               case.conv_spare[layer, slot].cpu())
            q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
            g = -a_log.exp() * F.softplus(a[rows].cpu().double() + dt_bias)
            beta = torch.sigmoid(b[rows].cpu().double())
            _, rec[layer, slot] = oracle_rule(
                q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta,
                case.rec_spare[layer, slot].cpu())
    return conv, rec


def replaced_path(case: RollbackCase) -> None:
    """What the kernel replaces, on the case's states: the slots of sequences with rows
    back from their spares, then per layer the varlen conv, ``gdn_gates`` and the delta
    rule (their Triton kernels) over those sequences' rows."""
    r, hk = case.rows_per_seq, case.hk
    hv, dk, dv = case.rec_state.shape[2:]
    redo = [s for s, n in enumerate(case.num_rows) if n]
    slots = torch.tensor([case.slots[s] for s in redo], dtype=torch.int32,
                         device=case.conv_state.device)
    index = slots.long()
    case.conv_state.index_copy_(1, index, case.conv_spare.index_select(1, index))
    case.rec_state.index_copy_(1, index, case.rec_spare.index_select(1, index))
    rows = torch.tensor([s * r + j for s in redo for j in range(case.num_rows[s])],
                        device=case.conv_state.device)
    qsl_cpu = [0]
    for s in redo:
        qsl_cpu.append(qsl_cpu[-1] + case.num_rows[s])
    qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=case.conv_state.device)
    n = qsl_cpu[-1]
    for layer, (mixed, b, a) in enumerate(case.inputs):
        y = gdn.causal_conv1d_varlen(mixed[rows], case.conv_w[layer], case.conv_state[layer],
                                     qsl, qsl_cpu, slots, 0)
        q, k, v = y.split((hk * dk, hk * dk, hv * dv), dim=-1)
        g, beta = gdn_gates(a[rows], b[rows], case.a_log[layer], case.dt_bias[layer])
        gdn.gated_delta_rule_varlen(q.reshape(n, hk, dk), k.reshape(n, hk, dk),
                                    v.reshape(n, hv, dv), g, beta, case.rec_state[layer],
                                    qsl, qsl_cpu, slots, 0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def check_untouched(case: RollbackCase, before: list[torch.Tensor]) -> None:
    """Bit for bit: slots of sequences with no rows and of no sequence (the null slot
    among them), the spares, the record."""
    written = {slot for slot, n in zip(case.slots, case.num_rows) if n}
    kept = [s for s in range(case.conv_state.shape[1]) if s not in written]
    assert torch.equal(case.conv_state[:, kept], before[0][:, kept])
    assert torch.equal(case.rec_state[:, kept], before[1][:, kept])
    after = case.snapshot()
    for got, was in zip(after[2:], before[2:]):
        assert torch.equal(got, was)


# sequences: kept 2, none (a live slot), all 4, 1, 3, none (padding on the null slot)
CASE = ([2, 0, 4, 1, 3, 0], 4, [7, 2, 9, 0, 4, 10])


@functools.cache
def rolled_back(dtype: torch.dtype, shape: tuple[tuple[str, int], ...]
                ) -> tuple[RollbackCase, list[torch.Tensor]]:
    """``CASE`` at ``shape`` after the kernel, and its snapshot from before: one launch per
    dtype and shape, which the oracle test and the replaced-path test both check, reading
    only (under the interpreter a launch at ``SMALL`` takes seconds)."""
    case = make_case(*CASE, dtype=dtype, **dict(shape))
    before = case.snapshot()
    case.run_kernel()
    return case, before


@needs_triton
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [SMALL, {"hk": 2, "hv": 2, "dk": 16, "dv": 32}])
def test_rollback_matches_the_float64_oracle(dtype, bound, shape):
    want_conv, want_rec = oracle_rollback(make_case(*CASE, dtype=dtype, **shape))
    case, before = rolled_back(dtype, tuple(shape.items()))
    for layer in range(case.num_layers):
        for slot, n in zip(case.slots, case.num_rows):
            if n:
                # The conv state is the last inputs: copied, never rounded.
                assert torch.equal(case.conv_state[layer, slot].cpu(),
                                   want_conv[layer, slot].to(dtype)), (layer, slot)
                err = rel_err(case.rec_state[layer, slot], want_rec[layer, slot])
                assert err < bound, (layer, slot, err)
    check_untouched(case, before)


@needs_triton
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rollback_matches_the_path_it_replaces(monkeypatch, dtype, tol):
    """The same states as restoring and running the forward pass's kernels over the kept
    rows: conv states bit for bit; recurrent states to the gates' rounding (Triton's
    exp and log here, torch's there; in bf16 under the interpreter also beta's rounding,
    which the interpreter truncates where torch and the GPU round to nearest)."""
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)  # the Triton kernels, on any device
    case, _ = rolled_back(dtype, tuple(SMALL.items()))
    eager = make_case(*CASE, dtype=dtype, **SMALL)
    replaced_path(eager)
    assert torch.equal(case.conv_state, eager.conv_state)
    torch.testing.assert_close(case.rec_state, eager.rec_state, atol=tol, rtol=tol)


@needs_triton
def test_every_row_count_and_layer_is_independent():
    """One sequence per count 1 .. r in every layer, r = 2 (K - 1 > r: the new conv state
    keeps spare columns), and a lone sequence: each matches the oracle."""
    for num_rows, r, slots in (([1, 2], 2, [3, 1]), ([3], 3, [5])):
        case = make_case(num_rows, r, slots, num_layers=2, seed=2, **SMALL)
        before = case.snapshot()
        want_conv, want_rec = oracle_rollback(case)
        case.run_kernel()
        for slot in slots:
            assert torch.equal(case.conv_state[:, slot].cpu(), want_conv[:, slot].float())
            assert rel_err(case.rec_state[:, slot], want_rec[:, slot]) < 1e-5
        check_untouched(case, before)


@needs_triton
def test_no_rows_writes_nothing():
    case = make_case([0, 0, 0], 3, [1, 4, 10], seed=3, **SMALL)
    before = case.snapshot()
    case.run_kernel()
    for got, was in zip(case.snapshot(), before):
        assert torch.equal(got, was)


def test_layers_must_share_shapes_and_strides():
    case = make_case([1], 2, [0], num_layers=2, device="cpu", **SMALL)
    mixed, b, a = case.inputs[1]
    bad = [case.inputs[0], (mixed.contiguous(), b, a)]
    with pytest.raises(ValueError, match="layer 0"):
        gdn_rollback.rollback_layers(bad, case.conv_w, case.a_log, case.dt_bias)
    with pytest.raises(ValueError, match="number"):
        gdn_rollback.rollback_layers(case.inputs, case.conv_w[:1], case.a_log, case.dt_bias)
    num_rows, slots = case.device_counts()
    with pytest.raises(ValueError, match="spare"):
        gdn_rollback.roll_back(case.layers(), num_rows, 2, slots, case.conv_state,
                               case.rec_state, case.conv_spare[:, :-1], case.rec_spare)
    with pytest.raises(ValueError, match="record holds"):
        gdn_rollback.roll_back(case.layers(), num_rows, 9, slots, case.conv_state,
                               case.rec_state, case.conv_spare, case.rec_spare)
