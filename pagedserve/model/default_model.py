"""The model served without ``--model``: a small trained Qwen3.5, shipped in the package.

``default_checkpoint/`` is an ordinary Hugging Face checkpoint as transformers writes it --
``config.json``, ``generation_config.json``, the tokenizer (a byte-level BPE with Qwen3.5's
special tokens and chat template), safetensors shards with their index, and the MTP head
(``mtp.*``) in a shard of its own -- made by ``scripts/train_default_model.py``. Its
``MODEL_CARD.md`` says what it was trained on, how well it does, and how to retrain it.
It goes through the same loader as any checkpoint; nothing about it is special-cased.
The tests use ``random_checkpoint.py``'s tiny random model instead.
"""

from __future__ import annotations

from pathlib import Path

NAME = "pagedserve-default-20m"
DIRECTORY = Path(__file__).with_name("default_checkpoint")


def default_model_path() -> Path:
    """The shipped checkpoint's directory."""
    if not (DIRECTORY / "config.json").is_file():
        raise FileNotFoundError(
            f"the default model is missing from {DIRECTORY}; reinstall pagedserve, or pass "
            "--model")
    return DIRECTORY
