"""Quantized K/V end to end: q8_0 and q4_0 generate, and how far they stay with f16.

Random tiny models have small logit margins, so quantized K/V is expected to diverge from
f16 at some point; the agreement is reported (stdout and junit properties) and asserted only
loosely. The logit error against transformers is measured with teacher forcing.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import greedy
from hybrid_checkpoints import NEW_TOKENS

from pagedserve.config import CacheConfig

# Loose floors: measured q8_0 48/48 on every shape and q4_0 7-48/48; max |logit diff| vs
# transformers: bf16 <= 1.4e-3, q8_0 <= 4.2e-3, q4_0 <= 7.3e-2 (logits of magnitude ~1).
MIN_AGREEMENT = {"bf16": 0.5, "q8_0": 0.5, "q4_0": 0.0}
MAX_LOGIT_DIFF = {"bf16": 1e-2, "q8_0": 2e-2, "q4_0": 0.25}


def _agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(b)


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0", "q4_0"])
def test_kv_type_end_to_end(checkpoint, kv_type: str, record_property) -> None:
    ref = checkpoint.reference
    f16 = greedy(checkpoint.runner(), checkpoint.prompt, NEW_TOKENS).tokens
    cache = CacheConfig(cache_type_k=kv_type, cache_type_v=kv_type)
    runner = checkpoint.runner(cache)
    tokens = greedy(runner, checkpoint.prompt, NEW_TOKENS).tokens
    forced = greedy(runner, checkpoint.prompt, NEW_TOKENS, chunk=16, forced=ref.tokens)
    diff = (torch.stack(forced.step_logits) - ref.step_logits).abs().max().item()
    agreement = _agreement(tokens, f16)
    prefix = next((i for i, (x, y) in enumerate(zip(tokens, f16)) if x != y), len(f16))
    print(
        f"\n{checkpoint.name} {kv_type}: agreement with f16 {agreement:.0%} "
        f"(identical prefix {prefix}/{len(f16)}), max logit diff vs HF {diff:.2e}"
    )
    record_property(f"{kv_type}_agreement_with_f16", agreement)
    record_property(f"{kv_type}_max_logit_diff", diff)
    assert all(0 <= t < checkpoint.loaded.config.vocab_size for t in tokens)
    assert agreement >= MIN_AGREEMENT[kv_type]
    assert diff <= MAX_LOGIT_DIFF[kv_type]


def test_mixed_k_and_v_types(checkpoints) -> None:
    """K and V types are independent: q8_0 K with q4_0 V and f16 K with q8_0 V both run."""
    ckpt = checkpoints("d64-mha-tied")
    for k_type, v_type in (("q8_0", "q4_0"), ("f16", "q8_0")):
        cache = CacheConfig(cache_type_k=k_type, cache_type_v=v_type)
        seq = greedy(ckpt.runner(cache), ckpt.prompt, 8, chunk=7)
        assert len(seq.tokens) == 8
        assert torch.isfinite(torch.stack(seq.step_logits)).all()
