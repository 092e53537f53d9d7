"""Grammar-constrained decoding in the engine (xgrammar masks applied in the sampler).

Oracles: transformers' own model with the allowed tokens worked out in plain Python (for a
set of choices, a token is allowed while the bytes so far are a prefix of a choice), and
``jsonschema`` for schema-constrained samples.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams
from pagedserve.engine.sampler import apply_token_bitmask
from pagedserve.engine.structured import GrammarSpec
from pagedserve.model import byte_tokenizer as bt

CHOICES = ["alpha", "alphabet", "beta gamma", "δ-delta"]
EOS = (bt.IM_END_ID, bt.ENDOFTEXT_ID)


@pytest.fixture
def engine(loaded, model_dir) -> LLMEngine:
    """One engine (constrained requests never look ahead, so one scheduling mode)."""
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                  check_integrity=True), loaded=loaded)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def choice_spec(options: list[str]) -> GrammarSpec:
    return GrammarSpec.of_format(
        {"type": "or", "elements": [{"type": "const_string", "value": o} for o in options]})


def run(engine, prompts: dict[str, tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in prompts.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.request.output_token_ids)
    return out


def oracle_choice_greedy(model, prompt: str, options: list[str], n: int) -> list[int]:
    """transformers' greedy decoding, each step restricted in Python to the tokens that keep
    the output a prefix of one of ``options`` (EOS once it is one)."""
    targets = [o.encode() for o in options]
    ids, out = list(prompt.encode()), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            done = bytes(out)
            allowed = [t for t in range(256) if any(x.startswith(done + bytes([t]))
                                                    for x in targets)]
            if done in targets:
                allowed += list(EOS)
            token = max(allowed, key=lambda t: float(logits[t]))
            out.append(token)
            if token in EOS:
                break
    return out


def test_bitmask_application_matches_a_python_oracle():
    torch.manual_seed(0)
    B, V = 3, 100
    allowed = torch.rand(B, V) < 0.3  # [B, V]
    words = []
    for row in allowed.tolist():
        packed = [0] * ((V + 31) // 32)
        for t, ok in enumerate(row):
            if ok:
                packed[t // 32] |= 1 << (t % 32)
        words.append([w - (1 << 32) if w >= 1 << 31 else w for w in packed])  # as int32
    logits = torch.randn(B, V)
    masked = apply_token_bitmask(logits, torch.tensor(words, dtype=torch.int32))
    assert torch.equal(torch.isfinite(masked), allowed)
    assert torch.equal(masked[allowed], logits[allowed])


def test_greedy_choice_matches_transformers_with_a_python_mask(make_engine, hf_model):
    engine = make_engine()
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=30, temperature=0.0,
                                 structured=choice_spec(CHOICES))
    # A constrained and an unconstrained request share every step.
    out = run(engine, {"c": ("Pick one: ", constrained), "f": ("Pick one: ", free)})
    expected = oracle_choice_greedy(hf_model, "Pick one: ", CHOICES, 30)
    assert out["c"] == expected
    if engine.async_scheduling:  # the constrained row's sampling waited for each step
        assert engine.stats.num_lookahead_steps > 0
    assert bytes(t for t in out["c"] if t < 256).decode() in CHOICES
    alone = run(make_engine(), {"f": ("Pick one: ", free)})
    assert out["f"] == alone["f"]


@pytest.mark.parametrize("seed", range(3))
def test_sampled_json_validates_against_its_schema(engine, seed):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"]}
    spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": schema,
                                  "max_whitespace_cnt": 4})
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, structured=spec)
    out = run(engine, {"j": ("{", params), "k": ("x", SamplingParams(max_tokens=5))})
    text = engine.tokenizer.decode(out["j"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), schema)
    assert out["j"][-1] in EOS


def test_compiled_grammars_are_cached_by_spec(engine):
    before = engine.structured.num_compiled
    for _ in range(3):
        engine.structured.compile(choice_spec(["x", "y"]))
    engine.structured.compile(choice_spec(["x", "z"]))
    assert engine.structured.num_compiled == before + 2


def test_an_invalid_schema_is_a_value_error_naming_it(engine):
    bad = GrammarSpec.of_format({"type": "json_schema", "json_schema": {"type": "objekt"}})
    with pytest.raises(ValueError, match="objekt"):
        engine.structured.compile(bad)


def test_special_tokens_are_never_allowed_as_grammar_text(engine):
    spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": {"type": "string"}})
    grammar = engine.structured.new_grammar(spec)
    for t in b'"ab':
        assert grammar.accept(t)
    mask = engine.structured.fill_bitmask([grammar, None])  # [2, W]
    allowed = torch.isfinite(apply_token_bitmask(torch.zeros(2, engine.vocab_size), mask))
    assert not allowed[0, bt.IM_START_ID] and allowed[0, ord("a")]
    assert bool(allowed[1].all())  # the unconstrained row


@pytest.mark.parametrize("max_length", [1, 4])
def test_length_bounded_strings_are_json_strings(engine, max_length):
    """What a bounded string admits is what JSON admits: escapes yes, raw control
    characters no (xgrammar's own grammar has it the other way round)."""
    schema = {"type": "string", "maxLength": max_length}
    spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": schema})

    def accepts(text: bytes) -> bool:
        grammar = engine.structured.new_grammar(spec)
        return all(grammar.accept(t) for t in text)

    assert accepts(b'"\\n"') and json.loads('"\\n"') == "\n"
    assert not accepts(b'"\x06') and not accepts(b'"\t')


def test_lookahead_samples_the_same_constrained_tokens(loaded, model_dir):
    """With async scheduling a constrained step's sampling waits for the previous step's
    tokens; what it samples must not change (seeded rows, mixed batch)."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": schema})
    outs = []
    for lookahead in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                        async_scheduling=lookahead), loaded=loaded)
        outs.append(run(engine, {
            "j": ("[", SamplingParams(max_tokens=24, temperature=1.0, seed=5, structured=spec)),
            "f": ("x", SamplingParams(max_tokens=24, temperature=1.0, seed=6,
                                      ignore_eos=True))}))
        assert (engine.stats.num_lookahead_steps > 0) == lookahead
    assert outs[0] == outs[1]
