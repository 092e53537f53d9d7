"""CUDA graphs for the MTP drafter's passes (``engine/drafter.py``), one per padded batch size.

A pass of the one-layer MTP head and its logits over the draft vocabulary (``N'`` ids: the
shared lm_head's rows of them, all ``V`` without a subset; ``engine/draft_vocab.py``), run
eagerly, is bound by the host's launches, not by its reads (``docs/kernel-decisions.md``).
Both passes of the drafter replay graphs of the smallest captured size ``P >= B``, padded
as the decode and verify graphs pad.

**Propose** (``ProposeGraphs``): draft ``j + 1`` of each sequence (``j = 1 .. k - 1``)
comes from one row per sequence: the head's output behind draft ``j`` and draft ``j``
itself, at K/V row ``c + j - 1`` (``c`` the sequence's computed tokens). One graph per
(size, ``j``) reads the buffers' row ``j - 1`` and writes row ``j``::

    buffer                 sequence 0 .. B-1, j < d (live)   B .. P-1, or j >= d (padding)
    ids [k, P]             draft j + 1 (row 0: the tail's)   what the pass computed
    hidden [k, P, H]       the head's output behind it       what the pass computed
    logits [k, P, N']      its float32 draft logits          what the pass computed
    positions [k-1, P]     RoPE position c + j               0
    slot_mapping [k-1, P]  the slot of K/V row c + j - 1     -1   (kv_write skips the row)
    seq_lens [k-1, P]      c + j                             0    (decode attention: zeros)
    block_tables [P, w]    their tables                      stale (never read: seq_len 0)

Each pass ends in the greedy draft on the device: ``ids[j]`` is the target id of column
``argmax logits[j]`` (``DraftHead.token_ids``), which the next pass embeds. The passes are
separate graphs, not one chain: a sampled draft's draw (its request's seed and filters,
from the host) falls between two passes, where the drafter overwrites that sequence's id;
with every request greedy the replays follow each other with no host sync.

**Observe** (``ObserveGraphs``): the kept rows of each sequence, ``1 .. r`` of them
(``r = k + 1``), packed as ``build_forward_batch`` packs them and padded to ``P r`` rows
as ``verify_graphs.py`` pads a verify step (padding rows write no K/V row; the device
``query_start_loc`` holds each sequence's real row count, the captured host copy ``r``
each); the head's output at each sequence's last kept row (its *tail*, row
``logits_indices``) is gathered on the device, with its draft logits ``[P, N']``.

Every graph writes static buffers shared by all sizes, and they share one memory pool
(the decode graphs' when given), captured largest first; a capture failure leaves the
drafter eager.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Protocol

import torch

from pagedserve.engine.graph_capture import captured
from pagedserve.model.forward_batch import ForwardBatch

# (batch, hidden [T, H]) -> the MTP head's output [T, H], its K/V rows written.
MTPPassFn = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]


class DraftLogits(Protocol):
    """The drafter's head (``engine/draft_vocab.DraftHead``): float32 logits ``[N, N']``
    over ``num_rows`` draft-vocabulary columns from ``[N, H]``, and each column's target
    id."""

    num_rows: int

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor: ...


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            fill: int = 0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype, device=device)


def _smallest_holding(sizes: list[int], n: int) -> int:
    return sizes[bisect.bisect_left(sizes, n)]


def _capture(body: Callable[[], None], pool: torch.cuda._POOL_HANDLE,
             stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """``body`` twice on a side stream (Triton compiles and autotunes outside the
    capture), then captured."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


class ProposeGraphs:
    """The propose passes ``j = 1 .. k - 1`` of every size, and their buffers (table above).

    Args:
        mtp_pass, head: the MTP head's pass (``ModelRunner._mtp_pass``) and its logits
            over the draft vocabulary (``ModelRunner.draft_head``).
        sizes: the padded batch sizes (``graph_batch_sizes``).
        num_drafts: ``k``, at least 2.
    """

    def __init__(self, mtp_pass: MTPPassFn, head: DraftLogits, device: torch.device,
                 dtype: torch.dtype, sizes: list[int], num_drafts: int, hidden_size: int,
                 max_blocks_per_seq: int, null_slot: int) -> None:
        if num_drafts < 2:
            raise ValueError(f"propose graphs need num_drafts >= 2, got {num_drafts}")
        self.mtp_pass, self.head = mtp_pass, head
        self.sizes, self.num_drafts = sizes, num_drafts
        n, k = sizes[-1], num_drafts
        self.buffers = {
            "ids": _buffer((k, n), torch.long, device),  # [k, P]
            "hidden": _buffer((k, n, hidden_size), dtype, device),  # [k, P, H]
            "logits": _buffer((k, n, head.num_rows), torch.float32, device),  # [k, P, N']
            "positions": _buffer((k - 1, n), torch.long, device),  # [k - 1, P]
            "slot_mapping": _buffer((k - 1, n), torch.long, device, -1),  # [k - 1, P]
            "seq_lens": _buffer((k - 1, n), torch.int32, device),  # [k - 1, P]
            "block_tables": _buffer((n, max_blocks_per_seq), torch.int32, device),  # [P, w]
            "state_slots": _buffer((n,), torch.int32, device, null_slot),  # [P], unread
            "query_start_loc": torch.arange(n + 1, dtype=torch.int32, device=device),
            "logits_indices": torch.arange(n, dtype=torch.long, device=device),
        }
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def holds(self, num_seqs: int, num_drafts: int) -> bool:
        """Whether a captured size holds ``num_seqs`` sequences drafting at most
        ``num_drafts`` tokens."""
        return num_seqs <= self.sizes[-1] and num_drafts <= self.num_drafts

    def static_batch(self, size: int, j: int) -> ForwardBatch:
        """The batch pass ``j`` of ``size`` sequences runs on: one decode row each."""
        b = self.buffers
        return ForwardBatch(
            input_ids=b["ids"][j - 1, :size], positions=b["positions"][j - 1, :size],
            query_start_loc=b["query_start_loc"][: size + 1],
            seq_lens=b["seq_lens"][j - 1, :size], block_tables=b["block_tables"][:size],
            slot_mapping=b["slot_mapping"][j - 1, :size], state_slots=b["state_slots"][:size],
            logits_indices=b["logits_indices"][:size], num_decode_seqs=size,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[0] * size)

    def run_pass(self, size: int, j: int) -> None:
        """Pass ``j`` of ``size`` sequences, eagerly (what its graph captures)."""
        b = self.buffers
        out = self.mtp_pass(self.static_batch(size, j), b["hidden"][j - 1, :size])  # [P, H]
        logits = self.head.logits(out)  # [P, N']
        b["hidden"][j, :size].copy_(out)
        b["logits"][j, :size].copy_(logits)
        b["ids"][j, :size].copy_(self.head.token_ids(logits.argmax(dim=-1)))

    def load(self, hidden: torch.Tensor, logits: torch.Tensor, kv_rows: list[list[int]],
             kv_slots: list[list[int]], block_tables: torch.Tensor) -> int:
        """Fill row 0 and the passes' inputs; return the padded size.

        Args:
            hidden: ``[B, H]`` the tails' outputs; logits: float32 ``[B, N']`` their
                draft logits (``ids[0]`` becomes their greedy drafts).
            kv_rows, kv_slots: per sequence, the K/V row pass ``j`` writes (its
                ``j - 1``-th entry, ``c + j - 1``) and its slot, for ``j < d``.
            block_tables: int32 ``[B, w]``, ``w <= max_blocks_per_seq`` (host or device).
        """
        size = _smallest_holding(self.sizes, hidden.shape[0])
        passes = self.num_drafts - 1
        host = [[[0] * size for _ in range(passes)], [[-1] * size for _ in range(passes)]]
        for i, (rows, slots) in enumerate(zip(kv_rows, kv_slots)):
            for j, (row, slot) in enumerate(zip(rows, slots)):
                host[0][j][i] = row + 1  # RoPE position, and the length after the row
                host[1][j][i] = slot
        dev = torch.tensor(host, dtype=torch.long).to(self.buffers["ids"].device,
                                                      non_blocking=True)
        return self._fill(hidden, logits, dev[0], dev[1], block_tables)

    def load_on_device(self, hidden: torch.Tensor, logits: torch.Tensor, kv_rows: torch.Tensor,
                       kv_slots: torch.Tensor, block_tables: torch.Tensor) -> int:
        """``load`` for sequences that all draft ``k`` tokens, with no host value read:
        ``kv_rows`` and ``kv_slots`` int64 ``[B, k - 1]`` on the device (row ``j - 1``
        of a sequence: what pass ``j`` writes), ``block_tables`` int32 ``[B, w]`` there."""
        size = _smallest_holding(self.sizes, hidden.shape[0])
        n, passes = hidden.shape[0], self.num_drafts - 1
        lengths = kv_rows.new_zeros(passes, size)
        lengths[:, :n] = kv_rows.T + 1
        slots = kv_rows.new_full((passes, size), -1)
        slots[:, :n] = kv_slots.T
        return self._fill(hidden, logits, lengths, slots, block_tables)

    def _fill(self, hidden: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor,
              slots: torch.Tensor, block_tables: torch.Tensor) -> int:
        """Row 0 from the tails, and the passes' inputs: ``lengths`` and ``slots`` int64
        ``[k - 1, P]`` on the device (padding: 0 and -1); return ``P``."""
        b, n, size = self.buffers, hidden.shape[0], lengths.shape[1]
        b["hidden"][0, :n].copy_(hidden)
        b["logits"][0, :n].copy_(logits)
        b["ids"][0, :n].copy_(self.head.token_ids(logits.argmax(dim=-1)))
        b["positions"][:, :size].copy_(lengths)
        b["seq_lens"][:, :size].copy_(lengths)
        b["slot_mapping"][:, :size].copy_(slots)
        width = block_tables.shape[1]
        b["block_tables"][:n, :width].copy_(block_tables, non_blocking=True)
        return size

    def replay(self, size: int, j: int) -> None:
        self.graphs[(size, j)].replay()

    def clear(self) -> None:
        """Every row padding: a pass writes no K/V row."""
        self.buffers["slot_mapping"].fill_(-1)
        self.buffers["seq_lens"].zero_()

    def capture(self, pool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream) -> None:
        self.clear()
        for size in reversed(self.sizes):
            for j in range(1, self.num_drafts):
                self.graphs[(size, j)] = _capture(
                    functools.partial(self.run_pass, size, j), pool, stream)


class ObserveGraphs:
    """The observe pass of every size over up to ``rows_per_seq`` kept rows per sequence,
    and its buffers.

    Args:
        mtp_pass, head: the MTP head's pass (``ModelRunner._mtp_pass``) and its logits
            over the draft vocabulary (``ModelRunner.draft_head``).
        sizes: the padded batch sizes (``verify_graph_sizes``).
        rows_per_seq: ``r = k + 1``, the most rows a sequence keeps in one step.
        max_model_len: the captured host copy of ``seq_lens`` (the attention's split of
            the key range suits any context, as the verify graphs').
    """

    def __init__(self, mtp_pass: MTPPassFn, head: DraftLogits, device: torch.device,
                 dtype: torch.dtype, sizes: list[int], rows_per_seq: int, hidden_size: int,
                 max_blocks_per_seq: int, null_slot: int, max_model_len: int) -> None:
        self.mtp_pass, self.head = mtp_pass, head
        self.sizes, self.rows_per_seq = sizes, rows_per_seq
        self.null_slot, self.max_model_len = null_slot, max_model_len
        n, r = sizes[-1], rows_per_seq
        self.buffers = {
            "input_ids": _buffer((n * r,), torch.long, device),  # [P r]
            "positions": _buffer((n * r,), torch.long, device),  # [P r]
            "slot_mapping": _buffer((n * r,), torch.long, device, -1),  # [P r]
            "row_valid": _buffer((n * r,), torch.bool, device),  # [P r]
            "hidden": _buffer((n * r, hidden_size), dtype, device),  # [P r, H]
            "query_start_loc": _buffer((n + 1,), torch.int32, device),  # [P + 1]
            "seq_lens": _buffer((n,), torch.int32, device),  # [P]
            "block_tables": _buffer((n, max_blocks_per_seq), torch.int32, device),  # [P, w]
            "state_slots": _buffer((n,), torch.int32, device, null_slot),  # [P], unread
            "logits_indices": _buffer((n,), torch.long, device),  # [P]: the tails' rows
            "tail_hidden": _buffer((n, hidden_size), dtype, device),  # [P, H]
            "tail_logits": _buffer((n, head.num_rows), torch.float32, device),  # [P, N']
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def fits(self, query_lens: list[int]) -> bool:
        """Whether a captured size holds sequences keeping ``query_lens`` rows each."""
        return (len(query_lens) <= self.sizes[-1]
                and all(1 <= q <= self.rows_per_seq for q in query_lens))

    def static_batch(self, size: int) -> ForwardBatch:
        """The batch the pass of ``size`` sequences runs on (views of the buffers; the
        host copies describe ``r`` rows each over the longest context)."""
        b, r = self.buffers, self.rows_per_seq
        rows = size * r
        return ForwardBatch(
            input_ids=b["input_ids"][:rows], positions=b["positions"][:rows],
            query_start_loc=b["query_start_loc"][: size + 1], seq_lens=b["seq_lens"][:size],
            block_tables=b["block_tables"][:size], slot_mapping=b["slot_mapping"][:rows],
            state_slots=b["state_slots"][:size], logits_indices=b["logits_indices"][:size],
            num_decode_seqs=0, query_start_loc_cpu=list(range(0, rows + 1, r)),
            seq_lens_cpu=[self.max_model_len] * size, row_valid=b["row_valid"][:rows])

    def run_pass(self, size: int) -> None:
        """The pass of ``size`` sequences, eagerly (what its graph captures)."""
        b = self.buffers
        out = self.mtp_pass(self.static_batch(size), b["hidden"][: size * self.rows_per_seq])
        tail = out[b["logits_indices"][:size]]  # [P, H]
        b["tail_hidden"][:size].copy_(tail)
        b["tail_logits"][:size].copy_(self.head.logits(tail))

    def load(self, batch: ForwardBatch, hidden: torch.Tensor) -> int:
        """Copy ``batch`` (``fits``; ``positions`` the RoPE positions, ``logits_indices``
        each sequence's last row) and its input states ``hidden`` ``[T, H]`` into the
        buffers, padded; return the padded size. Padding rows keep stale (finite) states:
        their outputs are never read."""
        b, n, t = self.buffers, batch.num_seqs, batch.num_tokens
        size = _smallest_holding(self.sizes, n)
        rows = size * self.rows_per_seq
        for name in ("input_ids", "positions", "slot_mapping"):
            b[name][:t].copy_(getattr(batch, name), non_blocking=True)
        b["hidden"][:t].copy_(hidden)
        for name in ("seq_lens", "logits_indices"):
            b[name][:n].copy_(getattr(batch, name), non_blocking=True)
        b["query_start_loc"][: n + 1].copy_(batch.query_start_loc, non_blocking=True)
        width = batch.block_tables.shape[1]
        b["block_tables"][:n, :width].copy_(batch.block_tables, non_blocking=True)
        b["row_valid"][:t].fill_(True)
        if t < rows:
            b["input_ids"][t:rows].zero_()
            b["positions"][t:rows].zero_()
            b["slot_mapping"][t:rows].fill_(-1)
            b["row_valid"][t:rows].fill_(False)
        if n < size:
            b["query_start_loc"][n + 1: size + 1].fill_(t)
            b["seq_lens"][n:size].zero_()
            b["logits_indices"][n:size].zero_()
        return size

    def run(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for ``batch``; return copies of its tails' outputs ``[B, H]``
        and draft logits float32 ``[B, N']``."""
        size = self.load(batch, hidden)
        self.graphs[size].replay()
        n = batch.num_seqs
        return self.buffers["tail_hidden"][:n].clone(), self.buffers["tail_logits"][:n].clone()

    def clear(self) -> None:
        """Every row and sequence padding: the pass writes no K/V row."""
        b = self.buffers
        b["slot_mapping"].fill_(-1)
        b["row_valid"].fill_(False)
        b["query_start_loc"].zero_()
        b["seq_lens"].zero_()
        b["logits_indices"].zero_()

    def capture(self, pool: torch.cuda._POOL_HANDLE, stream: torch.cuda.Stream) -> None:
        self.clear()
        for size in reversed(self.sizes):
            self.graphs[size] = _capture(functools.partial(self.run_pass, size), pool, stream)


class DraftGraphs:
    """The drafter's captured passes: ``propose`` (``None`` for ``k = 1``: no chained
    pass) and ``observe``."""

    def __init__(self, propose: ProposeGraphs | None, observe: ObserveGraphs) -> None:
        self.propose = propose
        self.observe = observe

    @classmethod
    def try_capture(cls, propose: ProposeGraphs | None, observe: ObserveGraphs,
                    pool: torch.cuda._POOL_HANDLE | None = None) -> DraftGraphs | None:
        """Capture every size of both; on failure log why and return ``None`` (the
        drafter runs eagerly)."""
        graphs = cls(propose, observe)

        @torch.inference_mode()
        def capture() -> None:
            shared = pool if pool is not None else torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            for part in (propose, observe):
                if part is not None:
                    part.capture(shared, stream)
            torch.cuda.synchronize()

        if not captured(capture, "draft CUDA graph capture failed, the drafter runs eagerly"):
            return None
        return graphs

    def replay_all(self) -> None:
        """Replay every graph over an all-padding batch (nothing is written): the first
        launch of a graph uploads it to the device, which no request waits for then."""
        with torch.inference_mode():
            if self.propose is not None:
                self.propose.clear()
                for size, j in self.propose.graphs:
                    self.propose.replay(size, j)
            self.observe.clear()
            for graph in self.observe.graphs.values():
                graph.replay()
