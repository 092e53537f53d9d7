"""Logits -> tokens for a whole batch at once, on the logits' device.

Per-row settings arrive as tensors, so one batch mixes greedy and sampled requests with
different temperatures, filters and penalties, with no host sync until the caller reads
the chosen ids. Processing order per row:

    penalties (repetition on prompt+output; presence/frequency on output)
      -> greedy rows: argmax
      -> sampled rows: / temperature -> min_p -> top_k -> top_p -> exponential race

The exponential race picks ``argmax(p_i / E_i)`` with ``E_i ~ Exp(1)``, which draws
exactly from ``p``. ``E`` comes from a counter-based hash of (request seed, output index,
token id) instead of a stateful generator, so a seeded request gets the same noise
whatever else shares its batch, and the step stays free of per-row generator calls.
(The race trick is the one FlashInfer and vLLM use for batched sampling; the hash is
murmur3's 32-bit finalizer.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.engine.request import GREEDY_TEMPERATURE, SEED_RANGE, Request, SamplingParams

_M32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row settings of one step, ``B`` rows. Built on the host, moved non-blocking.

    Attributes:
        temperature, top_p, min_p, presence, frequency, repetition: float32 ``[B]``
        top_k: int64 ``[B]`` (0 = off)
        seed_lo, seed_hi: int64 ``[B]`` 32-bit halves of each request's seed
        step: int64 ``[B]`` output index of the token being drawn
        prompt_ids, output_ids: int64 ``[B, L]`` padded with ``vocab_size`` (ignored)
        bias: float32 ``[B, V]``, each row's ``logit_bias`` (``None``: no row has one)
        flags (host): which stages any row needs; ``max_logprobs`` (0 = none)
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    step: torch.Tensor
    prompt_ids: torch.Tensor | None
    output_ids: torch.Tensor | None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    max_logprobs: int
    bias: torch.Tensor | None = None

    @classmethod
    def from_requests(
        cls, requests: list[Request], vocab_size: int, device: torch.device | str,
        tokens_ahead: int = 0,
    ) -> SamplingTensors:
        """``tokens_ahead``: outputs already sampled on the device but not yet appended on
        the host (async scheduling); they shift each row's output index."""
        ps = [r.params for r in requests]
        # Whatever a request holds, every value fits its tensor: seeds wrap to 64 bits,
        # top-k beyond the vocabulary is no top-k.
        seeds = [r.sample_seed % SEED_RANGE for r in requests]
        top_k = [p.top_k_within(vocab_size) for p in ps]
        # Two host->device copies for all the per-row settings (each copy has a fixed cost).
        floats = torch.tensor(
            [[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
             [p.presence_penalty for p in ps], [p.frequency_penalty for p in ps],
             [p.repetition_penalty for p in ps]], dtype=torch.float32,
        ).to(device, non_blocking=True)  # [6, B]
        longs = torch.tensor(
            [top_k, [s & _M32 for s in seeds],
             [(s >> 32) & _M32 for s in seeds],
             [len(r.output_token_ids) + tokens_ahead for r in requests]],
            dtype=torch.long,
        ).to(device, non_blocking=True)  # [4, B]
        any_rep = any(p.repetition_penalty != 1.0 for p in ps)
        any_out = _any_penalty(ps)
        prompt_ids = _pad([r.prompt_token_ids for r in requests], vocab_size, device) \
            if any_rep else None
        output_ids = _pad([r.output_token_ids for r in requests], vocab_size, device) \
            if any_out else None
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], presence=floats[3],
            frequency=floats[4], repetition=floats[5],
            top_k=longs[0], seed_lo=longs[1], seed_hi=longs[2], step=longs[3],
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            all_greedy=all(p.greedy for p in ps),
            any_top_k=any(k > 0 and not p.greedy for k, p in zip(top_k, ps)),
            any_top_p=any(p.top_p < 1.0 and not p.greedy for p in ps),
            any_min_p=any(p.min_p > 0.0 and not p.greedy for p in ps),
            any_penalty=any_out,
            max_logprobs=max((p.logprobs or 0) for p in ps) if any(
                p.logprobs is not None for p in ps) else -1,
            bias=_bias(ps, vocab_size, device),
        )


    # The per-row settings (the rest are a batch's flags and token histories).
    ROW_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence", "frequency",
                  "repetition", "seed_lo", "seed_hi", "step")

    def first_rows(self, n: int) -> SamplingTensors:
        """The first ``n`` rows (per-row settings only: no token histories)."""
        bias = self.bias[:n] if self.bias is not None else None
        return replace(self, **{name: getattr(self, name)[:n] for name in self.ROW_FIELDS},
                       bias=bias)

    def rows_repeated(self, n: int, step: torch.Tensor,
                      output_ids: torch.Tensor | None = None) -> SamplingTensors:
        """Each row ``n`` times in a row (one sequence's verify rows), drawing at output
        indices ``step`` int64 ``[B n]``, with the rows' output histories ``output_ids``
        ``[B n, L]`` (padded with the vocabulary size; needed with penalties) and each
        row's prompt."""
        rows = {name: getattr(self, name).repeat_interleave(n) for name in self.ROW_FIELDS}
        prompt = (self.prompt_ids.repeat_interleave(n, dim=0)
                  if self.prompt_ids is not None else None)
        bias = self.bias.repeat_interleave(n, dim=0) if self.bias is not None else None
        return replace(self, **{**rows, "step": step}, prompt_ids=prompt,
                       output_ids=output_ids, bias=bias)

    @classmethod
    def along_drafts(cls, request: Request, drafts: list[int], vocab_size: int,
                     device: torch.device | str) -> SamplingTensors:
        """The ``d + 1`` rows of one speculative verify step of ``request``: row ``j``
        samples output index ``len(outputs) + j`` as if ``drafts[:j]`` had been generated,
        so its noise index and its penalties' counts are the plain sampler's there."""
        n = len(drafts) + 1
        st = cls.from_requests([request] * n, vocab_size, device)
        st.step = st.step + torch.arange(n, device=st.step.device)
        if st.output_ids is not None:
            outputs = list(request.output_token_ids)
            st.output_ids = _pad([outputs + list(drafts[:j]) for j in range(n)], vocab_size,
                                 device)
        return st


def has_penalty(p: SamplingParams) -> bool:
    """Whether ``p`` sets a presence, frequency or repetition penalty."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def _any_penalty(ps: list[SamplingParams]) -> bool:
    return any(has_penalty(p) for p in ps)


def uses_host_history(requests: list[Request]) -> bool:
    """Whether sampling reads the requests' token history (the penalties do)."""
    return _any_penalty([r.params for r in requests])


def plain_argmax(requests: list[Request]) -> bool:
    """Whether every request takes the plain argmax: greedy, no penalties, no logit bias,
    no logprobs. ``sample`` would then compute exactly ``logits.argmax(-1)``, so the caller
    can skip building the per-row settings (their host work and copies)."""
    ps = [r.params for r in requests]
    return all(p.greedy and p.logprobs is None and not p.logit_bias for p in ps) \
        and not _any_penalty(ps)


def _bias(ps: list[SamplingParams], vocab_size: int,
          device: torch.device | str) -> torch.Tensor | None:
    """float32 ``[B, V]``: each row's ``logit_bias`` (zero elsewhere); ``None`` when no row
    has one. Ids at or past ``vocab_size`` are the caller's to refuse (``make_request``)."""
    pairs = [(row, t, b) for row, p in enumerate(ps) for t, b in p.logit_bias]
    if not pairs:
        return None
    rows, ids, values = zip(*pairs)
    # Filled on the device: only the pairs cross, not the dense [B, V] rows.
    index = torch.tensor([rows, ids], dtype=torch.long).to(device, non_blocking=True)
    bias = torch.zeros(len(ps), vocab_size, dtype=torch.float32, device=device)
    bias[index[0], index[1]] = torch.tensor(values, dtype=torch.float32).to(
        device, non_blocking=True)
    return bias


def _pad(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    """``token_ids`` int64 ``[B]``; with logprobs: ``sampled_logprob`` ``[B]``,
    ``top_ids``/``top_logprobs`` ``[B, N]`` (N = the batch's largest request)."""

    token_ids: torch.Tensor
    sampled_logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample(logits: torch.Tensor, st: SamplingTensors,
           token_bitmask: torch.Tensor | None = None,
           scores: torch.Tensor | None = None) -> SamplerOutput:
    """Choose one token per row of ``logits`` float32 ``[B, V]``; with ``token_bitmask``
    (int32 ``[B, ceil(V / 32)]``, ``engine/structured.py``) only among allowed tokens.
    ``scores``: ``adjusted_logits(logits, st)``, when the caller holds it already.
    Logprobs stay those of the model's own distribution."""
    raw = logits.float()
    x = adjusted_logits(raw, st) if scores is None else scores
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    greedy_ids = x.argmax(dim=-1)
    if st.all_greedy:
        token_ids = greedy_ids
    else:
        sampled_ids = _sample_random(x, st)
        token_ids = torch.where(st.temperature < GREEDY_TEMPERATURE, greedy_ids, sampled_ids)
    out = SamplerOutput(token_ids=token_ids)
    if st.max_logprobs >= 0:
        # Log-probabilities of the model's own distribution (before penalties/filters).
        logp = torch.log_softmax(raw, dim=-1)
        out.sampled_logprob = logp.gather(1, token_ids[:, None]).squeeze(1)
        if st.max_logprobs > 0:
            out.top_logprobs, out.top_ids = logp.topk(st.max_logprobs, dim=-1)
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` float ``[B, V]`` with every token whose bit is clear in ``bitmask`` (int32
    ``[B, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32``) set to -inf. One pass on the
    logits' device, no host sync."""
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(B, -1)[:, :V].bool()  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def ban_tokens(bitmask: torch.Tensor | None, bans: list[tuple[int, list[int]]], B: int,
               V: int, device: torch.device | str) -> torch.Tensor | None:
    """``bitmask`` (int32 ``[B, ceil(V / 32)]``, or ``None``: all allowed) with the bit of
    every ``(row, token ids)`` in ``bans`` cleared; ids outside ``[0, V)`` are ignored.
    ``None`` when nothing is constrained. Built on the host in a few tensor ops, however
    many ids a row bans."""
    if not bans:
        return bitmask
    W = (V + 31) // 32
    allowed = torch.ones(B, W * 32, dtype=torch.bool)  # [B, W * 32]
    pairs = [(row, t) for row, ids in bans for t in ids if 0 <= t < V]
    if pairs:
        index = torch.tensor(pairs, dtype=torch.long)  # [N, 2]
        allowed[index[:, 0], index[:, 1]] = False
    words = (allowed.view(B, W, 32).long() << torch.arange(32)).sum(-1)  # [B, W] unsigned
    host = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    host_gpu = host.to(device, non_blocking=True)
    return host_gpu if bitmask is None else bitmask & host_gpu


def adjusted_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``logits`` float32 ``[B, V]`` with each row's ``logit_bias`` added, then its
    penalties applied (vLLM's order); ``logits`` itself when no row has either."""
    x = logits if st.bias is None else logits + st.bias
    return apply_penalties(x, st) if st.any_penalty else x


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens (OpenAI)."""
    B, V = logits.shape
    if st.output_ids is None:
        raise ValueError("apply_penalties needs SamplingTensors built with a penalty")
    out_counts = _counts(st.output_ids, B, V, logits.device)  # [B, V]
    x = logits - st.frequency[:, None] * out_counts \
        - st.presence[:, None] * (out_counts > 0).float()
    if st.prompt_ids is not None:
        seen = (_counts(st.prompt_ids, B, V, logits.device) + out_counts) > 0
        r = st.repetition[:, None]
        penalized = torch.where(x > 0, x / r, x * r)
        x = torch.where(seen, penalized, x)
    return x


def _counts(ids: torch.Tensor, B: int, V: int, device: torch.device | str) -> torch.Tensor:
    counts = torch.zeros(B, V + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :V]


def _sample_random(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    x = filtered_logits(x, st)
    noise = exponential_noise(st.seed_lo, st.seed_hi, st.step, x.shape[1])  # [B, V]
    # argmax(p / E) == argmax(log p - log E); the softmax normalizer is common to a row.
    return (x - noise.log()).argmax(dim=-1)


def filtered_logits(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``x`` float32 ``[B, V]`` divided by each row's temperature, with the tokens that
    min_p, top_k and top_p drop at the dtype's minimum: ``softmax`` of the result is the
    distribution a sampled row draws from."""
    temp = torch.where(st.temperature >= GREEDY_TEMPERATURE, st.temperature,
                       torch.ones_like(st.temperature))
    x = x / temp[:, None]
    neg_inf = torch.finfo(x.dtype).min
    if st.any_min_p:
        probs = torch.softmax(x, dim=-1)
        floor = st.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        x = x.masked_fill(probs < floor, neg_inf)
    if st.any_top_k or st.any_top_p:
        x = _top_k_top_p(x, st, neg_inf)
    return x


def _top_k_top_p(x: torch.Tensor, st: SamplingTensors, neg_inf: float) -> torch.Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    V = x.shape[1]
    rank = torch.arange(V, device=x.device)[None, :]
    if st.any_top_k:
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, V))
        sorted_x = sorted_x.masked_fill(rank >= k[:, None], neg_inf)
    if st.any_top_p:
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop = (before >= st.top_p[:, None]) & (rank > 0)
        sorted_x = sorted_x.masked_fill(drop, neg_inf)
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def exponential_noise(
    seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab: int
) -> torch.Tensor:
    """Exp(1) noise ``[B, vocab]``, a pure function of (seed, step, token id)."""
    row = _fmix32(seed_lo ^ _fmix32(seed_hi ^ _fmix32(step + 0x9E3779B9)))  # [B]
    idx = torch.arange(vocab, device=seed_lo.device, dtype=torch.long)[None, :]
    h = _fmix32(row[:, None] ^ ((idx * 0x9E3779B1) & _M32))
    h = _fmix32(h ^ row[:, None])
    return -torch.log(open_uniform(h >> 8)).float()


def open_uniform(bits: torch.Tensor) -> torch.Tensor:
    """24-bit integers ``k`` -> float64 ``(k + 1/2) / 2^24``, exact and strictly inside
    (0, 1), so that the noise ``-log u`` lies in [2^-25, 17.4]: never 0, never infinite.

    In float32, ``2^24 - 1/2`` rounds up to ``2^24``: the top ``k`` would give ``u = 1``
    and a noise of 0, which wins the exponential race for any token, masked ones included
    (about once per 2^24 tokens, so once in a few steps of a 248K vocabulary)."""
    return (bits.double() + 0.5) * 2.0**-24


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # Values stay in [0, 2**32) in int64; products wrap, and the low 32 bits are exact.
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)
