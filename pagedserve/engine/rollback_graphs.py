"""CUDA graphs that roll back a pure verify step, one per verify graph size.

After a verify graph of ``P`` sequences (``r = k + 1`` rows each, ``verify_graphs.py``)
replays, a sequence that kept ``m`` of its drafts goes back to its spare state and is
advanced again over its first ``c = m + 1`` rows of the graph's recorded Gated DeltaNet
inputs (``spec_step.py``). Run eagerly that is a few launches per layer and sequence
group, bound by the host; here it is one replay of the graph of the same size ``P``,
whose every shape is fixed by ``P`` and ``r``. Only the counts change between replays:
the host writes ``c`` per sequence into a static buffer (one copy), and the graph derives
the rest on the device::

    record rows (the verify graph's, r = 3)   s0: a0 a1 a2 | s1: b0 b1 b2 | s2: c0 c1 c2 | pad
    num_rows      c per sequence, 0: as is    0, 2, 3, 0
    restore       slot back from its spare    s1, s1, s2, s1  (c = 0: the first restored
                                              sequence's slot again, the same values)
    query_start_loc   0, cumsum(c)            0, 0, 2, 5, 5
    rows          record row of packed row j  3 4 6 7 8 | 0 0 0 0 0 0 0
                                              (past the last sequence: row 0, a live row
                                              that no sequence walks)
    advance       every GDN layer's conv and delta rule over the packed rows, from the
                  restored states (``Qwen3_5Model.advance_linear_states``)

A sequence with no rows (one that kept every draft, or padding) is neither restored nor
advanced: the kernels leave a state with no rows as it is, and its place in the restore
goes to a slot that is restored anyway. So no slot but those of sequences that rejected a
draft is written, the null slot included, and one graph serves any mix of counts.
Restoring a sequence that kept every draft and advancing it over all ``r`` rows would also
do (the same kernels on the same inputs leave its state where the verify pass did); it
would only cost its slot's traffic.

The captured ``ForwardBatch`` is the verify graph's static batch with the packed
``query_start_loc``: its host copy says ``r`` rows for every sequence, which fixes the
ops' choices at capture (the delta rule walks rows, ``kernels/gdn_recurrent.py``, as
``r <= MAX_CAPTURED_ROWS``; the varlen conv covers all ``P r`` rows), while every kernel
takes the real bounds from the device. The graph reads the verify graph's state slots and
record buffers as they were left by its last replay, so it replays before the next one.
The graphs share the verify graphs' memory pool; a capture failure leaves rollback eager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from pagedserve.engine.graph_capture import captured
from pagedserve.engine.verify_graphs import VerifyGraphs
from pagedserve.model.forward_batch import ForwardBatch
from pagedserve.model.gated_deltanet import MAX_CAPTURED_ROWS

log = logging.getLogger(__name__)

# (restore_slots int32 [P], batch, record inputs, rows int64 [P r]): restore each slot
# from its spare, then advance every GDN layer over ``rows`` of the inputs.
RollbackFn = Callable[
    [torch.Tensor, ForwardBatch, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
     torch.Tensor],
    None,
]


def pack_rows(num_rows: torch.Tensor, rows_per_seq: int, query_start_loc: torch.Tensor,
              rows: torch.Tensor) -> None:
    """The packed layout of each sequence's first ``num_rows`` rows, on the device.

    Args:
        num_rows: int32 ``[P]`` rows per sequence, each in ``0 .. rows_per_seq``.
        rows_per_seq: ``r``: sequence ``s``'s rows of the record are ``s r .. s r + r - 1``.
        query_start_loc: int32 ``[P + 1]``, written: ``0, cumsum(num_rows)``.
        rows: int64 ``[P r]``, written: the record row of each packed row; the rows past
            the last sequence's read row 0.
    """
    p, r = num_rows.shape[0], rows_per_seq
    ends = torch.cumsum(num_rows, 0, dtype=torch.int32)  # [P]
    query_start_loc[:1].zero_()
    query_start_loc[1:].copy_(ends)
    packed = torch.arange(p * r, dtype=torch.int32, device=num_rows.device)  # [P r]
    seq = torch.searchsorted(ends, packed, right=True)  # [P r] int64, P past the last
    owner = seq.clamp(max=p - 1)
    source = owner * r + (packed - query_start_loc.index_select(0, owner))  # [P r] int64
    rows.copy_(torch.where(seq < p, source, 0))


class RollbackGraphs:
    """Captured rollbacks of pure verify steps, one per verify graph size.

    Args:
        rollback: the restore-and-advance pass (``ModelRunner._rollback_pass``).
        verify: the verify graphs whose replays these roll back (their state slots,
            record buffers and static batches).
        pool: a CUDA graph memory pool to share (the verify graphs'), or ``None``.
    """

    def __init__(self, rollback: RollbackFn, verify: VerifyGraphs,
                 pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        self.rollback = rollback
        self.verify = verify
        self.sizes = verify.sizes
        self.rows_per_seq = r = verify.rows_per_seq
        self.pool = pool
        n = self.sizes[-1] if self.sizes else 0
        device = verify.buffers["state_slots"].device
        self.buffers = {
            "num_rows": torch.zeros(n, dtype=torch.int32, device=device),  # [P]
            "query_start_loc": torch.zeros(n + 1, dtype=torch.int32, device=device),  # [P + 1]
            "rows": torch.zeros(n * r, dtype=torch.long, device=device),  # [P r]
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    def try_capture(cls, rollback: RollbackFn, verify: VerifyGraphs,
                    pool: torch.cuda._POOL_HANDLE | None = None) -> RollbackGraphs | None:
        """Capture all sizes; ``None`` (eager rollback) when ``r`` is past
        ``MAX_CAPTURED_ROWS`` or a capture fails (logged)."""
        if verify.rows_per_seq > MAX_CAPTURED_ROWS:
            log.info("verify steps of %d rows per sequence roll back eagerly (graphs hold "
                     "at most %d)", verify.rows_per_seq, MAX_CAPTURED_ROWS)
            return None
        if not verify.sizes or verify.output is None:
            return None
        graphs = cls(rollback, verify, pool)
        if not captured(graphs.capture,
                        "rollback CUDA graph capture failed, rollback runs eagerly"):
            return None
        return graphs

    def static_batch(self, size: int) -> ForwardBatch:
        """The batch a graph of ``size`` sequences advances: the verify graph's, with the
        packed ``query_start_loc`` on the device and no padding rows."""
        qsl = self.buffers["query_start_loc"][: size + 1]
        return replace(self.verify.static_batch(size), query_start_loc=qsl, row_valid=None,
                       gdn_record=None)

    def step(self, size: int) -> None:
        """What a graph of ``size`` sequences runs: pack, restore, advance."""
        b, r = self.buffers, self.rows_per_seq
        assert self.verify.output is not None
        num_rows = b["num_rows"][:size]
        rows = b["rows"][: size * r]
        pack_rows(num_rows, r, b["query_start_loc"][: size + 1], rows)
        slots = self.verify.buffers["state_slots"][:size]  # [P] padding: the null slot
        walks = num_rows > 0  # [P]
        first = torch.argmax(walks.to(torch.int32)).view(1)  # [1] first with rows, or 0
        restore = torch.where(walks, slots, slots.index_select(0, first))  # [P]
        self.rollback(restore, self.static_batch(size), self.verify.output.gdn_inputs, rows)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, with no rows (nothing advances)."""
        self.buffers["num_rows"].zero_()
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        self.pool = pool
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            # Warm up on a side stream: Triton compiles outside the capture.
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.step(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def load(self, num_rows: list[int]) -> int:
        """Write each sequence's rows to advance over (``1 .. r``; 0 leaves it as it is),
        in the last verify replay's order, and zeros for its padding sequences; return
        that replay's size."""
        size = self.verify.last_size
        assert size is not None and 0 < len(num_rows) <= size, (size, num_rows)
        assert all(0 <= n <= self.rows_per_seq for n in num_rows), num_rows
        host = torch.zeros(size, dtype=torch.int32)
        host[: len(num_rows)] = torch.tensor(num_rows, dtype=torch.int32)
        self.buffers["num_rows"][:size].copy_(host, non_blocking=True)
        return size

    def run(self, num_rows: list[int]) -> None:
        """Roll back the last verify replay's sequences to their first ``num_rows`` rows
        each (``load``; 0: not rolled back), by one replay."""
        self.graphs[self.load(num_rows)].replay()

    def replay_idle(self) -> None:
        """Replay every size with no rows: it restores the first slot of the last verify
        replay and advances nothing. Only for when no sequence is live (the
        warm-up's end), so that a replay's first cost is paid there."""
        self.buffers["num_rows"].zero_()
        for size in self.sizes:
            self.graphs[size].replay()
