"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, on the served model's tokenizer.

``/tokenize`` reports exactly the ids the generation routes would feed the engine: text is
encoded without added special tokens, and ``messages`` go through the chat template.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from pagedserve.server.chat import render_chat_text, template_messages
from pagedserve.server.context import ServingContext
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    if body.messages is not None:
        text = await asyncio.to_thread(
            render_chat_text, ctx, template_messages(body.messages),
            body.add_generation_prompt, body.chat_template_kwargs,
            continue_final_message=body.continue_final_message)
        ids = await ctx.encode_async(text, "messages")
    else:
        ctx.require_tokenizer("/tokenize")
        ids = await ctx.encode_async(body.prompt or "", "prompt", body.add_special_tokens)
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx: ServingContext = request.app.state.ctx
    ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    ctx.require_tokenizer("/detokenize")
    return DetokenizeResponse(prompt=await ctx.decode_async(body.tokens))
