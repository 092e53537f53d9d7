"""The vocabulary-parallel embedding: each rank holds a contiguous shard of the rows.

Rank r of N holds token ids ``[r V', (r+1) V')`` with ``V' = ceil(V / N)``, the last shard
padded with zero rows. A lookup zeroes the ids outside the shard and the ranks' rows are
summed; the same shard, used as the (tied or untied) LM head, gives the logits of its ids,
gathered over the ranks and cut back to V (vLLM's ``VocabParallelEmbedding``, the idea).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.parallel.group import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """``weight`` ``[V', H]``: the rows of this rank's token ids (``V' = ceil(V / N)``)."""

    def __init__(self, vocab_size: int, shard_rows: int, hidden_size: int,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.first = tp.rank * shard_rows
        self.num_rows = max(0, min(shard_rows, vocab_size - self.first))  # real, unpadded
        self.weight = nn.Parameter(torch.zeros(shard_rows, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: int64 ``[T]`` -> ``[T, H]`` (summed over the ranks)."""
        local = ids - self.first
        outside = (local < 0) | (local >= self.num_rows)  # [T]
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))
