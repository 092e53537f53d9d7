"""Speculative decoding with prefix caching (float32, CPU): greedy tokens equal
transformers' and those of speculation without caching after every kind of hit (repeated
prompts, shared prefixes of any length, multi-turn, a hit then preemption), the MTP head's
drafts after a hit equal a cold run's, every rollback branch runs while caching is on, and
nothing leaks."""

from __future__ import annotations

import functools
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from draft_stand_in import stand_in_draft_graphs  # noqa: E402
from hybrid_checkpoints import build_hf_model, prompt_ids  # noqa: E402
from mtp_checkpoints import build_mtp, save_with_mtp  # noqa: E402
from prefix_workload import drive_shared_prefixes  # noqa: E402
from test_speculative import SHAPE, ForcedDrafter, hf_greedy  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import Request, SamplingParams  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

BASE = prompt_ids(5, 120)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint dir, loaded with MTP, ``greedy(prompt, n)``: transformers' tokens,
    transformers' model)."""
    hf = build_hf_model(SHAPE)
    path = save_with_mtp(hf, build_mtp(hf), tmp_path_factory.mktemp("spec_prefix"))
    loaded = load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)

    @functools.cache
    def greedy(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
        return tuple(hf_greedy(hf, list(prompt), n))

    return path, loaded, lambda prompt, n: list(greedy(tuple(prompt), n)), hf


def make_engine(model, k: int = 3, drafter=None, caching: bool = True, **kw) -> LLMEngine:
    path, loaded = model[:2]
    kw.setdefault("check_integrity", True)
    kw.setdefault("max_model_len", 160)
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", progress=False, enable_prefix_caching=caching,
        speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kw),
        loaded=loaded, drafter=drafter)


def greedy_params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(engine: LLMEngine, *items: tuple[str, list[int], int | SamplingParams]
        ) -> dict[str, Request]:
    """Add every ``(id, prompt, max_tokens or params)`` at once; run to the end."""
    reqs = {rid: engine.add_request(rid, p, greedy_params(n) if isinstance(n, int) else n)
            for rid, p, n in items}
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


def record_drafts(engine: LLMEngine) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    """Every draft the engine's drafter proposes from now on, by request id: its ids and
    the MTP head's logits behind the first of them (the request's tail, which every
    request has, greedy ones included)."""
    drafts: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
    propose = engine.spec.drafter.propose

    def recording(wants):
        tails = [w.request.draft_tail.logits.clone() for w in wants]  # [N'] each
        out = propose(wants)
        for w, d, tail in zip(wants, out.drafts(), tails):
            drafts.setdefault(w.request.request_id, []).append((d.token_ids, tail))
        return out

    engine.spec.drafter.propose = recording
    return drafts


def assert_empty(engine: LLMEngine) -> None:
    assert engine.kv.pool.num_used_blocks == 0 and engine.kv.num_live_seqs == 0
    assert engine.runner.state_pool.num_used_slots == 0 and not engine.requests


@pytest.mark.parametrize("k", [1, 3])
def test_repeated_prompts_give_transformers_tokens(model, k) -> None:
    greedy = model[2]
    prompts = [prompt_ids(0, 37), prompt_ids(1, 5), prompt_ids(2, 32)]
    engine = make_engine(model, k, max_num_seqs=3)
    cold = run(make_engine(model, k, caching=False, max_num_seqs=3),
               *[(str(i), p, 20) for i, p in enumerate(prompts)])
    for send in range(3):
        got = run(engine, *[(f"{send}-{i}", p, 20) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            req = got[f"{send}-{i}"]
            assert req.num_cached_tokens == (len(p) if send else 0), (send, i)
            assert req.output_token_ids == greedy(p, 20) == cold[str(i)].output_token_ids
    assert engine.spec.stats.num_drafts > 0
    assert_empty(engine)


def test_hits_with_draft_graphs_give_transformers_tokens(model) -> None:
    """The drafter's graph passes (stand-ins over the padded static batches) after hits:
    the first observe after a hit (from row ``p - 1``) runs eagerly or through the graph
    as its rows fit, and the tokens stay transformers'."""
    greedy = model[2]
    prompts = [prompt_ids(0, 37), BASE[:33], BASE[:50]]
    engine = make_engine(model, 3, max_num_seqs=3)
    calls: list[tuple] = []
    engine.runner.draft_graphs = stand_in_draft_graphs(engine.runner, 3, calls)
    for send in range(2):
        got = run(engine, *[(f"{send}-{i}", p, 16) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            req = got[f"{send}-{i}"]
            assert (req.num_cached_tokens > 0) == (send > 0), (send, i)
            assert req.output_token_ids == greedy(p, 16)
    assert {c[0] for c in calls} == {"propose", "observe"}
    assert_empty(engine)


def test_a_hit_at_every_prefix_length_gives_transformers_tokens(model) -> None:
    greedy = model[2]
    engine = make_engine(model, prefill_chunk=32)
    for shared in (0, 1, 15, 16, 17, 100):  # each round's hits lie off the next one's path
        donor = BASE[:shared] or prompt_ids(7, 5)
        run(engine, (f"donor{shared}", donor, 3))  # checkpoints its prompt's end
        probe = BASE[:shared] + prompt_ids(8, 20)
        got = run(engine, (f"probe{shared}", probe, 12))[f"probe{shared}"]
        assert got.num_cached_tokens == shared
        assert got.output_token_ids == greedy(probe, 12), f"shared {shared}"
    assert_empty(engine)


def assert_drafts_as_cold(model, on: LLMEngine, rid: str, probe: list[int], cached: int,
                          chunk: int) -> None:
    """``probe``, run on ``on`` after its donors, resumes after ``cached`` tokens, and its
    tokens and the MTP head's drafts (ids and logits) are those of a run without caching
    (in ``chunk``-token chunks); its tokens are transformers'."""
    hit_drafts = record_drafts(on)
    hit = run(on, (rid, probe, 16))[rid]
    assert hit.num_cached_tokens == cached
    off = make_engine(model, caching=False, prefill_chunk=chunk)
    cold_drafts = record_drafts(off)
    cold = run(off, (rid, probe, 16))[rid]
    assert hit.output_token_ids == cold.output_token_ids == model[2](probe, 16)
    a, b = hit_drafts[rid], cold_drafts[rid]
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    for (_, la), (_, lb) in zip(a, b):
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-4)


@pytest.mark.parametrize("shared", [1, 40, 48, 50])
def test_drafts_after_a_hit_equal_a_cold_runs(model, shared) -> None:
    """The MTP head's drafts (tokens and logits) after a hit at ``shared`` are those of a
    request that computed everything itself: its K/V rows in shared blocks hold this
    request's tokens, and its row at the hit is rewritten from the checkpoint's hidden
    state. ``shared == 50``: the whole prompt is cached."""
    probe = BASE[:shared] + (prompt_ids(9, 10) if shared < 50 else [])
    on = make_engine(model, prefill_chunk=32)
    run(on, ("donor", BASE[:shared], 4))
    assert_drafts_as_cold(model, on, "probe", probe, shared, 32)


def test_drafts_after_a_hit_at_a_state_tap_equal_a_cold_runs(model) -> None:
    """The donor's 60 tokens run as one chunk, its checkpoints at 16, 32 and 48 taken by
    state taps with the final hidden states of the rows before them (transformers'); a
    probe that leaves its path at 50 resumes at 48 and drafts as a cold run does."""
    on = make_engine(model, prefill_chunk=64, prefix_checkpoint_interval=16)
    run(on, ("donor", BASE[:60], 4))
    with torch.no_grad():
        expected = model[3].model(input_ids=torch.tensor([BASE[:60]])).last_hidden_state[0]
    pool = on.runner.checkpoint_pool
    taps = {c.num_tokens: c for c in pool._entries.values() if c.num_tokens in (16, 32, 48)}
    assert len(taps) == 3
    for p, entry in taps.items():
        # float32 on both sides; the chunked rule and transformers' differ by ~6e-4 here.
        torch.testing.assert_close(pool.hidden_row(entry), expected[p - 1], atol=2e-3,
                                   rtol=0)
    assert_drafts_as_cold(model, on, "probe", BASE[:50] + prompt_ids(18, 10), 48, 64)
    assert_empty(on)


@pytest.mark.parametrize("chunk", [16, 64], ids=["chunks end at checkpoints", "state taps"])
def test_drafts_stay_exact_where_requests_branch_at_a_block_boundary(model, chunk) -> None:
    """The MTP head's K/V row at a block's end holds the next block's first token: two
    requests that share a block but not the token after it share no drafter rows there,
    so that a third, which shares both with one of them, drafts as a cold run does. In
    64-token chunks the checkpoints at 16 and 32 come from state taps, with their rows'
    hidden states."""
    on = make_engine(model, prefill_chunk=chunk, prefix_checkpoint_interval=16)
    branch_b = BASE[:32] + prompt_ids(15, 8)
    run(on, ("a", BASE[:40], 4))  # blocks 0 and 1, checkpoints at 16 and 32
    run(on, ("b", branch_b, 4))  # resumes at 32 with another token 32
    run(on, ("d", BASE[:32] + prompt_ids(16, 8), 4))  # and a third one
    probe = branch_b + prompt_ids(17, 5)  # follows b past the branch
    assert_drafts_as_cold(model, on, "c", probe, 32 + 8, 16)


def test_multi_turn_resumes_from_the_finished_turn(model) -> None:
    """Turn t + 1 sends turn t's prompt and output and more: it resumes where turn t
    finished (its last output token was never fed back)."""
    greedy = model[2]
    engine = make_engine(model)
    prompt = prompt_ids(3, 21)
    resume = 0  # the first turn finds nothing
    for turn in range(3):
        req = run(engine, (f"t{turn}", prompt, 9))[f"t{turn}"]
        assert req.output_token_ids == greedy(prompt, 9), turn
        assert req.num_cached_tokens == resume, turn
        resume = len(prompt) + len(req.output_token_ids) - 1
        prompt = prompt + req.output_token_ids + prompt_ids(10 + turn, 6)
    assert_empty(engine)


def test_a_stop_on_a_kept_draft_is_not_checkpointed_past_it(model) -> None:
    """A stop id on a kept draft ends the request with later drafts' rows in its state:
    no checkpoint at its end, so the next turn resumes at the prompt's end instead, and
    every token is still transformers'."""
    greedy = model[2]
    first = prompt_ids(4, 32)
    ref = greedy(first, 20)
    stop = ref[3]  # k = 4 perfect drafts: output 0 from the prompt, 1..4 drafts, 5 bonus
    cut = ref[:ref.index(stop) + 1]
    second = first + cut + prompt_ids(11, 4)
    drafter = ForcedDrafter({"t0": ref, "t1": greedy(second, 10)}, lambda i: False,
                            model[1].config.vocab_size)
    engine = make_engine(model, 4, drafter)
    t0 = run(engine, ("t0", first, greedy_params(20, stop_token_ids=(stop,))))["t0"]
    assert t0.output_token_ids == cut
    t1 = run(engine, ("t1", second, 10))["t1"]
    assert t1.output_token_ids == greedy(second, 10)
    assert t1.num_cached_tokens == len(first)
    assert_empty(engine)


def test_a_hit_followed_by_preemption_stays_exact(model) -> None:
    greedy = model[2]
    # 10 blocks of 16 tokens: four sequences that grow to ~70 tokens cannot all fit.
    engine = make_engine(model, max_num_seqs=4, num_blocks=10, max_model_len=128,
                         prefill_chunk=16)
    run(engine, ("donor", BASE[:33], 2))
    probes = [(f"p{i}", BASE[:33] + prompt_ids(20 + i, 10 + i), 28) for i in range(4)]
    got = run(engine, *probes)
    assert engine.scheduler.num_preemptions > 0
    assert engine.prefix.stats.num_hits > 4 * 33  # preempted ones resumed from the cache too
    for rid, prompt, n in probes:
        assert got[rid].output_token_ids == greedy(prompt, n), rid
    assert_empty(engine)


def test_forced_drafts_hit_every_rollback_branch_with_caching(model) -> None:
    greedy = model[2]
    items = [("a", BASE[:40], 24), ("b", BASE[:40] + prompt_ids(12, 9), 24),
             ("c", BASE[:40], 24), ("d", BASE[:17] + prompt_ids(13, 30), 24)]
    refs = {rid: greedy(p, n) for rid, p, n in items}
    # Corrupt indices 1 mod 5 and 2 mod 7: runs of every length 0..3 get kept.
    drafter = ForcedDrafter(refs, lambda i: i % 5 == 1 or i % 7 == 2,
                            model[1].config.vocab_size)
    engine = make_engine(model, 3, drafter, max_num_seqs=2, prefill_chunk=16,
                         prefix_checkpoint_interval=16)
    got = {}
    for item in items:  # one after another: each later one hits the earlier ones
        got.update(run(engine, item))
    for rid, _, _ in items:
        assert got[rid].output_token_ids == refs[rid], rid
    assert [got[r].num_cached_tokens for r in "bcd"] == [40, 40, 16]
    assert all(n > 0 for n in engine.spec.stats.num_by_accepted), \
        engine.spec.stats.num_by_accepted
    assert_empty(engine)


def test_seeded_sampling_after_a_hit_repeats_a_cold_run(model) -> None:
    """Rejection sampling draws the same tokens after a hit as cold: the target's rows and
    the drafts' distributions are the same."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=99,
                            ignore_eos=True)
    on = make_engine(model)
    run(on, ("donor", BASE[:45], 2))
    items = [("whole", BASE[:45], params), ("part", BASE[:45] + prompt_ids(14, 6), params)]
    hit: dict[str, Request] = {}
    for item in items:
        hit.update(run(on, item))
    cold = run(make_engine(model, caching=False), *items)
    assert [hit[r].num_cached_tokens for r in ("whole", "part")] == [45, 45]
    for rid, _, _ in items:
        assert hit[rid].output_token_ids == cold[rid].output_token_ids, rid


def test_no_leak_with_shared_prefixes_cancellations_and_preemption(model) -> None:
    rng = random.Random(11)
    per_checkpoint = make_engine(model).runner.checkpoint_pool.bytes_per_checkpoint
    engine = make_engine(model, 3, max_num_seqs=6, num_blocks=12, max_model_len=96,
                         prefill_chunk=32, max_num_batched_tokens=48,
                         prefix_checkpoint_interval=16,
                         prefix_checkpoint_memory=str(6 * per_checkpoint))
    reqs = drive_shared_prefixes(engine, rng, prompt_ids)
    assert engine.scheduler.num_preemptions > 0 and engine.prefix.stats.num_hits > 0
    assert engine.spec.stats.num_drafts > 0
    assert sum(r.num_cached_tokens == r.num_prompt_tokens for r in reqs) >= 3  # resent
    assert all(r.cached_logits is None for r in reqs)
    assert_empty(engine)
    assert engine.kv_cache_usage() == 0.0 and engine.kv.pool.num_cached_blocks > 0
    assert engine.runner.checkpoint_pool.num_used <= 6
