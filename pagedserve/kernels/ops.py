"""Op dispatch: the Triton kernels on CUDA tensors, the torch reference elsewhere."""

from __future__ import annotations

import torch

from pagedserve.kernels import reference
from pagedserve.kv.formats import KVBlockStorage


def kv_write(cache: KVBlockStorage, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """See ``reference.kv_write``."""
    reference.kv_write(cache, rows, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """See ``reference.paged_decode_attention``."""
    return reference.paged_decode_attention(q, cache_k, cache_v, block_tables, seq_lens, scale)
