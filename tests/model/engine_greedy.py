"""One request's greedy tokens through ``LLMEngine``, stepped to its end."""

from __future__ import annotations

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request import SamplingParams


def engine_greedy(engine: LLMEngine, prompt: list[int], new_tokens: int) -> list[int]:
    """Add ``prompt`` as one greedy request of ``new_tokens`` tokens (EOS ignored), step
    ``engine`` until nothing is left, and return the request's tokens."""
    engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                   ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens
