"""Stateful property test: random create/append/reserve/commit/free/fork/stale calls, with
``check_invariants()`` and an independent model of the expected state after every step."""

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.handles import OutOfCapacityError, StaleHandleError
from pagedserve.kv.kv_manager import KVCacheManager

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS, MAX_BLOCKS = 24, 4, 6, 8


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE), MAX_SEQS, MAX_BLOCKS)
        self.live = {}  # handle -> (committed, reserved) expected
        self.dead = []

    def _blocks_in_use(self):
        # Expected free count from the model: distinct blocks over live sequences.
        ids = set()
        for h in self.live:
            ids.update(self.kv.block_ids(h))
        return len(ids)

    @rule()
    def create(self):
        if len(self.live) == MAX_SEQS:
            try:
                self.kv.create()
            except OutOfCapacityError:
                return
            raise AssertionError("create beyond max_num_seqs succeeded")
        self.live[self.kv.create()] = (0, 0)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(0, 20))
    def append(self, data, n):
        h = data.draw(st.sampled_from(sorted(self.live)))
        committed, reserved = self.live[h]
        need = max(reserved, committed + n)
        before = self.kv.snapshot()
        if need > MAX_BLOCKS * BLOCK_SIZE:
            try:
                self.kv.append(h, n)
            except ValueError:
                assert self.kv.snapshot() == before
                return
            raise AssertionError("append beyond capacity succeeded")
        ok = self.kv.append(h, n)
        if ok:
            self.live[h] = (committed + n, need)
        else:
            assert self.kv.snapshot() == before  # all or nothing

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(0, 12))
    def reserve(self, data, n):
        h = data.draw(st.sampled_from(sorted(self.live)))
        committed, reserved = self.live[h]
        need = max(reserved, committed + n)
        if need > MAX_BLOCKS * BLOCK_SIZE:
            return
        before = self.kv.snapshot()
        if self.kv.reserve(h, n):
            self.live[h] = (committed, need)
        else:
            assert self.kv.snapshot() == before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit_reserved(self, data):
        h = data.draw(st.sampled_from(sorted(self.live)))
        committed, reserved = self.live[h]
        self.kv.commit(h, reserved - committed)
        self.live[h] = (reserved, reserved)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        h = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[h]
        self.kv.free(h)
        self.dead.append(h)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        h = data.draw(st.sampled_from(sorted(self.live)))
        if len(self.live) == MAX_SEQS:
            return
        child = self.kv.fork(h)
        committed = self.live[h][0]
        self.live[child] = (committed, committed)
        n = -(-committed // BLOCK_SIZE)
        assert self.kv.block_ids(child) == self.kv.block_ids(h)[:n]

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def use_stale_handle(self, data):
        h = data.draw(st.sampled_from(self.dead))
        before = self.kv.snapshot()
        for op in (lambda: self.kv.append(h, 1), lambda: self.kv.free(h),
                   lambda: self.kv.block_table(h)):
            try:
                op()
            except StaleHandleError:
                continue
            raise AssertionError(f"stale handle {h} was accepted")
        assert self.kv.snapshot() == before

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        for h, (committed, reserved) in self.live.items():
            assert self.kv.num_tokens(h) == committed
            assert self.kv.num_reserved(h) == reserved
        assert self.kv.pool.num_used_blocks == self._blocks_in_use()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
