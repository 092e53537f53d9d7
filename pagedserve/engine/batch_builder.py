"""Building a step's ``ForwardBatch`` from the scheduled chunks and the K/V manager."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kv.handles import Handle
from pagedserve.kv.kv_manager import KVCacheManager
from pagedserve.model.forward_batch import ForwardBatch, HostBatch
from pagedserve.model.state_taps import StateTap, gdn_rounds


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: ``token_ids`` written at ``start_pos`` onwards.

    The K/V rows ``[start_pos, start_pos + len(token_ids))`` must already be reserved in
    the ``KVCacheManager`` (``reserve``), so that their slots exist. ``state_taps``:
    ``(rows, slot)`` pairs, each a copy of the state after the chunk's first ``rows`` rows
    into state slot ``slot`` (``model/state_taps.py``).
    """

    kv_handle: Handle
    state_slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    state_taps: tuple[tuple[int, int], ...] = ()


class HostStaging:
    """Reusable host buffers for a step's host->device copies, pinned on CUDA.

    From pageable memory the driver stages a copy while the host waits; from pinned memory
    it is an asynchronous DMA, which matters for a long sequence's block table (256 KB at
    128K tokens). The buffers are rewritten every step, so each step's copies are fenced
    by an event that the next step waits on before writing (a step normally ends in a
    device sync: the wait is free).

    Args:
        device: where the batches go; buffers are pinned only for CUDA.
        max_tokens: most tokens in one step; max_seqs: most sequences; max_blocks: most
            block-table columns. Larger batches bypass the staging (plain copies).
    """

    def __init__(self, device: str | torch.device, max_tokens: int, max_seqs: int,
                 max_blocks: int) -> None:
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        longs, ints = packed_lengths(max_tokens, max_seqs)
        self._longs = torch.empty(longs, dtype=torch.long, pin_memory=pin)
        self._ints = torch.empty(ints, dtype=torch.int32, pin_memory=pin)
        self._tables = torch.empty(max_seqs * max_blocks, dtype=torch.int32, pin_memory=pin)
        self._copied = torch.cuda.Event() if pin else None

    def fits(self, num_tokens: int, num_seqs: int, num_cols: int) -> bool:
        return (num_tokens <= self.max_tokens and num_seqs <= self.max_seqs
                and num_cols <= self.max_blocks)

    def to_device(self, *host: torch.Tensor) -> list[torch.Tensor]:
        """Copy each host tensor (int64, int32, int32 2-D: the longs, ints and tables of
        ``build_forward_batch``) to the device through its buffer."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the buffers
        out = []
        for src, buf in zip(host, (self._longs, self._ints, self._tables)):
            staged = buf[: src.numel()].view(src.shape)
            staged.copy_(src)
            out.append(staged.to(self.device, non_blocking=True))
        if self._copied is not None:
            self._copied.record()
        return out


# Each section of the packed vectors below starts on a 16-byte boundary. Triton specializes
# a pointer argument on 16-byte alignment: a section whose offset depended on the batch's
# token or sequence count would compile a second variant of its kernels (kv_write, the
# decode and prefill attention, the GDN kernels) in the middle of serving, after the
# warm-up.
_ALIGN_BYTES = 16


def _aligned(n: int, itemsize: int) -> int:
    """``n`` elements of ``itemsize`` bytes, rounded up to whole 16-byte units."""
    per = _ALIGN_BYTES // itemsize
    return -(-n // per) * per


def _section_offsets(lengths: list[int], itemsize: int) -> list[int]:
    """Start of each section when every one begins on a 16-byte boundary; the last entry
    is the packed length."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + _aligned(n, itemsize))
    return offsets


def packed_lengths(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """Elements of the packed int64 and int32 vectors of a batch (``build_forward_batch``)."""
    return (_section_offsets([num_tokens] * 3 + [num_seqs], 8)[-1],
            _section_offsets([num_seqs + 1, num_seqs, num_seqs], 4)[-1])


def _pack(sections: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Concatenate 1-D ``sections`` with zero padding so that each starts on a 16-byte
    boundary; returns the vector and the start of each section."""
    offsets = _section_offsets([t.numel() for t in sections], dtype.itemsize)
    packed = torch.zeros(offsets[-1], dtype=dtype)
    for t, start in zip(sections, offsets):
        packed[start:start + t.numel()] = t
    return packed, offsets


def table_width(widest: int, max_blocks: int) -> int:
    """The block-table width of a batch whose longest table has ``widest`` blocks: a
    multiple of 16 columns (at most ``max_blocks``).

    The decode kernels take the table's row stride as a plain integer, which Triton
    specializes on divisibility by 16 (that lets the tiles read their table entries in
    vectors). Widths that were sometimes multiples of 16 and sometimes not would compile a
    second variant of each kernel in the middle of serving, after the warm-up; padded
    widths give one variant, and the capped width the one the CUDA graphs capture. A
    one-column table would also mean the contiguous layout to the kernels: padding rules
    it out."""
    return min(max_blocks, -(-max(widest, 2) // 16) * 16)


def slots_from_tables(block_tables: torch.Tensor, positions: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """int64 ``[B, n]``: the pool slot of each position of ``positions`` int64 ``[B, n]``
    through its sequence's row of ``block_tables`` int32 ``[B, w]``, on their device
    (what ``KVCacheManager.slot_mapping`` computes on the host). Every position must lie
    in a block the table holds."""
    blocks = block_tables.gather(1, positions // block_size).long()
    return blocks * block_size + positions % block_size


def build_forward_batch(
    chunks: list[SeqChunk], kv: KVCacheManager, device: str | torch.device = "cpu",
    num_table_cols: int | None = None, staging: HostStaging | None = None,
) -> ForwardBatch:
    """Assemble a ``ForwardBatch`` from per-sequence chunks (decode chunks first).

    ``num_table_cols`` fixes the block-table width (default: the widest table in the batch).
    ``staging``: reusable (pinned) host buffers for the copies; ``None`` copies from
    temporaries.
    """
    if not chunks:
        raise ValueError("a forward batch needs at least one sequence")
    num_decode = 0
    while num_decode < len(chunks) and len(chunks[num_decode].token_ids) == 1:
        num_decode += 1
    if any(len(c.token_ids) == 0 for c in chunks):
        raise ValueError("every sequence in a batch needs at least one new token")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []  # the leading decode rows
    prefill_slots: list[torch.Tensor] = []  # then the other chunks, in order
    qsl = [0]
    seq_lens: list[int] = []
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        ids.extend(c.token_ids)
        positions.extend(range(c.start_pos, c.start_pos + n))
        if i < num_decode:
            slots.append(kv.slot_of(c.kv_handle, c.start_pos))
        else:
            prefill_slots.append(kv.slot_mapping(c.kv_handle, c.start_pos, c.start_pos + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(c.start_pos + n)
    handles = [c.kv_handle for c in chunks]
    tables, _ = kv.batch_view(handles, num_table_cols or table_width(
        max(len(kv.block_table(h)) for h in handles), kv.max_blocks_per_seq))

    # Two host->device copies for all the small vectors (each copy has a fixed cost), each
    # section starting on a 16-byte boundary (| . | marks the zero padding):
    #   int64: input_ids [T] | . | positions [T] | . | slot_mapping [T] | . | logits_indices [B] | .
    #   int32: query_start_loc [B + 1] | . | seq_lens [B] | . | state_slots [B] | .
    longs, lo = _pack([torch.tensor(ids, dtype=torch.long),
                       torch.tensor(positions, dtype=torch.long),
                       torch.cat([torch.tensor(slots, dtype=torch.long), *prefill_slots]),
                       torch.tensor(qsl[1:], dtype=torch.long) - 1], torch.long)
    ints, io = _pack([torch.tensor(qsl, dtype=torch.int32),
                      torch.tensor(seq_lens, dtype=torch.int32),
                      torch.tensor([c.state_slot for c in chunks], dtype=torch.int32)],
                     torch.int32)
    taps = [StateTap(i, rows, slot) for i, c in enumerate(chunks) for rows, slot in c.state_taps]
    host = HostBatch(longs, ints, tables, lo, io, num_decode, qsl, seq_lens, taps)
    return upload(host, device, staging)


def upload(host: HostBatch, device: str | torch.device,
           staging: HostStaging | None = None) -> ForwardBatch:
    """``host``'s two packed vectors and block table, copied to ``device`` (through
    ``staging`` when it fits), as the ``ForwardBatch`` they describe."""
    B, T = len(host.seq_lens), host.query_start_loc[-1]
    lo, io = host.long_offsets, host.int_offsets
    if staging is not None and staging.fits(T, B, host.tables.shape[1]):
        longs, ints, tables = staging.to_device(host.longs, host.ints, host.tables)
    else:
        longs, ints, tables = (t.contiguous().to(device, non_blocking=True)
                               for t in (host.longs, host.ints, host.tables))
    rounds = None
    if host.state_taps:
        slots = host.ints[io[2]:io[2] + B].tolist()
        rounds = gdn_rounds(host.state_taps, host.query_start_loc, slots,
                            host.num_decode_seqs, device)
    return ForwardBatch(
        input_ids=longs[lo[0]:lo[0] + T],
        positions=longs[lo[1]:lo[1] + T],
        slot_mapping=longs[lo[2]:lo[2] + T],
        logits_indices=longs[lo[3]:lo[3] + B],
        query_start_loc=ints[io[0]:io[0] + B + 1],
        seq_lens=ints[io[1]:io[1] + B],
        state_slots=ints[io[2]:io[2] + B],
        block_tables=tables,
        num_decode_seqs=host.num_decode_seqs,
        query_start_loc_cpu=host.query_start_loc,
        seq_lens_cpu=host.seq_lens,
        gdn_rounds=rounds,
        host=host,
    )
