"""CUDA graphs for steps that prefill one sequence's chunk, one per padded row count.

A short prefill step is bound by the host, not the GPU: an eager 512-token step of the 27B
shape launches about 2,500 kernels through Python (fla-core's wrappers, the compiled
elementwise ops' guards), several times the GPU's own time. Replaying a captured graph
removes all of it. A step qualifies when it holds exactly one sequence, no decode rows,
and at most the largest captured row count; it replays the graph of the smallest captured
size ``P >= n`` with the chunk padded::

    row             0 .. n-1 (the chunk)        n .. P-1 (padding)
    input_ids       the chunk's tokens          0
    positions       their K/V rows              0
    slot_mapping    their K/V slots             -1   (kv_write skips the row)
    row_valid       True                        False (GDN: no decay, no write; attention
                                                       outputs zeros)
    query_start_loc [0, n] on the device; the captured host copy says [0, P]
    seq_lens, state_slots, block_tables, logits_indices: the one sequence's

Every op on the path takes its lengths from the device tensors or treats the padding as
inert (``ForwardBatch.row_valid``), so the result is the eager step's. The graphs share
one memory pool, captured largest first; a capture failure leaves prefill eager.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from pagedserve.engine.graph_capture import captured
from pagedserve.model.forward_batch import ForwardBatch

ForwardFn = Callable[[ForwardBatch], torch.Tensor]
# Row counts captured, up to the step's token budget. Past 512 rows the GPU's time per
# step outgrows the host's, so eager steps lose little (docs/kernel-decisions.md).
PREFILL_GRAPH_SIZES = (16, 32, 64, 128, 256, 512)


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The captured row counts for steps of at most ``max_tokens`` tokens."""
    sizes = [s for s in PREFILL_GRAPH_SIZES if s < max_tokens]
    if max_tokens <= PREFILL_GRAPH_SIZES[-1]:
        sizes.append(max_tokens)
    return sizes


class PrefillGraphs:
    """Captured one-sequence prefill steps and their persistent input buffers."""

    def __init__(self, forward: ForwardFn, device: torch.device, max_tokens: int,
                 max_blocks_per_seq: int, null_slot: int, max_model_len: int) -> None:
        self.forward = forward
        # The captured host copy of seq_lens: the longest a sequence can be, so that the
        # attention's split of the key range suits a chunk over any cached prefix.
        self.max_model_len = max_model_len
        # A chunk never holds more rows than a sequence may hold tokens (and a larger
        # graph's capture would read past the block table's width).
        self.sizes = prefill_graph_sizes(min(max_tokens, max_model_len))
        n = self.max_tokens

        def buf(shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.buffers = {
            "input_ids": buf((n,), torch.long),  # [P]
            "positions": buf((n,), torch.long),  # [P]
            "slot_mapping": buf((n,), torch.long, -1),  # [P]
            "row_valid": buf((n,), torch.bool, 1),  # [P]
            "query_start_loc": torch.tensor([0, n], dtype=torch.int32, device=device),  # [2]
            "seq_lens": buf((1,), torch.int32, n),  # [1]
            "block_tables": buf((1, max_blocks_per_seq), torch.int32),  # [1, max_blocks]
            "state_slots": buf((1,), torch.int32, null_slot),  # [1]
            "logits_indices": buf((1,), torch.long, n - 1),  # [1]
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [1, vocab] float32 each

    @classmethod
    def try_capture(cls, forward: ForwardFn, device: torch.device, max_tokens: int,
                    max_blocks_per_seq: int, null_slot: int,
                    max_model_len: int) -> PrefillGraphs | None:
        """Capture all sizes; on failure log why and return ``None`` (eager prefill)."""
        graphs = cls(forward, device, max_tokens, max_blocks_per_seq, null_slot,
                     max_model_len)
        if not graphs.sizes:
            return None
        if not captured(graphs.capture,
                        "prefill CUDA graph capture failed, prefill runs eagerly"):
            return None
        return graphs

    def static_batch(self, size: int) -> ForwardBatch:
        """The ``ForwardBatch`` a graph of ``size`` rows is captured with."""
        b = self.buffers
        return ForwardBatch(
            input_ids=b["input_ids"][:size],
            positions=b["positions"][:size],
            query_start_loc=b["query_start_loc"],
            seq_lens=b["seq_lens"],
            block_tables=b["block_tables"],
            slot_mapping=b["slot_mapping"][:size],
            state_slots=b["state_slots"],
            logits_indices=b["logits_indices"],
            num_decode_seqs=0,
            query_start_loc_cpu=[0, size],
            seq_lens_cpu=[self.max_model_len],
            row_valid=b["row_valid"][:size],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first. The buffers hold a harmless batch meanwhile:
        no K/V is written (slots -1), the state is the null slot's, and the keys read are
        block 0's."""
        b = self.buffers
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            b["query_start_loc"][1] = size
            b["seq_lens"][0] = size
            b["logits_indices"][0] = size - 1
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

    @property
    def max_tokens(self) -> int:
        """The most rows a captured graph holds (0: none captured)."""
        return self.sizes[-1] if self.sizes else 0

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is one prefill chunk that a captured size holds (with no
        state taps: the graphs advance the linear layers in one round)."""
        return (batch.num_seqs == 1 and batch.num_decode_seqs == 0
                and batch.num_tokens <= self.max_tokens and batch.row_valid is None
                and batch.gdn_rounds is None)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay the graph for ``batch`` (``fits``). Returns float32 ``[1, vocab]``, a
        copy: the graph's own output is overwritten by the next replay."""
        size = self.load(batch)
        self.graphs[size].replay()
        return self.outputs[size].clone()

    def load(self, batch: ForwardBatch) -> int:
        """Copy ``batch`` into the buffers, padded (table above); return the padded size."""
        n = batch.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        b = self.buffers
        for name in ("input_ids", "positions", "slot_mapping"):
            b[name][:n].copy_(getattr(batch, name), non_blocking=True)
        for name in ("query_start_loc", "seq_lens", "state_slots", "logits_indices"):
            b[name].copy_(getattr(batch, name), non_blocking=True)
        width = batch.block_tables.shape[1]
        b["block_tables"][:, :width].copy_(batch.block_tables, non_blocking=True)
        b["row_valid"][:n].fill_(True)
        if size > n:
            b["input_ids"][n:size].zero_()
            b["positions"][n:size].zero_()
            b["slot_mapping"][n:size].fill_(-1)
            b["row_valid"][n:size].fill_(False)
        return size
