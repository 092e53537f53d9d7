"""The draft vocabulary's rule (``engine/draft_vocab.py``), its scatter back to the whole
vocabulary, the FP8 rows a subset head gathers, and ``draft_vocab_size``'s checks."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.draft_vocab import (
    draft_vocab,
    draft_vocab_ids,
    scatter_to_vocab,
    special_token_ids,
)
from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.model.byte_tokenizer import IM_END_ID, build_tokenizer
from pagedserve.quant import fp8


def test_first_ids_plus_special_and_eos_ids_sorted_and_distinct():
    assert draft_vocab_ids(4, 20, [17, 2, 17, 25, -1]) == [0, 1, 2, 3, 17]  # 25 >= V
    assert draft_vocab_ids(30, 20, [5]) == list(range(20))


def test_a_subset_covering_the_vocabulary_is_the_whole_vocabulary():
    assert draft_vocab(None, 20, None, [3]) is None
    assert draft_vocab(19, 20, None, [19]) is None
    assert draft_vocab(18, 20, None, [19]) == [*range(18), 19]


def test_the_tokenizers_special_tokens_stay_draftable():
    """The byte tokenizer's ChatML tokens (256..258) follow the 256 byte ids."""
    tok = _transformers_tokenizer()
    assert special_token_ids(tok) == {256, 257, 258}
    assert special_token_ids(None) == set()
    ids = draft_vocab(100, 320, tok, [IM_END_ID])
    assert ids == [*range(100), 256, 257, 258]
    tok.add_tokens(["<think>", "</think>"])  # added, not special (as in Qwen's vocabulary)
    assert special_token_ids(tok) == {256, 257, 258, 259, 260}


def _transformers_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|im_end|>")


def test_scatter_puts_each_column_at_its_id_and_minus_inf_elsewhere():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [2, N' = 3]
    ids = torch.tensor([0, 3, 5])
    out = scatter_to_vocab(logits, ids, 7)
    inf = float("-inf")
    assert out.tolist() == [[1.0, inf, inf, 2.0, inf, 3.0, inf],
                            [4.0, inf, inf, 5.0, inf, 6.0, inf]]
    probs = torch.softmax(out, dim=-1)
    assert probs[:, [1, 2, 4, 6]].eq(0).all()  # q is exactly 0 outside the subset
    same = scatter_to_vocab(logits, None, 3)
    assert torch.equal(same, logits) and same.data_ptr() != logits.data_ptr()


@pytest.mark.parametrize("parts", [(300,), (200, 72, 28)])
def test_fp8_rows_are_the_dequantized_weights_rows(parts):
    """Rows of a fused weight whose parts end inside a 128-row block use their own part's
    scale rows."""
    gen = torch.Generator().manual_seed(len(parts))
    pieces = [fp8.quantize(torch.randn(n, 200, generator=gen) * (1 + 10 * i))
              for i, n in enumerate(parts)]
    data = torch.cat([q for q, _ in pieces])
    scale = torch.cat([s for _, s in pieces])
    rows = torch.tensor([0, 127, 128, 199, 200, 271, 272, 299, 5])
    want = fp8.dequantize(data, scale, parts, torch.bfloat16)[rows]
    assert torch.equal(fp8.dequantize_rows(data, scale, rows, parts, torch.bfloat16), want)


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "32768", [1]])
def test_bad_draft_vocab_sizes_name_the_value_and_the_range(value):
    with pytest.raises(ValueError, match=r"draft_vocab_size must be an integer in "
                                         r"\[1, vocab_size\].*got " + repr(value)
                                         .replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 3,
                                 "draft_vocab_size": value})


def test_draft_vocab_size_above_the_vocabulary_is_rejected_against_the_model():
    spec = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3, '
                                   '"draft_vocab_size": 248321}')
    assert spec.draft_vocab_size == 248321
    spec.check_draft_vocab(248321)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be an integer in "
                                         r"\[1, 248320\] \(the model's vocab_size\), got 248321"):
        spec.check_draft_vocab(248320)
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1}) \
        .draft_vocab_size is None
