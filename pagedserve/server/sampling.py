"""OpenAI sampling fields -> ``SamplingParams``, falling back to the checkpoint's defaults.

Precedence for every field: the request, then the checkpoint's ``generation_config.json``,
then OpenAI's default (temperature 1, top_p 1, no top-k/min-p, no penalties). A checkpoint
that says ``do_sample: false`` asks for greedy decoding, so its default temperature is 0.
"""

from __future__ import annotations

from typing import Any

from pagedserve.engine.request import SEED_RANGE, SamplingParams
from pagedserve.model.generation_defaults import GenerationDefaults
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import SamplingFields

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def default_max_tokens(defaults: GenerationDefaults, *, room: int | None = None) -> int:
    """``max_tokens`` when the request gives none: for chat, ``room`` (the context left
    after the prompt) -- fill it; for completions (``room=None``) OpenAI's 16. A checkpoint's
    ``max_new_tokens`` caps both. Never below 1, so an over-long prompt is reported as such
    rather than as a bad ``max_tokens``."""
    base = COMPLETIONS_DEFAULT_MAX_TOKENS if room is None else room
    if defaults.max_new_tokens is not None:
        base = min(base, defaults.max_new_tokens)
    return max(1, base)


def check_context(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int,
                  param: str = "max_tokens") -> None:
    """400 (as vLLM) when an explicit ``max_tokens`` does not fit beside the prompt. A
    prompt that leaves no room at all is reported by the engine, naming the prompt."""
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        return
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"'{param}' is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens})", param=param)


def logit_bias_pairs(bias: dict[str, float] | None,
                     vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) as ``(id, bias)`` pairs;
    400 naming a key that is not a token id of the vocabulary. The values' range is
    ``SamplingParams``'."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), "
                              f"got {key!r}", param="logit_bias")
        pairs.append((token, value))
    return tuple(pairs)


def build_sampling_params(body: SamplingFields, defaults: GenerationDefaults, *,
                          max_tokens: int, vocab_size: int, choice_index: int = 0,
                          logprobs: int | None = None) -> SamplingParams:
    """The engine's parameters for choice ``choice_index`` of ``body``.

    With a ``seed``, choice ``i`` samples with ``(seed + i) mod 2**64``: the ``n`` choices
    differ, and each is reproducible (a negative seed maps onto its unsigned twin). Raises
    ``APIError`` (400) for values the engine refuses.
    """
    greedy_default = 0.0 if defaults.do_sample is False else None
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = None if body.seed is None else (body.seed + choice_index) % SEED_RANGE
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_first(body.temperature, greedy_default, defaults.temperature, 1.0),
            top_p=_first(body.top_p, defaults.top_p, 1.0),
            top_k=_first(body.top_k, defaults.top_k, 0),
            min_p=_first(body.min_p, defaults.min_p, 0.0),
            seed=seed,
            presence_penalty=_first(body.presence_penalty, 0.0),
            frequency_penalty=_first(body.frequency_penalty, 0.0),
            repetition_penalty=_first(body.repetition_penalty, defaults.repetition_penalty,
                                      1.0),
            stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=logit_bias_pairs(body.logit_bias, vocab_size),
            prompt_logprobs=body.prompt_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
