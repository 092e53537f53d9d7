"""Speculative decoding in the engine: greedy tokens equal plain decoding's and
transformers', every rollback branch, stops inside a kept run, no leaks under preemption
and aborts, reproducible seeded sampling, and the start-up checks.

Two drafters: the checkpoint's own MTP head with random weights (drafts are mostly
rejected, so rollback runs nearly every step), over the whole vocabulary or a draft
vocabulary subset, and a forced drafter that proposes transformers' own greedy
continuation, corrupted at chosen output indices, so that every number of kept drafts
occurs.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from draft_stand_in import stand_in_draft_graphs  # noqa: E402
from hybrid_checkpoints import build_hf_model, prompt_ids  # noqa: E402
from mtp_checkpoints import build_mtp, save_with_mtp  # noqa: E402
from test_engine import run_keeping_requests  # noqa: E402

from pagedserve.engine.drafter import Draft, DraftRequest, Observed, Proposal  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import Request, RequestStatus, SamplingParams  # noqa: E402
from pagedserve.engine.rollback_graphs import RollbackGraphs  # noqa: E402
from pagedserve.engine.runner import speculative_graph_bytes  # noqa: E402
from pagedserve.engine.verify_graphs import (  # noqa: E402
    VerifyGraphs,
    VerifyOutput,
    is_pure_verify,
    verify_graph_sizes,
)
from pagedserve.model.loader import load_model  # noqa: E402

SHAPE = "d64-gqa3-untied"
NEW = 24
PROMPTS = [prompt_ids(0, 37), prompt_ids(1, 5), prompt_ids(2, 18)]
# A draft vocabulary of ids 0..99 and the byte tokenizer's special ids 256..258 (of 320):
# most of transformers' greedy tokens fall outside it.
SUBSET_SIZE = 100
SPECIAL_IDS = {256, 257, 258}


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory):
    return build_spec_model(tmp_path_factory)


def build_spec_model(tmp_path_factory):
    """(checkpoint dir, loaded with MTP, transformers' greedy tokens per prompt)."""
    hf = build_hf_model(SHAPE)
    path = save_with_mtp(hf, build_mtp(hf), tmp_path_factory.mktemp("spec"))
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    refs = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    return path, loaded, refs


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' model and its own cache, argmax at every step."""
    ids, past, out = torch.tensor([prompt]), None, []
    for _ in range(n):
        o = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = o.past_key_values
        out.append(int(o.logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def make_engine(spec_model, k: int | None, drafter=None, draft_vocab_size: int | None = None,
                **kw) -> LLMEngine:
    path, loaded, _ = spec_model
    kw.setdefault("check_integrity", True)
    kw.setdefault("max_model_len", 128)
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    if draft_vocab_size is not None:
        spec["draft_vocab_size"] = draft_vocab_size
    # Speculative engines take the default: prefix caching on (test_spec_prefix_cache.py).
    kw.setdefault("enable_prefix_caching", False if k is None else None)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", progress=False,
                                  speculative_config=spec, **kw),
                     loaded=loaded, drafter=drafter)


def run(engine: LLMEngine, prompts, params) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain_decoding_and_transformers(spec_model, k) -> None:
    refs = spec_model[2]
    engine = make_engine(spec_model, k, max_num_seqs=3)
    got = run(engine, PROMPTS, GREEDY)
    assert [got[str(i)] for i in range(len(PROMPTS))] == refs
    plain = run(make_engine(spec_model, None, max_num_seqs=3), PROMPTS, GREEDY)
    assert plain == got
    s = engine.spec.stats
    assert s.num_drafts > 0 and s.num_draft_tokens >= s.num_drafts
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0


def recorded_drafts(engine: LLMEngine) -> list[Draft]:
    """Every ``Draft`` the engine's drafter proposes from now on, as it proposes it."""
    drafts: list[Draft] = []
    propose = engine.spec.drafter.propose

    def proposing(wants):
        out = propose(wants)
        drafts.extend(out.drafts())
        return out

    engine.spec.drafter.propose = proposing
    return drafts


def assert_drafts_in(drafts: list[Draft], subset: set[int], vocab: int) -> None:
    """Every drafted id lies in ``subset``, and each sampled draft's distribution is 0
    (logits -inf) outside it."""
    assert drafts and all(t in subset for d in drafts for t in d.token_ids)
    outside = sorted(set(range(vocab)) - subset)
    for d in drafts:
        if d.logits is not None:
            assert bool((d.logits[:, outside] == float("-inf")).all())


@pytest.mark.parametrize("k, size", [(1, SUBSET_SIZE), (3, SUBSET_SIZE), (2, 1)])
def test_subset_draft_head_greedy_equals_transformers(spec_model, k, size, caplog) -> None:
    """Drafting over a draft vocabulary (ids below ``size`` and the special ids) that most
    of transformers' greedy tokens lie outside: transformers' tokens still, and every
    draft inside the subset."""
    refs = spec_model[2]
    with caplog.at_level("INFO", logger="pagedserve.engine.llm_engine"):
        engine = make_engine(spec_model, k, draft_vocab_size=size, max_num_seqs=3)
    subset = set(range(size)) | SPECIAL_IDS
    assert set(engine.runner.draft_head.ids.tolist()) == subset
    assert f"draft vocabulary: {len(subset)} of 320 token ids" in caplog.text
    assert sum(t not in subset for r in refs for t in r) > len(PROMPTS) * NEW / 4
    drafts = recorded_drafts(engine)
    got = run(engine, PROMPTS, GREEDY)
    assert [got[str(i)] for i in range(len(PROMPTS))] == refs
    assert_drafts_in(drafts, subset, 320)
    assert all(d.logits is None for d in drafts)  # greedy: the argmax, no distribution
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0


def test_sampled_drafts_of_a_subset_head_stay_in_it(spec_model) -> None:
    """Sampled requests draw their drafts from q over the whole vocabulary, 0 outside the
    draft vocabulary; a seeded run repeats itself."""
    params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=11, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = make_engine(spec_model, 3, draft_vocab_size=SUBSET_SIZE, max_num_seqs=3)
        drafts = recorded_drafts(engine)
        outs.append(run(engine, PROMPTS, params))
        assert_drafts_in(drafts, set(range(SUBSET_SIZE)) | SPECIAL_IDS, 320)
        assert all(d.logits is not None and d.logits.shape == (len(d.token_ids), 320)
                   for d in drafts)
    assert outs[0] == outs[1] and all(len(v) == NEW for v in outs[0].values())
    outside = [t for v in outs[0].values() for t in v if t >= SUBSET_SIZE]
    assert outside  # the target's own draws reach past the subset


def test_draft_vocab_size_is_checked_against_the_model_before_weights_load(spec_model) -> None:
    path = spec_model[0]
    message = r"draft_vocab_size must be an integer in \[1, 320\] \(the model's vocab_size\), " \
              r"got 321"
    spec = {"method": "mtp", "num_speculative_tokens": 3, "draft_vocab_size": 321}
    with mock.patch("pagedserve.engine.llm_engine.load_model",
                    side_effect=AssertionError("weights loaded")), \
            pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", progress=False,
                               enable_prefix_caching=False, speculative_config=spec))
    with pytest.raises(ValueError, match=message):
        make_engine(spec_model, 3, draft_vocab_size=321)  # a LoadedModel passed in
    assert make_engine(spec_model, 1, draft_vocab_size=320).runner.draft_head.ids is None

    from pagedserve.commands.engine_args import add_engine_arguments, engine_config
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "mtp", '
                              '"num_speculative_tokens": 3, "draft_vocab_size": 0}'])
    with pytest.raises(ValueError, match=r"draft_vocab_size must be an integer in "
                                         r"\[1, vocab_size\].*got 0"):
        engine_config(args)


def test_plan_takes_the_engines_draft_vocabulary(capsys) -> None:
    """``pagedserve plan`` counts the draft vocabulary the engine builds: on the default
    checkpoint, its first 1000 ids and its 26 added tokens (8166..8191, EOS among them)."""
    import json

    from pagedserve import cli
    from pagedserve.model.default_model import default_model_path

    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": 1000}
    assert cli.main(["plan", "--model", str(default_model_path()), "--memory", "1GiB",
                     "--max-model-len", "512", "--speculative-config", json.dumps(spec),
                     "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["speculation"]
    engine = LLMEngine(EngineConfig(progress=False, max_model_len=512, max_num_seqs=1,
                                    enable_prefix_caching=False, speculative_config=spec))
    head = engine.runner.draft_head
    assert head.ids.tolist() == [*range(1000), *range(8166, 8192)]
    assert planned["draft_vocab_rows"] == head.num_rows == 1026
    hidden = engine.runner.model_config.hidden_size
    assert planned["draft_head_bytes"] == 1026 * (hidden * 2 + 8)  # planned in bf16
    assert head.nbytes == 1026 * (hidden * 4 + 8)  # float32 on the CPU


class ForcedDrafter:
    """Proposes ``continuation[request][i]`` for output index ``i``, plus one (mod the
    vocabulary) wherever ``corrupt(i)``. Requests it has no continuation for (the engine's
    own warm-up on CUDA) get token 0 at every index. ``on_device``: the proposal holds
    the ids as a tensor (``Proposal.device_ids``, padded with -1), as the MTP drafter's
    graphs leave them."""

    def __init__(self, continuation: dict[str, list[int]], corrupt, vocab: int,
                 on_device: bool = False) -> None:
        self.continuation, self.corrupt, self.vocab = continuation, corrupt, vocab
        self.on_device = on_device

    def ready(self, req: Request) -> bool:
        return True

    def propose(self, wants: list[DraftRequest]) -> Proposal:
        drafts = []
        for w in wants:
            first = len(w.request.output_token_ids)
            ref = self.continuation.get(w.request.request_id, [0] * (first + w.num_drafts))
            ids = [(ref[i] + 1) % self.vocab if self.corrupt(i) else ref[i]
                   for i in range(first, first + w.num_drafts)]
            drafts.append(Draft(ids))
        if not self.on_device or not drafts:
            return Proposal(drafts)
        width = max(w.num_drafts for w in wants)
        ids = torch.tensor([d.token_ids + [-1] * (width - len(d.token_ids)) for d in drafts])
        return Proposal(device_ids=ids, num_drafts=[w.num_drafts for w in wants])

    def observe(self, kept: list[Observed]) -> None:
        pass


def forced(spec_model, corrupt, on_device: bool = False) -> ForcedDrafter:
    refs = spec_model[2]
    return ForcedDrafter({str(i): r for i, r in enumerate(refs)}, corrupt,
                         spec_model[1].config.vocab_size, on_device)


def test_forced_drafts_hit_every_rollback_branch(spec_model) -> None:
    refs = spec_model[2]
    # Corrupt indices 1 mod 5 and 2 mod 7: runs of every length 0..3 get kept.
    engine = make_engine(spec_model, 3, forced(spec_model, lambda i: i % 5 == 1 or i % 7 == 2),
                         max_num_seqs=3)
    got = run(engine, PROMPTS, GREEDY)
    assert [got[str(i)] for i in range(len(PROMPTS))] == refs
    assert all(n > 0 for n in engine.spec.stats.num_by_accepted), \
        engine.spec.stats.num_by_accepted


def stand_in_verify_graph(engine: LLMEngine, k: int, calls: list[tuple]) -> None:
    """Give ``engine.runner`` a stand-in verify graph, which runs the captured pass
    (``_verify_pass``: every row recorded, every row's logits) eagerly for the steps a
    graph holds (every sequence ``k + 1`` rows). ``calls`` logs each step's path and its
    rows per sequence."""
    runner = engine.runner
    eager = runner.forward_hidden

    def verify(batch):
        if not is_pure_verify(batch, k + 1):
            return None
        calls.append(("graph", tuple(batch.query_lens_cpu())))
        with torch.inference_mode():
            return runner._verify_pass(batch)

    def forward_hidden(batch):
        calls.append(("eager", tuple(batch.query_lens_cpu())))
        return eager(batch)

    runner.verify = verify
    runner.forward_hidden = forward_hidden


@pytest.mark.parametrize("k,on_device", [(1, False), (3, False), (3, True)])
def test_pure_verify_steps_take_the_graph_path(spec_model, k, on_device) -> None:
    """The step's graph branch (all logits from the pass, the record of every row, the
    rollback from it) gives transformers' tokens; a step with a prompt chunk, a plain
    decode row or fewer drafts than k runs eagerly. ``on_device``: the drafts reach the
    batch as a tensor (a wrong id there, such as the proposal's -1 padding or the
    placeholders' 0, changes the tokens)."""
    refs = spec_model[2]
    corrupt = (lambda i: i % 5 == 1 or i % 7 == 2) if k == 3 else (lambda i: i % 3 == 1)
    engine = make_engine(spec_model, k, forced(spec_model, corrupt, on_device),
                         max_num_seqs=3)
    calls: list[tuple] = []
    stand_in_verify_graph(engine, k, calls)
    lengths = [NEW, NEW - 7, NEW - 3]  # finishing apart: batches of 3, 2 and 1
    items = [(2 * i, str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for i, (p, n) in enumerate(zip(PROMPTS, lengths))]  # arriving apart: mixed steps
    got = run_keeping_requests(engine, items)
    assert [got[str(i)].output_token_ids for i in range(3)] == \
        [r[:n] for r, n in zip(refs, lengths)]
    r = k + 1
    assert {("graph", (r,) * b) for b in (1, 2, 3)} <= set(calls), calls
    assert all(lens == (r,) * len(lens) for path, lens in calls if path == "graph")
    eager = [lens for path, lens in calls if path == "eager"]
    assert not [lens for lens in eager if lens == (r,) * len(lens)], calls  # none pure
    assert any(r in lens for lens in eager), calls  # verify chunks beside others
    assert all(n > 0 for n in engine.spec.stats.num_by_accepted), \
        engine.spec.stats.num_by_accepted
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0


def stand_in_graphs(engine: LLMEngine, k: int, calls: list[tuple]) -> None:
    """Give ``engine.runner`` stand-in verify and rollback graphs on the CPU: a verify
    "replay" runs the captured pass eagerly over the live batch and leaves its rows in
    the shared record buffers (``VerifyGraphs.run`` does the rest: padding, state slots,
    the size replayed); a rollback "replay" runs ``RollbackGraphs.step`` of that size: the
    one-launch rollback kernel (the Triton interpreter), which reads the counts on the
    device as a captured graph does. ``calls`` logs each replay.

    The live batch's host ``seq_lens`` are taken from its device copy, which a captured
    graph reads alone (an async speculative step moves its rows there)."""
    runner, r = engine.runner, k + 1
    graphs = VerifyGraphs(runner._verify_pass, runner.device,
                          verify_graph_sizes(runner.config.max_num_seqs, r, None), r,
                          runner.max_blocks_per_seq, runner.state_pool.null_slot,
                          runner.config.max_model_len)
    live: list = []
    load = graphs.load

    def loading(batch):
        batch.seq_lens_cpu = batch.seq_lens.tolist()
        live[:] = [batch]
        return load(batch)

    def verify_replay(size: int) -> None:
        calls.append(("verify", size))
        out = runner._verify_pass(live[0])
        if graphs.output is None:
            rows = graphs.sizes[-1] * r
            graphs.output = VerifyOutput(
                out.hidden.new_zeros(rows, out.hidden.shape[1]),
                out.logits.new_zeros(rows, out.logits.shape[1]),
                [tuple(t.new_zeros(rows, t.shape[1]) for t in x) for x in out.gdn_inputs])
        n = out.hidden.shape[0]
        graphs.output.hidden[:n] = out.hidden
        graphs.output.logits[:n] = out.logits
        for dst, src in zip(graphs.output.gdn_inputs, out.gdn_inputs):
            for d, t in zip(dst, src):
                d[:n] = t

    rollback = RollbackGraphs(runner._rollback_pass, graphs)

    def rollback_replay(size: int) -> None:
        calls.append(("rollback", size, tuple(rollback.buffers["num_rows"][:size].tolist())))
        rollback.step(size)

    graphs.load = loading
    graphs.graphs = {s: SimpleNamespace(replay=lambda s=s: verify_replay(s))
                     for s in graphs.sizes}
    rollback.graphs = {s: SimpleNamespace(replay=lambda s=s: rollback_replay(s))
                       for s in graphs.sizes}
    runner.verify_graphs, runner.rollback_graphs = graphs, rollback


@pytest.mark.parametrize("k", [1, 3])
def test_pure_verify_steps_roll_back_by_graph(spec_model, k) -> None:
    """Verify steps through (stand-in) verify graphs roll back through the rollback graph
    of the same size, which restores and re-advances only the sequences that rejected a
    draft, with transformers' tokens; steps that keep every draft replay none."""
    refs = spec_model[2]
    corrupt = (lambda i: i % 5 == 1 or i % 7 == 2) if k == 3 else (lambda i: i % 3 == 1)
    engine = make_engine(spec_model, k, forced(spec_model, corrupt), max_num_seqs=3)
    calls: list[tuple] = []
    stand_in_graphs(engine, k, calls)
    eager_restores: list = []
    restore_states = engine.runner.restore_states
    engine.runner.restore_states = lambda slots: eager_restores.append(slots) or \
        restore_states(slots)
    lengths = [NEW, NEW - 7, NEW - 3]
    items = [(2 * i, str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = run_keeping_requests(engine, items)
    assert [got[str(i)].output_token_ids for i in range(3)] == \
        [r[:n] for r, n in zip(refs, lengths)]
    rollbacks = [c for c in calls if c[0] == "rollback"]
    assert {c[1] for c in rollbacks} == {1, 2, 3}, calls  # every size replayed
    for j, c in enumerate(calls):
        if c[0] == "rollback":  # right after the verify replay of its size
            assert calls[j - 1] == ("verify", c[1]), calls
            assert any(0 < n < k + 1 for n in c[2]) and all(0 <= n <= k for n in c[2])
    if k == 3:  # (k = 1: the corrupted indices line the sequences up)
        assert any(0 in c[2] for c in rollbacks if c[1] > 1), rollbacks  # some kept all
    assert len(rollbacks) < len([c for c in calls if c[0] == "verify"])  # none to undo
    assert eager_restores, "steps beside a prompt or a plain row roll back eagerly"
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0


@pytest.mark.parametrize("size", [None, SUBSET_SIZE])
@pytest.mark.parametrize("k", [1, 3])
def test_draft_graph_passes_give_transformers_tokens(spec_model, k, size) -> None:
    """The drafter through its graph passes (stand-ins replaying the captured passes over
    the padded static batches) beside the verify graph's path: transformers' tokens, with
    propose passes (k > 1) and observe passes of every batch size replayed, and the
    prompts' observes eager; with a draft vocabulary (``size``), every draft in it."""
    refs = spec_model[2]
    engine = make_engine(spec_model, k, draft_vocab_size=size, max_num_seqs=3)
    drafts = recorded_drafts(engine)
    stand_in_verify_graph(engine, k, [])
    calls: list[tuple] = []
    engine.runner.draft_graphs = stand_in_draft_graphs(engine.runner, 3, calls)
    observed: list[list[int]] = []
    observe = engine.spec.drafter.observe
    engine.spec.drafter.observe = lambda kept: observed.append(
        [len(o.next_ids) for o in kept]) or observe(kept)
    lengths = [NEW, NEW - 7, NEW - 3]  # finishing apart: batches of 3, 2 and 1
    items = [(2 * i, str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = run_keeping_requests(engine, items)
    assert [got[str(i)].output_token_ids for i in range(3)] == \
        [r[:n] for r, n in zip(refs, lengths)]
    assert {("observe", s) for s in (1, 2, 3)} <= set(calls), calls
    if k > 1:
        assert {("propose", s, j) for s in (1, 2, 3) for j in range(1, k)} <= set(calls)
    else:
        assert not [c for c in calls if c[0] == "propose"]
    assert any(max(lens) > k + 1 for lens in observed)  # prompts: eager
    if size is not None:
        assert_drafts_in(drafts, set(range(size)) | SPECIAL_IDS, 320)
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0


@pytest.mark.parametrize("size", [None, SUBSET_SIZE])
def test_seeded_sampled_drafts_through_the_graphs_repeat_the_eager_drafters(spec_model,
                                                                           size) -> None:
    """Sampled drafts are drawn between the graph passes with the eager drafter's noise:
    a seeded batch gives the eager drafter's tokens, over a draft vocabulary too."""
    params = [SamplingParams(max_tokens=NEW, temperature=0.9, top_k=20, seed=7 + i,
                             ignore_eos=True) if i != 1 else GREEDY for i in range(3)]
    outs = []
    for graphs in (False, True):
        engine = make_engine(spec_model, 3, draft_vocab_size=size, max_num_seqs=3)
        calls: list[tuple] = []
        if graphs:
            engine.runner.draft_graphs = stand_in_draft_graphs(engine.runner, 3, calls)
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            engine.add_request(str(i), p, sp)
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert bool(calls) == graphs
        outs.append(out)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("size", [None, SUBSET_SIZE])
@pytest.mark.parametrize("k", [3])  # k = 1's graphs: the rollback and drafter tests above
def test_verify_rollback_and_draft_graphs_together(spec_model, k, size) -> None:
    """Every graph of a speculative step at once (stand-ins: verify, rollback, drafter
    passes), with the MTP head's own drafts, which the random target mostly rejects:
    transformers' tokens, each kind of graph replayed, nothing leaked; the drafter's
    buffers are as wide as its draft vocabulary, and the reserve covers them."""
    refs = spec_model[2]
    engine = make_engine(spec_model, k, draft_vocab_size=size, max_num_seqs=3)
    calls: list[tuple] = []
    stand_in_graphs(engine, k, calls)
    engine.runner.draft_graphs = stand_in_draft_graphs(engine.runner, 3, calls)
    # Fewer tokens than the tests above (each rollback replay runs the interpreter),
    # still finishing apart: verify graphs of 3, 2 and 1 sequences (asserted below).
    lengths = [NEW - 8, NEW - 15, NEW - 11]
    items = [(2 * i, str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    got = run_keeping_requests(engine, items)
    assert [got[str(i)].output_token_ids for i in range(3)] == \
        [r[:n] for r, n in zip(refs, lengths)]
    kinds = {c[0] for c in calls}
    assert {c[1] for c in calls if c[0] == "verify"} == {1, 2, 3}, calls
    assert {"verify", "rollback", "observe"} <= kinds, kinds
    assert ("propose" in kinds) == (k > 1), kinds
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0
    # The memory set aside for the graphs on CUDA covers their static buffers as built.
    runner = engine.runner
    verify_out = runner.verify_graphs.output
    drafting = runner.draft_graphs
    buffers = [verify_out.hidden, verify_out.logits, *(t for x in verify_out.gdn_inputs
                                                        for t in x)]
    for part in (drafting.propose, drafting.observe):
        if part is not None:
            buffers += list(part.buffers.values())
    static = sum(t.numel() * t.element_size() for t in buffers)
    columns = runner.draft_head.num_rows
    assert columns == (320 if size is None else size + len(SPECIAL_IDS))
    assert drafting.propose.buffers["logits"].shape[-1] == columns
    assert drafting.observe.buffers["tail_logits"].shape[-1] == columns
    reserved = speculative_graph_bytes(runner.model_config, k + 1, 3, runner.dtype, columns)
    assert static <= reserved < 4 * static, (static, reserved)
    if size is not None:  # the draft rows are narrower: the reserve is smaller
        assert reserved < speculative_graph_bytes(runner.model_config, k + 1, 3, runner.dtype)


@torch.no_grad()
def hf_greedy_penalized(model, prompt: list[int], n: int, presence: float, frequency: float,
                        repetition: float) -> list[int]:
    """transformers' logits in float64 with the penalties applied by hand, in the
    sampler's order: presence and frequency over the outputs, then the repetition
    penalty over prompt and outputs (divide positive logits, multiply negative ones)."""
    out: list[int] = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].double()
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        for t in set(prompt + out):
            x = logits[t]
            logits[t] = x / repetition if x > 0 else x * repetition
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafter", ["mtp", "forced"])
def test_penalized_greedy_with_speculation_matches_the_oracle(spec_model, k, drafter) -> None:
    """Presence, frequency and repetition penalties: each verify row counts the drafts
    before it, so the kept tokens are the penalized greedy ones; the forced drafter's
    corrupted drafts are replaced, its right ones kept."""
    hf = build_hf_model(SHAPE)
    pen = dict(presence=0.4, frequency=0.3, repetition=1.3)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                            presence_penalty=pen["presence"],
                            frequency_penalty=pen["frequency"],
                            repetition_penalty=pen["repetition"])
    want = [hf_greedy_penalized(hf, p, NEW, **pen) for p in PROMPTS]
    forced_drafter = None
    if drafter == "forced":
        forced_drafter = ForcedDrafter({str(i): w + [0] * 8 for i, w in enumerate(want)},
                                       lambda i: i % 3 == 1, spec_model[1].config.vocab_size)
    engine = make_engine(spec_model, k, forced_drafter, max_num_seqs=3)
    got = run(engine, PROMPTS, params)
    assert [got[str(i)] for i in range(len(PROMPTS))] == want
    stats = engine.spec.stats
    assert stats.num_drafts > 0
    if drafter == "forced":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("drafter", ["mtp", "forced"])
def test_min_tokens_with_speculation_bans_the_stop_id_until_then(spec_model, drafter) -> None:
    """Below ``min_tokens`` outputs each verify row bans the stop id, so a draft of it is
    replaced there (plain greedy decoding would stop at output 3). Oracle: transformers'
    greedy tokens with the id banned by hand while fewer than ``min_tokens`` came out, and
    a stop on it after."""
    hf = build_hf_model(SHAPE)
    prompt = PROMPTS[0]
    stop = spec_model[2][0][2]
    min_tokens = 9
    want: list[int] = []
    with torch.no_grad():
        while len(want) < NEW:
            logits = hf(input_ids=torch.tensor([prompt + want])).logits[0, -1]
            if len(want) < min_tokens:
                logits[stop] = float("-inf")
            want.append(int(logits.argmax()))
            if want[-1] == stop:
                break
    forced_drafter = None
    if drafter == "forced":  # every draft the stop id: kept only from min_tokens on
        forced_drafter = ForcedDrafter({"0": [stop] * (NEW + 8)}, lambda i: False,
                                       spec_model[1].config.vocab_size)
    engine = make_engine(spec_model, 3, forced_drafter)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, min_tokens=min_tokens,
                            stop_token_ids=(stop,))
    got = run(engine, [prompt], params)["0"]
    assert got == want
    stats = engine.spec.stats
    assert stats.num_drafts > 0
    if drafter == "forced":
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # the banned drafts


@pytest.mark.parametrize("stop_at", [3, 9])
def test_stop_inside_a_kept_run_truncates_exactly(spec_model, stop_at) -> None:
    """A stop id, a max_tokens cut and the plain engine's output agree, with every draft
    right (the stop falls inside a run of kept drafts)."""
    ref = spec_model[2][0]
    stop = ref[stop_at]
    want_len = ref.index(stop) + 1  # the stop id is the last token (not emitted as text)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(stop,))
    engine = make_engine(spec_model, 4, forced(spec_model, lambda i: False))
    got = run(engine, PROMPTS[:1], params)["0"]
    assert got == ref[:want_len]
    cut = run(make_engine(spec_model, 4, forced(spec_model, lambda i: False)), PROMPTS[:1],
              SamplingParams(max_tokens=stop_at + 2, temperature=0.0, ignore_eos=True))["0"]
    assert cut == ref[:stop_at + 2]


def test_logprobs_of_kept_drafts_are_the_models(spec_model) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    engine = make_engine(spec_model, 3, forced(spec_model, lambda i: i == 4))
    plain = make_engine(spec_model, None)
    for e in (engine, plain):
        e.add_request("0", PROMPTS[0], params)
    outs = {}
    for name, e in (("spec", engine), ("plain", plain)):
        lps = []
        while e.has_unfinished_requests():
            for o in e.step():
                lps.extend(o.new_logprobs)
        outs[name] = lps
    assert [lp.token_id for lp in outs["spec"]] == [lp.token_id for lp in outs["plain"]]
    for a, b in zip(outs["spec"], outs["plain"]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_no_leaks_with_preemptions_and_aborts(spec_model) -> None:
    """Many requests through a pool too small for all of them, some aborted mid-run:
    every step passes the integrity checks and everything ends free."""
    engine = make_engine(spec_model, 3, num_blocks=7, max_num_seqs=4, block_size=16)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(10):  # two of them need 8 blocks: the younger is preempted
        engine.add_request(f"r{i}", prompt_ids(i, rng.randint(30, 44)), params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        running = [r.request_id for r in engine.scheduler.running]
        if running and rng.random() < 0.15:
            engine.abort_request(rng.choice(running))
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec.stats.num_drafts > 0
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0 and engine.kv.num_live_seqs == 0


@pytest.mark.parametrize("penalty", [0.0, 0.5])
def test_seeded_sampling_with_speculation_repeats(spec_model, penalty) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=40, seed=1234,
                            ignore_eos=True, presence_penalty=penalty,
                            repetition_penalty=1.0 + penalty)
    a = run(make_engine(spec_model, 3, max_num_seqs=3), PROMPTS, params)
    b = run(make_engine(spec_model, 3, max_num_seqs=1), PROMPTS, params)
    assert a == b
    assert all(len(v) == 10 for v in a.values())


@pytest.mark.parametrize("spec, kw, message", [
    ('{"method": "mtp"', {}, "not valid JSON"),
    ({"method": "eagle", "num_speculative_tokens": 2}, {}, "method 'eagle'"),
    ({"method": "mtp", "num_speculative_tokens": 5}, {}, r"in \[1, 4\]"),
    ({"method": "mtp", "num_speculative_tokens": 2, "x": 1}, {}, "unsupported fields"),
])
def test_bad_speculative_configs_are_rejected(spec, kw, message) -> None:
    kw.setdefault("enable_prefix_caching", False)
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec, **kw)


def test_prefix_caching_is_on_by_default_with_speculation(spec_model) -> None:
    """Speculation takes prefix caching's default (on), and either setting is accepted."""
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    assert EngineConfig(speculative_config=spec).prefix_caching
    assert EngineConfig(speculative_config=spec, enable_prefix_caching=True).prefix_caching
    assert not EngineConfig(speculative_config=spec,
                            enable_prefix_caching=False).prefix_caching
    engine = make_engine(spec_model, 2)
    assert engine.prefix is not None and engine.prefix.speculative
    assert engine.runner.checkpoint_pool.hidden_size == spec_model[1].config.hidden_size
    assert make_engine(spec_model, 2, enable_prefix_caching=False).prefix is None

    from pagedserve.commands.engine_args import add_engine_arguments, engine_config
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", spec])
    assert engine_config(args).prefix_caching is True


def test_checkpoint_without_mtp_is_rejected_at_start_up(tmp_path) -> None:
    from hybrid_checkpoints import save_checkpoint

    path = save_checkpoint(build_hf_model(SHAPE), tmp_path)
    with pytest.raises(ValueError, match="no mtp"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", progress=False,
                               enable_prefix_caching=False,
                               speculative_config='{"method": "mtp", '
                                                  '"num_speculative_tokens": 2}'))


def test_unfinished_status_is_exact(spec_model) -> None:
    """Finish reasons under speculation: length at max_tokens, counted once."""
    engine = make_engine(spec_model, 2, forced(spec_model, lambda i: False))
    engine.add_request("0", PROMPTS[0], SamplingParams(max_tokens=7, temperature=0.0,
                                                       ignore_eos=True))
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o
    assert last is not None and last.finished and last.finish_reason == "length"
    assert last.num_output_tokens == 7
    assert last.request is not None and last.request.status is RequestStatus.FINISHED_LENGTH


def test_spec_counters_reach_prometheus(spec_model) -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from pagedserve.engine.async_engine import EngineSnapshot
    from pagedserve.server.metrics import _EngineCollector

    engine = make_engine(spec_model, 2, forced(spec_model, lambda i: i % 3 == 0))
    run(engine, PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    counts = engine.spec_decode_counts()
    s = engine.spec.stats
    assert counts["spec_decode_num_accepted_tokens"] == sum(s.accepted_per_pos) > 0
    assert sum(s.num_by_accepted) == s.num_drafts == counts["spec_decode_num_drafts"]
    registry = CollectorRegistry()
    registry.register(_EngineCollector(
        SimpleNamespace(snapshot=EngineSnapshot(**counts)), "m", None))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert f'pagedserve:spec_decode_num_drafts_total{{model_name="m"}} {s.num_drafts}.0' in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"}' in text
    # The forced drafter's acceptances, counted here from the per-length histogram.
    emitted = sum((n + 1) * c for n, c in enumerate(s.num_by_accepted))
    mean = emitted / s.num_drafts
    line = next(x for x in text.splitlines()
                if x.startswith("pagedserve:spec_decode_mean_acceptance_length{"))
    assert abs(float(line.split()[-1]) - mean) < 1e-9 and 1.0 < mean < 3.0


def test_warm_up_keeps_every_count_of_drafts(spec_model) -> None:
    """The warm-up's greedy verifies keep 0 .. k drafts in turn, so every rollback shape
    runs before the first request (on CUDA: compiles); its counters are then reset, the
    verify decision is the engine's own again, and nothing stays allocated."""
    k = 3
    engine = make_engine(spec_model, k, max_num_seqs=3)
    spec = engine.spec
    seen: list[list[int]] = []
    reset = spec.reset_stats

    def reset_stats():
        seen.append(list(spec.stats.num_by_accepted))
        reset()

    spec.reset_stats = reset_stats
    engine.warm_up()
    assert len(seen) == 1 and all(n > 0 for n in seen[0]), seen  # m = 0, 1, .., k
    assert spec.stats.num_drafts == 0 and spec.stats.num_by_accepted == [0] * (k + 1)
    assert spec.kept_drafts is None  # the engine decides again
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0
    got = run(engine, PROMPTS, GREEDY)
    assert [got[str(i)] for i in range(len(PROMPTS))] == spec_model[2]


def test_prompt_logprobs_are_refused_with_speculation(spec_model) -> None:
    engine = make_engine(spec_model, 2)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with speculative"):
        engine.add_request("r", PROMPTS[0], SamplingParams(prompt_logprobs=1))
