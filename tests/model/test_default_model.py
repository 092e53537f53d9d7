"""The shipped default model (``model/default_model.py``): what loads without ``--model``,
what transformers loads as it is, greedy tokens equal to transformers', quantized K/V that
agrees with f16, and continuations made of English words.

Agreement is the model card's measure (``scripts/default_model/measure.py``): per token with
teacher forcing, f16's greedy tokens fed to a runner with quantized K/V and each step's
argmax compared with f16's. (Free-running agreement is printed too; after a first
difference the two texts part ways, so it measures only the longest identical prefix.)
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from greedy_driver import greedy
from transformers import AutoTokenizer, Qwen3_5ForCausalLM

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model import default_model
from pagedserve.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "default_model"))
import measure  # noqa: E402

PROMPTS = (
    "Once upon a time",
    "It is a truth universally acknowledged, that a single man",
    "And God said unto Moses,",
    "The Python interpreter reads",
)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, device="cpu", dtype=torch.float32, progress=False)


def _runner(loaded, cache: CacheConfig | None = None) -> ModelRunner:
    return ModelRunner(loaded.model, cache or CacheConfig(),
                       RunnerConfig(max_model_len=256, max_num_seqs=1))


def _prompt_ids(loaded, prompt: str) -> list[int]:
    return loaded.require_tokenizer()(prompt).input_ids


def test_it_is_what_loads_without_a_model(loaded) -> None:
    assert loaded.path == default_model.DIRECTORY
    files = {p.name for p in default_model.DIRECTORY.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "mtp.safetensors", "MODEL_CARD.md"} <= files
    size = sum(p.stat().st_size for p in default_model.DIRECTORY.glob("*.safetensors"))
    assert size <= 42_000_000


@torch.no_grad()
def test_greedy_equals_transformers(loaded) -> None:
    hf, info = Qwen3_5ForCausalLM.from_pretrained(
        default_model.DIRECTORY, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    hf.eval()
    hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens
    for prompt in PROMPTS:
        ids = _prompt_ids(loaded, prompt)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                           do_sample=False)[0, len(ids):].tolist()
        assert greedy(_runner(loaded), ids, NEW_TOKENS, chunk=5).tokens == want, prompt


@torch.no_grad()
def test_mtp_head_loads_with_it() -> None:
    lm = load_model(None, device="cpu", dtype=torch.float32, progress=False, mtp=True)
    assert lm.model.mtp is not None


def test_continuations_read_as_words(loaded) -> None:
    """Without a dictionary, a proxy for readable text: the greedy continuation of "Once
    upon a time" has at least 16 words; at least 80% are letters with at most trailing
    punctuation; none is longer than 20 letters; and at least half of them are distinct
    (a random model gives byte soup, an undertrained one "the the the ...")."""
    tok = AutoTokenizer.from_pretrained(default_model.DIRECTORY)
    ids = _prompt_ids(loaded, PROMPTS[0])
    text = tok.decode(greedy(_runner(loaded), ids, NEW_TOKENS).tokens,
                      skip_special_tokens=True)
    words = text.split()
    assert len(words) >= 16, text
    plain = [w for w in words if re.fullmatch(r"[A-Za-z][a-z']*[,.;:!?]?", w)]
    assert len(plain) >= 0.8 * len(words), text
    assert max(len(w) for w in words) <= 20, text
    assert len({w.strip(",.;:!?").lower() for w in words}) >= 0.5 * len(words), text


@torch.no_grad()
@pytest.mark.parametrize("kv_type,floor", [("q8_0", 0.95), ("q4_0", 0.0)])
def test_quantized_kv_agrees_with_f16(loaded, kv_type: str, floor: float,
                                      record_property) -> None:
    """The model card's measure (``scripts/default_model/measure.py``), asserted."""
    got = measure.kv_agreement(loaded, (kv_type,), PROMPTS, NEW_TOKENS)[kv_type]
    print(f"\ndefault model, {kv_type} K/V against f16: {got['teacher_forced']:.1%} per "
          f"token (teacher-forced), {got['free_running']:.1%} free-running")
    record_property(f"{kv_type}_agreement_with_f16", got["teacher_forced"])
    assert got["teacher_forced"] >= floor


def test_divergence_gap_is_the_larger_of_the_two_runs_margins() -> None:
    """``measure.divergence_gaps``: at the first differing token, each run's margin of its
    own choice over the other's, the larger; unlisted tokens count as -inf."""
    from pagedserve.engine.request import TokenLogprob

    def lp(token: int, top: list[tuple[int, float]]) -> TokenLogprob:
        return TokenLogprob(token, dict(top)[token], top)

    same = lp(5, [(5, -0.1), (6, -2.5)])
    got = [[5, 7, 1], [5, 5], [5, 9]]
    ref = [[5, 8, 1], [5, 5], [5, 3]]
    got_lp = [[same, lp(7, [(7, -0.70), (8, -0.72)]), same], [same, same],
              [same, lp(9, [(9, -0.2), (4, -3.0)])]]
    ref_lp = [[same, lp(8, [(8, -0.69), (7, -0.74)]), same], [same, same],
              [same, lp(3, [(3, -0.5), (9, -1.5)])]]
    gaps = measure.divergence_gaps(got, got_lp, ref, ref_lp)
    assert gaps[0] == pytest.approx(0.05)  # ref's margin, 0.05 > got's 0.02
    assert gaps[1] is None
    assert gaps[2] == math.inf  # got never listed ref's token 3
