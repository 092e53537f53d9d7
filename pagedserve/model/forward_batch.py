"""``ForwardBatch``: everything one forward step needs, passed explicitly (no globals).

The step contract between the engine and the model; ``engine/batch_builder.py`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.model.state_taps import GdnRound, StateTap


@dataclass
class GdnRecord:
    """What the Gated DeltaNet layers of one step advance their states on, for some rows.

    ``rows`` int64 ``[R]``: rows of the step to record, or ``None``: every row (``R = T``).
    Each layer appends, in layer order, those rows of its projected inputs
    ``(mixed [R, conv_dim], b [R, Hv], a [R, Hv])`` to ``inputs`` (copies, or views of
    the projection for every row); ``Qwen3_5Model.advance_linear_states`` replays them."""

    rows: torch.Tensor | None
    inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class HostBatch:
    """A step's batch as the batch builder packs it on the host, before its two
    host->device copies: what a tensor-parallel worker receives to build the same
    ``ForwardBatch`` on its own device (``engine/batch_builder.py`` has the layout).

    ``longs`` int64 and ``ints`` int32 are the packed vectors, ``tables`` int32
    ``[B, max_blocks]``; ``long_offsets`` / ``int_offsets`` start each section.
    """

    longs: torch.Tensor
    ints: torch.Tensor
    tables: torch.Tensor
    long_offsets: list[int]
    int_offsets: list[int]
    num_decode_seqs: int
    query_start_loc: list[int]
    seq_lens: list[int]
    state_taps: list[StateTap] = field(default_factory=list)


@dataclass
class ForwardBatch:
    """One step over B sequences holding T new tokens, decode sequences first.

    Device tensors (on the model's device):
        input_ids:        int64 ``[T]``
        positions:        int64 ``[T]``; RoPE position = the K/V row each token is written to
        query_start_loc:  int32 ``[B + 1]``; cu_seqlens of the new tokens
        seq_lens:         int32 ``[B]``; cached tokens after this step (context + new)
        block_tables:     int32 ``[B, max_blocks]``
        slot_mapping:     int64 ``[T]``; K/V write slot per token, -1 for padding rows
        state_slots:      int32 ``[B]``; recurrent-state slot per sequence
        logits_indices:   int64 ``[B]``; row of each sequence's last new token

    Host copies (plain lists, so planning never syncs the device):
        query_start_loc_cpu, seq_lens_cpu

    Recording (speculative verify steps, ``engine/spec_step.py``):
        gdn_record:       ``None``, or a ``GdnRecord``: the rows whose Gated DeltaNet
                          inputs every such layer copies out, in layer order.

    State taps (prefix-cache checkpoints inside prefill chunks, ``model/state_taps.py``):
        gdn_rounds:       ``None``, or the rounds the Gated DeltaNet layers advance the
                          batch's rows in, so that tap slots receive the states partway
                          through chunks. Such a batch runs eagerly.

    Host form (tensor parallelism, ``parallel/runner.py``):
        host:             the ``HostBatch`` the device tensors were copied from, or ``None``
                          (a batch built otherwise, or whose tensors were replaced since).

    Padding (prefill CUDA graphs, ``engine/prefill_graphs.py``):
        row_valid:        bool ``[T]`` or ``None`` (every row real). A graph's batch is one
                          sequence padded to a captured row count: the device
                          ``query_start_loc`` ends at the real rows, the host copies at
                          the padded count, and rows past the real ones are False here.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    num_decode_seqs: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    row_valid: torch.Tensor | None = None
    gdn_record: GdnRecord | None = None
    gdn_rounds: list[GdnRound] | None = None
    host: HostBatch | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    def query_lens_cpu(self) -> list[int]:
        q = self.query_start_loc_cpu
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    def context_lens_cpu(self) -> list[int]:
        """Tokens cached before this step, per sequence."""
        return [s - n for s, n in zip(self.seq_lens_cpu, self.query_lens_cpu())]

    def sequences(self, start: int, stop: int) -> ForwardBatch:
        """Sequences ``start:stop`` as a batch of their own, indexing its rows from 0.
        Needs no state taps and no padding rows."""
        assert self.gdn_rounds is None, "a batch with state taps does not split"
        assert self.row_valid is None, "a padded batch does not split"
        assert 0 <= start < stop <= self.num_seqs, (start, stop, self.num_seqs)
        q = self.query_start_loc_cpu
        first, end = q[start], q[stop]
        return ForwardBatch(
            self.input_ids[first:end], self.positions[first:end],
            self.query_start_loc[start:stop + 1] - first, self.seq_lens[start:stop],
            self.block_tables[start:stop], self.slot_mapping[first:end],
            self.state_slots[start:stop], self.logits_indices[start:stop] - first,
            max(0, min(self.num_decode_seqs, stop) - start),
            [x - first for x in q[start:stop + 1]], self.seq_lens_cpu[start:stop])
