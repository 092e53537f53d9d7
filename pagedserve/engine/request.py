"""``Request`` (the unit of work) and ``SamplingParams`` (how its tokens are chosen)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.kv.handles import Handle
from pagedserve.kv.prefix_hash import HashChain

if TYPE_CHECKING:
    import torch

    from pagedserve.engine.structured import GrammarSpec, RequestGrammar
    from pagedserve.kv.checkpoint_pool import Checkpoint

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value
SEED_RANGE = 2**64  # seeds are unsigned 64-bit: the sampler hashes two 32-bit halves
# Temperatures below this sample as greedy: dividing logits by a smaller one overflows
# float32 to inf (vLLM uses the same threshold).
GREEDY_TEMPERATURE = 1e-5


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, validated once (OpenAI semantics where they exist).

    ``temperature`` below ``GREEDY_TEMPERATURE`` is greedy. ``top_k <= 0`` (or at least
    the vocabulary size) and ``top_p == 1`` and ``min_p == 0`` disable those filters.
    ``seed`` (an unsigned 64-bit integer) makes the request's tokens reproducible whatever
    else shares its batch. ``logprobs=N`` returns the sampled token's log-probability and
    the N most likely alternatives at each step. ``min_tokens``: EOS, stop token ids and
    stop strings cannot end the request before that many tokens. With
    ``include_stop_str_in_output`` the stop string that ends the request stays in its
    text. ``structured``: a grammar the output must match (``engine/structured.py``).
    ``logit_bias``: ``(token id, bias)`` pairs added to those tokens' logits before the
    penalties and filters (OpenAI's field; a bias of -100 bans a token, +100 all but
    forces it); logprobs stay the model's own. ``prompt_logprobs=N``: each prompt
    token's log-probability after the tokens before it, with the N most likely
    alternatives (vLLM's field; the first token has none). Every float is finite.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured: GrammarSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value),
                   f"{name} must be a finite number, got {value!r}")
        _check(self.temperature >= 0.0,
               f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < SEED_RANGE),
               f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
               f"got {self.min_tokens!r}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop strings must be non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for token, bias in self.logit_bias:
            _check(isinstance(token, int) and token >= 0,
                   f"logit_bias token ids must be integers >= 0, got {token!r}")
            _check(isinstance(bias, (int, float)) and math.isfinite(bias)
                   and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                   f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                   f"{MAX_LOGIT_BIAS:g}], got {bias!r}")
        _check(len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
               "logit_bias names a token id twice")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def top_k_within(self, vocab_size: int) -> int:
        """The number of tokens top-k keeps, or 0 for no top-k (``top_k`` of 0, -1, or
        at least ``vocab_size``)."""
        return self.top_k if 0 < self.top_k < vocab_size else 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again; its blocks and slot were freed
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first
    rank: int | None = None  # 1 + the tokens scored above it (prompt logprobs only)


@dataclass
class Request:
    """One prompt being served.

    ``num_computed_tokens`` counts tokens whose K/V and recurrent state are in the cache.
    The next forward step processes ``all_token_ids[num_computed_tokens:]``; after a
    token is sampled it is forwarded next step at position ``num_computed_tokens`` (the
    seed's first-token rule: no skipped and no duplicated row).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With ``params.prompt_logprobs``: one entry per prompt token (the first ``None``),
    # filled as its prefill runs.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    kv_handle: Handle | None = None
    state_handle: Handle | None = None
    num_preemptions: int = 0
    sample_seed: int = 0  # the seed actually used (params.seed or one drawn at admission)
    output_text: str = ""
    stop_reason: str | int | None = None
    grammar: RequestGrammar | None = None  # the state of params.structured, if any
    # The drafter's state at the request's computed tokens (``engine/drafter.py``).
    draft_tail: Any = None
    # Prefix caching: the tokens' block names (computed once), and the prompt tokens the
    # first admission found cached (``usage.prompt_tokens_details.cached_tokens``).
    prefix_chain: HashChain | None = None
    num_cached_tokens: int = 0
    checkpoint_branch: int = 0  # where its tokens leave the cached chain (0: nowhere)
    # The checkpoints it resumed from or saved, shortest first (``PrefixCache.save``
    # marks them superseded as it saves longer ones).
    checkpoints_on_path: list[Checkpoint] = field(default_factory=list)
    # Admitted with every token cached: the stored logits of its last token, from which
    # its next token is sampled in the step that admits it (then None).
    cached_logits: torch.Tensor | None = None
    # Speculative decoding: ``(n, h)``, the target's final hidden state ``h`` ``[H]`` of
    # token ``n - 1`` once ``n`` tokens are computed (what a checkpoint at ``n`` keeps);
    # and after a prefix hit, the checkpoint's such row until the drafter has taken it.
    last_hidden: tuple[int, torch.Tensor] | None = None
    resume_hidden: torch.Tensor | None = None
    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def live_kv_handle(self) -> Handle:
        """``kv_handle`` of an admitted request; raises if it holds no K/V sequence."""
        if self.kv_handle is None:
            raise RuntimeError(f"request {self.request_id} holds no K/V sequence")
        return self.kv_handle

    @property
    def live_state_handle(self) -> Handle:
        """``state_handle`` of an admitted request; raises if it holds no state slot."""
        if self.state_handle is None:
            raise RuntimeError(f"request {self.request_id} holds no state slot")
        return self.state_handle

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without copying the whole prompt (a decode step of a
        128K-token prompt must not copy 128K ids)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet forwarded (the rest of the prompt, or the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                           RequestStatus.FINISHED_ABORTED):
            return self.status.value
        return None
