"""State taps: the Gated DeltaNet states partway through a prefill chunk, each copied into a
state slot of its own, without cutting the chunk.

The prefix cache checkpoints a prompt's state every ``checkpoint_interval`` tokens. Cut
into chunks that end there, a long prompt would run four times the forward steps at the
default interval and idle chunk, each paying the fixed costs of a step. Only the linear
layers' conv and delta rule carry state, so only they are split, and the rest of the model
(GEMMs, attention, MLPs) runs the whole chunk at once.

A chunk of ``n`` rows tapped after rows ``r1 < r2`` runs its linear layers in three
rounds, each starting from the state the previous one left::

    rows of the chunk     [0, r1)         [r1, r2)        [r2, n)
    state slot            tap a           tap b           the sequence's own
    copied in before      a <- own        b <- a          own <- b

Round ``j`` advances the ``j``-th segment of every sequence; an untapped sequence (every
decode row among them) runs whole in round 0, on its own slot. After the step, ``a`` holds
the state after ``r1`` rows, ``b`` after ``r2``, and the sequence's own slot after all
``n``: what chunks cut at ``r1`` and ``r2`` would leave, from the same kernels run over the
same segments. The conv outputs do not depend on the split either (each row reads the
``kernel - 1`` rows before it, from the state carried in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTap:
    """Sequence ``seq`` of a batch: copy its state after the first ``rows`` rows of its
    chunk (``0 < rows < chunk length``) into state slot ``slot``."""

    seq: int
    rows: int
    slot: int


@dataclass
class GdnRound:
    """One round of a tapped step's linear layers: ``rows`` of the batch, as a batch of
    their own.

    ``rows``: a slice of the batch's rows when they are contiguous, else int64 ``[t]``
    row indices, in order. ``query_start_loc`` int32 ``[b + 1]`` (device) and its host copy
    ``query_start_loc_cpu``; ``state_slots`` int32 ``[b]``; the first ``num_decode_seqs``
    segments hold one decode row each. Before the round runs, every layer copies the
    state of slot ``copy_src[i]`` into slot ``copy_dst[i]`` (int64 ``[c]``; ``None``: no
    copy).
    """

    rows: slice | torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: list[int]
    state_slots: torch.Tensor
    num_decode_seqs: int
    copy_src: torch.Tensor | None
    copy_dst: torch.Tensor | None


def gdn_rounds(taps: list[StateTap], query_start_loc_cpu: list[int], state_slots: list[int],
               num_decode_seqs: int, device: str | torch.device) -> list[GdnRound]:
    """The rounds (module docstring) of a batch with ``taps``: sequence ``i`` holds rows
    ``query_start_loc_cpu[i] .. [i + 1]`` and state slot ``state_slots[i]``; decode
    sequences take no tap."""
    qsl = query_start_loc_cpu
    cuts: dict[int, list[StateTap]] = {}
    for tap in sorted(taps, key=lambda t: (t.seq, t.rows)):
        n = qsl[tap.seq + 1] - qsl[tap.seq]
        if tap.seq < num_decode_seqs or not 0 < tap.rows < n:
            raise ValueError(f"a tap after {tap.rows} rows of sequence {tap.seq} "
                             f"({n} rows, {num_decode_seqs} decode sequences) is not inside "
                             "a prefill chunk")
        cuts.setdefault(tap.seq, []).append(tap)
    # Per sequence: its segments' (first row, end row, slot), in order.
    segments = []
    for s in range(len(qsl) - 1):
        seq_taps = cuts.get(s, [])
        bounds = [qsl[s], *(qsl[s] + t.rows for t in seq_taps), qsl[s + 1]]
        slots = [*(t.slot for t in seq_taps), state_slots[s]]
        segments.append([(bounds[j], bounds[j + 1], slots[j]) for j in range(len(slots))])
    rounds = []
    for j in range(max(len(segs) for segs in segments)):
        in_round = [s for s in range(len(segments)) if j < len(segments[s])]
        parts = [segments[s][j] for s in in_round]
        # The state each segment starts from: its sequence's slot, or the previous segment's.
        src = [segments[s][j - 1][2] if j else state_slots[s] for s in in_round]
        copies = [(a, p[2]) for a, p in zip(src, parts) if a != p[2]]
        contiguous = all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))
        rows: slice | torch.Tensor = slice(parts[0][0], parts[-1][1])
        if not contiguous:
            rows = torch.cat([torch.arange(a, b) for a, b, _ in parts]).to(device)
        starts = [0]
        for a, b, _ in parts:
            starts.append(starts[-1] + b - a)
        rounds.append(GdnRound(
            rows=rows,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            query_start_loc_cpu=starts,
            state_slots=torch.tensor([p[2] for p in parts], dtype=torch.int32, device=device),
            num_decode_seqs=num_decode_seqs if j == 0 else 0,
            copy_src=torch.tensor([c[0] for c in copies], device=device) if copies else None,
            copy_dst=torch.tensor([c[1] for c in copies], device=device) if copies else None,
        ))
    return rounds
