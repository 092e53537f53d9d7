"""The default model's tokenizer: a byte-level BPE trained on its corpus, with Qwen's
special tokens and pagedserve's copy of the Qwen3.5 chat template.

    ids 0 .. V-27    BPE tokens (the 256 byte symbols first, then the merges)
    ids V-26 .. V-1  Qwen's added tokens, in Qwen's order: <|endoftext|> (pad and document
                     separator), <|im_start|>, <|im_end|> (EOS) ... <think>, </think>

The ChatML and vision markers are special (dropped by ``skip_special_tokens``); the tool
and thinking tags are not, so that they stay in decoded text for the parsers, as in Qwen's
own tokenizer. Text is NFC-normalized and split with the GPT-4-style pattern Qwen uses
(case-insensitive contractions, letters, one digit at a time, punctuation, whitespace)
before the byte-level BPE.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from pagedserve.model.byte_tokenizer import save_tokenizer

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# (content, special) in Qwen's order of added tokens.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True), (IM_START, True), (IM_END, True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True), ("<|repo_name|>", True), ("<|file_sep|>", True),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens in all, the added tokens included."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([
        AddedToken(t, special=special, normalized=False) for t, special in ADDED_TOKENS
    ])
    for t, special in ADDED_TOKENS:
        if special:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    return tok


def token_id(tok: Tokenizer, content: str) -> int:
    found = tok.token_to_id(content)
    if found is None:
        raise ValueError(f"{content!r} is not in the tokenizer")
    return found


def write_tokenizer(tok: Tokenizer, directory: Path, model_max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template)."""
    save_tokenizer(tok, directory, model_max_length, add_prefix_space=False)
