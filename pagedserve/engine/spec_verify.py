"""Which drafted tokens a verify step keeps, so that the output stays the target's own.

One sequence's verify rows score ``d + 1`` positions: row ``j`` is the target's
distribution ``p_j`` after the tokens before draft ``j``; drafts ``t_1..t_d`` came from
distributions ``q_1..q_d`` (``None``: a deterministic drafter, ``q_j`` one-hot at ``t_j``).

Greedy rows keep drafts while each equals ``argmax p_j``; the first that does not is
replaced by that argmax, and if all are kept ``argmax p_d`` follows (the bonus token): the
tokens are exactly those of plain greedy decoding.

Sampled rows use rejection sampling (Leviathan et al., Chen et al.): draft ``t_j`` is kept
with probability ``min(1, p_j(t_j) / q_j(t_j))``; the first rejected one is replaced by a
draw from ``max(0, p_j - q_j)`` (normalized), and after ``d`` kept drafts a bonus token is
drawn from ``p_d``. Each emitted token is then distributed exactly as ``p_j``.

The randomness is counter-based like the sampler's (``sampler.exponential_noise``): a pure
function of (request seed, output index, stream), one stream each for drafting, the
accept test and the residual draw; the bonus token is the plain sampler's own draw. Every
output index is decided once, so a seeded request repeats itself whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.request import SEED_RANGE, TokenLogprob
from pagedserve.engine.sampler import SamplingTensors, _fmix32, exponential_noise, filtered_logits

_M32 = 0xFFFFFFFF


@dataclass
class Verified:
    """One speculating chunk's outcome: ``tokens`` emitted (m + 1), their logprobs."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]

# Streams of noise, each hashed with the seed (``_seed_halves``); 0 is the sampler's own.
DRAFT_STREAM = 0x5EC0_0001
ACCEPT_STREAM = 0x5EC0_0002
RESIDUAL_STREAM = 0x5EC0_0003


def race(probs: torch.Tensor, seed: int, index: torch.Tensor, stream: int) -> torch.Tensor:
    """One draw per row of ``probs`` float ``[N, V]`` (rows need not be normalized) by the
    exponential race, with the noise of (``seed``, output index ``index`` int64 ``[N]``,
    ``stream``). Returns int64 ``[N]``."""
    return race_rows(probs, *_seed_halves(seed, index), index, stream)


def race_rows(probs: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
              index: torch.Tensor, stream: int) -> torch.Tensor:
    """``race`` with a seed per row: ``seed_lo``, ``seed_hi`` int64 ``[N]`` the 32-bit
    halves of each row's seed (``SamplingTensors``'), all on the device."""
    lo, hi = _stream_halves(seed_lo, seed_hi, stream)
    noise = exponential_noise(lo, hi, index, probs.shape[1])  # [N, V]
    return (probs / noise).argmax(dim=-1)


def draw_drafts(full_logits: torch.Tensor, settings: SamplingTensors,
                index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled drafts: each row's draw from its own filtered distribution over the whole
    vocabulary, from the draft logits float32 ``[N, V]`` (``-inf`` outside the draft
    vocabulary), with the draft stream's noise at output index ``index`` int64 ``[N]``.
    Returns the ids int64 ``[N]`` and the distributions ``[N, V]`` (the ``q`` that
    rejection sampling weighs them by)."""
    probs = torch.softmax(filtered_logits(full_logits, settings), dim=-1)
    return race_rows(probs, settings.seed_lo, settings.seed_hi, index, DRAFT_STREAM), probs


def uniforms(seed: int, index: torch.Tensor, stream: int) -> torch.Tensor:
    """float32 ``[N]`` in (0, 1] (the top noise value rounds to 1 in float32, which the
    acceptance test ``u * q <= p`` treats as it should): one uniform per output index of
    ``index`` int64 ``[N]``."""
    return uniforms_rows(*_seed_halves(seed, index), index, stream)


def uniforms_rows(seed_lo: torch.Tensor, seed_hi: torch.Tensor, index: torch.Tensor,
                  stream: int) -> torch.Tensor:
    """``uniforms`` with a seed per row (halves as in ``race_rows``)."""
    lo, hi = _stream_halves(seed_lo, seed_hi, stream)
    return torch.exp(-exponential_noise(lo, hi, index, 1)[:, 0])


def _seed_halves(seed: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``seed``, folded as the sampler folds it, as 32-bit halves shaped like ``index``."""
    seed %= SEED_RANGE
    return torch.full_like(index, seed & _M32), torch.full_like(index, (seed >> 32) & _M32)


def _stream_halves(lo: torch.Tensor, hi: torch.Tensor,
                   stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 32-bit seed halves of ``stream``: two rounds of the hash over (seed, stream),
    so that streams of one seed are independent. (Only XORing the stream into a half
    leaves the rows of two streams related by a fixed XOR, which the finalizer does not
    hide: draft and accept noise then correlate measurably.)"""
    s = _fmix32(torch.full_like(lo, stream))
    lo = _fmix32(_fmix32(lo ^ s) + hi + 0x9E3779B9)
    return lo, _fmix32(_fmix32(hi + s) ^ lo)


def verify_greedy(target_logits: torch.Tensor, draft_ids: list[int],
                  best: list[int] | None = None) -> list[int]:
    """``target_logits`` ``[d + 1, V]`` (``best``: their argmax, when the caller has read
    it already); returns the ``m + 1`` tokens emitted (``m`` drafts kept, then the
    target's own choice)."""
    if best is None:
        best = target_logits.argmax(dim=-1).tolist()  # [d + 1]
    out = []
    for j, t in enumerate(draft_ids):
        if t != best[j]:
            break
        out.append(t)
    out.append(best[len(out)])
    return out


def verify_sampled(p: torch.Tensor, q: torch.Tensor | None, draft_ids: list[int], seed: int,
                   first_index: int, bonus_sample: torch.Tensor) -> list[int]:
    """Rejection sampling of one sequence's drafts.

    Args:
        p: float32 ``[d + 1, V]`` the target's distributions (filtered, normalized).
        q: float32 ``[d, V]`` the drafts' distributions, or ``None`` (one-hot drafts).
        draft_ids: the ``d`` drafted tokens.
        seed: the request's sampling seed; ``first_index``: output index of draft 1.
        bonus_sample: int64 ``[d + 1]`` the plain sampler's draw from each ``p_j`` (used
            for the bonus token only, so that it is the sampler's own).
    Returns:
        The ``m + 1`` tokens emitted.
    """
    d = len(draft_ids)
    if d == 0:
        return [int(bonus_sample[0])]
    ids = torch.tensor(draft_ids, dtype=torch.long, device=p.device)  # [d]
    rows = torch.arange(d, device=p.device)
    p_draft = p[rows, ids]  # [d]
    if q is None:
        q = torch.zeros_like(p[:d]).scatter_(1, ids[:, None], 1.0)
    q_draft = q[rows, ids]  # [d]
    index = torch.arange(first_index, first_index + d, dtype=torch.long, device=p.device)
    u = uniforms(seed, index, ACCEPT_STREAM)  # [d]
    keep = (u * q_draft <= p_draft).tolist()  # u < p / q, without dividing by q = 0
    m = keep.index(False) if False in keep else d
    if m == d:
        return [*draft_ids, int(bonus_sample[d])]
    residual = (p[m] - q[m]).clamp_min(0)  # [V]
    if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
        residual = p[m]
    fix = race(residual[None], seed, index[m:m + 1], RESIDUAL_STREAM)
    return [*draft_ids[:m], int(fix[0])]
