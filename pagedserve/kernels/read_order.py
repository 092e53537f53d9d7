"""The order in which decode attention reads a sequence's blocks: by physical address.

Decode attention of one query token is a sum over the sequence's tokens; the order of the
terms does not matter (RoPE is already in the stored K, and every stored token is visible).
Only the table's *set* of blocks and which block holds the partial tail count. So a
decode step may read each sequence's blocks in any order, and reading them in ascending
physical order turns a scattered pool into near-sequential streams: the split plan gives
each program a run of the sorted list, so programs sweep the pool in address order::

    table row (logical order)   [ 907  12  388  40  611 | 95 ]  len = 5 * 16 + 9
    read order                  [  12  40  388 611  907 | 95 ]  full blocks sorted,
                                                                the partial tail last

The write path (``kv_write``) still needs the logical table: slot ``p`` of the sequence
lives in block ``table[p // block_size]``. This order is for reads only.
"""

from __future__ import annotations

import torch


def physical_read_order(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """``block_tables`` (int32 ``[B, max_blocks]``) with each row's full blocks (the first
    ``seq_lens // block_size``) sorted ascending; the partial last block, and the unused
    entries after it, stay where they are. Device ops only (no host sync): capturable in
    a CUDA graph."""
    if block_tables.dim() != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError(f"want block_tables [B, max_blocks] and seq_lens [B], got "
                         f"{list(block_tables.shape)} and {list(seq_lens.shape)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    pos = torch.arange(block_tables.shape[1], device=block_tables.device)
    full = pos[None, :] < (seq_lens // block_size)[:, None]  # [B, max_blocks]
    # Entries past the full blocks sort after them, in place (a stable sort).
    key = torch.where(full, block_tables, torch.iinfo(block_tables.dtype).max)
    order = torch.sort(key, dim=1, stable=True).indices
    return torch.gather(block_tables, 1, order)
