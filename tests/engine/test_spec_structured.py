"""Speculative decoding under a grammar: each verify row is masked by the grammar's state
after the drafts before it (``StructuredOutputs.bitmask_along``), so the kept tokens are the
constrained sampler's.

Oracles: transformers' greedy decoding with the allowed tokens worked out in plain Python
(``test_structured.oracle_choice_greedy``), a fresh matcher fed the drafts one by one, and
``jsonschema`` for sampled JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
from test_speculative import ForcedDrafter
from test_structured import CHOICES, EOS, choice_spec, oracle_choice_greedy, run
from transformers import Qwen3_5ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from mtp_checkpoints import build_mtp, save_with_mtp  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.engine.structured import GrammarSpec  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

PROMPT = "Pick one: "
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mtp_model(model_dir, hf_model, tmp_path_factory):
    """The tests' random model (byte tokenizer) with a random MTP head: (dir, loaded)."""
    path = save_with_mtp(hf_model, build_mtp(hf_model), tmp_path_factory.mktemp("mtp"))
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path, load_model(path, device="cpu", dtype=torch.float32, progress=False, mtp=True)


def spec_engine(mtp_model, k: int, drafter=None) -> LLMEngine:
    path, loaded = mtp_model
    return LLMEngine(EngineConfig(
        model=str(path), dtype="float32", progress=False, check_integrity=True,
        max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": k}),
        loaded=loaded, drafter=drafter)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("drafter", ["mtp", "forced"])
def test_greedy_choice_with_speculation_matches_the_oracle(mtp_model, hf_model, k, drafter):
    """The MTP head's own drafts (mostly refused), and the oracle's tokens with every third
    one replaced by a byte no choice continues with: the grammar's verify rows keep the
    allowed drafts and replace the others, giving the oracle's tokens."""
    expected = oracle_choice_greedy(hf_model, PROMPT, CHOICES, 30)
    forced = None
    if drafter == "forced":  # "~" continues no choice
        drafts = [ord("~") if i % 3 == 1 else t for i, t in enumerate(expected + [0] * 8)]
        forced = ForcedDrafter({"c": drafts}, lambda i: False, 256)
    engine = spec_engine(mtp_model, k, forced)
    constrained = SamplingParams(max_tokens=30, temperature=0.0,
                                 structured=choice_spec(CHOICES))
    out = run(engine, {"c": (PROMPT, constrained)})
    assert out["c"] == expected
    assert bytes(t for t in out["c"] if t < 256).decode() in CHOICES
    stats = engine.spec.stats
    assert stats.num_drafts > 0, "the constrained request speculated"
    if drafter == "forced" and k == 3:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.kv.pool.num_used_blocks == 0


def test_masks_along_the_drafts_match_a_matcher_fed_them_and_leave_it_unmoved(mtp_model):
    """Row j of ``bitmask_along`` is a fresh matcher's mask after drafts 0..j-1; past a
    refused draft the rows repeat; the request's matcher ends where it began."""
    engine = spec_engine(mtp_model, 3)
    structured = engine.structured
    spec = choice_spec(CHOICES)
    grammar = structured.new_grammar(spec)
    assert grammar.accept(ord("a"))
    drafts = [ord("l"), ord("p"), ord("~"), ord("h")]  # "lp" allowed after "a"; "~" refused
    before = structured.bitmask_along(grammar, [])
    rows = structured.bitmask_along(grammar, drafts)
    assert rows.shape == (len(drafts) + 1, before.shape[1])
    assert torch.equal(structured.bitmask_along(grammar, []), before)  # unmoved
    fresh = structured.new_grammar(spec)
    assert fresh.accept(ord("a"))
    for j in range(3):  # rows 0..2: after "a", "al", "alp"
        assert torch.equal(rows[j], structured.bitmask_along(fresh, [])[0]), j
        if j < 2:
            assert fresh.accept(drafts[j])
    assert torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])


@pytest.mark.parametrize("seed", range(2))
def test_sampled_json_with_speculation_validates_against_its_schema(mtp_model, seed):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}
    spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": schema,
                                  "max_whitespace_cnt": 2})
    engine = spec_engine(mtp_model, 3)
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=spec)
    out = run(engine, {"j": ("{", params)})
    text = engine.tokenizer.decode(out["j"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert out["j"][-1] in EOS
    assert engine.spec.stats.num_drafts > 0
