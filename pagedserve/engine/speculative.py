"""``SpeculativeConfig``: ``--speculative-config``, in vLLM's JSON form, checked once.

    {"method": "mtp", "num_speculative_tokens": k}      k in 1..4
    {"method": "mtp", "num_speculative_tokens": k, "draft_vocab_size": n}

``method`` ``"mtp"`` drafts with the checkpoint's own multi-token-prediction head
(``model/mtp.py``, ``engine/drafter.py``). ``draft_vocab_size`` (optional, ``n`` in
``1 .. vocab_size``) lets the head draft over the first ``n`` token ids and the
tokenizer's special ones only (``engine/draft_vocab.py``); without it the head drafts over
the whole vocabulary. The range's upper end is the model's, so it is checked once the
model's config is read (``check_draft_vocab``), before any weight loads. What speculative
steps support, and what the engine rejects at start-up beside them, is listed in
``engine/spec_step.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 4
FIELDS = ("method", "num_speculative_tokens", "draft_vocab_size")
REQUIRED = ("method", "num_speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    draft_vocab_size: int | None = None  # None: the whole vocabulary

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative-config method {self.method!r} is not supported; "
                             f"accepted: {METHODS}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative-config num_speculative_tokens must be an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        n = self.draft_vocab_size
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"speculative-config draft_vocab_size must be an integer in "
                             f"[1, vocab_size] (the model's vocabulary), got {n!r}")

    def check_draft_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if ``draft_vocab_size`` exceeds the model's ``vocab_size``."""
        n = self.draft_vocab_size
        if n is not None and n > vocab_size:
            raise ValueError(f"speculative-config draft_vocab_size must be an integer in "
                             f"[1, {vocab_size}] (the model's vocab_size), got {n}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text or its dict; errors name the bad field."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative-config must be a JSON object such as "
                             '{"method": "mtp", "num_speculative_tokens": 3}')
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"speculative-config has unsupported fields {unknown}; "
                             f"accepted: {', '.join(FIELDS)}")
        for key in REQUIRED:
            if key not in value:
                raise ValueError(f"speculative-config needs {key!r}")
        return cls(value["method"], value["num_speculative_tokens"],
                   value.get("draft_vocab_size"))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
