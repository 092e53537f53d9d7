"""``ServingContext``: what every route needs -- the engine, the model's tokenizer and limits,
admission, metrics -- built once per app from a ready ``LLMEngine``.

Tokenizing and detokenizing run in worker threads (``encode_async``, ``decode_async``): a
multi-megabyte prompt delays only its own request, never the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.generation_defaults import GenerationDefaults
from pagedserve.server.admission import Admission
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.reasoning import template_reasons
from pagedserve.server.tool_parser import template_calls_tools

REASONING_PARSERS = ("qwen3",)
TOOL_CALL_PARSERS = ("qwen3_coder",)


def resolve_parser(flag: str, value: str, names: tuple[str, ...],
                   detected: bool) -> str | None:
    """``value`` of ``--FLAG`` as a parser name or ``None``; ``ValueError`` if unknown."""
    if value == "auto":
        return names[0] if detected else None
    if value == "none":
        return None
    if value not in names:
        raise ValueError(f"--{flag} {value!r} is not supported; accepted: "
                         f"{', '.join(('auto', 'none') + names)}")
    return value


@dataclass
class ServingContext:
    """Attributes:
        engine: the engine on its step thread.
        served_model_names: names clients may send as ``model``; the first is reported.
        admission: the in-flight bound and the shutdown switch.
        metrics: the app's Prometheus metrics.
        api_key: bearer token required by the guarded routes, or ``None``.
        max_model_len: most tokens (prompt + output) one sequence may hold.
        context_limit: most tokens one sequence can really hold (``max_model_len``, or less
            when the K/V pool is smaller): the default chat ``max_tokens`` fills up to it.
        reasoning_parser: ``"qwen3"`` (``<think>`` blocks are reasoning) or ``None``.
        tool_call_parser: ``"qwen3_coder"`` (Qwen3.5's XML calls) or ``None`` (no tools).
    """

    engine: AsyncEngine
    served_model_names: tuple[str, ...]
    admission: Admission
    metrics: ServerMetrics
    api_key: str | None
    max_model_len: int
    context_limit: int
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    _token_text: dict[int, str] = field(default_factory=dict)

    @classmethod
    def create(cls, llm: LLMEngine, served_model_names: tuple[str, ...],
               max_queue: int | None = None, api_key: str | None = None,
               reasoning_parser: str = "auto", tool_call_parser: str = "auto",
               on_fatal: Callable[[BaseException], None] | None = None,
               ) -> ServingContext:
        """``reasoning_parser`` / ``tool_call_parser``: a name, ``"none"``, or ``"auto"``
        (on when the model's chat template writes ``<think>`` / ``<function=`` calls)."""
        if not served_model_names or not all(served_model_names):
            raise ValueError(f"served-model-name must be non-empty, got {served_model_names}")
        template = getattr(llm.tokenizer, "chat_template", None)
        reasoning = resolve_parser("reasoning-parser", reasoning_parser, REASONING_PARSERS,
                                   template_reasons(template))
        tools = resolve_parser("tool-call-parser", tool_call_parser, TOOL_CALL_PARSERS,
                               template_calls_tools(template))
        engine = AsyncEngine(llm, on_fatal=on_fatal)
        admission = Admission(llm.config.max_num_seqs, max_queue)
        return cls(engine=engine, served_model_names=tuple(served_model_names),
                   admission=admission,
                   metrics=ServerMetrics(engine, served_model_names[0], admission),
                   api_key=api_key,
                   max_model_len=llm.max_model_len,
                   context_limit=llm.scheduler.token_capacity,
                   reasoning_parser=reasoning, tool_call_parser=tools)

    # ---- the model --------------------------------------------------------------------
    @property
    def llm(self) -> LLMEngine:
        return self.engine.engine

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def generation(self) -> GenerationDefaults:
        return self.llm.loaded.generation

    def check_model(self, name: str | None) -> str:
        """The name to report for a request that asked for ``name`` (``None``: the default)."""
        if name is None or name in self.served_model_names:
            return self.model_name
        raise APIError(404, f"the model '{name}' does not exist; this server serves "
                       f"{list(self.served_model_names)}", param="model",
                       code="model_not_found")

    def require_tool_parser(self) -> str:
        if self.tool_call_parser is None:
            raise bad_request("tools need a tool-call parser, and this server has none: its "
                              "chat template writes no tool calls, or it was started with "
                              "--tool-call-parser none", param="tools")
        return self.tool_call_parser

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and this model has none; send "
                              "token ids to /v1/completions instead")
        return self.tokenizer

    def encode(self, text: str, param: str = "prompt",
               add_special_tokens: bool = False) -> list[int]:
        """``text``'s token ids; 400 naming ``param`` for text the tokenizer cannot take.
        By default no special tokens are added: the engine sees exactly the ids
        /tokenize reports."""
        tokenizer = self.require_tokenizer("a text prompt")
        try:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except UnicodeError as exc:
            raise bad_request(f"{param}: the text cannot be tokenized: {exc}",
                              param=param) from None

    async def encode_async(self, text: str, param: str = "prompt",
                           add_special_tokens: bool = False) -> list[int]:
        return await asyncio.to_thread(self.encode, text, param, add_special_tokens)

    async def decode_async(self, ids: list[int]) -> str:
        tokenizer = self.require_tokenizer("detokenizing")
        return str(await asyncio.to_thread(tokenizer.decode, ids))

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs); ``token_id:N`` when there is no tokenizer."""
        text = self._token_text.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            self._token_text[token_id] = text
        return text

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.llm.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is outside the vocabulary [0, {vocab})",
                                  param=param)

    # ---- lifecycle --------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """SIGTERM: refuse new work, end every stream in flight with ``abort``."""
        self.admission.close()
        self.engine.abort_all()
