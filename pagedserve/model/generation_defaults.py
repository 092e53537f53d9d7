"""A checkpoint's ``generation_config.json``: stop ids and sampling defaults.

Only what a request falls back to when it does not say otherwise. Fields the file leaves
out stay ``None`` so that the engine's own defaults apply; ``do_sample: false`` means the
checkpoint asks for greedy decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.config import as_id_tuple


def merge_ids(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """Concatenate id tuples, keeping the first occurrence of each id."""
    seen: dict[int, None] = {}
    for group in groups:
        for i in group:
            seen.setdefault(i, None)
    return tuple(seen)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults and stop ids of a checkpoint."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        checks = (
            ("temperature", lambda v: v >= 0.0, ">= 0"),
            ("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
            ("top_k", lambda v: v >= 0, ">= 0"),
            ("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
            ("repetition_penalty", lambda v: v > 0.0, "> 0"),
            ("max_new_tokens", lambda v: v > 0, "> 0"),
        )
        for name, ok, accepted in checks:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(
                    f"generation_config.json: {name} = {value!r} is invalid; accepted: {accepted}"
                )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationDefaults:
        def num(key: str, kind: type) -> Any:
            return None if raw.get(key) is None else kind(raw[key])

        return cls(
            eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
            bos_token_id=num("bos_token_id", int),
            pad_token_id=num("pad_token_id", int),
            do_sample=None if raw.get("do_sample") is None else bool(raw["do_sample"]),
            temperature=num("temperature", float),
            top_p=num("top_p", float),
            top_k=num("top_k", int),
            min_p=num("min_p", float),
            repetition_penalty=num("repetition_penalty", float),
            max_new_tokens=num("max_new_tokens", int),
        )

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Path) -> GenerationDefaults:
        """Read ``generation_config.json``; a checkpoint without one gets empty defaults."""
        path = checkpoint_dir / "generation_config.json"
        if not path.is_file():
            return cls()
        with open(path) as f:
            return cls.from_dict(json.load(f))
