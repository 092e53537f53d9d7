"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's
log-probability after the tokens before it, from the hidden states of the prefill rows.

Row ``j`` of a chunk that starts at position ``p`` predicts the token at ``p + j + 1``::

    prompt      t0    t1    t2   ...  t(P-1)
    rows        r0 -> r1 -> r2   ...  r(P-2)   r(P-1) samples the first output
    entries    None  lp1   lp2   ...  lp(P-1)

A chunk's vocabulary-wide logits are computed ``ROWS_PER_SLICE`` rows at a time, so a long
chunk never holds ``[T, V]`` at once. A request with prompt logprobs does not resume from
the prefix cache (``Scheduler._admit``): its cached rows would have no hidden states. Rows
recomputed after a preemption write their entries again, with the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedserve.engine.request import TokenLogprob
from pagedserve.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from pagedserve.engine.runner import ModelRunner
    from pagedserve.engine.scheduler import ScheduledChunk

# [256, V] float32 logits at a time: 254 MB for Qwen3.5's 248320 token ids.
ROWS_PER_SLICE = 256


def record_prompt_logprobs(runner: ModelRunner, chunks: list[ScheduledChunk],
                           batch: ForwardBatch, hidden: torch.Tensor) -> None:
    """Fill ``Request.prompt_logprobs`` of every chunk in ``chunks`` (the batch's, in its
    order) whose request asks for them, from the batch's hidden states ``[T, H]``."""
    for i, c in enumerate(chunks):
        req, n = c.request, c.request.params.prompt_logprobs
        if n is None:
            continue
        first_row = batch.query_start_loc_cpu[i] - c.start_pos  # row of position 0
        end = min(c.start_pos + c.num_tokens, req.num_prompt_tokens - 1)
        for start in range(c.start_pos, end, ROWS_PER_SLICE):
            stop = min(end, start + ROWS_PER_SLICE)
            logits = runner.compute_logits(hidden[first_row + start:first_row + stop])
            logp = torch.log_softmax(logits, dim=-1)  # [r, V]
            targets = req.prompt_token_ids[start + 1:stop + 1]
            index = torch.tensor(targets, device=logp.device)
            chosen = logp.gather(1, index[:, None])  # [r, 1]
            ranks = ((logp > chosen).sum(dim=-1) + 1).tolist()
            chosen_host = chosen[:, 0].tolist()
            tops: list[list[tuple[int, float]]] = [[] for _ in targets]
            if n > 0:
                values, ids = logp.topk(n, dim=-1)  # [r, n]
                tops = [list(zip(i_row, v_row))
                        for i_row, v_row in zip(ids.tolist(), values.tolist())]
            for j, token in enumerate(targets):
                req.prompt_logprobs[start + 1 + j] = TokenLogprob(
                    token, chosen_host[j], tops[j], ranks[j])
