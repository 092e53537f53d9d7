"""Prompt logprobs in the two response formats that carry them.

- vLLM's ``prompt_logprobs=N``: per prompt token (the first ``None``), a mapping from
  token id to ``{logprob, rank, decoded_token}`` holding the prompt's own token and the N
  most likely ones (``choices[i].prompt_logprobs`` on completions, ``prompt_logprobs`` on a
  chat response).
- OpenAI's legacy ``echo`` with ``logprobs=N`` on completions: the prompt's tokens lead the
  choice's ``logprobs`` lists, the first with ``null`` logprobs.
"""

from __future__ import annotations

from pagedserve.engine.request import TokenLogprob
from pagedserve.server.context import ServingContext
from pagedserve.server.protocol import CompletionLogprobs, PromptLogprob, PromptLogprobs


def top_by_text(ctx: ServingContext, top: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy format's alternatives, keyed by text: where tokens share a text (byte
    pieces of one character decode alike), the most likely one's logprob."""
    out: dict[str, float] = {}
    for t, v in top:  # most likely first
        out.setdefault(ctx.token_text(t), v)
    return out


def vllm_prompt_logprobs(ctx: ServingContext, entries: list[TokenLogprob | None],
                         n: int) -> PromptLogprobs:
    """``entries`` (``Request.prompt_logprobs``) with each position's top ``n``."""
    out: PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        assert e.rank is not None
        ranked = [(e.token_id, e.logprob, e.rank)]
        ranked += [(t, v, r) for r, (t, v) in enumerate(e.top[:n], start=1) if t != e.token_id]
        out.append({str(t): PromptLogprob(logprob=v, rank=r, decoded_token=ctx.token_text(t))
                    for t, v, r in ranked})
    return out


def echoed_logprobs(ctx: ServingContext, prompt_ids: list[int],
                    entries: list[TokenLogprob | None], n: int,
                    generated: CompletionLogprobs) -> CompletionLogprobs:
    """The legacy lists of an echoed choice: the prompt's tokens (top ``n``) before
    ``generated``'s, whose text offsets move past the prompt's text."""
    out = CompletionLogprobs()
    top: list[dict[str, float] | None] = []
    offset = 0
    for token, e in zip(prompt_ids, entries):
        text = ctx.token_text(token)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        out.token_logprobs.append(None if e is None else e.logprob)
        top.append(None if e is None else top_by_text(ctx, e.top[:n]))
    out.tokens += generated.tokens
    out.token_logprobs += generated.token_logprobs
    out.text_offset += [offset + o for o in generated.text_offset]
    out.top_logprobs = top + list(generated.top_logprobs or [])
    return out
