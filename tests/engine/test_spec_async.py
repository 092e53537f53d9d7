"""Async scheduling with speculative decoding (``engine/spec_async.py``) on the CPU.

The chains replay the runner's graphs, so the engines here hold stand-ins for all of
them (``stand_in_graphs``, ``stand_in_draft_graphs``: the captured passes run eagerly
over the graphs' buffers, reading device values only). Oracles: transformers' greedy
tokens, and under an imposed acceptance, transformers' argmax at every token the
target chose (teacher-forced over the whole output), which a wrong kept count, row
position, K/V slot or rolled-back state would change.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from draft_stand_in import stand_in_draft_graphs  # noqa: E402
from hybrid_checkpoints import build_hf_model, prompt_ids  # noqa: E402
from test_engine import run_keeping_requests  # noqa: E402
from test_speculative import (  # noqa: E402
    NEW,
    PROMPTS,
    SHAPE,
    build_spec_model,
    hf_greedy_penalized,
    make_engine,
    stand_in_graphs,
)

from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.engine.request import Request, SamplingParams  # noqa: E402
from pagedserve.model.forward_batch import ForwardBatch  # noqa: E402


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory):
    return build_spec_model(tmp_path_factory)


def eager_rollback(engine: LLMEngine, k: int) -> None:
    """Run the stand-in rollback graph's replays as the eager restore and re-advance that
    its kernel fuses (the interpreted kernel takes seconds a replay; its own tests and
    the graph tests cover it), reading the counts and slots from the graphs' device
    buffers as the kernel does."""
    runner, r = engine.runner, k + 1
    rollback, verify = runner.rollback_graphs, runner.verify_graphs

    def step(size: int) -> None:
        counts = rollback.buffers["num_rows"][:size].tolist()
        slots = verify.buffers["state_slots"][:size].tolist()
        redo = sorted((s for s, n in enumerate(counts) if n), key=lambda s: counts[s] > 1)
        if not redo:
            return
        runner.restore_states([slots[s] for s in redo])
        qsl = [0]
        for s in redo:
            qsl.append(qsl[-1] + counts[s])
        rows = torch.tensor([s * r + j for s in redo for j in range(counts[s])])
        none = torch.empty(0, dtype=torch.long)
        batch = ForwardBatch(
            input_ids=none, positions=none, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=none, block_tables=none, slot_mapping=none,
            state_slots=torch.tensor([slots[s] for s in redo], dtype=torch.int32),
            logits_indices=none, num_decode_seqs=sum(counts[s] == 1 for s in redo),
            query_start_loc_cpu=qsl, seq_lens_cpu=[0] * len(redo))
        runner.model.advance_linear_states(batch, runner.caches, verify.output.gdn_inputs,
                                           rows)

    rollback.step = step


def graphed_engine(spec_model, k: int, async_scheduling: bool, **kw) -> LLMEngine:
    """A speculative engine whose runner holds stand-ins for every graph a chain
    replays."""
    kw.setdefault("max_num_seqs", 3)
    engine = make_engine(spec_model, k, async_scheduling=async_scheduling, **kw)
    calls: list[tuple] = []
    stand_in_graphs(engine, k, calls)
    eager_rollback(engine, k)
    engine.runner.draft_graphs = stand_in_draft_graphs(engine.runner, kw["max_num_seqs"],
                                                       calls)
    assert async_scheduling == (engine.spec.chain is not None)
    assert engine.spec.chain is None or engine.spec.chain.graphs_ready()
    return engine


def staggered(lengths: list[int], **params) -> list[tuple]:
    """The three prompts arriving two steps apart, greedy, ``lengths`` tokens each."""
    return [(2 * i, str(i), p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                              **params))
            for i, (p, n) in enumerate(zip(PROMPTS, lengths))]


def assert_all_free(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0 and engine.kv.num_live_seqs == 0


@pytest.mark.parametrize("k", [1, 3])
def test_async_speculation_gives_transformers_tokens(spec_model, k) -> None:
    """The MTP head's own drafts (mostly rejected by the random target): transformers'
    tokens, with steps launched ahead of the previous one's read, finishing apart."""
    refs = spec_model[2]
    engine = graphed_engine(spec_model, k, True)
    lengths = [NEW, NEW - 7, NEW - 3]
    got = run_keeping_requests(engine, staggered(lengths))
    assert [got[str(i)].output_token_ids for i in range(3)] == \
        [r[:n] for r, n in zip(refs, lengths)]
    assert engine.stats.num_lookahead_steps > 5, engine.stats.num_lookahead_steps
    assert_all_free(engine)


class KeptInTurn:
    """An imposed acceptance: a request's ``n``-th verify keeps ``(n + offset) % (d + 1)``
    of its ``d`` drafts (``offset`` from its id), and each ``(d, m)`` is recorded per
    request in order."""

    def __init__(self) -> None:
        self.decided: dict[str, list[tuple[int, int]]] = defaultdict(list)

    def __call__(self, req: Request, d: int) -> int:
        seq = self.decided[req.request_id]
        m = (len(seq) + int(req.request_id)) % (d + 1)
        seq.append((d, m))
        return m


def target_positions(decided: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """The output indices the target chose, given each verify's ``(d, m)`` in order: the
    prompt's sampled token, each verify's token after its kept drafts, and the plain
    decode steps' tokens at the end (where one token is left, none is drafted)."""
    chosen, i = [0], 1
    for _, m in decided:
        i += m
        chosen.append(i)
        i += 1
    assert 0 <= num_tokens - i <= 1, (i, num_tokens)
    return chosen + list(range(i, num_tokens))


def test_imposed_acceptance_keeps_the_targets_choices_exact(spec_model) -> None:
    """Every kept count in turn (k = 3), so each step launched ahead starts 0 .. 3 rows
    short of where it was placed: every token the target chose is transformers' argmax
    over the output so far, and the synchronous engine gives the same tokens."""
    k, lengths = 3, [60, 45, 52]
    outs = {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, k, async_scheduling, max_model_len=128)
        kept = KeptInTurn()
        engine.spec.kept_drafts = kept
        got = run_keeping_requests(engine, staggered(lengths))
        outs[async_scheduling] = {rid: list(r.output_token_ids) for rid, r in got.items()}
        assert all(n > 4 for n in engine.spec.stats.num_by_accepted), \
            engine.spec.stats.num_by_accepted
        assert_all_free(engine)
    assert engine.stats.num_lookahead_steps > 10, engine.stats.num_lookahead_steps
    assert outs[True] == outs[False]
    hf = Qwen3_5ForCausalLM.from_pretrained(spec_model[0], dtype=torch.float32).eval()
    for i, prompt in enumerate(PROMPTS):
        out = outs[True][str(i)]
        assert len(out) == lengths[i]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + out])).logits[0]  # [L, V]
        for j in target_positions(kept.decided[str(i)], len(out)):
            row = logits[len(prompt) + j - 1]
            assert row[out[j]] >= row.max() - 1e-4, (i, j, out[j], int(row.argmax()))


@pytest.mark.parametrize("k,bias", [(1, ()), (3, ()), (3, ((17, 1.5), (40, -3.0)))])
def test_seeded_sampling_gives_the_synchronous_engines_tokens(spec_model, k, bias) -> None:
    """Two seeded sampled requests beside a greedy one (with ``bias``, a logit bias on
    every request): the chains draw the drafts, accept and resample with the noise of the
    output indices the synchronous engine uses (moved on the device with each step's kept
    count), so the tokens are its own."""
    outs, kept = {}, {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, k, async_scheduling)
        items = [(2 * i, str(i), p, SamplingParams(
            max_tokens=40, ignore_eos=True, logit_bias=bias,
            **({"temperature": 0.0} if i == 1 else
               {"temperature": 0.8, "top_k": 40, "seed": 11 + i})))
            for i, p in enumerate(PROMPTS)]
        got = run_keeping_requests(engine, items)
        outs[async_scheduling] = {rid: list(r.output_token_ids) for rid, r in got.items()}
        kept[async_scheduling] = engine.spec.stats.num_by_accepted
        assert_all_free(engine)
    assert engine.stats.num_lookahead_steps > 10, engine.stats.num_lookahead_steps
    assert sum(kept[True][1:]) > 0, kept  # some sampled draft was accepted
    assert kept[True] == kept[False]
    assert outs[True] == outs[False]


def test_requests_ending_at_max_model_len_stop_launching_ahead_in_time(spec_model) -> None:
    """Requests that run into ``max_model_len`` (not ``max_tokens``): no step goes ahead
    past what the model length leaves, each ends exactly at it (finish reason
    ``length``), and the tokens are the synchronous engine's."""
    outs = {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, 3, async_scheduling, max_model_len=64)
        engine.spec.kept_drafts = KeptInTurn()
        got = run_keeping_requests(engine, staggered([200, 200, 200]))
        outs[async_scheduling] = {rid: list(r.output_token_ids) for rid, r in got.items()}
        for i, prompt in enumerate(PROMPTS):
            req = got[str(i)]
            assert req.finish_reason == "length"
            assert len(prompt) + len(req.output_token_ids) == 64
        assert_all_free(engine)
    assert engine.stats.num_lookahead_steps > 5
    assert outs[True] == outs[False]


def test_logprobs_are_the_synchronous_engines(spec_model) -> None:
    """Requests asking for logprobs (top 3 greedy, top 0 sampled) beside one that does
    not: the chains report each emitted token's log-probability and the top ones of the
    model's own distribution, as the synchronous step does (itself checked against plain
    decoding in test_speculative.py)."""
    got = {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, 3, async_scheduling)
        params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3),
                  SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True,
                                 logprobs=0),
                  SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
        got[async_scheduling] = run_keeping_requests(
            engine, [(0, str(i), p, params[i]) for i, p in enumerate(PROMPTS)])
        assert_all_free(engine)
    assert engine.stats.num_lookahead_steps > 5
    for rid, req in got[True].items():
        sync = got[False][rid]
        assert req.output_token_ids == sync.output_token_ids
        assert len(req.output_logprobs) == (0 if rid == "2" else 30)
        for a, b in zip(req.output_logprobs, sync.output_logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
            assert len(a.top) == (3 if rid == "0" else 0)


PENALTIES = dict(presence=0.4, frequency=0.3, repetition=1.3)


def penalized(scale: float = 1.0, **params) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True,
                          presence_penalty=scale * PENALTIES["presence"],
                          frequency_penalty=scale * PENALTIES["frequency"],
                          repetition_penalty=PENALTIES["repetition"] ** scale, **params)


def test_penalized_greedy_requests_match_the_oracle(spec_model) -> None:
    """Presence, frequency and repetition penalties on the device: each verify row's
    history is the outputs so far (grown on the device by each step's kept tokens) and
    the drafts before it, so the tokens are transformers' float64 logits penalized by
    hand, greedy."""
    engine = graphed_engine(spec_model, 3, True)
    got = run_keeping_requests(engine, [(0, str(i), p, penalized(temperature=0.0))
                                        for i, p in enumerate(PROMPTS)])
    hf = build_hf_model(SHAPE)
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)].output_token_ids == hf_greedy_penalized(hf, prompt, NEW,
                                                                   **PENALTIES)
    assert engine.stats.num_lookahead_steps > 5
    assert_all_free(engine)


def test_penalized_seeded_sampling_gives_the_synchronous_engines_tokens(spec_model) -> None:
    """Penalties with seeded sampling (and one greedy request): the synchronous
    engine's tokens. At a high temperature the random draft head's distribution
    overlaps the target's, so drafts are kept and the rows after them, whose
    histories hold those drafts, decide too; strong penalties make those histories
    count."""
    outs, kept = {}, {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, 3, async_scheduling)
        params = [penalized(4.0, temperature=2.0, seed=21 + i) if i != 1 else
                  penalized(4.0, temperature=0.0) for i in range(3)]
        got = run_keeping_requests(engine, [(0, str(i), p, params[i])
                                            for i, p in enumerate(PROMPTS)])
        outs[async_scheduling] = {rid: list(r.output_token_ids) for rid, r in got.items()}
        kept[async_scheduling] = engine.spec.stats.num_by_accepted
        assert_all_free(engine)
    assert engine.stats.num_lookahead_steps > 5
    assert sum(kept[True][2:]) > 0, kept  # rows behind a kept draft decided
    assert outs[True] == outs[False]


def test_a_stop_found_late_truncates_exactly_and_leaks_nothing(spec_model) -> None:
    """A stop id among a step's tokens is found when the next step is already in flight:
    the output ends where the synchronous engine's does, and the rows, blocks and slot
    of the step launched ahead are given back."""
    refs = spec_model[2]
    stop = refs[0][12]
    outs = {}
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, 3, async_scheduling)
        got = run_keeping_requests(engine, staggered([NEW] * 3, stop_token_ids=[stop]))
        outs[async_scheduling] = {rid: list(r.output_token_ids) for rid, r in got.items()}
        assert_all_free(engine)
    assert outs[True] == outs[False]
    for i, ref in enumerate(refs):
        out = outs[True][str(i)]
        assert out == ref[:len(out)]
        assert len(out) == NEW or out[-1] == stop
    assert len(outs[True]["0"]) <= 13


def test_no_leaks_with_preemptions_and_aborts_while_launched_ahead(spec_model) -> None:
    """Many requests through a small pool with random aborts, steps launched ahead
    throughout: every step passes the integrity checks and everything ends free."""
    engine = graphed_engine(spec_model, 2, True, num_blocks=9, max_num_seqs=3,
                            block_size=16)
    rng = random.Random(3)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", prompt_ids(i, rng.randint(20, 40)), params)
    aborted = 0
    while engine.has_unfinished_requests():
        engine.step()
        running = [r.request_id for r in engine.scheduler.running]
        if running and engine._inflight is not None and rng.random() < 0.1:
            engine.abort_request(rng.choice(running))
            aborted += 1
    assert aborted > 0 and engine.stats.num_lookahead_steps > 0
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)


def test_each_verify_row_counts_the_outputs_and_the_drafts_before_it() -> None:
    """The penalties' histories on the device: verify row ``j`` holds the outputs so far
    and the first ``j`` drafts; after a step the outputs grow by its ``m + 1`` emitted
    tokens, at each sequence's own length."""
    from pagedserve.engine.sampler import SamplingTensors
    from pagedserve.engine.spec_async import Sampling

    vocab, outputs = 50, [[3, 4], [7]]
    reqs = []
    for i, out in enumerate(outputs):
        req = Request(str(i), [1, 2], SamplingParams(temperature=0.0, presence_penalty=0.5))
        req.output_token_ids.extend(out)
        reqs.append(req)
    settings = SamplingTensors.from_requests(reqs, vocab, "cpu")
    sampling = Sampling(settings, settings.step, settings.output_ids, vocab)
    drafts = [[10, 11, 12], [20, 21, 22]]
    rows = sampling.verify_rows(torch.tensor(drafts))
    for b, out in enumerate(outputs):
        for j in range(4):
            history = [t for t in rows.output_ids[b * 4 + j].tolist() if t != vocab]
            assert sorted(history) == sorted(out + drafts[b][:j]), (b, j)
            assert int(rows.step[b * 4 + j]) == len(out) + j
    emitted = torch.tensor([[10, 11, 30, 9], [25, 9, 9, 9]])  # m = 2 and 0
    after = sampling.after(torch.tensor([2, 0]), emitted, width=12)
    assert [[t for t in row if t != vocab] for row in after.outputs.tolist()] == \
        [[3, 4, 10, 11, 30], [7, 25]]
    assert after.index.tolist() == [5, 2] and after.outputs.shape[1] == 12


def test_logit_bias_scores_every_verify_row_of_a_chain(spec_model) -> None:
    """A logit bias is added to every verify row, in chains launched ahead and in
    synchronous steps alike: the tokens are plain decoding's under the same bias."""
    refs = spec_model[2]
    bias = tuple({refs[0][0]: -5.0, refs[0][2]: -5.0, 17: 2.0}.items())
    lengths = [NEW, NEW - 7, NEW - 3]
    plain = run_keeping_requests(make_engine(spec_model, None, max_num_seqs=3),
                                 staggered(lengths, logit_bias=bias))
    want = [plain[str(i)].output_token_ids for i in range(3)]
    assert want[0] != refs[0]
    for async_scheduling in (False, True):
        engine = graphed_engine(spec_model, 3, async_scheduling)
        got = run_keeping_requests(engine, staggered(lengths, logit_bias=bias))
        assert [got[str(i)].output_token_ids for i in range(3)] == want
        assert (engine.stats.num_lookahead_steps > 0) == async_scheduling
        assert engine.spec.stats.num_drafts > 0
        assert_all_free(engine)
