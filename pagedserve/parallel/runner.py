"""``TensorParallelRunner``: rank 0's ``ModelRunner``, which sends every call that changes
device state to the workers before applying it to its own shard (``commands.py``).

Rank 0 is a full rank: it holds its own heads, K/V pool and state slots, and runs its own
forward pass (its CUDA graphs on CUDA) beside the workers'. The engine above it is
unchanged: it schedules, samples (from the gathered logits) and post-processes once.
"""

from __future__ import annotations

import torch

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import BlockCopy
from pagedserve.kv.state_pool import StatePool, StateShapes
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.qwen3_5 import Qwen3_5Model
from pagedserve.parallel import commands as cmd
from pagedserve.parallel.launch import WorkerGroup
from pagedserve.parallel.sharding import FLAG


class MirroredStatePool(StatePool):
    """Rank 0's state slots: each assignment (which zeroes the slot) and release is sent
    to the workers, whose pools assign the same slot ids in the same order."""

    def __init__(self, shapes: StateShapes, num_slots: int, device: torch.device,
                 workers: WorkerGroup) -> None:
        super().__init__(shapes, num_slots, device)
        self.workers = workers

    def acquire(self) -> Handle:
        handle = super().acquire()
        self.workers.send(cmd.AcquireSlot(handle.index))
        return handle

    def release(self, handle: Handle) -> None:
        super().release(handle)
        self.workers.send(cmd.ReleaseSlot(handle.index))


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group (``workers``); the model is rank 0's shard."""

    def __init__(self, model: Qwen3_5Model, cache_config: CacheConfig,
                 config: RunnerConfig, workers: WorkerGroup) -> None:
        if config.verify_rows:  # a verify graph would run rank 0's shard alone
            raise ValueError(f"speculative decoding does not support {FLAG} yet")
        self.workers = workers
        with workers.watch():
            super().__init__(model, cache_config, config)
            workers.wait_ready()

    def _new_state_pool(self, shapes: StateShapes, num_slots: int) -> StatePool:
        return MirroredStatePool(shapes, num_slots, self.device, self.workers)

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.host is None:
            raise ValueError("a tensor-parallel step needs its batch's host form "
                             "(ForwardBatch.host, set by build_forward_batch)")
        self.workers.send(cmd.Execute.of(batch.host))
        with self.workers.watch():
            return super().execute(batch)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:
            self.workers.send(cmd.CopyBlocks([c.src for c in copies], [c.dst for c in copies]))
        super().copy_blocks(copies)

    @torch.inference_mode()
    def copy_state_slot(self, src: int, dst: int) -> None:
        self.workers.send(cmd.CopyStateSlot(src, dst))
        super().copy_state_slot(src, dst)

    def close(self) -> None:
        self.workers.close()

    # Speculative decoding's passes run on rank 0 alone; it is refused at start-up.
    def _unsupported(self, *args: object, **kwargs: object) -> None:
        raise ValueError(f"speculative decoding does not support {FLAG} yet")

    forward_hidden = advance_linear_states = compute_logits = verify = _unsupported  # type: ignore[assignment]
    mtp_forward = draft_logits = save_states = restore_states = _unsupported  # type: ignore[assignment]
    roll_back_verify = _unsupported  # type: ignore[assignment]
