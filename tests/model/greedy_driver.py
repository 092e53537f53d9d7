"""A minimal greedy loop over ``KVCacheManager`` + ``StatePool`` + ``ModelRunner``.

Not the engine: one or more sequences, a fixed prefill chunk size, argmax sampling. It keeps
the first-token bookkeeping explicit: the token sampled from a step's logits is the next
step's input, written at K/V row and RoPE position ``num_tokens`` (= prompt length for the
first sampled token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch
from pagedserve.engine.runner import ModelRunner
from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.model.forward_batch import ForwardBatch


@dataclass
class Sequence:
    """One sequence's handles and what it has produced."""

    kv_handle: Handle
    slot_handle: Handle
    slot: int
    num_tokens: int = 0  # committed K/V rows
    tokens: list[int] = field(default_factory=list)  # generated
    step_logits: list[torch.Tensor] = field(default_factory=list)  # one per generated token
    chunk_logits: list[torch.Tensor] = field(default_factory=list)  # end of each prefill chunk


class GreedyDriver:
    """Drives a runner step by step. ``batches`` records every ``ForwardBatch`` run."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager | None = None) -> None:
        self.runner = runner
        self.kv = kv or runner.create_kv_manager()
        self.batches: list[ForwardBatch] = []

    def new_sequence(self) -> Sequence:
        kv_handle = self.kv.create()
        slot_handle = self.runner.state_pool.acquire()
        return Sequence(kv_handle, slot_handle, self.runner.state_pool.slot(slot_handle))

    def free(self, seq: Sequence) -> None:
        self.kv.free(seq.kv_handle)
        self.runner.state_pool.release(seq.slot_handle)

    def step(self, work: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        """One forward over ``(sequence, new token ids)`` pairs (decode pairs first).
        Commits the rows and returns float32 logits ``[B, vocab]``."""
        chunks = []
        for seq, ids in work:
            if not self.kv.reserve(seq.kv_handle, len(ids)):
                raise RuntimeError("test pool too small")
            chunks.append(SeqChunk(seq.kv_handle, seq.slot, tuple(ids), seq.num_tokens))
        self.runner.apply_pending_copies(self.kv)
        batch = build_forward_batch(chunks, self.kv, self.runner.device)
        self.batches.append(batch)
        logits = self.runner.execute(batch)
        for seq, ids in work:
            self.kv.commit(seq.kv_handle, len(ids))
            seq.num_tokens += len(ids)
        return logits

    def prefill(self, seq: Sequence, prompt: list[int], chunk: int | None = None) -> int:
        """Prefill in chunks of ``chunk`` tokens (default: the whole prompt); returns the
        first sampled token."""
        chunk = chunk or len(prompt)
        for start in range(0, len(prompt), chunk):
            logits = self.step([(seq, prompt[start : start + chunk])])
            seq.chunk_logits.append(logits[0])
        self._sample(seq, logits[0])
        return seq.tokens[-1]

    def decode(self, seq: Sequence, feed: int | None = None) -> int:
        """Forward the last sampled token (or ``feed``, to teacher-force) and sample."""
        token = seq.tokens[-1] if feed is None else feed
        logits = self.step([(seq, [token])])
        self._sample(seq, logits[0])
        return seq.tokens[-1]

    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor) -> None:
        seq.step_logits.append(logits.detach().cpu())
        seq.tokens.append(int(logits.argmax()))


def greedy(
    runner: ModelRunner, prompt: list[int], new_tokens: int, chunk: int | None = None,
    forced: list[int] | None = None,
) -> Sequence:
    """Generate ``new_tokens`` greedily for one prompt. With ``forced`` (e.g. transformers'
    tokens) each decode step is fed ``forced[i]`` instead of the model's own choice, so that
    the logits stay comparable step by step even after a divergence."""
    driver = GreedyDriver(runner)
    seq = driver.new_sequence()
    driver.prefill(seq, prompt, chunk)
    while len(seq.tokens) < new_tokens:
        feed = None if forced is None else forced[len(seq.tokens) - 1]
        driver.decode(seq, feed)
    driver.free(seq)
    return seq
