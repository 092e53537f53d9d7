"""Model shapes shipped with pagedserve, named ``preset:NAME`` on the command line.

A preset is only a ``config.json`` (no weights): the real Qwen3.5-27B shape, used by
``pagedserve plan`` and by benchmarks that run random weights of that shape.
"""

from __future__ import annotations

from pathlib import Path

PRESET_PREFIX = "preset:"
_DIR = Path(__file__).parent


def names() -> list[str]:
    return sorted(p.stem for p in _DIR.glob("*.json"))


def preset_name(model: str) -> str | None:
    """``"preset:NAME"`` -> ``"NAME"``; any other ``--model`` value -> ``None``."""
    return model[len(PRESET_PREFIX):] if model.startswith(PRESET_PREFIX) else None


def config_path(name: str) -> Path:
    """Path of preset ``name``'s config.json; ``ValueError`` lists the known presets."""
    path = _DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; known presets: {names()}")
    return path
