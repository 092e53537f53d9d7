"""Continuous batching end to end on the embedded model, against transformers' greedy
decoding and against the engine's own invariants."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.request import SamplingParams

VOCAB = 256  # byte tokens: any of them is a valid prompt token


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_keeping_requests(engine, items):
    """``items``: (arrival_step, request_id, prompt, params). Returns id -> the finished
    ``Request``."""
    pending = sorted(items, key=lambda t: t[0])
    done, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.request
        step += 1
    return done


def run_with_arrivals(engine, items):
    """``items``: (arrival_step, request_id, prompt, params). Returns id -> token ids."""
    return {rid: list(req.output_token_ids)
            for rid, req in run_keeping_requests(engine, items).items()}


LENGTHS = [3, 17, 40, 9, 64]
MAX_TOKENS = [48, 20, 48, 33, 25]
ARRIVALS = [0, 0, 3, 5, 11]


@pytest.mark.parametrize("chunk,budget", [(512, 2048), (7, 24)])
def test_greedy_output_is_independent_of_batch_composition(make_engine, hf_greedy, chunk,
                                                           budget):
    ps = prompts(0, LENGTHS)
    engine = make_engine(max_num_seqs=4, prefill_chunk=chunk, max_num_batched_tokens=budget)
    got = run_with_arrivals(engine, [(a, f"r{i}", p, greedy(n)) for i, (a, p, n) in
                                     enumerate(zip(ARRIVALS, ps, MAX_TOKENS))])
    for i, (p, n) in enumerate(zip(ps, MAX_TOKENS)):
        assert got[f"r{i}"] == hf_greedy(p, n), f"request r{i}"
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0
    assert (engine.stats.num_lookahead_steps > 0) == engine.async_scheduling


class EagerGraphStandIn:
    """Stands in for the decode and prefill CUDA graphs on the CPU: runs each batch it is
    handed through the eager model, so that a step split for the graphs
    (``ModelRunner._split_for_graphs``) runs part by part as on CUDA."""

    def __init__(self, runner, max_rows: int) -> None:
        self.runner, self.max_tokens = runner, max_rows

    def holds(self, batch) -> bool:
        return batch.is_decode_only

    def fits(self, batch) -> bool:
        return (batch.num_seqs == 1 and batch.num_decode_seqs == 0 and batch.row_valid is None
                and batch.num_tokens <= self.max_tokens and batch.gdn_rounds is None)

    def run(self, batch):
        return self.runner._forward_logits(batch)


def test_steps_split_for_the_graphs_give_transformers_tokens(make_engine, hf_greedy):
    """Decode rows beside two short chunks, and two short chunks alone, run part by part
    (the decode graph, then the prefill graph once per chunk) and keep every token."""
    lengths, arrivals = [9, 31, 40, 100, 23, 17, 60], [0, 0, 2, 5, 8, 8, 12]
    ps = prompts(3, lengths)
    engine = make_engine(max_num_seqs=8, prefill_chunk=64, max_num_batched_tokens=128,
                         enable_prefix_caching=False)
    runner = engine.runner
    runner.graphs = runner.prefill_graphs = EagerGraphStandIn(runner, 64)
    split, splits = runner._split_for_graphs, []

    def recording(batch):
        out = split(batch)
        if out is not None:
            splits.append((batch.num_decode_seqs, batch.num_seqs - batch.num_decode_seqs))
        return out

    runner._split_for_graphs = recording
    got = run_with_arrivals(engine, [(a, f"r{i}", p, greedy(12)) for i, (a, p) in
                                     enumerate(zip(arrivals, ps))])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(p, 12), f"request r{i}"
    assert (0, 2) in splits and any(d > 0 and n == 2 for d, n in splits), splits
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.runner.state_pool.num_used_slots == 0


def test_logit_bias_gives_transformers_tokens_over_the_biased_logits(make_engine, hf_greedy):
    """A biased request beside unbiased ones: its tokens are transformers' argmax of the
    logits plus its bias, theirs stay plain."""
    ps = prompts(4, [11, 23, 7])
    plain = hf_greedy(ps[0], 10)
    bias = tuple({plain[0]: -4.0, plain[1]: -4.0, 65: 2.5}.items())
    want = hf_greedy(ps[0], 10, bias)
    assert want != plain  # the bias changes the path
    engine = make_engine(max_num_seqs=3)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias=bias),
              greedy(10), greedy(10)]
    got = run_with_arrivals(engine, [(0, f"r{i}", p, q) for i, (p, q) in
                                     enumerate(zip(ps, params))])
    assert got["r0"] == want
    assert got["r1"] == hf_greedy(ps[1], 10) and got["r2"] == hf_greedy(ps[2], 10)
    with pytest.raises(ValueError, match=r"logit_bias token id 999999 is outside the "
                                         r"vocabulary \[0, "):
        engine.add_request("bad", ps[0], SamplingParams(logit_bias=((999999, 1.0),)))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_prompt_logprobs_are_transformers(make_engine, hf_logprobs, hf_greedy,
                                          prefix_caching):
    """Every prompt token's log-probability, its rank and the top alternatives, across
    chunks of 7 rows and beside other requests; a second request of the same prompt does
    not resume from the prefix cache, and its entries are the same."""
    ps = prompts(5, [30, 12])
    engine = make_engine(max_num_seqs=3, prefill_chunk=7, max_num_batched_tokens=16,
                         enable_prefix_caching=prefix_caching)
    asks = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    done = run_keeping_requests(engine, [(0, "a", ps[0], asks), (0, "b", ps[1], greedy(4)),
                                         (3, "c", ps[0], asks)])
    want = hf_logprobs(ps[0])  # [P - 1, V]
    for rid in ("a", "c"):
        got = done[rid].prompt_logprobs
        assert len(got) == len(ps[0]) and got[0] is None
        for pos, lp in enumerate(got[1:]):
            row, token = want[pos], ps[0][pos + 1]
            # f16 K/V storage moves logits by up to ~1e-3 (test_parity.py).
            assert lp.token_id == token and abs(lp.logprob - row[token].item()) < 1e-3
            assert lp.rank == 1 + int((row > row[token]).sum())
            assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert done[rid].output_token_ids == hf_greedy(ps[0], 4)
    assert done["c"].num_cached_tokens == 0 and done["b"].prompt_logprobs == []
    assert engine.kv.pool.num_used_blocks == 0


def test_preemption_recomputes_exactly(make_engine, hf_greedy):
    ps = prompts(0, LENGTHS)
    # 10 blocks of 16 = 160 tokens for five sequences that want up to 104 each.
    engine = make_engine(max_num_seqs=5, num_blocks=10, max_model_len=128, prefill_chunk=16)
    got = run_with_arrivals(engine, [(0, f"r{i}", p, greedy(n)) for i, (p, n) in
                                     enumerate(zip(ps, MAX_TOKENS))])
    assert engine.scheduler.num_preemptions > 0
    for i, (p, n) in enumerate(zip(ps, MAX_TOKENS)):
        assert got[f"r{i}"] == hf_greedy(p, n), f"request r{i}"


def test_seeded_sampling_is_reproducible_across_batch_mixes(make_engine):
    p = prompts(1, [12])[0]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=123,
                            ignore_eos=True)
    alone = run_with_arrivals(make_engine(), [(0, "s", p, params)])["s"]
    others = prompts(2, [30, 5, 19])
    mixed = run_with_arrivals(make_engine(max_num_seqs=4, prefill_chunk=8), [
        (0, "a", others[0], SamplingParams(max_tokens=30, temperature=1.2, ignore_eos=True)),
        (1, "b", others[1], greedy(10)),
        (2, "s", p, params),
        (4, "c", others[2], SamplingParams(max_tokens=9, temperature=0.5, top_k=5, seed=9)),
    ])["s"]
    assert alone == mixed
    other_seed = run_with_arrivals(make_engine(), [
        (0, "s", p, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=124,
                                   ignore_eos=True))])["s"]
    assert other_seed != alone


def test_stop_strings_across_tokens_are_honoured_and_trimmed(make_engine):
    engine = make_engine()
    text = "The cat sat on the mat. The dog"
    # Prime the random model with text it then tends to continue byte by byte; find a
    # 3-character window of its greedy output to stop on (bytes are single tokens here,
    # so any 3 characters span 3 tokens).
    ref = engine.add_request("ref", text, greedy(40))
    while engine.has_unfinished_requests():
        engine.step()
    out_text = ref.output_text
    window = next(i for i in range(5, len(out_text) - 3)
                  if "\ufffd" not in out_text[i:i + 3])
    stop = out_text[window:window + 3]
    expected = out_text[:out_text.find(stop)]
    req = engine.add_request("stop", text, SamplingParams(max_tokens=40, temperature=0.0,
                                                          ignore_eos=True, stop=(stop,)))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.new_text for o in engine.step() if o.request_id == "stop"]
    assert req.finish_reason == "stop" and req.stop_reason == stop
    assert req.output_text == expected
    assert "".join(pieces) == expected


def test_admission_queues_instead_of_failing_and_rejects_the_impossible(make_engine):
    engine = make_engine(max_num_seqs=4, num_blocks=5, max_model_len=96, prefill_chunk=64)
    ps = prompts(3, [40, 40, 40, 40])
    for i, p in enumerate(ps):
        engine.add_request(f"q{i}", p, greedy(20))
    engine.step()
    assert engine.num_waiting > 0 and engine.num_running > 0
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="max_model_len is 96"):
        engine.add_request("long", prompts(4, [100])[0], greedy(1))
    with pytest.raises(ValueError, match="holds at most 80 tokens"):
        engine.add_request("big", ps[0], greedy(90))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [1, 999999], greedy(1))


def test_generation_reaching_max_model_len_finishes_with_length(make_engine):
    engine = make_engine(max_model_len=40)
    req = engine.add_request("r", prompts(5, [30])[0], greedy(1000))
    while engine.has_unfinished_requests():
        engine.step()
    assert req.finish_reason == "length"
    assert req.num_tokens == 40 and len(req.output_token_ids) == 10


def test_nothing_leaks_under_random_cancellation_and_preemption(make_engine):
    # Seed 0's 120 requests reach, in both modes, every branch that 300 requests of seed 7
    # reach, the rare ones included: steps with nothing to schedule, admissions that find no
    # block to reserve, prefix hits whose tail copy finds no free block, EOS; ~25 preemptions.
    rng = random.Random(0)
    engine = make_engine(max_num_seqs=6, num_blocks=12, max_model_len=96, prefill_chunk=16,
                         max_num_batched_tokens=48)
    live: list[str] = []
    submitted = 0
    steps = 0
    while submitted < 120 or engine.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if submitted < 120:
                rid = f"r{submitted}"
                n = rng.randrange(1, 40)
                params = SamplingParams(max_tokens=rng.randrange(1, 24),
                                        temperature=rng.choice([0.0, 0.8]),
                                        seed=rng.randrange(1000))
                engine.add_request(rid, [rng.randrange(VOCAB) for _ in range(n)], params)
                live.append(rid)
                submitted += 1
        if live and rng.random() < 0.15:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():  # check_integrity runs inside every step
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        steps += 1
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.state_pool.num_used_slots == 0
    assert engine.kv.num_live_seqs == 0 and not engine.requests
    engine.scheduler.check_integrity()


def test_abort_of_a_request_in_the_step_in_flight_frees_it_and_spares_its_neighbour(
        make_engine, hf_greedy):
    engine = make_engine(max_num_seqs=2)
    a, b = prompts(9, [12, 20])
    engine.add_request("a", a, greedy(30))
    engine.add_request("b", b, greedy(30))
    got = {"a": [], "b": []}
    for _ in range(6):  # prefill, then decode steps (in lookahead mode, one in flight)
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert (engine._inflight is not None) == engine.async_scheduling
    assert engine.abort_request("a")
    assert engine.runner.state_pool.num_used_slots == 1  # freed at once
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got["a"] == hf_greedy(a, 6)  # nothing after the abort
    assert got["b"] == hf_greedy(b, 30)
    assert engine.kv.pool.num_used_blocks == 0 and engine.runner.state_pool.num_used_slots == 0
