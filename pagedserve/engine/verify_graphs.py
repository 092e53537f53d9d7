"""CUDA graphs for pure speculative verify steps, one per padded batch size.

A verify step of B sequences that each verify all ``k`` drafts holds ``r = k + 1`` rows
per sequence. Run eagerly it is bound by the host (a launch per op and layer, about
2,000 for a 64-layer model), so speculation could not beat decode, which replays graphs.
Such a step replays the graph of the smallest captured size ``P >= B`` (the decode graphs'
sizes, ``graph_batch_sizes``), its ``T = B * r`` rows padded to ``P * r``::

    row (T = B r)     0 .. T-1 (live)               T .. P r - 1 (padding)
    input_ids         the rows' tokens              0
    positions         their K/V rows                0
    slot_mapping      their K/V slots               -1    (kv_write skips the row)
    row_valid         True                          False (attention outputs zeros)

    sequence          0 .. B-1 (live)               B .. P-1 (padding)
    query_start_loc   0, r, .., B r  (device)       T: no rows. The captured host copy
                                                    says 0, r, .., P r for every size
    seq_lens          context + r                   0
    state_slots       the sequences' slots          the null slot (never touched: no rows)
    block_tables      their tables (B x w)          whatever was there (never read)

Every op on the path takes its lengths from the device tensors: the paged prefill
attention finds its tiles from ``query_start_loc`` (method ``kernel``, never
``dequantized`` at ``r`` rows), the varlen conv's state kernel reads real lengths, and the
delta rule walks each sequence's rows (``kernels/gdn_recurrent.py``, taken for chunks of
at most ``gdn.RECURRENT_MAX_ROWS`` rows, eager verify steps included). The captured host
copy of ``seq_lens`` is ``max_model_len``, so that the attention's split of the key range
suits any context, as the prefill graphs do.

A graph computes every row's final-normed hidden state, every row's logits (a pure verify
step uses them all) and each Gated DeltaNet layer's projected inputs (``GdnRecord``, for
the rollback), into static buffers of ``max size * r`` rows shared by all sizes. The
graphs share one memory pool (the decode graphs' when given), captured largest first; a
capture failure leaves verify steps eager. A step that rejects a draft rolls back by the
rollback graph of the same size (``rollback_graphs.py``), which reads this replay's state
slots and record.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.decode_graphs import graph_batch_sizes
from pagedserve.engine.graph_capture import captured
from pagedserve.model.forward_batch import ForwardBatch


@dataclass
class VerifyOutput:
    """One verify pass: ``hidden`` ``[T, H]`` every row's final-normed hidden state,
    ``logits`` float32 ``[T, vocab]``, ``gdn_inputs`` each Gated DeltaNet layer's
    ``(mixed [T, conv_dim], b [T, Hv], a [T, Hv])`` in layer order (``GdnRecord.inputs``
    of every row)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    gdn_inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def rows(self, n: int) -> VerifyOutput:
        """The first ``n`` rows (views)."""
        return VerifyOutput(self.hidden[:n], self.logits[:n],
                            [(m[:n], b[:n], a[:n]) for m, b, a in self.gdn_inputs])


VerifyFn = Callable[[ForwardBatch], VerifyOutput]


def verify_graph_sizes(max_batch_size: int, rows_per_seq: int, max_tokens: int | None) -> list[int]:
    """The decode graphs' sizes up to ``max_batch_size`` sequences, and up to the first
    size that holds every step of at most ``max_tokens`` rows (``None``: no such cap)."""
    sizes = graph_batch_sizes(max_batch_size)
    if max_tokens is None:
        return sizes
    most = max(1, max_tokens // rows_per_seq)  # sequences a step of max_tokens rows holds
    return sizes[:bisect.bisect_left(sizes, most) + 1]


def is_pure_verify(batch: ForwardBatch, rows_per_seq: int) -> bool:
    """Whether every sequence of ``batch`` holds exactly ``rows_per_seq`` new rows (and
    the batch is unpadded)."""
    r = rows_per_seq
    return (r > 1 and batch.num_decode_seqs == 0 and batch.row_valid is None
            and batch.query_start_loc_cpu == list(range(0, batch.num_seqs * r + 1, r)))


class VerifyGraphs:
    """Captured pure verify steps and their persistent input and output buffers.

    Args:
        forward: one verify pass over a ``ForwardBatch`` (``ModelRunner._verify_pass``).
        rows_per_seq: ``r = k + 1``.
        sizes: the padded batch sizes to capture (``verify_graph_sizes``).
        pool: a CUDA graph memory pool to share (the decode graphs'), or ``None``.
    """

    def __init__(self, forward: VerifyFn, device: torch.device, sizes: list[int],
                 rows_per_seq: int, max_blocks_per_seq: int, null_slot: int,
                 max_model_len: int, pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        self.forward = forward
        self.sizes = sizes
        self.rows_per_seq = r = rows_per_seq
        self.null_slot = null_slot
        self.max_model_len = max_model_len
        self.pool = pool
        n = sizes[-1] if sizes else 0

        def buf(shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.buffers = {
            "input_ids": buf((n * r,), torch.long),  # [P r]
            "positions": buf((n * r,), torch.long),  # [P r]
            "slot_mapping": buf((n * r,), torch.long, -1),  # [P r]
            "row_valid": buf((n * r,), torch.bool),  # [P r]
            "query_start_loc": buf((n + 1,), torch.int32),  # [P + 1]
            "seq_lens": buf((n,), torch.int32),  # [P]
            "block_tables": buf((n, max_blocks_per_seq), torch.int32),  # [P, max_blocks]
            "state_slots": buf((n,), torch.int32, null_slot),  # [P]
            # Each sequence's last row; the verify pass reads every row, not these.
            "logits_indices": torch.arange(r - 1, n * r, r, dtype=torch.long, device=device),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # The size the last ``run`` replayed: its buffers hold that step until the next.
        self.last_size: int | None = None
        # [P_max r] rows each, shared by every size; set by the first (largest) capture.
        self.output: VerifyOutput | None = None

    @classmethod
    def try_capture(cls, forward: VerifyFn, device: torch.device, sizes: list[int],
                    rows_per_seq: int, max_blocks_per_seq: int, null_slot: int,
                    max_model_len: int, pool: torch.cuda._POOL_HANDLE | None = None,
                    ) -> VerifyGraphs | None:
        """Capture all sizes; on failure log why and return ``None`` (eager verify)."""
        if not sizes:
            return None
        graphs = cls(forward, device, sizes, rows_per_seq, max_blocks_per_seq, null_slot,
                     max_model_len, pool)
        if not captured(graphs.capture,
                        "verify CUDA graph capture failed, verify steps run eagerly"):
            return None
        return graphs

    def static_batch(self, size: int) -> ForwardBatch:
        """The ``ForwardBatch`` a graph of ``size`` sequences is captured with (views of
        the buffers; the host copies describe ``size`` sequences of ``r`` rows over the
        longest context)."""
        b, r = self.buffers, self.rows_per_seq
        rows = size * r
        return ForwardBatch(
            input_ids=b["input_ids"][:rows],
            positions=b["positions"][:rows],
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][:rows],
            state_slots=b["state_slots"][:size],
            logits_indices=b["logits_indices"][:size],
            num_decode_seqs=0,
            query_start_loc_cpu=list(range(0, rows + 1, r)),
            seq_lens_cpu=[self.max_model_len] * size,
            row_valid=b["row_valid"][:rows],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first. The buffers hold an all-padding batch
        meanwhile: no rows on the device, no K/V written, no state touched."""
        self.buffers["query_start_loc"].zero_()
        self.buffers["row_valid"].zero_()
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        self.pool = pool
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            batch = self.static_batch(size)
            # Warm up on a side stream: Triton compiles and autotunes outside the capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    out = self.forward(batch)
                if self.output is None:  # the largest size: the shared output buffers
                    self.output = _empty_like(out)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                _copy_into(self.output, self.forward(batch))
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a pure verify step that a captured size holds."""
        return (bool(self.sizes) and batch.num_seqs <= self.sizes[-1]
                and is_pure_verify(batch, self.rows_per_seq))

    def run(self, batch: ForwardBatch) -> VerifyOutput:
        """Replay the graph for ``batch`` (``fits``). ``hidden`` and ``logits`` are
        copies; ``gdn_inputs`` are views of the static buffers, valid until the next
        replay (the step's rollback reads them before that, ``rollback_graphs.py``)."""
        size = self.load(batch)
        self.graphs[size].replay()
        self.last_size = size
        assert self.output is not None
        out = self.output.rows(batch.num_tokens)
        return VerifyOutput(out.hidden.clone(), out.logits.clone(), out.gdn_inputs)

    def load(self, batch: ForwardBatch) -> int:
        """Copy ``batch`` into the buffers, padded (table above); return the padded size."""
        n, t = batch.num_seqs, batch.num_tokens
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        rows = size * self.rows_per_seq
        b = self.buffers
        for name in ("input_ids", "positions", "slot_mapping"):
            b[name][:t].copy_(getattr(batch, name), non_blocking=True)
        for name in ("seq_lens", "state_slots"):
            b[name][:n].copy_(getattr(batch, name), non_blocking=True)
        b["query_start_loc"][: n + 1].copy_(batch.query_start_loc, non_blocking=True)
        width = batch.block_tables.shape[1]
        b["block_tables"][:n, :width].copy_(batch.block_tables, non_blocking=True)
        b["row_valid"][:t].fill_(True)
        if size > n:
            b["input_ids"][t:rows].zero_()
            b["positions"][t:rows].zero_()
            b["slot_mapping"][t:rows].fill_(-1)
            b["row_valid"][t:rows].fill_(False)
            b["query_start_loc"][n + 1: size + 1].fill_(t)
            b["seq_lens"][n:size].zero_()
            b["state_slots"][n:size].fill_(self.null_slot)
        return size


def _empty_like(out: VerifyOutput) -> VerifyOutput:
    return VerifyOutput(torch.empty_like(out.hidden), torch.empty_like(out.logits),
                        [tuple(torch.empty_like(t) for t in x)  # type: ignore[misc]
                         for x in out.gdn_inputs])


def _copy_into(dst: VerifyOutput, src: VerifyOutput) -> None:
    """``src``'s rows into the first rows of ``dst``."""
    n = src.hidden.shape[0]
    dst.hidden[:n].copy_(src.hidden)
    dst.logits[:n].copy_(src.logits)
    for d, s in zip(dst.gdn_inputs, src.gdn_inputs):
        for d_t, s_t in zip(d, s):
            d_t[:n].copy_(s_t)
