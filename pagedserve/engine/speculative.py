"""``SpeculativeConfig``: ``--speculative-config``, in vLLM's JSON form, checked once.

    {"method": "mtp", "num_speculative_tokens": k}      k in 1..4

``method`` ``"mtp"`` drafts with the checkpoint's own multi-token-prediction head
(``model/mtp.py``, ``engine/drafter.py``). What speculative steps support, and what the
engine rejects at start-up beside them, is listed in ``engine/spec_step.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("mtp",)
MAX_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative-config method {self.method!r} is not supported; "
                             f"accepted: {METHODS}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) \
                or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative-config num_speculative_tokens must be an integer "
                             f"in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")

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
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative-config has unsupported fields {unknown}; "
                             "accepted: method, num_speculative_tokens")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative-config needs {key!r}")
        return cls(value["method"], value["num_speculative_tokens"])
