"""``pagedserve serve`` without ``--model`` serves the shipped trained model
(``model/default_model.py``), and its greedy completion through the official ``openai``
client is the engine's own greedy text for the same prompt."""

from __future__ import annotations

import torch
from server_harness import client, running

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams
from pagedserve.model import default_model
from pagedserve.server.launcher import ServerProcess

PROMPT = "Once upon a time"


def _engine_text(n: int) -> str:
    engine = LLMEngine(EngineConfig(model=None, dtype="float32", progress=False))
    engine.add_request("0", PROMPT, SamplingParams(max_tokens=n, temperature=0.0))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
    return text


@torch.no_grad()
def test_serve_without_a_model_flag_answers_in_english(tmp_path, serve_env):
    server = ServerProcess(["--max-num-seqs", "2"], tmp_path / "serve.log", env=serve_env,
                           startup_timeout=120)
    with running(server) as s:
        oai = client(s)
        assert [m.id for m in oai.models.list().data] == [default_model.NAME]
        out = oai.completions.create(model=default_model.NAME, prompt=PROMPT, max_tokens=32,
                                     temperature=0)
    text = out.choices[0].text
    assert text == _engine_text(32)
    words = text.split()
    assert len(words) >= 12 and sum(w.strip(",.;:!?\"'").isalpha() for w in words) \
        >= 0.8 * len(words), text
