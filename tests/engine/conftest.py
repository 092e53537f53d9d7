"""The tiny random checkpoint (a real HF-format hybrid, ``model/random_checkpoint.py``),
loaded once, and transformers' own greedy decoding on it as the oracle."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.model.loader import load_model
from pagedserve.model.random_checkpoint import random_model_path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
    path = random_model_path()
    mp.undo()
    return path


@pytest.fixture(scope="session")
def loaded(model_dir):
    return load_model(model_dir, device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(params=[False, True], ids=["sync", "lookahead"])
def make_engine(request, loaded, model_dir):
    """Engines in both scheduling modes: reading each step back before the next, and
    async scheduling (launching steady decode steps one step ahead), which is the CUDA
    default and must not change a single token."""
    def make(**kw) -> LLMEngine:
        kw.setdefault("check_integrity", True)
        kw.setdefault("async_scheduling", request.param)
        return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                      **kw), loaded=loaded)
    return make


@pytest.fixture(scope="session")
def hf_logprobs(model_dir):
    """``hf_logprobs(prompt_ids) -> float64 [P - 1, V]``: transformers' log-probabilities
    of the token after each prompt position but the last."""
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
        return torch.log_softmax(logits.double(), dim=-1)

    return run


@pytest.fixture(scope="session")
def hf_greedy(model_dir):
    """``hf_greedy(prompt_ids, n, bias=()) -> ids``: transformers' model and KV cache,
    argmax of the logits with ``bias`` (``(token id, value)`` pairs) added."""
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @functools.cache
    def run(prompt: tuple[int, ...], n: int,
            bias: tuple[tuple[int, float], ...]) -> tuple[int, ...]:
        ids = torch.tensor([prompt])
        past, out = None, []
        with torch.no_grad():
            for _ in range(n):
                o = model(input_ids=ids, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1].double()
                for t, b in bias:
                    logits[t] += b
                token = int(logits.argmax())
                out.append(token)
                ids = torch.tensor([[token]])
        return tuple(out)

    return lambda prompt, n, bias=(): list(run(tuple(prompt), n, tuple(bias)))
