"""Prefix caching: the hash chain, the pool's cached state, checkpoint eviction and
matching, with exact block ids; then random workloads that must leak nothing and change
no output."""

import random

import pytest
import torch
from prefix_driver import SHAPES, FakeEngine

from pagedserve.engine.request import Request, SamplingParams
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.checkpoint_pool import CheckpointPool
from pagedserve.kv.kv_manager import BlockCopy, KVCacheManager
from pagedserve.kv.prefix_hash import HashChain, block_hash, position_key, salt_of
from pagedserve.kv.state_pool import StatePool


# ---- hash chain ---------------------------------------------------------------------------
def _chain(tokens, salt=7, bs=4):
    c = HashChain(salt, bs)
    c.extend(len(tokens), lambda a, b: tokens[a:b])
    return c


def test_chain_names_full_blocks_from_their_parent():
    tokens = list(range(10))
    c = _chain(tokens)
    assert c.num_blocks == 2  # the 2 tokens past the last full block are not a block
    h1 = block_hash(7, [0, 1, 2, 3])
    assert c.block_name(0) == h1
    assert c.block_name(1) == block_hash(h1, [4, 5, 6, 7])
    assert c.key_at(10, lambda a, b: tokens[a:b]) == position_key(c.block_name(1), [8, 9])
    assert c.key_at(8, lambda a, b: tokens[a:b]) == position_key(c.block_name(1), [])


def test_chain_depends_on_every_earlier_token_and_the_salt():
    a, b = _chain(list(range(12))), _chain([99] + list(range(1, 12)))
    assert all(a.block_name(i) != b.block_name(i) for i in range(3))  # a change propagates
    same = _chain(list(range(8)) + [50, 51, 52, 53])
    assert same.block_name(1) == a.block_name(1) and same.block_name(2) != a.block_name(2)
    assert _chain(list(range(4)), salt=8).block_name(0) != a.block_name(0)
    assert salt_of("m", "f16", "f16", 16) != salt_of("m", "q8_0", "f16", 16)
    assert position_key(5, [1]) != block_hash(5, [1])  # the two name spaces differ


def test_a_chain_can_name_each_block_with_the_token_after_it():
    tokens = list(range(10))
    sl = lambda a, b: tokens[a:b]  # noqa: E731
    c = HashChain(7, 4, num_next_tokens=1)
    c.extend(8, sl)
    assert c.num_blocks == 1  # block 1 waits for token 8
    h1 = block_hash(7, [0, 1, 2, 3, 4])
    assert c.block_name(0) == h1
    c.extend(9, sl)
    assert c.block_name(1) == block_hash(h1, [4, 5, 6, 7, 8])
    assert [c.blocks_at(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]
    # A position hangs from the blocks its own tokens name: 8 from block 0, with 4 tail
    # tokens, since block 1's name needs token 8.
    assert c.key_at(8, sl) == position_key(h1, [4, 5, 6, 7])
    assert c.key_at(9, sl) == position_key(c.block_name(1), [8])
    other = HashChain(7, 4, num_next_tokens=1)
    other.extend(9, lambda a, b: (tokens[:8] + [99])[a:b])
    assert other.block_name(0) == h1 and other.block_name(1) != c.block_name(1)
    with pytest.raises(ValueError, match="num_next_tokens"):
        HashChain(7, 4, num_next_tokens=2)


def test_checkpoints_keep_a_hidden_row_when_asked():
    shapes = SHAPES
    pool = CheckpointPool(shapes, 2, "cpu", vocab_size=5, hidden_size=3)
    slots = StatePool(shapes, 1, "cpu")
    slot = slots.slot(slots.acquire())
    entry = pool.save(1, 4, 7, None, slots, slot, hidden=torch.tensor([1.0, 2.0, 3.0]))
    assert entry.has_hidden and not entry.has_logits
    assert pool.hidden_row(entry).tolist() == [1.0, 2.0, 3.0]
    bare = pool.save(2, 4, 7, None, slots, slot)
    assert not bare.has_hidden
    with pytest.raises(ValueError, match="no hidden row"):
        pool.hidden_row(bare)
    assert pool.save(2, 4, 7, None, slots, slot, hidden=torch.zeros(3)).has_hidden
    with pytest.raises(ValueError, match="does not fit"):
        pool.save(3, 4, 7, None, slots, slot, hidden=torch.zeros(4))
    plain = CheckpointPool(shapes, 1, "cpu")
    assert not plain.save(1, 4, 7, None, slots, slot, hidden=torch.zeros(3)).has_hidden
    assert pool.bytes_per_checkpoint == plain.bytes_per_checkpoint + 5 * 4 + 3 * 4
    pool.check_invariants()


# ---- the pool's third state ---------------------------------------------------------------
def test_cached_blocks_are_kept_then_evicted_least_recently_cached_first():
    pool = BlockPool(6)
    assert pool.allocate(4) == [0, 1, 2, 3]
    for b, name in zip([0, 1, 2], [100, 101, 102]):
        assert pool.set_name(b, name)
    pool.decref([0, 1, 2, 3])  # 3 is unnamed: free; 0-2 cached, last block first
    assert (pool.num_free_blocks, pool.num_cached_blocks, pool.num_used_blocks) == (6, 3, 0)
    assert pool.utilization == 0.0  # cached blocks count as free
    assert pool.lookup(101) == 1
    assert pool.allocate(3) == [4, 5, 3]  # free blocks first: nothing evicted
    epoch_1 = pool.epoch(1)
    assert pool.allocate(1) == [2]  # then the tail of the chain
    assert pool.lookup(102) is None and pool.num_evictions == 1
    pool.incref([1])  # a hit takes a cached block back: no longer evictable
    assert pool.allocate(1) == [0] and pool.allocate(1) is None
    assert pool.holds(1, epoch_1) and pool.refcount(1) == 1
    pool.check_invariants({1: 1, 0: 1, 2: 1, 3: 1, 4: 1, 5: 1})


def test_pool_refuses_to_name_twice_and_to_share_free_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.set_name(a, 9) and not pool.set_name(b, 9) and not pool.set_name(a, 10)
    pool.decref([b])
    with pytest.raises(ValueError, match="free"):
        pool.incref([b])
    snapshot = pool.snapshot()
    assert pool.allocate(5) is None and pool.snapshot() == snapshot


def test_prefix_sequence_shares_full_blocks_and_copies_the_tail():
    kv = KVCacheManager(BlockPool(8, 4), 4, 8)
    h = kv.create()
    assert kv.append(h, 10)
    kv.name_full_blocks(h, [11, 12])
    kv.free(h, keep_tail=True)  # blocks 0, 1 named, 2 kept for a checkpoint inside it
    assert kv.pool.num_cached_blocks == 3
    child = kv.create_from_prefix([0, 1], 9, tail_block=2)
    assert kv.block_ids(child) == [0, 1, 3] and kv.num_tokens(child) == 9
    assert kv.pending_copies == [BlockCopy(2, 3)]
    assert kv.pool.refcount(2) == 1  # held until the copy has run
    kv.check_invariants()
    kv.copies_done()
    assert kv.pool.refcount(2) == 0 and kv.pool.num_cached_blocks == 1
    kv.free(child)
    kv.check_invariants()
    assert kv.pool.num_used_blocks == 0


# ---- checkpoints --------------------------------------------------------------------------
def test_checkpoint_eviction_goes_by_value_not_age():
    states = StatePool(SHAPES, 1, "cpu")
    pool = CheckpointPool(SHAPES, 2, "cpu")
    slot = states.slot(states.acquire())
    for key, n in ((1, 500), (2, 20)):
        states.recurrent_state[0, slot] = float(key)
        pool.save(key, n, parent=0, tail=None, states=states, state_slot=slot)
    pool.touch(pool.get(2))  # the short one is more recent, still worth less
    pool.save(3, 40, parent=0, tail=None, states=states, state_slot=slot)
    assert pool.get(2) is None and pool.get(1) is not None and pool.num_evictions == 1
    pool.restore(pool.get(1), states, slot)
    assert states.recurrent_state[0, slot].item() == 1.0
    pool.check_invariants()


def test_a_logits_row_lives_and_dies_with_its_checkpoint():
    states = StatePool(SHAPES, 1, "cpu")
    pool = CheckpointPool(SHAPES, 1, "cpu", vocab_size=3)
    assert pool.bytes_per_checkpoint == SHAPES.bytes_per_slot + 3 * 4
    slot = states.slot(states.acquire())
    a = pool.save(1, 10, parent=0, tail=None, states=states, state_slot=slot)
    assert not a.has_logits
    with pytest.raises(ValueError, match="no logits row"):
        pool.logits_row(a)
    row = torch.tensor([1.0, 2.0, 3.0])
    assert pool.save(1, 10, 0, None, states, slot, logits=row) is a and a.has_logits
    copy = pool.logits_row(a)
    assert copy.tolist() == [1.0, 2.0, 3.0]
    b = pool.save(2, 20, 0, None, states, slot)  # evicts a: its slot, row and all
    assert pool.get(1) is None and b.slot == a.slot and not b.has_logits
    with pytest.raises(ValueError, match="no logits row"):
        pool.logits_row(a)
    pool.save(3, 30, 0, None, states, slot, logits=torch.zeros(3))  # evicts b
    assert copy.tolist() == [1.0, 2.0, 3.0]  # a copy taken before stays what it was
    with pytest.raises(ValueError, match="does not fit"):
        pool.save(4, 40, 0, None, states, slot, logits=torch.zeros(4))
    pool.check_invariants()


# ---- matching -----------------------------------------------------------------------------
def test_match_resumes_at_the_longest_checkpointed_prefix_with_exact_blocks():
    e = FakeEngine(block_size=4, chunk=64, interval=1000)
    base = list(range(1, 15))  # 14 tokens: blocks 0-2 full, 2 tokens in block 3
    a = e.add("a", base, max_tokens=3)
    e.run()
    # Checkpoints: prompt end (14) and the finish (14 + 3 - 1 = 16).
    keys = sorted(c.num_tokens for c in e.checkpoints._entries.values())
    assert keys == [14, 16]
    assert e.kv.pool.num_cached_blocks == 4  # 16 computed tokens: 4 named full blocks
    # Extending a's whole history: resumes at its end, sharing blocks 0-3 as they are.
    b = Request("b", base + a.output_token_ids + [7, 8], SamplingParams(max_tokens=1))
    match = e.prefix.match(b)
    assert match.hit.num_tokens == 16 and match.hit.full_blocks == [0, 1, 2, 3]
    assert match.hit.tail_block is None
    # Sharing the prompt and 1 more token: resumes at 14, the tail rows copied from
    # block 3 (full by now: the 2 generated tokens filled it).
    c = Request("c", base + [33, 34, 35], SamplingParams(max_tokens=1))
    match = e.prefix.match(c)
    assert (match.hit.num_tokens, match.hit.full_blocks, match.hit.tail_block) == \
        (14, [0, 1, 2], 3)
    assert match.num_kv_tokens == 12  # block 3 differs in its last two rows
    # A different first token shares nothing.
    assert e.prefix.match(Request("d", [0] + base, SamplingParams())).hit is None


def test_identical_prompt_resumes_at_its_end_and_samples_from_the_stored_logits():
    off = FakeEngine(caching=False)
    cold = off.add("cold", list(range(1, 20)), max_tokens=3)
    off.run()
    e = FakeEngine(block_size=4, chunk=64, interval=8)
    prompt = list(range(1, 20))
    reqs = []
    for i in range(2):
        reqs.append(e.add(str(i), prompt, max_tokens=3))
        e.run()
    # 2nd: every token cached; its first token comes from the row saved with the
    # prompt-end checkpoint, so it forwards no prompt token at all.
    assert [r.num_cached_tokens for r in reqs] == [0, 19]
    assert e.prefix.stats.num_hits == 19
    assert reqs[0].output_token_ids == reqs[1].output_token_ids == cold.output_token_ids
    # Interval checkpoints (8, 16) keep their chunk's last logits too: a prompt that ends
    # there resumes whole. The finish checkpoint (19 + 2 fed back = 21) has no row: a
    # request whose tokens end there resumes at the longest checkpoint below (19).
    whole = e.prefix.match(Request("p16", prompt[:16], SamplingParams())).hit
    assert whole.num_tokens == 16 and whole.checkpoint.has_logits
    ends = {c.num_tokens: c.has_logits for c in e.checkpoints._entries.values()}
    assert ends == {8: True, 16: True, 19: True, 21: False}
    history = prompt + reqs[0].output_token_ids[:2]
    assert e.prefix.match(Request("h", history, SamplingParams())).hit.num_tokens == 19


# ---- random workloads ----------------------------------------------------------------------
def _workload(seed: int, n: int):
    rng = random.Random(seed)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 60))] for _ in range(5)]
    for i in range(n):
        base = rng.choice(bases)
        cut = rng.randrange(len(base) + 1)
        tail = [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        yield str(i), (base[:cut] + tail) or [1], rng.randrange(1, 6)


def _drive(e: FakeEngine, seed: int, n: int, chaos: bool) -> dict[str, list[int]]:
    rng = random.Random(seed + 1)
    live: list[str] = []
    for rid, prompt, max_tokens in _workload(seed, n):
        e.add(rid, prompt, max_tokens)
        live.append(rid)
        for _ in range(rng.randrange(0, 4)):
            e.step()
            if chaos and rng.random() < 0.15 and e.scheduler.running:
                e.scheduler._preempt(rng.choice(e.scheduler.running))  # forced
            if chaos and rng.random() < 0.05:
                e.abort(rng.choice(live))
            e.check()
    e.run()
    e.check()
    return {rid: r.output_token_ids for rid, r in e.finished.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shared_prefixes_change_no_output_and_leak_nothing(seed):
    on = FakeEngine(num_blocks=40, num_checkpoints=8)
    off = FakeEngine(caching=False, num_blocks=40)
    n = 300 if seed == 0 else 120
    outputs_on = _drive(on, seed, n, chaos=True)
    outputs_off = _drive(off, seed, n, chaos=False)
    # Aborted requests differ between the runs; every request finished in both agrees.
    common = outputs_on.keys() & outputs_off.keys()
    assert len(common) > n // 2
    assert all(outputs_on[k] == outputs_off[k] for k in common)
    assert on.prefix.stats.num_hits > 0 and on.scheduler.num_preemptions > 0
    assert on.kv.pool.num_used_blocks == 0 and on.states.num_used_slots == 0
    assert on.kv.num_live_seqs == 0 and on.kv.pool.num_cached_blocks > 0


def test_default_checkpoint_budget() -> None:
    from pagedserve.engine.prefix_cache import num_checkpoints_for
    from pagedserve.kv.memory import GiB, MiB

    big = 148 * MiB  # one checkpoint of the 27B shape
    assert num_checkpoints_for(None, big, 16) == 4 * GiB // big  # the 4 GiB budget: 27
    assert num_checkpoints_for(None, MiB, 16) == 8 * 16  # small models: the count cap
    assert num_checkpoints_for(3 * big, big, 16) == 3  # an explicit budget is the budget


def test_a_conversation_keeps_its_finish_over_another_ones_superseded_prompt_end():
    # Two checkpoints. x leaves its prompt end (14, superseded by its finish) and its
    # finish (16); y's prompt end (30) evicts x's prompt end, and y's finish (32) must
    # evict y's own prompt end, superseded by it, not x's finish: longer, but of no use to
    # a conversation that has moved past it, where x's finish is what x's next turn needs.
    e = FakeEngine(block_size=4, chunk=64, interval=1000, num_checkpoints=2)
    x_prompt = list(range(1, 15))
    x = e.add("x", x_prompt, max_tokens=3)
    e.run()
    e.add("y", list(range(100, 130)), max_tokens=3)
    e.run()
    kept = sorted(c.num_tokens for c in e.checkpoints._entries.values())
    assert kept == [16, 32]
    x_next = Request("x2", x_prompt + x.output_token_ids + [7, 8], SamplingParams())
    assert e.prefix.match(x_next).hit.num_tokens == 16
