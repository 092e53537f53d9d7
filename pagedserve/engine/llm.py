"""``LLM``: offline batch generation in the style of vLLM's ``LLM.generate``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from tqdm import tqdm

from pagedserve.engine.failures import FINISH_ERROR
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams, TokenLogprob


@dataclass
class CompletionOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens resumed from the prefix cache


class LLM:
    """``LLM(model=None, **EngineConfig fields).generate(prompts, params)``.

    ``model=None`` is the embedded default model. Every prompt goes through the same
    continuous-batching engine as the server. A prompt whose own work fails
    (``engine/failures.py``) comes back with ``finish_reason: "error"``; the others finish.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion; results come back in input order."""
        one = isinstance(prompts, str) or bool(prompts and isinstance(prompts[0], int))
        batch = cast(list[str | list[int]], [prompts] if one else prompts)
        params = sampling_params if isinstance(sampling_params, list) else (
            [sampling_params or SamplingParams()] * len(batch))
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        ids = [f"llm-{i}" for i in range(len(batch))]
        # Validate all before enqueueing any, so a bad prompt leaves nothing half-started.
        reqs = [self.engine.make_request(i, p, sp) for i, p, sp in zip(ids, batch, params)]
        for r in reqs:
            self.engine.enqueue(r)
        bar = tqdm(total=len(reqs), disable=not use_tqdm, desc="generate")
        failed: set[str] = set()  # ended by their own failure (finish_reason "error")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    bar.update(1)
                if out.error is not None:
                    failed.add(out.request_id)
        bar.close()
        return [CompletionOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                                 r.output_text, FINISH_ERROR if r.request_id in failed
                                 else r.finish_reason or "abort",
                                 list(r.output_logprobs), r.num_preemptions,
                                 r.num_cached_tokens) for r in reqs]
