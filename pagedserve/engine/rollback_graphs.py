"""CUDA graphs that roll back a pure verify step, one per verify graph size.

After a verify graph of ``P`` sequences (``r = k + 1`` rows each, ``verify_graphs.py``)
replays, a sequence that kept ``m`` of its drafts goes back to its spare state and is
advanced again over its first ``c = m + 1`` rows of the graph's recorded Gated DeltaNet
inputs (``spec_step.py``). Run eagerly that is a restore and a few launches per layer,
bound by the host; here it is one replay of the graph of the same size ``P``, which
holds a single launch (``kernels/gdn_rollback.py``): every layer and every sequence, each
program reading the spares and writing the live slot, so the restore is fused in. Only
the counts change between replays: the host writes ``c`` per sequence into a static
buffer (one copy), and the kernel reads them on the device::

    record rows (the verify graph's, r = 3)   s0: a0 a1 a2 | s1: b0 b1 b2 | s2: c0 c1 c2 | pad
    num_rows      c per sequence, 0: as is    0, 2, 3, 0
    state_slots   the verify replay's         5, 1, 7, null
    each slot     its spare advanced over     -, b0 b1, c0 c1 c2, -

A sequence with no rows (one that kept every draft, or padding on the null slot) is
neither read nor written. So no slot but those of sequences that rejected a draft is
written, and one graph serves any mix of counts. Advancing a sequence that kept every
draft over all ``r`` rows would also do: it would end at the verify pass's conv state,
and at its recurrent state up to the gates' rounding, for its slot's traffic.

The graph reads the verify graph's state slots and record buffers as they were left by
its last replay, so it replays before the next one. The graphs share the verify graphs'
memory pool; a capture failure leaves rollback eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.engine.graph_capture import captured
from pagedserve.engine.verify_graphs import VerifyGraphs

# (num_rows int32 [P], state_slots int32 [P], rows_per_seq, record inputs): each
# sequence's slot back from its spare and advanced over its first ``num_rows`` rows of
# its ``rows_per_seq`` rows of the record, in every GDN layer (0 rows: left as it is).
RollbackFn = Callable[
    [torch.Tensor, torch.Tensor, int,
     list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
    None,
]


class RollbackGraphs:
    """Captured rollbacks of pure verify steps, one per verify graph size.

    Args:
        rollback: the restore-and-advance pass (``ModelRunner._rollback_pass``).
        verify: the verify graphs whose replays these roll back (their state slots and
            record buffers).
        pool: a CUDA graph memory pool to share (the verify graphs'), or ``None``.
    """

    def __init__(self, rollback: RollbackFn, verify: VerifyGraphs,
                 pool: torch.cuda._POOL_HANDLE | None = None) -> None:
        self.rollback = rollback
        self.verify = verify
        self.sizes = verify.sizes
        self.rows_per_seq = verify.rows_per_seq
        self.pool = pool
        n = self.sizes[-1] if self.sizes else 0
        device = verify.buffers["state_slots"].device
        self.buffers = {
            "num_rows": torch.zeros(n, dtype=torch.int32, device=device),  # [P]
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    def try_capture(cls, rollback: RollbackFn, verify: VerifyGraphs,
                    pool: torch.cuda._POOL_HANDLE | None = None) -> RollbackGraphs | None:
        """Capture all sizes; ``None`` (eager rollback) when a capture fails (logged)."""
        if not verify.sizes or verify.output is None:
            return None
        graphs = cls(rollback, verify, pool)
        if not captured(graphs.capture,
                        "rollback CUDA graph capture failed, rollback runs eagerly"):
            return None
        return graphs

    def step(self, size: int) -> None:
        """What a graph of ``size`` sequences runs: the rollback pass over the counts."""
        assert self.verify.output is not None
        self.rollback(self.buffers["num_rows"][:size],
                      self.verify.buffers["state_slots"][:size],  # [P] padding: the null slot
                      self.rows_per_seq, self.verify.output.gdn_inputs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, with no rows (nothing is written)."""
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

    def load(self, num_rows: list[int] | torch.Tensor) -> int:
        """Write each sequence's rows to advance over (``1 .. r``; 0 leaves it as it is),
        in the last verify replay's order, and zeros for its padding sequences; return
        that replay's size. ``num_rows``: host ints, or int32 ``[B]`` on the device
        (computed there by an async speculative step, ``spec_async.py``: no host value
        is read)."""
        size = self.verify.last_size
        assert size is not None and 0 < len(num_rows) <= size, (size, num_rows)
        counts = self.buffers["num_rows"]
        if isinstance(num_rows, torch.Tensor):
            counts[len(num_rows):size].zero_()
            counts[: len(num_rows)].copy_(num_rows)
            return size
        assert all(0 <= n <= self.rows_per_seq for n in num_rows), num_rows
        host = torch.zeros(size, dtype=torch.int32)
        host[: len(num_rows)] = torch.tensor(num_rows, dtype=torch.int32)
        counts[:size].copy_(host, non_blocking=True)
        return size

    def run(self, num_rows: list[int] | torch.Tensor) -> None:
        """Roll back the last verify replay's sequences to their first ``num_rows`` rows
        each (``load``; 0: not rolled back), by one replay."""
        self.graphs[self.load(num_rows)].replay()

    def replay_idle(self) -> None:
        """Replay every size with no rows: it writes nothing. Run at the warm-up's end,
        so that a replay's first cost is paid there."""
        self.buffers["num_rows"].zero_()
        for size in self.sizes:
            self.graphs[size].replay()
