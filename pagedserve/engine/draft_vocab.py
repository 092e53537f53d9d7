"""The draft vocabulary: the token ids the MTP drafter may propose, and its head over them.

With ``draft_vocab_size`` ``n`` (``--speculative-config``) the draft vocabulary is::

    ids 0 .. n - 1            the first n ids of the vocabulary
    + special / added ids     the tokenizer's (all_special_ids, added_tokens_decoder)
    + generation EOS ids      generation_config.json, config.json and the tokenizer's

each below the model's ``vocab_size``, deduplicated and sorted (``draft_vocab_ids``). Why
these ids: a byte-level BPE vocabulary numbers its tokens in merge order, so its low ids
are roughly its most frequent ones; the chat control tokens (``<|im_end|>``, ``<think>``,
``</think>``, ``<tool_call>``) are added tokens at the end of Qwen's vocabulary, and a head
that could not propose them would miss its draft at every end of turn, reasoning switch
and tool call.

``DraftHead`` computes the drafter's logits over those ``N'`` ids: the LM head's rows of
them (``[N', H]``, gathered once at start-up; an FP8 head's rows dequantized), so a draft
pass reads ``N' / V`` of the head. Column ``c`` of a draft logits row scores target id
``ids[c]``::

    greedy draft   ids[argmax over the N' columns]            on the device, graphs too
    sampled q      the whole vocabulary: the N' logits at their ids, -inf at every other
                   id, so q is 0 outside the subset and rejection sampling stays exact

Verification is unchanged: the target scores all ``V`` ids, so the output is the target's
whatever the drafter proposes. Without ``draft_vocab_size``, or when the subset is the
whole vocabulary, ``DraftHead`` is the shared head itself and gathers nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.model.qwen3_5 import Qwen3_5Model


def special_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's special and added token ids (none without a tokenizer)."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    ids.update(getattr(tokenizer, "added_tokens_decoder", None) or {})
    return {int(i) for i in ids}


def draft_vocab_ids(draft_vocab_size: int, vocab_size: int, always: Iterable[int]) -> list[int]:
    """The draft vocabulary by the module's rule: ids ``0 .. draft_vocab_size - 1`` and the
    ids of ``always`` (special and EOS ids), those below ``vocab_size``, sorted."""
    keep = set(range(min(draft_vocab_size, vocab_size)))
    keep.update(i for i in always if 0 <= i < vocab_size)
    return sorted(keep)


def draft_vocab(draft_vocab_size: int | None, vocab_size: int, tokenizer: Any,
                eos_token_ids: Iterable[int]) -> list[int] | None:
    """The draft vocabulary of a model whose tokenizer is ``tokenizer`` (or ``None``) and
    whose generation stops at ``eos_token_ids``; ``None`` for the whole vocabulary (no
    ``draft_vocab_size``, or a subset that covers every id)."""
    if draft_vocab_size is None:
        return None
    ids = draft_vocab_ids(draft_vocab_size, vocab_size,
                          special_token_ids(tokenizer) | set(eos_token_ids))
    return None if len(ids) == vocab_size else ids


def subset_bytes(num_rows: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Device bytes of a draft head over ``num_rows`` ids: its ``[N', H]`` rows in
    ``dtype`` and its int64 ids (what ``DraftHead.nbytes`` measures)."""
    return num_rows * (hidden_size * dtype.itemsize + 8)


def scatter_to_vocab(logits: torch.Tensor, ids: torch.Tensor | None,
                     vocab_size: int) -> torch.Tensor:
    """``logits`` float32 ``[..., N']`` (column ``c`` scores id ``ids[c]``) as a new
    ``[..., V]`` tensor with ``-inf`` at every id outside ``ids`` (int64 ``[N']``, or
    ``None``: ``N' = V``, a copy)."""
    if ids is None:
        return logits.clone()
    out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, ids, logits)


class DraftHead:
    """The drafter's logits over the draft vocabulary of ``model``.

    Args:
        model: the decoder whose LM head this reads (``compute_logits``, ``lm_head_rows``).
        ids: the draft vocabulary (sorted, distinct target ids, as ``draft_vocab`` gives
            them), or ``None``: the whole vocabulary through the shared head itself.

    Attributes:
        vocab_size: ``V``, the target's vocabulary.
        num_rows: ``N'``, the columns of a draft logits row (``V`` without a subset).
        ids: int64 ``[N']`` on the model's device, or ``None``.
        weight: ``[N', H]`` the LM head's rows of ``ids`` in the model dtype, or ``None``.
    """

    def __init__(self, model: Qwen3_5Model, ids: Sequence[int] | None = None) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.num_rows = self.vocab_size
        self.ids: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if ids is None:
            return
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) \
                or not 0 <= ids[0] <= ids[-1] < self.vocab_size:
            raise ValueError(f"a draft vocabulary is a non-empty sorted list of distinct ids "
                             f"in [0, {self.vocab_size}); got {len(ids)} ids")
        device = model.embed_tokens.weight.device
        self.ids = torch.tensor(list(ids), dtype=torch.long, device=device)  # [N']
        with torch.inference_mode():
            self.weight = model.lm_head_rows(self.ids)  # [N', H]
        self.num_rows = len(ids)

    @property
    def nbytes(self) -> int:
        """Device bytes the subset adds beside the model (0 without one)."""
        return sum(t.numel() * t.element_size() for t in (self.ids, self.weight)
                   if t is not None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, H]`` -> float32 draft logits ``[N, N']``."""
        if self.weight is None:
            return self.model.compute_logits(hidden)
        return F.linear(hidden, self.weight).float()

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """The target ids of draft-logits columns ``columns`` (int64, any shape; on the
        device, no sync)."""
        return columns if self.ids is None else self.ids[columns]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., N']`` as a new ``[..., V]`` tensor, ``-inf`` at the ids
        outside the draft vocabulary (``scatter_to_vocab``)."""
        return scatter_to_vocab(logits, self.ids, self.vocab_size)
