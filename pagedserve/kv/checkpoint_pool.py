"""Recurrent-state checkpoints: copies of a sequence's GDN state at exact token positions.
Pure mechanism.

A hybrid model resumes a prefix at position ``p`` only with the conv and recurrent state
of every linear-attention layer after exactly ``p`` tokens. The pool keeps such copies in
preallocated tensors with the state pool's per-slot layout, each under a key (the prefix's
chained hash at ``p``, ``prefix_hash.HashChain.key_at``), beside one float32 row of
logits per checkpoint: those of the prefix's last token (the distribution of token
``p``), present when the save had them at hand (``Checkpoint.has_logits``)::

    conv_state      [num_linear_layers, num_checkpoints, conv_dim, conv_kernel - 1]
    recurrent_state [num_linear_layers, num_checkpoints, Hv, Dk, Dv]            float32
    logits          [num_checkpoints, vocab_size]                               float32

With ``hidden_size`` set (speculative decoding), each checkpoint also keeps the target's
final-normed hidden state of the prefix's last token (``Checkpoint.has_hidden``): a
drafter that resumes at ``p`` feeds it to its head for row ``p - 1``::

    hidden          [num_checkpoints, hidden_size]                              model dtype

``save`` copies a state slot (and a logits row) into a checkpoint (evicting the entry of
least value when the pool is full); ``restore`` copies a checkpoint into a state slot, and
``logits_row`` copies out its row. All are device copies queued in stream order, so a save
queued after a forward pass sees that pass's state, and a restore queued before a forward
pass feeds it. Which positions to save and what an entry is worth are the caller's policy
(``value``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kv.state_pool import StatePool, StateShapes

LOGITS_DTYPE = torch.float32


def checkpoint_bytes(shapes: StateShapes, vocab_size: int, hidden_bytes: int = 0) -> int:
    """Bytes of one checkpoint: a state slot's, a float32 logits row of ``vocab_size``
    and ``hidden_bytes`` (a hidden-state row, or 0 when none is kept)."""
    return shapes.bytes_per_slot + vocab_size * LOGITS_DTYPE.itemsize + hidden_bytes


@dataclass
class Checkpoint:
    """One saved state: ``num_tokens`` tokens of a prefix, in checkpoint slot ``slot``.

    ``parent``: the chain name the key hangs from (its last full block, or the salt);
    ``tail``: ``(block id, epoch)`` of the K/V block holding the rows past the last full
    block, ``None`` when ``num_tokens`` is block-aligned; ``last_used``: the pool's clock;
    ``has_logits``: its slot's logits row holds the logits of the prefix's last token;
    ``has_hidden``: its slot's hidden row holds that token's final hidden state;
    ``superseded``: the caller's mark that a longer checkpoint now covers the path that
    used it (policy data: the pool itself never reads it).
    """

    key: int
    slot: int
    num_tokens: int
    parent: int
    tail: tuple[int, int] | None
    last_used: int
    has_logits: bool = False
    has_hidden: bool = False
    superseded: bool = False


class CheckpointPool:
    """``num_checkpoints`` state checkpoints on ``device`` (0: checkpointing off).

    Args:
        shapes: per-slot state shapes (the state pool's).
        num_checkpoints: capacity.
        device: where the copies live (the state pool's device).
        vocab_size: width of each checkpoint's logits row (0: none is kept).
        hidden_size: width of each checkpoint's hidden row (0: none is kept), of
            ``hidden_dtype``.
        value: what keeping an entry saves, given the pool's clock; the entry of least
            value is evicted when a save needs room. Default: tokens covered.
    """

    def __init__(self, shapes: StateShapes, num_checkpoints: int, device: str | torch.device,
                 value: Callable[[Checkpoint, int], float] | None = None,
                 vocab_size: int = 0, hidden_size: int = 0,
                 hidden_dtype: torch.dtype = torch.float32) -> None:
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        self.shapes = shapes
        self.num_checkpoints = num_checkpoints
        self.value = value or (lambda c, now: float(c.num_tokens))
        # [num_linear_layers, num_checkpoints, conv_dim, conv_kernel - 1]
        self.conv_state = torch.zeros((shapes.num_layers, num_checkpoints, *shapes.conv),
                                      dtype=shapes.conv_dtype, device=device)
        # [num_linear_layers, num_checkpoints, Hv, Dk, Dv]
        self.recurrent_state = torch.zeros(
            (shapes.num_layers, num_checkpoints, *shapes.recurrent),
            dtype=shapes.recurrent_dtype, device=device)
        # [num_checkpoints, vocab_size]
        self.logits = torch.zeros((num_checkpoints, vocab_size), dtype=LOGITS_DTYPE,
                                  device=device)
        self.vocab_size = vocab_size
        # [num_checkpoints, hidden_size]
        self.hidden = torch.zeros((num_checkpoints, hidden_size), dtype=hidden_dtype,
                                  device=device)
        self.hidden_size = hidden_size
        self._entries: dict[int, Checkpoint] = {}
        self._by_parent: dict[int, dict[int, Checkpoint]] = {}
        self._free_slots = list(range(num_checkpoints - 1, -1, -1))
        self.clock = 0
        self.num_saves = 0
        self.num_evictions = 0

    @property
    def bytes_per_checkpoint(self) -> int:
        return checkpoint_bytes(self.shapes, self.vocab_size,
                                self.hidden_size * self.hidden.element_size())

    @property
    def total_bytes(self) -> int:
        return self.num_checkpoints * self.bytes_per_checkpoint

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> Checkpoint | None:
        return self._entries.get(key)

    def under(self, parent: int) -> list[Checkpoint]:
        """Every entry whose key hangs from chain name ``parent``."""
        return list(self._by_parent.get(parent, {}).values())

    def touch(self, entry: Checkpoint) -> None:
        self.clock += 1
        entry.last_used = self.clock

    def save(self, key: int, num_tokens: int, parent: int, tail: tuple[int, int] | None,
             states: StatePool, state_slot: int, logits: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None) -> Checkpoint | None:
        """Copy state slot ``state_slot`` of ``states`` into a checkpoint under ``key``,
        with ``logits`` (``[vocab_size]`` float32: those of the prefix's last token) and
        ``hidden`` (``[hidden_size]``: that token's final hidden state), if given.

        An entry already under ``key`` is only touched (same prefix, same state), and
        takes ``logits`` and ``hidden`` where it has no row yet. Returns the entry, or
        ``None`` when the pool has no capacity.
        """
        if logits is not None and self.vocab_size and logits.shape != (self.vocab_size,):
            raise ValueError(f"a logits row of shape {tuple(logits.shape)} does not fit "
                             f"rows of {self.vocab_size}")
        if hidden is not None and self.hidden_size and hidden.shape != (self.hidden_size,):
            raise ValueError(f"a hidden row of shape {tuple(hidden.shape)} does not fit "
                             f"rows of {self.hidden_size}")
        entry = self._entries.get(key)
        if entry is not None:
            self.touch(entry)
            if logits is not None and not entry.has_logits:
                self._put_logits(entry, logits)
            if hidden is not None and not entry.has_hidden:
                self._put_hidden(entry, hidden)
            return entry
        if self.num_checkpoints == 0:
            return None
        if not self._free_slots:
            self.drop(min(self._entries.values(), key=lambda c: self.value(c, self.clock)))
            self.num_evictions += 1
        slot = self._free_slots.pop()
        self.conv_state[:, slot] = states.conv_state[:, state_slot]
        self.recurrent_state[:, slot] = states.recurrent_state[:, state_slot]
        self.clock += 1
        entry = Checkpoint(key, slot, num_tokens, parent, tail, self.clock)
        if logits is not None:
            self._put_logits(entry, logits)
        if hidden is not None:
            self._put_hidden(entry, hidden)
        self._entries[key] = entry
        self._by_parent.setdefault(parent, {})[key] = entry
        self.num_saves += 1
        return entry

    def _put_logits(self, entry: Checkpoint, logits: torch.Tensor) -> None:
        if self.vocab_size == 0:
            return  # this pool keeps no rows
        self.logits[entry.slot] = logits
        entry.has_logits = True

    def _put_hidden(self, entry: Checkpoint, hidden: torch.Tensor) -> None:
        if self.hidden_size == 0:
            return  # this pool keeps no hidden rows
        self.hidden[entry.slot] = hidden
        entry.has_hidden = True

    def hidden_row(self, entry: Checkpoint) -> torch.Tensor:
        """A copy of ``entry``'s hidden row (``[hidden_size]``)."""
        if self._entries.get(entry.key) is not entry or not entry.has_hidden:
            raise ValueError(f"checkpoint {entry.key:x} holds no hidden row")
        return self.hidden[entry.slot].clone()

    def logits_row(self, entry: Checkpoint) -> torch.Tensor:
        """A copy of ``entry``'s logits row (``[vocab_size]`` float32; the copy stays valid
        whatever later saves write into the entry's slot)."""
        if self._entries.get(entry.key) is not entry or not entry.has_logits:
            raise ValueError(f"checkpoint {entry.key:x} holds no logits row")
        self.touch(entry)
        return self.logits[entry.slot].clone()

    def restore(self, entry: Checkpoint, states: StatePool, state_slot: int) -> None:
        """Copy ``entry``'s state into state slot ``state_slot`` of ``states``."""
        if self._entries.get(entry.key) is not entry:
            raise ValueError(f"checkpoint {entry.key:x} is no longer in the pool")
        states.conv_state[:, state_slot] = self.conv_state[:, entry.slot]
        states.recurrent_state[:, state_slot] = self.recurrent_state[:, entry.slot]
        self.touch(entry)

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self.drop(entry)

    def drop(self, entry: Checkpoint) -> None:
        del self._entries[entry.key]
        siblings = self._by_parent[entry.parent]
        del siblings[entry.key]
        if not siblings:
            del self._by_parent[entry.parent]
        self._free_slots.append(entry.slot)

    def check_invariants(self) -> None:
        slots = [e.slot for e in self._entries.values()]
        if len(set(slots)) != len(slots) or set(slots) & set(self._free_slots):
            raise AssertionError("a checkpoint slot is used twice or both used and free")
        if len(slots) + len(self._free_slots) != self.num_checkpoints:
            raise AssertionError(f"{len(slots)} used + {len(self._free_slots)} free "
                                 f"checkpoint slots != {self.num_checkpoints}")
        if self.vocab_size == 0 and any(e.has_logits for e in self._entries.values()):
            raise AssertionError("a checkpoint claims a logits row the pool does not keep")
        if self.hidden_size == 0 and any(e.has_hidden for e in self._entries.values()):
            raise AssertionError("a checkpoint claims a hidden row the pool does not keep")
        indexed = sum(len(v) for v in self._by_parent.values())
        if indexed != len(self._entries):
            raise AssertionError(f"{indexed} indexed checkpoints for {len(self._entries)}")
