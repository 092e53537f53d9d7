"""A byte-level tokenizer in Hugging Face format, built without any download.

Token ``b`` (0..255) is the byte ``b``, spelled with GPT-2's printable byte alphabet, so any
UTF-8 text round-trips; three ChatML special tokens follow. The BPE model has no merges,
so nothing here depends on training data and the files are the same on every machine. The
chat template is Qwen3.5's layout (``chat_template.py``). The tests' tiny checkpoints use
it; the trained default model's BPE tokenizer is saved through ``save_tokenizer`` too.

    ids 0..255   the 256 bytes
    id  256      <|endoftext|>   (pad)
    id  257      <|im_start|>
    id  258      <|im_end|>      (end of turn: EOS)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from pagedserve.model.chat_template import CHAT_TEMPLATE

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258
NUM_TOKENS = 256 + len(SPECIAL_TOKENS)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (the ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def build_tokenizer() -> Tokenizer:
    """The byte-level tokenizer (``tokenizers.Tokenizer``)."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok


def write_tokenizer(directory: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
    save_tokenizer(build_tokenizer(), directory, model_max_length)


def save_tokenizer(tok: Tokenizer, directory: Path, model_max_length: int,
                   **config_extra: Any) -> None:
    """Write ``tok`` as ``tokenizer.json`` and a ``tokenizer_config.json`` that carries the
    Qwen3.5 chat template and its special tokens (``config_extra`` adds keys)."""
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **config_extra,
    }
    with open(directory / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
