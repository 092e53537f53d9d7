"""``ForwardBatch``: everything one forward step needs, passed explicitly (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import KVCacheManager


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


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: ``token_ids`` written at ``start_pos`` onwards.

    The K/V rows ``[start_pos, start_pos + len(token_ids))`` must already be reserved in
    the ``KVCacheManager`` (``reserve``), so that their slots exist.
    """

    kv_handle: Handle
    state_slot: int
    token_ids: tuple[int, ...]
    start_pos: int


def build_forward_batch(
    chunks: list[SeqChunk], kv: KVCacheManager, device: str | torch.device = "cpu",
    num_table_cols: int | None = None,
) -> ForwardBatch:
    """Assemble a ``ForwardBatch`` from per-sequence chunks (decode chunks first).

    ``num_table_cols`` fixes the block-table width (default: the widest table in the batch).
    """
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    num_decode = 0
    while num_decode < len(chunks) and len(chunks[num_decode].token_ids) == 1:
        num_decode += 1
    if any(len(c.token_ids) == 0 for c in chunks):
        raise ValueError("every sequence in a batch needs at least one new token")
    ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    qsl = [0]
    seq_lens: list[int] = []
    for c in chunks:
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        positions.append(torch.arange(c.start_pos, c.start_pos + n, dtype=torch.long))
        slots.append(kv.slot_mapping(c.kv_handle, c.start_pos, c.start_pos + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(c.start_pos + n)
    handles = [c.kv_handle for c in chunks]
    width = max(len(kv.block_table(h)) for h in handles)
    tables, _ = kv.batch_view(handles, num_table_cols or width)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=put(torch.tensor(ids, dtype=torch.long)),
        positions=put(torch.cat(positions)),
        query_start_loc=put(torch.tensor(qsl, dtype=torch.int32)),
        seq_lens=put(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=put(tables.contiguous()),
        slot_mapping=put(torch.cat(slots)),
        state_slots=put(torch.tensor([c.state_slot for c in chunks], dtype=torch.int32)),
        logits_indices=put(torch.tensor(qsl[1:], dtype=torch.long) - 1),
        num_decode_seqs=num_decode,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
