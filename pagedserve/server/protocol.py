"""The OpenAI wire format: request bodies (validated) and response bodies.

Request models are strict about types -- ``"0.5"`` where a number belongs is an error, not a
coercion -- and refuse fields they do not know (``request_body.py``; ``user`` and
``metadata``, which OpenAI's clients send and which change no output, are accepted).
Numeric ranges are declared on the fields, so ``/docs`` shows them and a bad value fails
naming the field, the value and the accepted range (``errors.py`` turns pydantic's report
into an OpenAI error). ``SamplingParams`` checks the same ranges again as the engine's own
contract. Parameters pagedserve cannot honour (``chat_template``...) are
refused by name, never silently ignored. Tools and output constraints have their own
module, ``agent_protocol.py``.

The routers that balance vLLM and SGLang replicas (vllm-router, sglang-router) add their
engines' switches to every body they forward, at their defaults: ``skip_special_tokens``,
``no_stop_trim``, ``return_hidden_states``, and on chat ``separate_reasoning``,
``stream_reasoning``, ``include_reasoning``. Those defaults are what pagedserve does, so
each field is accepted at its default value and refused at any other.

Ranges that differ from a plain "positive": ``top_k`` at or beyond the vocabulary means no
top-k (as in vLLM), so any integer >= -1 is accepted; ``seed`` is any signed or unsigned
64-bit integer (``[-2**63, 2**64)``), used modulo ``2**64``; ``temperature`` is in
``[0, 100]`` (higher is already uniform sampling, and overflows float32 logits).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedserve.engine.request import MAX_LOGPROBS
from pagedserve.server.agent_protocol import (
    MAX_TOOLS,
    DeltaToolCall,
    ResponseFormat,
    StructuredOutputsParams,
    ToolCall,
    ToolCallIn,
    ToolChoice,
    ToolDefinition,
)
from pagedserve.server.request_body import NestedBody, RequestBody

MAX_N = 128  # choices per request: a fan-out bound, far above any sane use
PROMPT_FORMS = ("must be a string, a list of strings, a list of token ids, "
                "or a list of token-id lists")
MAX_TEMPERATURE = 100.0
SEED_MIN, SEED_END = -(2**63), 2**64
# Parameters of vLLM or OpenAI that change the output and that pagedserve does not
# implement: each is refused by name.
UNSUPPORTED = {
    "chat_template": "chat_template is not supported: the server renders every chat with "
                     "the model's own template",
    "functions": "functions is not supported; send its entries as tools "
                 "([{\"type\": \"function\", \"function\": ...}])",
    "function_call": "function_call is not supported; use tool_choice",
}


class StreamOptions(NestedBody):
    include_usage: bool = False


class SamplingFields(RequestBody):
    """Fields both generation routes share. ``None`` means "use the model's default"."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, lt=SEED_END)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # Routers' engine switches, at the only values pagedserve implements (module doc).
    skip_special_tokens: Literal[True] = True
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False

    @model_validator(mode="after")
    def _refuse_unsupported_common(self) -> SamplingFields:
        for name, message in UNSUPPORTED.items():
            if getattr(self, name, None) is not None:
                raise ValueError(message)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ConstraintFields(RequestBody):
    """Output constraints both generation routes take (``constraints.py``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)


class CompletionRequest(SamplingFields, ConstraintFields):
    """``POST /v1/completions``. ``prompt``: text, texts, token ids or token-id lists."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    return_token_ids: bool = False  # vLLM's: each choice also carries its token ids

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: Any) -> Any:
        try:
            value = handler(value)
        except ValidationError:
            raise ValueError(PROMPT_FORMS) from None  # one message, not one per union member
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> CompletionRequest:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be omitted, "
                             f"got {self.best_of}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry per prompt (a list of ints is one prompt)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(NestedBody):
    type: Literal["text"]
    text: str


class ChatMessage(NestedBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant: its earlier calls
    tool_call_id: str | None = None  # tool: the call this answers
    reasoning_content: str | None = None  # assistant: its earlier thinking
    reasoning: str | None = None  # the same, under vLLM's newer name

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates expect it: ``content`` a plain string, a call's
        ``arguments`` a mapping. ``ValueError`` for arguments that are not a JSON object."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": c.function.arguments_object()}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        return out


class ChatCompletionRequest(SamplingFields, ConstraintFields):
    """``POST /v1/chat/completions``, rendered with the model's own chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = None
    functions: Any = None
    function_call: Any = None
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True
    include_reasoning: Literal[True] = True

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not supported with stream on chat "
                             "completions")
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message continues the last (assistant) message; "
                         "send add_generation_prompt: false with it")


class TokenizeRequest(RequestBody):
    """vLLM's ``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens resumed from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt logprobs: per prompt token (the first ``None``), token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with ``return_token_ids``
    prompt_logprobs: PromptLogprobs | None = None  # with ``prompt_logprobs``


class CompletionResponse(BaseModel):
    """A whole completion, or (with ``stream``) one chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    """``reasoning`` repeats ``reasoning_content`` under vLLM's newer name."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # with ``prompt_logprobs``


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant message; fields it does not carry are left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagedserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
