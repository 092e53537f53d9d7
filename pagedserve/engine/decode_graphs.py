"""CUDA graphs for decode-only steps, one per padded batch size.

A decode step of B sequences is replayed by the graph of the smallest captured size
``P >= B``. Every input lives in one persistent buffer dict; a step copies its tensors into
the first B rows and points rows B..P-1 at nothing::

    row          0 .. B-1 (live)            B .. P-1 (padding)
    input_ids    the new tokens             0
    positions    their K/V rows             0
    slot_mapping their K/V slots            -1   (kv_write skips the row)
    seq_lens     context + 1                0    (decode attention returns zeros)
    state_slots  the sequences' slots       null slot (conv/recurrent writes land there)
    block_tables their tables (B x w)       whatever was there (never read: seq_len 0)

The graphs share one memory pool and are captured largest first. Capture needs every op
on the decode path to be free of host syncs; if one is not (for example a CPU-reference op
still dispatched on CUDA), capture fails and the runner falls back to eager decode.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from pagedserve.engine.graph_capture import captured
from pagedserve.model.forward_batch import ForwardBatch

ForwardFn = Callable[[ForwardBatch], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including ``max_batch_size``."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


class DecodeGraphs:
    """Captured decode steps and their persistent input buffers."""

    def __init__(
        self, forward: ForwardFn, device: torch.device, max_batch_size: int,
        max_blocks_per_seq: int, null_slot: int,
    ) -> None:
        self.forward = forward
        self.sizes = graph_batch_sizes(max_batch_size)
        self.null_slot = null_slot
        n = max_batch_size

        def buf(shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.buffers = {
            "input_ids": buf((n,), torch.long),  # [P]
            "positions": buf((n,), torch.long),  # [P]
            "slot_mapping": buf((n,), torch.long, -1),  # [P]
            "seq_lens": buf((n,), torch.int32),  # [P]
            "block_tables": buf((n, max_blocks_per_seq), torch.int32),  # [P, max_blocks]
            "state_slots": buf((n,), torch.int32, null_slot),  # [P]
            "query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(n, dtype=torch.long, device=device),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [P, vocab] float32 each
        # The graphs' memory pool (set by ``capture``), for others replayed on the same
        # stream to share (``VerifyGraphs``).
        self.pool: torch.cuda._POOL_HANDLE | None = None

    @classmethod
    def try_capture(
        cls, forward: ForwardFn, device: torch.device, max_batch_size: int,
        max_blocks_per_seq: int, null_slot: int,
    ) -> DecodeGraphs | None:
        """Capture all sizes; on failure log why and return ``None`` (eager decode)."""
        graphs = cls(forward, device, max_batch_size, max_blocks_per_seq, null_slot)
        if not captured(graphs.capture, "CUDA graph capture failed, decode runs eagerly"):
            return None
        return graphs

    def static_batch(self, size: int) -> ForwardBatch:
        """The ``ForwardBatch`` a graph of ``size`` rows is captured with (views of the
        buffers; the host lists describe ``size`` one-token sequences)."""
        b = self.buffers
        return ForwardBatch(
            input_ids=b["input_ids"][:size],
            positions=b["positions"][:size],
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][:size],
            state_slots=b["state_slots"][:size],
            logits_indices=b["logits_indices"][:size],
            num_decode_seqs=size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[0] * size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        self.pool = pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            batch = self.static_batch(size)
            # Warm up on a side stream: Triton compiles and autotunes outside the capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(batch)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Replay the graph for ``batch`` (decode-only); ``None`` if it is too large.

        Returns float32 ``[B, vocab]``, a copy: the graph's own output is overwritten by
        the next replay.
        """
        size = self.load(batch)
        if size is None:
            return None
        self.graphs[size].replay()
        return self.outputs[size][: batch.num_seqs].clone()

    def holds(self, batch: ForwardBatch) -> bool:
        """Whether a captured size holds ``batch`` (decode-only)."""
        return bool(self.sizes) and batch.num_seqs <= self.sizes[-1]

    def load(self, batch: ForwardBatch) -> int | None:
        """Copy ``batch`` into the buffers and pad it (table above); return the padded size
        (``None`` if no captured size holds it). ``static_batch(size)`` then describes it."""
        n = batch.num_seqs
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        b = self.buffers
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "state_slots"):
            b[name][:n].copy_(getattr(batch, name), non_blocking=True)
        width = batch.block_tables.shape[1]
        b["block_tables"][:n, :width].copy_(batch.block_tables, non_blocking=True)
        if size > n:
            b["input_ids"][n:size].zero_()
            b["positions"][n:size].zero_()
            b["slot_mapping"][n:size].fill_(-1)
            b["seq_lens"][n:size].zero_()
            b["state_slots"][n:size].fill_(self.null_slot)
        return size
