"""Async scheduling: launch step N+1 before step N's tokens reach the host.

A synchronous engine leaves the GPU idle while the host reads a step's tokens, checks
stops, plans the next batch and launches it. With lookahead, a steady decode step is
launched first and the previous step is read back after, so that host work overlaps the
GPU's (the idea of vLLM's async scheduling and SGLang's overlap scheduler)::

    host   | launch N | launch N+1 | read N, post-process | launch N+2 | read N+1 ...
    GPU    |   . . .  N  . . . . . | N+1 . . . . . . . . . . . . . . | N+2 ...

Step N+1's input tokens are step N's sampled ids, still on the device; the host learns
them one step later. What that costs, and how each case stays exact:

- **Only steady decode looks ahead**: every sequence of step N sampled, none wants
  logprobs or penalties (both read the host's token history), none can finish by length
  at N (known in advance), and the head of the queue could not be admitted. Anything
  else (prefill, admission, preemption) runs through the scheduler once nothing is in
  flight, so the scheduler never sees a half-known sequence.
- **A stop found late** (EOS, stop id or stop string at step N) means step N+1 computed
  one extra row for that sequence. Its blocks and slot are freed when N is read, and that
  row's token is dropped when N+1 is read. Frees are safe: every later use of those
  blocks is launched after N+1 on the same stream.
- **A grammar** (structured outputs) needs the token of step N for the mask of N+1: such
  a step's forward pass is launched ahead, its sampling only once N has been read back
  and its tokens have advanced the grammars (``InflightStep.logits`` holds the logits
  meanwhile). The forward pass still overlaps the host's work on N.
- **Seeded sampling** draws output index ``len(output) + 1`` for the row of N+1, the
  index the synchronous engine would use, so tokens do not change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampler import SamplerOutput, uses_host_history
from pagedserve.engine.scheduler import ScheduledChunk, Scheduler
from pagedserve.kv.kv_manager import KVCacheManager


class LaunchedStep:
    """A step launched before its tokens are read: ``chunks`` says which requests it
    holds."""

    chunks: list[ScheduledChunk]

    @functools.cached_property
    def request_ids(self) -> frozenset[int]:
        """``id()`` of each request the step holds (``LLMEngine.is_in_flight``)."""
        return frozenset(id(c.request) for c in self.chunks)


@dataclass
class InflightStep(LaunchedStep):
    """A launched forward pass whose sampled tokens the host has not read yet.

    ``chunks``: what ran, decode chunks first; ``sampling``: the indices of the chunks that
    sampled, in ``sampled``'s row order; ``readback``: the host copy of the ids, if started;
    ``logits``: the forward pass's logits while its sampling waits to be queued.
    """

    chunks: list[ScheduledChunk]
    sampling: list[int]
    sampled: SamplerOutput | None
    readback: HostTokens | None = None
    logits: torch.Tensor | None = None  # [B, V] float32

    def host_output(self) -> dict | None:
        """The sampled ids (and logprobs) as lists; waits for the device if needed."""
        if self.sampled is None:
            return None
        out = self.sampled
        if self.readback is not None:
            host = {"token_ids": self.readback.wait()}
        else:
            host = {"token_ids": out.token_ids.tolist()}
        if out.sampled_logprob is not None:
            host["sampled_logprob"] = out.sampled_logprob.tolist()
        if out.top_ids is not None and out.top_logprobs is not None:
            host["top_ids"] = out.top_ids.tolist()
            host["top_logprobs"] = out.top_logprobs.tolist()
        return host


class HostTokens:
    """One step's sampled ids (or other values) on their way to pinned host memory
    (CUDA)."""

    def __init__(self, buffer: torch.Tensor, ready: torch.cuda.Event, ids: torch.Tensor) -> None:
        self._host = buffer[: ids.numel()]
        self._host.copy_(ids, non_blocking=True)
        self._ready = ready
        self._ready.record()

    def wait(self) -> list:
        self._ready.synchronize()
        return self._host.tolist()


class TokenReadback:
    """Two pinned buffers used in turn: while one step's ids are read, the next step's
    copy may already be writing the other. ``dtype``: int64 ids by default."""

    def __init__(self, max_rows: int, dtype: torch.dtype = torch.long) -> None:
        self._buffers = [(torch.empty(max_rows, dtype=dtype, pin_memory=True),
                          torch.cuda.Event()) for _ in range(2)]
        self._turn = 0

    def start(self, ids: torch.Tensor) -> HostTokens:
        buffer, ready = self._buffers[self._turn]
        self._turn ^= 1
        return HostTokens(buffer, ready, ids)


def lookahead_chunks(
    step: InflightStep, scheduler: Scheduler, kv: KVCacheManager, max_model_len: int,
) -> list[ScheduledChunk] | None:
    """The decode chunks of the step after ``step``, with their K/V rows reserved; ``None``
    when that step must wait for the scheduler (the rules in the module docstring)."""
    if step.sampled is None or len(step.sampling) != len(step.chunks):
        return None
    reqs = [c.request for c in step.chunks]
    if any(r.status is not RequestStatus.RUNNING for r in reqs):
        return None  # aborted since the launch
    if not _plain_enough(reqs):
        return None
    if scheduler.can_admit_next():
        return None  # let the scheduler admit
    if any(_finishes_by_length(r, max_model_len) for r in reqs):
        return None
    chunks = []
    for c in step.chunks:
        req, pos = c.request, c.start_pos + c.num_tokens  # the row of step's token
        if not kv.reserve(req.live_kv_handle, pos + 1 - kv.num_tokens(req.live_kv_handle)):
            return None  # the pool is full: the scheduler preempts (rows reserved so far
            # stay reserved; the sequences use them in their next step)
        chunks.append(ScheduledChunk(req, 1, pos))
    return chunks


def _plain_enough(reqs: list[Request]) -> bool:
    """No logprobs and nothing read from the token history on the host."""
    return not (uses_host_history(reqs) or any(r.params.logprobs is not None for r in reqs))


def _finishes_by_length(req: Request, max_model_len: int) -> bool:
    """Whether the token in flight is the request's last by length (so nothing follows)."""
    return (len(req.output_token_ids) + 1 >= req.params.max_tokens
            or req.num_tokens + 1 >= max_model_len)
