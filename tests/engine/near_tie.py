"""Comparing two runs of the same requests whose batches differ in shape (bf16 on CUDA).

A different batch shape changes the rounding of every GEMM, so two correct runs may choose
different tokens where the top two candidates' scores lie within rounding of each other.
At the first position where two runs differ, both saw the same context; with ``a`` run A's
token and ``b`` run B's, each run's score of a token is its log-probability (greedy) or its
log-probability minus the log of the sampler's exponential noise for (seed, output index,
token) (seeded sampling), and the gap is

    max(score_B(b) - score_B(a), score_A(a) - score_A(b))

A gap within ``tol`` is a near-tie. A run that read a wrong token, K/V row, state or noise
index picks a token whose score lies far below the clean run's choice.
"""

from __future__ import annotations

import math

import torch

from pagedserve.engine.request import Request, TokenLogprob
from pagedserve.engine.sampler import SEED_RANGE, exponential_noise

_M32 = (1 << 32) - 1


def _noise(seed: int, step: int, token: int) -> float:
    s = seed % SEED_RANGE
    e = exponential_noise(torch.tensor([s & _M32]), torch.tensor([(s >> 32) & _M32]),
                          torch.tensor([step]), token + 1)
    return float(e[0, token])


def _score(lp: TokenLogprob, token: int, seed: int | None, temperature: float,
           step: int) -> float:
    """``token``'s score in a run whose choice at this step is ``lp`` (-inf if unlisted)."""
    listed = dict(lp.top)
    listed.setdefault(lp.token_id, lp.logprob)
    if token not in listed:
        return -math.inf
    if seed is None:
        return listed[token]
    return listed[token] / temperature - math.log(_noise(seed, step, token))


def divergence(a: Request, b: Request) -> tuple[int, float] | None:
    """(position, gap) of the first token where ``a`` and ``b`` differ; ``None`` if equal.
    Both requests ran with the same sampling parameters, and at least ``a`` with
    ``logprobs`` set; a run without logprobs (``b``: a mode that refuses them) adds no
    term to the gap, so only ``a``'s side of it is checked."""
    seed = None if a.params.greedy else a.sample_seed
    t = a.params.temperature
    for pos, (x, y) in enumerate(zip(a.output_token_ids, b.output_token_ids)):
        if x != y:
            la = a.output_logprobs[pos]
            gap = _score(la, x, seed, t, pos) - _score(la, y, seed, t, pos)
            if b.output_logprobs:
                lb = b.output_logprobs[pos]
                gap = max(gap, _score(lb, y, seed, t, pos) - _score(lb, x, seed, t, pos))
            return pos, gap
    assert len(a.output_token_ids) == len(b.output_token_ids)
    return None


def assert_equal_or_near_ties(a: dict[str, Request], b: dict[str, Request],
                              tol: float = 0.1) -> int:
    """Every request's tokens equal in both runs, or first differing at a near-tie.
    Returns how many requests differ (at near-ties)."""
    assert sorted(a) == sorted(b)
    far = {}
    ties = 0
    for rid in a:
        d = divergence(a[rid], b[rid])
        if d is not None:
            if d[1] > tol:
                far[rid] = d
            ties += 1
    assert not far, f"runs differ beyond a near-tie (id: (position, gap)): {far}"
    return ties

