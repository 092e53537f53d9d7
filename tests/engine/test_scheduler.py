"""Scheduler policy on real pools, with the forward pass simulated by committing tokens."""

import pytest
import torch

from pagedserve.engine.request import Request, RequestStatus, SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.kv.state_pool import StatePool, StateShapes

SHAPES = StateShapes(num_layers=1, conv=(4, 3), recurrent=(1, 2, 2), conv_dtype=torch.float32)


def make(num_blocks=16, block_size=4, max_seqs=4, budget=64, chunk=8, max_len=64,
         idle_chunk=0, mixed_chunks=None, bursts=True):
    kv = KVCacheManager(BlockPool(num_blocks, block_size), max_seqs, max_len // block_size)
    states = StatePool(SHAPES, max_seqs, "cpu")
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          prefill_chunk=chunk, max_model_len=max_len,
                          idle_prefill_chunk=idle_chunk, max_mixed_prompt_chunks=mixed_chunks,
                          bursts_take_idle_sizes=bursts)
    return Scheduler(cfg, kv, states)


def req(rid, prompt_len, max_tokens=8):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, next_token=7):
    """Simulate the forward: commit the scheduled tokens, sample for completing chunks."""
    out = s.schedule()
    for c in out.chunks:
        s.kv.commit(c.request.kv_handle, c.num_tokens)
        c.request.num_computed_tokens += c.num_tokens
        if c.request.num_computed_tokens == c.request.num_tokens:
            c.request.output_token_ids.append(next_token)
    s.check_integrity()
    return out


def shape(out):
    return [(c.request.request_id, c.num_tokens, c.start_pos) for c in out.chunks]


def test_chunked_prefill_then_decode_rows_go_first():
    s = make(chunk=8)
    s.add(req("a", 20))
    assert shape(run_step(s)) == [("a", 8, 0)]
    s.add(req("b", 5))
    assert shape(run_step(s)) == [("a", 8, 8), ("b", 5, 0)]
    # a finishes its prompt (4 left); b decodes its first sampled token at position 5.
    assert shape(run_step(s)) == [("b", 1, 5), ("a", 4, 16)]
    assert shape(run_step(s)) == [("a", 1, 20), ("b", 1, 6)]


def test_token_budget_caps_a_step_and_decodes_are_never_starved():
    s = make(budget=6, chunk=8)
    s.add(req("a", 3))
    run_step(s)  # a: prompt done, now decoding
    s.add(req("b", 30))
    out = run_step(s)
    assert shape(out) == [("a", 1, 3), ("b", 5, 0)]
    assert out.num_tokens == 6


def test_admission_waits_for_blocks_instead_of_failing():
    s = make(num_blocks=4, block_size=4, max_seqs=4, chunk=16, max_len=16)
    s.add(req("a", 12, max_tokens=4))
    s.add(req("b", 8, max_tokens=4))
    out = run_step(s)
    assert shape(out) == [("a", 12, 0)]
    assert [r.request_id for r in s.waiting] == ["b"]
    assert s.waiting[0].status is RequestStatus.WAITING and s.waiting[0].kv_handle is None


def test_impossible_requests_are_rejected_with_the_reason():
    s = make(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="the prompt has 64 tokens, but max_model_len is 64"):
        s.add(req("a", 64))
    with pytest.raises(ValueError, match="holds at most 16 tokens"):
        s.add(req("b", 10, max_tokens=20))
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add(Request("c", [], SamplingParams()))


def test_newest_sequence_is_preempted_and_requeued_first():
    s = make(num_blocks=4, block_size=4, max_seqs=3, chunk=16, max_len=16)
    s.add(req("old", 4, max_tokens=8))
    s.add(req("new", 3, max_tokens=8))
    run_step(s)  # old: 1 block, new: 1 block (admitted with 2 free)
    run_step(s)  # old grows into block 2 (pos 4); new decodes at pos 3
    assert s.kv.pool.num_free_blocks == 1
    run_step(s)  # new grows into block 3 (pos 4)
    assert s.kv.pool.num_free_blocks == 0
    # old decodes positions 6, 7, then needs a block at position 8: "new" is preempted.
    assert not run_step(s).preempted and not run_step(s).preempted
    out = run_step(s)
    assert out.chunks[0].start_pos == 8
    assert [r.request_id for r in out.preempted] == ["new"]
    assert s.num_preemptions == 1
    new = s.waiting[0]
    assert new.request_id == "new" and new.status is RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and len(new.output_token_ids) > 0
    assert [c.request.request_id for c in out.chunks] == ["old"]


def test_lone_sequence_never_preempts_itself_into_a_loop():
    s = make(num_blocks=2, block_size=4, max_seqs=2, chunk=8, max_len=8)
    s.add(req("a", 4, max_tokens=4))
    for _ in range(4):
        out = run_step(s)
        assert not out.preempted


def test_abort_frees_blocks_and_slot_at_once():
    s = make()
    a, b = req("a", 10), req("b", 6)
    s.add(a)
    s.add(b)
    run_step(s)
    used = s.kv.pool.num_used_blocks
    s.abort(a)
    assert a.status is RequestStatus.FINISHED_ABORTED and a.kv_handle is None
    assert s.kv.pool.num_used_blocks == used - 2  # a reserved its first 8-token chunk
    assert s.states.num_used_slots == 1
    s.check_integrity()
    s.abort(b)
    assert s.kv.pool.num_used_blocks == 0 and s.states.num_used_slots == 0


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="max-num-batched-tokens \\(2\\) must be >= "):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2)
    with pytest.raises(ValueError, match="prefill-chunk must be an integer > 0, got 0"):
        SchedulerConfig(prefill_chunk=0)


def test_step_sizes_fill_in_only_what_the_caller_left_out():
    cuda = SchedulerConfig.for_device("cuda", max_num_seqs=16, max_model_len=4096)
    assert (cuda.prefill_chunk, cuda.idle_prefill_chunk, cuda.max_num_batched_tokens) \
        == (512, 8192, 8192)
    cpu = SchedulerConfig.for_device("cpu", max_num_seqs=16, max_model_len=4096)
    assert (cpu.prefill_chunk, cpu.idle_prefill_chunk, cpu.max_num_batched_tokens) \
        == (512, 512, 2048)
    # A smaller budget caps both chunks; a larger chunk raises the idle chunk with it.
    small = SchedulerConfig.for_device("cuda", max_num_seqs=4, max_model_len=4096,
                                       max_num_batched_tokens=256)
    assert (small.prefill_chunk, small.idle_prefill_chunk) == (256, 256)
    big = SchedulerConfig.for_device("cpu", max_num_seqs=4, max_model_len=4096,
                                     prefill_chunk=1024)
    assert (big.prefill_chunk, big.idle_prefill_chunk) == (1024, 1024)
    # Many sequences raise the budget so that each can decode in every step.
    assert SchedulerConfig.for_device("cpu", max_num_seqs=4096,
                                      max_model_len=64).max_num_batched_tokens == 4096


def test_prompts_beside_decode_rows_share_one_chunk():
    # While "a" decodes, the step's prompts together take at most prefill_chunk (4)
    # tokens: "b"'s whole 3-token prompt, then 1 of "c"'s; alone, each would take 4.
    # (Two prompts outnumber one decode row: the burst rule is off to see the bound.)
    s = make(chunk=4, idle_chunk=12, budget=32, bursts=False)
    s.add(req("a", 2))
    assert shape(run_step(s)) == [("a", 2, 0)]
    s.add(req("b", 3))
    s.add(req("c", 6))
    assert shape(run_step(s)) == [("a", 1, 2), ("c", 1, 0), ("b", 3, 0)]  # one-token chunks first
    assert shape(run_step(s)) == [("a", 1, 3), ("b", 1, 3), ("c", 4, 1)]
    assert shape(run_step(s)) == [("a", 1, 4), ("b", 1, 4), ("c", 1, 5)]


def test_steps_with_decode_rows_take_at_most_max_mixed_prompt_chunks():
    # Beside "a"'s decode row, two of the three short prompts (2 chunks of more than one
    # token); the third waits though tokens are left. With no decode row, all of them.
    s = make(chunk=16, idle_chunk=16, budget=32, mixed_chunks=2, bursts=False)
    s.add(req("a", 2))
    run_step(s)
    for rid in "bcd":
        s.add(req(rid, 3))
    assert shape(run_step(s)) == [("a", 1, 2), ("b", 3, 0), ("c", 3, 0)]
    assert [r.request_id for r in s.waiting] == ["d"]
    s = make(chunk=16, idle_chunk=16, budget=32, mixed_chunks=2)
    for rid in "bcd":
        s.add(req(rid, 3))
    assert shape(run_step(s)) == [("b", 3, 0), ("c", 3, 0), ("d", 3, 0)]
    with pytest.raises(ValueError, match="max_mixed_prompt_chunks"):
        SchedulerConfig(max_mixed_prompt_chunks=0)


def test_prompts_that_outnumber_decode_rows_take_idle_sizes():
    # One decode row ("a") and two waiting prompts: the step takes them as if no row
    # decoded (idle chunk 12 each, any number of chunks). Two decode rows beside one
    # prompt keep the bound (4 prompt tokens in all).
    s = make(max_seqs=6, chunk=4, idle_chunk=12, budget=64, mixed_chunks=1)
    s.add(req("a", 2))
    run_step(s)
    s.add(req("b", 10))
    s.add(req("c", 14))
    assert shape(run_step(s)) == [("a", 1, 2), ("b", 10, 0), ("c", 12, 0)]
    s.add(req("d", 9))
    # Decode rows a and b; prompts c (2 tokens left) and d do not outnumber them: one
    # chunk of at most 4 tokens, and d waits.
    assert shape(run_step(s)) == [("a", 1, 3), ("b", 1, 10), ("c", 2, 12)]
    assert [r.request_id for r in s.waiting] == ["d"]


def test_a_victim_readmitted_in_the_same_step_runs_once_from_the_start():
    # "new" decodes first; "old"'s last prefill chunk then preempts it (the newest), and
    # the freed blocks let it back in from the queue's front within the same schedule(),
    # with the prompt tokens the step has left.
    s = make(num_blocks=6, block_size=4, max_seqs=2, chunk=4, max_len=32)
    s.add(req("old", 14, max_tokens=6))
    s.add(req("new", 7, max_tokens=6))
    for _ in range(3):
        assert not run_step(s).preempted
    out = run_step(s)
    assert [r.request_id for r in out.preempted] == ["new"]
    assert shape(out) == [("old", 2, 12), ("new", 2, 0)]  # its stale decode row is gone


def test_can_admit_next_matches_what_schedule_then_does():
    s = make(num_blocks=4, block_size=4, max_seqs=3, chunk=8, max_len=16)
    assert not s.can_admit_next()  # nothing waits
    s.add(req("a", 12, max_tokens=4))
    assert s.can_admit_next()
    run_step(s)  # a: 8 of 12 prompt tokens, 2 blocks
    s.add(req("b", 8, max_tokens=4))
    # b's first chunk needs 2 blocks + 1 watermark block; 2 are free.
    assert not s.can_admit_next()
    out = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["a"] and len(s.waiting) == 1
    s.abort(s.running[0])
    assert s.can_admit_next()
    assert [c.request.request_id for c in run_step(s).chunks] == ["b"]
    # A full set of running sequences admits nobody, however much memory is free.
    s = make(num_blocks=16, block_size=4, max_seqs=2, chunk=8, max_len=16)
    for rid in "cde":
        s.add(req(rid, 2, max_tokens=2))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 1 and not s.can_admit_next()


def test_steps_without_decode_rows_take_the_idle_chunk():
    # Alone, a prompt takes idle_prefill_chunk tokens a step; once another sequence
    # decodes, prompts are cut to prefill_chunk so that the decoding user's step stays short.
    s = make(chunk=4, idle_chunk=12, budget=32)
    s.add(req("a", 14))
    assert shape(run_step(s)) == [("a", 12, 0)]
    assert shape(run_step(s)) == [("a", 2, 12)]
    s.add(req("b", 30))
    assert shape(run_step(s)) == [("a", 1, 14), ("b", 4, 0)]
    assert shape(run_step(s)) == [("a", 1, 15), ("b", 4, 4)]
