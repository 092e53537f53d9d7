"""CUDA: grammar-constrained rows through CUDA graphs, pinned bitmask buffers and async
scheduling (the forward pass launched ahead, the sampling after the read-back).

On the CPU every op is synchronous; here a race between a bitmask buffer being filled and
its copy, or a deferred sampling that reads the wrong step, would show as tokens that differ
from the synchronous engine's or outputs that break their grammar (``jsonschema``, the
choice list). Skipped without CUDA.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams
from pagedserve.engine.structured import GrammarSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"]}
CHOICES = ["alpha", "alphabet", "beta gamma"]


def _requests() -> dict[str, SamplingParams]:
    json_spec = GrammarSpec.of_format({"type": "json_schema", "json_schema": SCHEMA,
                                       "max_whitespace_cnt": 4})
    choice_spec = GrammarSpec.of_format(
        {"type": "or", "elements": [{"type": "const_string", "value": c} for c in CHOICES]})
    out = {}
    for i in range(3):
        out[f"json{i}"] = SamplingParams(max_tokens=300, temperature=1.0, seed=i,
                                         structured=json_spec)
        out[f"free{i}"] = SamplingParams(max_tokens=40, temperature=0.8, seed=10 + i,
                                         ignore_eos=True)
    out["choice"] = SamplingParams(max_tokens=30, temperature=1.0, seed=7,
                                   structured=choice_spec)
    return out


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_constrained_rows_match_synchronous_steps_on_cuda(model_dir, kv_type):
    outputs = {}
    for lookahead in (False, True):
        engine = LLMEngine(EngineConfig(
            model=str(model_dir), device="cuda", dtype="bfloat16", max_num_seqs=8,
            max_model_len=512, cache_type_k=kv_type, cache_type_v=kv_type,
            async_scheduling=lookahead, check_integrity=True, progress=False))
        for rid, params in _requests().items():
            engine.add_request(rid, "{" if rid.startswith("json") else "Pick: ", params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.request.output_token_ids)
        assert (engine.stats.num_lookahead_steps > 0) == lookahead
        assert engine.kv.pool.num_used_blocks == 0
        outputs[lookahead] = done
        for rid, ids in done.items():
            text = engine.tokenizer.decode(ids, skip_special_tokens=True)
            if rid.startswith("json"):
                jsonschema.validate(json.loads(text), SCHEMA)
            elif rid == "choice":
                assert text in CHOICES
    assert outputs[True] == outputs[False]
