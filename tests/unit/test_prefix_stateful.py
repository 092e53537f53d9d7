"""Stateful property test of prefix caching: random add, step, match, finish, evict, fork,
abort and preempt over the real scheduler, pools and prefix cache (``prefix_driver``).

After every step: the pools' invariants (every block exactly one of free, cached, owned;
cached + free + owned = total; refcounts equal owners), no owned block was ever given
away (its epoch is unchanged), and every match names blocks whose rows hold the request's
tokens and a checkpoint holding exactly their state (and their logits row, for a match of
every token).
"""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from prefix_driver import FakeEngine, state_of

from pagedserve.engine.request import Request, SamplingParams

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 9, 9, 9, 9, 9],
         [7] * 21]


class PrefixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.e = FakeEngine(num_blocks=24, block_size=4, max_num_seqs=3, num_checkpoints=5,
                            chunk=5, interval=8)
        self.n = 0
        self.forks = []
        self.owned_epochs = {}  # block -> epoch while some sequence owns it

    def _prompt(self, data):
        base = data.draw(st.sampled_from(BASES))
        cut = data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(0, 20), max_size=6))
        return (base[:cut] + tail) or [3]

    @rule(data=st.data(), max_tokens=st.integers(1, 5))
    def add(self, data, max_tokens):
        self.n += 1
        self.e.add(str(self.n), self._prompt(data), max_tokens)

    @rule()
    def step(self):
        self.e.step()

    @rule(data=st.data())
    def match(self, data):
        req = Request("probe", self._prompt(data), SamplingParams())
        hit = self.e.prefix.match(req).hit
        if hit is None:
            return
        tokens, bs = req.prompt_token_ids, self.e.block_size
        blocks = hit.full_blocks + ([hit.tail_block] if hit.tail_block is not None else [])
        for pos in range(hit.num_tokens):
            assert self.e.rows[blocks[pos // bs]][pos % bs] == tokens[pos]
        value = self.e.checkpoints.recurrent_state[0, hit.checkpoint.slot, 0, 0, 0].item()
        assert int(value) == state_of(tokens[:hit.num_tokens])
        if hit.num_tokens == len(tokens):  # resumes whole: its stored logits are exact too
            row = self.e.checkpoints.logits[hit.checkpoint.slot, 0].item()
            assert int(row) == state_of(tokens)

    @rule(n=st.integers(1, 24))
    def evict(self, n):
        kv = self.e.kv
        if kv.num_free_seq_rows <= 1:
            return  # leave a row for a fork
        h = kv.create()
        kv.append(h, min(n * kv.block_size, kv.max_tokens_per_seq))  # may fail: all or nothing
        kv.free(h)

    @precondition(lambda self: self.e.scheduler.running)
    @rule(data=st.data())
    def fork(self, data):
        if self.forks:
            return  # at most one fork at a time: the driver has two spare rows
        req = data.draw(st.sampled_from(self.e.scheduler.running))
        self.forks.append(self.e.kv.fork(req.live_kv_handle))

    @precondition(lambda self: self.forks)
    @rule()
    def free_fork(self):
        self.e.kv.free(self.forks.pop(0))

    @precondition(lambda self: self.e.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.e.abort(data.draw(st.sampled_from(sorted(self.e.requests))))

    @precondition(lambda self: self.e.scheduler.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.e.scheduler._preempt(data.draw(st.sampled_from(self.e.scheduler.running)))

    @invariant()
    def pools_consistent(self):
        e = self.e
        e.kv.check_invariants()
        e.states.check_invariants()
        e.prefix.check_invariants()
        pool = e.kv.pool
        assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks
        owned = {b for r in e.scheduler.running for b in e.kv.block_ids(r.live_kv_handle)}
        owned |= {b for h in self.forks for b in e.kv.block_ids(h)}
        for b, epoch in list(self.owned_epochs.items()):
            if b in owned:
                assert pool.epoch(b) == epoch, f"owned block {b} was given away"
            else:
                del self.owned_epochs[b]
        for b in owned:
            self.owned_epochs.setdefault(b, pool.epoch(b))

    def teardown(self):
        for h in self.forks:
            self.e.kv.free(h)
        self.forks = []
        self.e.run()
        assert self.e.kv.pool.num_used_blocks == 0 and self.e.states.num_used_slots == 0


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
