"""Chained hashes of token prefixes: the names under which K/V blocks and state
checkpoints are cached.

Each full block of ``block_size`` tokens is named by the hash of its parent block's name
and its own token ids; the chain starts from a salt that covers everything else that
changes K/V and state (the model, its dtype, the K/V types, the block size)::

    tokens   | t0 ... t15 | t16 ... t31 | t32 ... t36
    names      h1 = H(salt, t0..t15)
                            h2 = H(h1, t16..t31)
    position   p = 37:  key(37) = H(h2, t32..t36)      (full-block chain + partial tail)
               p = 32:  key(32) = H(h2, ())

Two prefixes have the same name only if they have the same tokens (up to a 128-bit hash
collision), so a name found in the cache is a prefix whose K/V (and, for a key, whose
recurrent state) can be reused as is.

With ``num_next_tokens`` of one, a block's name also covers the first token after it
(speculative decoding: the MTP head's K/V row at a block's end holds the next token's
embedding, so the block's contents depend on it). A block is then named once that token
is known, and a position ``p`` hangs from the blocks named by its first ``p`` tokens
alone, ``(p - 1) // block_size`` of them, with a tail of 1 to ``block_size`` tokens::

    next 1        h1 = H(salt, t0..t16)   h2 = H(h1, t16..t32)
                  p = 32:  key(32) = H(h1, t16..t31)      (t32 unknown at p)
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

# ``token_slice(start, end)``: the sequence's token ids in ``[start, end)``.
TokenSlice = Callable[[int, int], Sequence[int]]

DIGEST_BYTES = 16


def _digest(parent: int, token_ids: Sequence[int], tag: bytes) -> int:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(tag)
    h.update(parent.to_bytes(DIGEST_BYTES, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_of(*parts: object) -> int:
    """The chain's root: a hash of everything besides the tokens that changes K/V."""
    text = "\x1f".join(repr(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=DIGEST_BYTES).digest(), "little")


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The name of one full block, given its parent's name (the salt for block 0)."""
    return _digest(parent, token_ids, b"B")


def position_key(parent: int, tail_ids: Sequence[int]) -> int:
    """The name of the exact position ``16 * i + len(tail_ids)``, given the name of the
    chain's ``i``-th full block (the salt for ``i = 0``)."""
    return _digest(parent, tail_ids, b"P")


class HashChain:
    """The block names of one growing token sequence, computed once each.

    ``parents[i]`` is the name that block ``i`` hangs from: ``parents[0]`` is the salt and
    ``parents[i + 1]`` is block ``i``'s own name. ``num_next_tokens`` (0 or 1): tokens past
    its end that a block's name covers too.
    """

    def __init__(self, salt: int, block_size: int, num_next_tokens: int = 0) -> None:
        if num_next_tokens not in (0, 1):
            raise ValueError(f"num_next_tokens must be 0 or 1, got {num_next_tokens!r}")
        self.block_size = block_size
        self.num_next_tokens = num_next_tokens
        self.parents: list[int] = [salt]

    @property
    def num_blocks(self) -> int:
        return len(self.parents) - 1

    def blocks_at(self, num_tokens: int) -> int:
        """How many leading blocks the first ``num_tokens`` tokens name."""
        return max(0, num_tokens - self.num_next_tokens) // self.block_size

    def extend(self, num_tokens: int, token_slice: TokenSlice) -> None:
        """Name every block the first ``num_tokens`` tokens name and that is not named yet."""
        bs = self.block_size
        for i in range(self.num_blocks, self.blocks_at(num_tokens)):
            self.parents.append(block_hash(
                self.parents[i], token_slice(i * bs, (i + 1) * bs + self.num_next_tokens)))

    def block_name(self, i: int) -> int:
        return self.parents[i + 1]

    def key_at(self, pos: int, token_slice: TokenSlice) -> int:
        """The name of position ``pos`` (``extend`` must have covered ``pos``)."""
        i = self.blocks_at(pos)
        return position_key(self.parents[i], token_slice(i * self.block_size, pos))
