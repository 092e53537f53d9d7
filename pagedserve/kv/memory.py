"""K/V memory arithmetic: bytes per token, per block, per sequence; paged vs padded.

All figures count K and V of every full-attention layer. A paged sequence of ``n`` tokens
holds ``ceil(n / block_size)`` blocks; a padded-contiguous one holds ``max_len`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.kv import formats

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class KVFootprint:
    num_layers: int  # full-attention layers that keep K/V
    num_kv_heads: int
    head_dim: int
    cache_type_k: str
    cache_type_v: str
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        formats.spec(self.cache_type_k).check_head_dim(self.head_dim)
        formats.spec(self.cache_type_v).check_head_dim(self.head_dim)

    @property
    def bytes_per_token_per_layer(self) -> int:
        row_k = formats.bytes_per_row(self.cache_type_k, self.head_dim)
        row_v = formats.bytes_per_row(self.cache_type_v, self.head_dim)
        return self.num_kv_heads * (row_k + row_v)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        """One block id: ``block_size`` rows of K and V in every full-attention layer."""
        return self.block_size * self.bytes_per_token

    def block_rounded_tokens(self, seq_lens: list[int]) -> int:
        bs = self.block_size
        return sum(-(-n // bs) * bs for n in seq_lens)

    def paged_bytes(self, seq_lens: list[int], per_layer: bool = False) -> int:
        per_token = self.bytes_per_token_per_layer if per_layer else self.bytes_per_token
        return self.block_rounded_tokens(seq_lens) * per_token

    def padded_bytes(
        self, seq_lens: list[int], max_len: int | None = None, per_layer: bool = False
    ) -> int:
        """Every sequence padded to ``max_len`` (default: the longest in ``seq_lens``)."""
        width = max(seq_lens) if max_len is None else max_len
        per_token = self.bytes_per_token_per_layer if per_layer else self.bytes_per_token
        return len(seq_lens) * width * per_token
