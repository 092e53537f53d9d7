"""Prefix caching on the embedded hybrid model: every hit gives transformers' greedy tokens
(float32, CPU), in both scheduling modes, and nothing leaks."""

from __future__ import annotations

import logging
import random

import pytest
from prefix_workload import drive_shared_prefixes

from pagedserve.engine.request import SamplingParams

VOCAB = 256  # byte tokens


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine, *items):
    """Add every ``(id, prompt, max_tokens)`` at once; run to the end; id -> request."""
    reqs = {rid: engine.add_request(rid, p, greedy(n)) for rid, p, n in items}
    while engine.has_unfinished_requests():
        engine.step()
    return reqs


BASE = ids(1, 120)
SYNC = pytest.mark.parametrize("make_engine", [False], indirect=True, ids=["sync"])


@SYNC
def test_a_hit_at_every_prefix_length_gives_transformers_tokens(make_engine, hf_greedy):
    engine = make_engine(prefill_chunk=32)
    for shared in (0, 1, 15, 16, 17, 100):  # each round's hits lie off the next one's path
        donor = BASE[:shared] or ids(2, 5)
        run(engine, (f"donor{shared}", donor, 3))  # checkpoints its prompt's end
        probe = BASE[:shared] + ids(3, 20)
        got = run(engine, (f"probe{shared}", probe, 6))[f"probe{shared}"]
        assert got.num_cached_tokens == shared
        assert got.output_token_ids == hf_greedy(probe, 6), f"shared {shared}"
    assert engine.kv.pool.num_used_blocks == 0


def count_forwarded(engine) -> list[int]:
    """Tokens each forward pass of ``engine`` runs, from now on."""
    counts: list[int] = []
    execute = engine.runner.execute

    def counting(batch):
        counts.append(int(batch.input_ids.numel()))
        return execute(batch)

    engine.runner.execute = counting
    return counts


def test_an_identical_prompt_is_all_cached_from_its_second_send(make_engine, hf_greedy):
    engine = make_engine(prefill_chunk=32)
    forwarded = count_forwarded(engine)
    for prompt in (BASE[:50], BASE[:48], BASE[:1]):  # a tail row, block-aligned, one token
        first = run(engine, ("first", prompt, 6))["first"]
        assert first.num_cached_tokens == 0
        forwarded.clear()
        again = [run(engine, (f"again{i}", prompt, 6))[f"again{i}"] for i in range(2)]
        # No prompt token runs again: its first token is sampled from the logits stored
        # with the prompt-end checkpoint, then 5 decode steps of one token each.
        assert sum(forwarded) == 2 * 5
        assert [r.num_cached_tokens for r in again] == [len(prompt)] * 2
        expected = hf_greedy(prompt, 6)
        assert first.output_token_ids == expected, len(prompt)
        assert all(r.output_token_ids == expected for r in again), len(prompt)
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0


def test_a_whole_prompt_hit_samples_as_caching_off(make_engine):
    """Seeded sampling, a repetition penalty and logprobs on the stored row give what a
    cold prefill gives; the first send sampled with other settings."""
    prompt = BASE[:37]
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rich = SamplingParams(max_tokens=8, temperature=1.3, top_k=40, seed=1234,
                          repetition_penalty=1.5, logprobs=3, ignore_eos=True)

    def send(engine, rid, params):
        req = engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
        return req

    on = make_engine(prefill_chunk=16)
    send(on, "first", plain)
    hit = send(on, "hit", rich)
    cold = send(make_engine(prefill_chunk=16, enable_prefix_caching=False), "cold", rich)
    assert hit.num_cached_tokens == 37
    assert hit.output_token_ids == cold.output_token_ids
    assert hit.output_logprobs == cold.output_logprobs
    assert len(hit.output_logprobs) == 8 and len(hit.output_logprobs[0].top) == 3


def checkpoint_lengths(engine) -> set[int]:
    return {c.num_tokens for c in engine.runner.checkpoint_pool._entries.values()}


@SYNC
def test_interval_checkpoints_come_from_taps_inside_whole_chunks(make_engine, hf_greedy):
    """The donor's prompt runs as two chunks (64 + 56 rows); the states at the interval
    positions inside them come from state taps, and a probe that leaves the donor's path
    resumes at the last one below: transformers' tokens, no slot left taken."""
    engine = make_engine(prefill_chunk=64, idle_prefill_chunk=64,
                         prefix_checkpoint_interval=16)
    forwarded = count_forwarded(engine)
    run(engine, ("donor", BASE, 2))
    assert forwarded[:2] == [64, 56]
    assert checkpoint_lengths(engine) >= set(range(16, 120, 16)) | {120}
    for k in (20, 119):
        probe = BASE[:k] + ids(k, 9)
        got = run(engine, (f"p{k}", probe, 6))[f"p{k}"]
        assert got.num_cached_tokens == k // 16 * 16
        assert got.output_token_ids == hf_greedy(probe, 6)
    assert engine.runner.state_pool.num_used_slots == 0


@SYNC
def test_a_chunk_passing_more_intervals_than_tap_slots_is_cut(make_engine, hf_greedy):
    """Interval 8 in 120-row chunks: 14 positions, 8 tap slots (``MAX_TAP_SLOTS``): the
    first chunk ends at the ninth position (72), the second taps the rest."""
    engine = make_engine(prefill_chunk=120, prefix_checkpoint_interval=8)
    assert engine.prefix.num_tap_slots == 8
    forwarded = count_forwarded(engine)
    run(engine, ("donor", BASE, 2))
    assert forwarded[:2] == [72, 48]
    assert checkpoint_lengths(engine) >= set(range(8, 120, 8)) | {120}
    probe = BASE[:100] + ids(7, 9)
    got = run(engine, ("probe", probe, 6))["probe"]
    assert got.num_cached_tokens == 96
    assert got.output_token_ids == hf_greedy(probe, 6)


@SYNC
@pytest.mark.parametrize(("graphed", "steps"), [(0, [80]), (128, [32, 32, 16])],
                         ids=["tapped", "cut-for-graphs"])
def test_the_branch_point_is_tapped_unless_a_prefill_graph_holds_the_chunk(
        make_engine, hf_greedy, graphed, steps):
    """A sibling that leaves the donor's K/V chain at 32 (two full 16-token blocks shared,
    no checkpoint below) runs as one 80-row chunk, its states at the branch point and at
    the interval position 64 tapped there, unless a prefill graph would hold the chunk
    (``graphed`` rows): then it is cut at both. A probe along the sibling's first 40
    tokens resumes at 32."""
    engine = make_engine(prefill_chunk=128, idle_prefill_chunk=128,
                         prefix_checkpoint_interval=64)
    assert engine.kv.block_size == 16
    engine.prefix.graphed_chunk_tokens = graphed  # the CPU captures no graphs
    run(engine, ("donor", BASE[:50], 2))
    forwarded = count_forwarded(engine)
    sibling = BASE[:40] + ids(5, 40)
    run(engine, ("sibling", sibling, 2))
    assert forwarded[:len(steps)] == steps
    assert 32 in checkpoint_lengths(engine)
    probe = sibling[:40] + ids(6, 20)
    got = run(engine, ("probe", probe, 6))["probe"]
    assert got.num_cached_tokens == 32
    assert got.output_token_ids == hf_greedy(probe, 6)
    assert engine.runner.state_pool.num_used_slots == 0


@SYNC
def test_multi_turn_chat_reuses_history_through_the_real_template(make_engine, hf_greedy):
    engine = make_engine(prefix_checkpoint_interval=32)
    tok = engine.tokenizer
    messages = [{"role": "system", "content": "You answer briefly. " * 3}]
    hits = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: what is {turn}+1?"})
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        req = run(engine, (f"t{turn}", prompt, 8))[f"t{turn}"]
        assert req.output_token_ids == hf_greedy(prompt, 8), f"turn {turn}"
        hits.append(req.num_cached_tokens)
        messages.append({"role": "assistant", "content": req.output_text})
    # The template rewrites earlier turns: reuse stops at the first differing token.
    assert hits[0] == 0 and hits[1] > 0 and hits[2] > hits[1]


def test_several_requests_share_one_prefix_in_one_step(make_engine, hf_greedy):
    engine = make_engine(max_num_seqs=4)
    run(engine, ("donor", BASE[:40], 3))
    probes = [(f"p{i}", BASE[:40] + ids(10 + i, 5 + 3 * i), 7) for i in range(3)]
    reqs = {rid: engine.add_request(rid, p, greedy(n)) for rid, p, n in probes}
    outs = engine.step()  # all three resume from the same blocks and finish their prompts
    assert {o.request_id for o in outs} == set(reqs)
    while engine.has_unfinished_requests():
        engine.step()
    for rid, prompt, n in probes:
        assert reqs[rid].num_cached_tokens == 40
        assert reqs[rid].output_token_ids == hf_greedy(prompt, n), rid


def test_a_hit_followed_by_preemption_stays_exact(make_engine, hf_greedy):
    # 10 blocks of 16 tokens: four sequences that grow to ~90 tokens cannot all fit.
    engine = make_engine(max_num_seqs=4, num_blocks=10, max_model_len=128, prefill_chunk=16)
    run(engine, ("donor", BASE[:33], 2))
    probes = [(f"p{i}", BASE[:33] + ids(20 + i, 10 + i), 28) for i in range(4)]
    got = run(engine, *probes)
    assert engine.scheduler.num_preemptions > 0
    assert engine.prefix.stats.num_hits > 4 * 33  # preempted ones resumed from the cache too
    for rid, prompt, n in probes:
        assert got[rid].output_token_ids == hf_greedy(prompt, n), rid
    assert engine.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("make_engine", [True], indirect=True, ids=["lookahead"])
def test_no_leak_with_shared_prefixes_cancellations_and_preemption(make_engine):
    rng = random.Random(11)
    per_checkpoint = make_engine().runner.checkpoint_pool.bytes_per_checkpoint
    engine = make_engine(max_num_seqs=6, num_blocks=14, max_model_len=96, prefill_chunk=32,
                         max_num_batched_tokens=48, prefix_checkpoint_interval=16,
                         prefix_checkpoint_memory=str(6 * per_checkpoint))
    taps: list[tuple[int, int]] = []  # (position, the request's branch point) of each tap
    save_taps = engine.prefix.save_taps

    def counting(req, req_taps, hidden=None):
        taps.extend((p, req.checkpoint_branch) for p, _ in req_taps)
        return save_taps(req, req_taps, hidden)

    engine.prefix.save_taps = counting
    reqs = drive_shared_prefixes(engine, rng, ids)
    assert engine.scheduler.num_preemptions > 0 and engine.prefix.stats.num_hits > 0
    assert taps and any(p == branch for p, branch in taps)  # interval and branch taps
    assert sum(r.num_cached_tokens == r.num_prompt_tokens for r in reqs) >= 3  # resent
    assert all(r.cached_logits is None for r in reqs)
    assert engine.kv.pool.num_used_blocks == 0 and engine.kv.num_live_seqs == 0
    assert engine.runner.state_pool.num_used_slots == 0 and not engine.requests
    assert engine.kv_cache_usage() == 0.0 and engine.kv.pool.num_cached_blocks > 0
    assert engine.runner.checkpoint_pool.num_used <= 6


@SYNC
def test_caching_off_and_contiguous_layout_say_so(make_engine, caplog):
    assert make_engine(enable_prefix_caching=False).prefix is None
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.llm_engine"):
        engine = make_engine(kv_layout="contiguous")
    assert engine.prefix is None and engine.runner.checkpoint_pool.num_checkpoints == 0
    assert "prefix caching is off" in caplog.text
    assert make_engine(prefix_checkpoint_memory="0").prefix is None
    with pytest.raises(ValueError, match="interval"):
        make_engine(prefix_checkpoint_interval=0)


@SYNC
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_every_kv_type_gives_the_tokens_of_caching_off(make_engine, kv_type):
    """A hit at 40 then a chunk [40, 60) is the same computation as a cold prefill cut into
    chunks [0, 40) and [40, 60): the tokens agree exactly, whatever the K/V type."""
    kw = dict(cache_type_k=kv_type, cache_type_v=kv_type, prefill_chunk=40)
    probe = BASE[:40] + ids(5, 20)
    on = make_engine(**kw)
    run(on, ("donor", BASE[:40], 2))
    hit = run(on, ("probe", probe, 8))["probe"]
    assert hit.num_cached_tokens == 40
    cold = run(make_engine(enable_prefix_caching=False, **kw), ("probe", probe, 8))["probe"]
    assert hit.output_token_ids == cold.output_token_ids
