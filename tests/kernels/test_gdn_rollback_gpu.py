"""CUDA: the one-launch GDN rollback (``kernels/gdn_rollback.py``) at the real head counts
and dims of Qwen3.5-27B (Hk=16, Hv=48, Dk=Dv=128, conv kernel 4; 4 of its 48 GDN layers),
bf16 records: against the path it replaces (restore, then each layer's Triton conv,
``gdn_gates`` and row-walking rule) and the float64 oracle, and captured in a CUDA graph
whose replays with new counts equal eager launches bit for bit. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from test_gdn_rollback import (
    RollbackCase,
    check_untouched,
    make_case,
    oracle_rollback,
    rel_err,
    replaced_path,
)

from pagedserve.kernels import gdn_rollback

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

REAL = {"hk": 16, "hv": 48, "dk": 128, "dv": 128, "kw": 4}
R = 4  # k = 3
# kept 3, none (a live slot), all 4, 1; padding on the null slot (16)
CASE = ([3, 0, 4, 1, 0], R, [5, 2, 9, 0, 16])


def real_case(seed: int) -> RollbackCase:
    return make_case(*CASE, num_layers=4, num_slots=16, dtype=torch.bfloat16, device="cuda",
                     seed=seed, **REAL)


def test_gpu_rollback_real_size_matches_the_replaced_path_and_the_oracle():
    case, eager = real_case(1), real_case(1)
    before = case.snapshot()
    want_conv, want_rec = oracle_rollback(case)
    case.run_kernel()
    replaced_path(eager)
    torch.cuda.synchronize()
    assert torch.equal(case.conv_state, eager.conv_state)
    for slot, n in zip(case.slots, case.num_rows):
        if n:
            # The gates' rounding: exp and log to an ulp, and so beta to a bf16 ulp where
            # sigmoid lands near a rounding boundary.
            assert rel_err(case.rec_state[:, slot], eager.rec_state[:, slot]) < 2e-3, slot
            assert torch.equal(case.conv_state[:, slot].cpu(),
                               want_conv[:, slot].to(torch.bfloat16)), slot
            assert rel_err(case.rec_state[:, slot], want_rec[:, slot]) < 1e-2, slot
    check_untouched(case, before)


def test_gpu_rollback_captured_replays_equal_eager_launches():
    case = real_case(2)
    layers = case.layers()
    num_rows = torch.zeros(len(case.num_rows), dtype=torch.int32, device="cuda")
    slots = torch.tensor(case.slots, dtype=torch.int32, device="cuda")

    def launch(counts: torch.Tensor) -> None:
        gdn_rollback.roll_back(layers, counts, R, slots, case.conv_state, case.rec_state,
                               case.conv_spare, case.rec_spare)

    before = case.snapshot()
    launch(num_rows)  # compiled outside the capture; no rows: writes nothing
    torch.cuda.synchronize()
    check_untouched(case, before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(num_rows)
    for counts in ([3, 0, 4, 1, 0], [1, 2, 0, 4, 0], [0, 0, 0, 0, 0]):
        start = [t.clone() for t in (case.conv_state, case.rec_state)]
        num_rows.copy_(torch.tensor(counts, dtype=torch.int32))
        graph.replay()
        replayed = [t.clone() for t in (case.conv_state, case.rec_state)]
        case.conv_state.copy_(start[0])
        case.rec_state.copy_(start[1])
        launch(torch.tensor(counts, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], case.conv_state), counts
        assert torch.equal(replayed[1], case.rec_state), counts
        written = [s for s, n in zip(case.slots, counts) if n]
        kept = [s for s in range(case.conv_state.shape[1]) if s not in written]
        assert torch.equal(replayed[0][:, kept], start[0][:, kept])
        assert torch.equal(replayed[1][:, kept], start[1][:, kept])
