"""The drafter's graph passes on their padded static batches, on the GPU kernels (Triton
interpreter, CPU): the same drafts, MTP K/V rows and tails as the eager drafter, over the
whole vocabulary and over a draft vocabulary subset, and padding writes no K/V row.

The graphs replay exactly these passes (``draft_stand_in.py``); what a capture adds (no
host syncs, fixed launches) only a GPU can check (tests/engine/test_draft_graphs_gpu.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from draft_stand_in import stand_in_draft_graphs
from mtp_checkpoints import build_mtp, save_with_mtp

from pagedserve.config import CacheConfig
from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.draft_vocab import draft_vocab_ids
from pagedserve.engine.drafter import DraftRequest, MTPDrafter, Observed
from pagedserve.engine.request import SamplingParams
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.kernels import gdn, ops
from pagedserve.model.loader import load_model

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)

K = 3
R = K + 1
CONTEXTS = [10, 17, 30]  # kept rows and drafts cross block edges (block size 16)
# Ids below 100 and the byte tokenizer's three special ids (256..258) of 320.
SUBSET = draft_vocab_ids(100, 320, [256, 257, 258])


def mtp_storage(runner: ModelRunner) -> list[torch.Tensor]:
    k, v = runner.kv_caches[-1]  # the MTP head's pair
    return [t for s in (k, v) for t in (s.data, s.scales) if t is not None]


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in mtp_storage(runner)]


def restore(runner: ModelRunner, saved: list[torch.Tensor]) -> None:
    for dst, src in zip(mtp_storage(runner), saved):
        dst.copy_(src)


@pytest.fixture
def setup(checkpoints, tmp_path, monkeypatch, request):
    """Three sequences past their prompts (the MTP rows and tails of the prompts written
    eagerly) and ``R`` more target rows each, with the target's hidden states there.
    ``request.param``: the K/V type, or (K/V type, draft vocabulary)."""
    kv_type, subset = request.param if isinstance(request.param, tuple) \
        else (request.param, None)
    ckpt = checkpoints("d64-gqa3-untied")
    path = save_with_mtp(ckpt.hf_model, build_mtp(ckpt.hf_model), tmp_path)
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    runner = ModelRunner(loaded.model, CacheConfig(kv_type, kv_type, block_size=16),
                         RunnerConfig(max_model_len=128, max_num_seqs=8, verify_rows=R),
                         draft_vocab=subset)
    kv = runner.create_kv_manager()
    drafter = MTPDrafter(runner, kv)
    # The CUDA branches of every op, on CPU tensors, under the interpreter.
    monkeypatch.setattr(ops, "_pick", lambda backend, device: "triton")
    monkeypatch.setattr(gdn, "_on_gpu", lambda t: True)
    seqs = []
    for i, n in enumerate(CONTEXTS):
        handle = kv.create()
        slot = runner.state_pool.slot(runner.state_pool.acquire())
        assert kv.reserve(handle, n + 2 * R)
        ids = [(t + 3 * i) % 200 for t in ckpt.prompt[: n + R + 1]]
        req = SimpleNamespace(live_kv_handle=handle, draft_tail=None, output_token_ids=[],
                              params=SamplingParams(temperature=0.8 if i == 1 else 0.0),
                              sample_seed=1234 + i)
        with torch.inference_mode():
            hidden = runner.forward_hidden(build_forward_batch(
                [SeqChunk(handle, slot, tuple(ids[: n + R]), 0)], kv))  # [n + R, H]
        drafter.observe([Observed(req, slot, 0, ids[1: n + 1], hidden[:n], True)])
        seqs.append(SimpleNamespace(req=req, slot=slot, ids=ids, hidden=hidden))
    return runner, drafter, seqs


def graphed(runner: ModelRunner, calls: list[tuple]):
    graphs = stand_in_draft_graphs(runner, 8, calls, reference_host_copies=False)
    for part in (graphs.propose, graphs.observe):
        part.buffers["block_tables"].fill_(3)  # stale tables under the padding
    return graphs


def tails(seqs) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    return [(s.req.draft_tail.num_computed, s.req.draft_tail.hidden.clone(),
             s.req.draft_tail.logits.clone()) for s in seqs]


def assert_same_storage(got: list[torch.Tensor], want: list[torch.Tensor],
                        before: list[torch.Tensor]) -> None:
    """The rows the passes write agree (but for a stored rounding flipped by the GEMMs'
    row count: one f16 ulp, one q8_0 step), and the graphs write no other row: a
    padding row's write would change a whole row (head_dim values) that the eager pass
    leaves as it was, where a flip changes a value or two."""
    for g, w, b in zip(got, want, before):
        assert (g != w).float().mean() < 1e-3
        assert int(((g != b) & (w == b)).sum()) < 8


@pytest.mark.parametrize("setup", ["f16", "q8_0", ("f16", SUBSET)], indirect=True)
def test_observe_graph_gives_the_eager_tails_and_mtp_rows(setup):
    runner, drafter, seqs = setup
    kept_rows = [1, 3, R]  # every kept count of a verify step: 1 .. k + 1
    kept = [Observed(s.req, s.slot, n, s.ids[n + 1: n + 1 + m], s.hidden[n: n + m], True)
            for s, n, m in zip(seqs, CONTEXTS, kept_rows)]
    before = snapshot(runner)
    drafter.observe(kept)
    eager, after_eager = tails(seqs), snapshot(runner)
    restore(runner, before)

    calls: list[tuple] = []
    runner.draft_graphs = graphed(runner, calls)
    drafter.observe(kept)
    assert calls == [("observe", 4)]
    for (n_g, h_g, l_g), (n_e, h_e, l_e), c, m in zip(tails(seqs), eager, CONTEXTS, kept_rows):
        assert n_g == n_e == c + m
        assert l_g.shape == (runner.draft_head.num_rows,)
        # A one-row run is a decode row eagerly (the decode kernel), a prefill row here.
        torch.testing.assert_close(h_g, h_e, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l_g, l_e, atol=1e-4, rtol=1e-5)
    assert_same_storage(snapshot(runner), after_eager, before)


@pytest.mark.parametrize("setup", ["f16", ("f16", SUBSET)], indirect=True)
def test_propose_graphs_give_the_eager_drafts_and_mtp_rows(setup):
    runner, drafter, seqs = setup
    num_drafts = [K, 2, K]  # one request drafts fewer (its last pass is padding)
    wants = [DraftRequest(s.req, s.slot, c, d) for s, c, d in zip(seqs, CONTEXTS, num_drafts)]
    before = snapshot(runner)
    eager, after_eager = drafter.propose(wants).drafts(), snapshot(runner)
    restore(runner, before)

    calls: list[tuple] = []
    runner.draft_graphs = graphed(runner, calls)
    proposal = drafter.propose(wants)
    assert calls == [("propose", 4, 1), ("propose", 4, 2)]
    assert proposal.device_ids is not None  # the graphs' drafts stay on the device
    got = proposal.drafts()
    allowed = set(SUBSET) if runner.draft_head.ids is not None else set(range(320))
    for g, e, d, s in zip(got, eager, num_drafts, seqs):
        assert g.token_ids == e.token_ids and len(g.token_ids) == d
        assert set(g.token_ids) <= allowed
        if s.req.params.greedy:  # the argmax: no distribution
            assert g.logits is None and e.logits is None
            continue
        assert g.logits is not None and e.logits is not None
        assert g.logits.shape == (d, 320)
        assert bool((g.logits[:, sorted(set(range(320)) - allowed)] == float("-inf")).all())
        torch.testing.assert_close(g.logits, e.logits, atol=1e-4, rtol=1e-5)
    assert_same_storage(snapshot(runner), after_eager, before)
