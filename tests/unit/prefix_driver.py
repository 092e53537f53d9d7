"""A model-free engine over the real scheduler, K/V manager, state pool and prefix cache.

Its "model" keeps, per K/V row, the token id written there, and as the recurrent state a
running hash of every token fed to the sequence (exact in float32); its "logits" are a
one-wide row holding that hash. Each chunk checks, before it runs, that its sequence's
rows below the chunk hold exactly its tokens and that its state slot holds exactly the
hash of those tokens: a prefix hit with wrong blocks, a missing copy-on-write or a wrong
checkpoint fails at once. The next token is a function of the logits row (a zero-token
chunk, admitted with every token cached, takes its stored row), so outputs with caching
on equal those with caching off only if every resumed state and row is exact.
"""

from __future__ import annotations

import torch

from pagedserve.engine.prefix_cache import PrefixCache, logits_with_cached_rows
from pagedserve.engine.request import Request, RequestStatus, SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.checkpoint_pool import CheckpointPool
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.kv.state_pool import StatePool, StateShapes

MOD = 16_777_213  # below 2**24: every value is exact in float32
VOCAB = 50
SHAPES = StateShapes(num_layers=1, conv=(1, 1), recurrent=(1, 1, 1), conv_dtype=torch.float32)


def fold(state: int, token: int) -> int:
    return (state * 31 + token + 1) % MOD


def state_of(tokens: list[int]) -> int:
    s = 0
    for t in tokens:
        s = fold(s, t)
    return s


class FakeEngine:
    def __init__(self, caching: bool = True, num_blocks: int = 64, block_size: int = 4,
                 max_num_seqs: int = 4, max_model_len: int = 128, num_checkpoints: int = 16,
                 chunk: int = 7, budget: int = 64, interval: int = 16) -> None:
        # Two rows beyond the scheduler's, for sequences a test makes by hand (forks).
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size), max_num_seqs + 2,
                                 -(-max_model_len // block_size))
        self.states = StatePool(SHAPES, max_num_seqs, "cpu")
        self.checkpoints = CheckpointPool(SHAPES, num_checkpoints, "cpu", vocab_size=1)
        self.prefix = PrefixCache(self.kv, self.states, self.checkpoints, salt=1,
                                  checkpoint_interval=interval) if caching else None
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            prefill_chunk=chunk, max_model_len=max_model_len),
            self.kv, self.states, self.prefix)
        self.rows: dict[int, list[int | None]] = {}  # block -> token id per row
        self.block_size = block_size
        self.requests: dict[str, Request] = {}
        self.finished: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))
        self.scheduler.add(req)
        self.requests[rid] = req
        return req

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self.scheduler.abort(req)

    def _apply_copies(self) -> None:
        for c in self.kv.pending_copies:
            self.rows[c.dst] = list(self.rows.get(c.src, [None] * self.block_size))
        self.kv.copies_done()

    def _row_token(self, req: Request, pos: int) -> int | None:
        block = self.kv.block_at(req.live_kv_handle, pos)
        return self.rows.get(block, [None] * self.block_size)[pos % self.block_size]

    def step(self) -> int:
        """One step; returns the number of chunks run."""
        plan = self.scheduler.schedule()
        self._apply_copies()
        bs = self.block_size
        logits: dict[int, torch.Tensor] = {}  # chunk index -> its logits row
        for i, c in enumerate(plan.chunks):
            req = c.request
            tokens = req.all_token_ids
            for pos in range(c.start_pos):  # the cached and computed rows are exact
                assert self._row_token(req, pos) == tokens[pos], (req.request_id, pos)
            slot = self.states.slot(req.live_state_handle)
            s = int(self.states.recurrent_state[0, slot, 0, 0, 0].item())
            assert s == state_of(tokens[:c.start_pos]), (req.request_id, c.start_pos)
            for pos in range(c.start_pos, c.start_pos + c.num_tokens):
                block = self.kv.block_at(req.live_kv_handle, pos)
                self.rows.setdefault(block, [None] * bs)[pos % bs] = tokens[pos]
                s = fold(s, tokens[pos])
            self.states.recurrent_state[0, slot, 0, 0, 0] = float(s)
            if c.num_tokens == 0:
                continue  # every token cached: it samples from its stored row
            logits[i] = torch.tensor([float(s)])
            end = c.start_pos + c.num_tokens
            if self.prefix is not None and self.prefix.wants_checkpoint(req, c.start_pos, end):
                self.prefix.save(req, end, logits[i])
        resumed = [i for i, c in enumerate(plan.chunks) if c.num_tokens == 0]
        if resumed:
            stored = logits_with_cached_rows(None, [plan.chunks[i].request for i in resumed])
            logits.update(zip(resumed, stored))
        for i, c in enumerate(plan.chunks):
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            self.kv.commit(req.live_kv_handle, c.num_tokens)
            req.num_computed_tokens += c.num_tokens
            if self.prefix is not None:
                self.prefix.on_commit(req)
            if c.completes:
                req.output_token_ids.append(int(logits[i][0].item()) % VOCAB)
                if len(req.output_token_ids) >= req.params.max_tokens:
                    self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                    self.finished[req.request_id] = self.requests.pop(req.request_id)
        return len(plan.chunks)

    def run(self) -> None:
        while self.scheduler.num_unfinished:
            self.step()

    def check(self) -> None:
        self.scheduler.check_integrity()
        assert self.kv.num_free_seq_rows >= 2
