"""Sampler against float64 references: filters, penalties, distribution, seeds, logprobs."""

import math

import pytest
import torch

from pagedserve.engine.request import Request, SamplingParams
from pagedserve.engine.sampler import SamplingTensors, exponential_noise, plain_argmax, sample

V = 12


def requests(params, outputs=None, seeds=None, prompts=None):
    out = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", prompts[i] if prompts else [1, 2, 3], p)
        r.output_token_ids = list(outputs[i]) if outputs else []
        r.sample_seed = seeds[i] if seeds else 1234 + i
        out.append(r)
    return out


def draw(logits, params, **kw):
    reqs = requests(params, **kw)
    st = SamplingTensors.from_requests(reqs, logits.shape[1], "cpu")
    return sample(logits, st)


def allowed_set(logits64, p: SamplingParams):
    """Float64 reference of the tokens a request may draw (temperature, min_p, top_k, top_p)."""
    x = logits64 / p.temperature
    probs = torch.softmax(x, 0)
    keep = probs >= p.min_p * probs.max()
    order = torch.argsort(x, descending=True)
    if p.top_k > 0:
        keep[order[p.top_k:]] = False
    masked = torch.where(keep, x, torch.tensor(-math.inf, dtype=torch.float64))
    probs = torch.softmax(masked, 0)
    order = torch.argsort(masked, descending=True)
    mass = 0.0
    allowed = set()
    for t in order.tolist():
        if not keep[t] or (allowed and mass >= p.top_p):
            break
        allowed.add(t)
        mass += probs[t].item()
    return allowed


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(3, V)
    out = draw(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                        SamplingParams(temperature=0.0)])
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_plain_argmax_is_exactly_what_sample_does_for_such_rows():
    # The engine skips building SamplingTensors when this holds; it must not change a token.
    plain = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=3)]
    logits = torch.randn(2, V)
    assert plain_argmax(requests(plain))
    assert torch.equal(draw(logits, plain, outputs=[[1, 1], [2]]).token_ids, logits.argmax(-1))
    for other in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.0, logprobs=1),
                  SamplingParams(temperature=0.0, presence_penalty=0.5),
                  SamplingParams(temperature=0.0, frequency_penalty=0.5),
                  SamplingParams(temperature=0.0, repetition_penalty=1.2)):
        assert not plain_argmax(requests([plain[0], other])), other


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.05),
])
def test_filters_only_ever_draw_allowed_tokens(p):
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 2
    allowed = allowed_set(logits[0].double(), p)
    seen = set()
    for seed in range(400):
        seen.add(int(draw(logits, [p], seeds=[seed]).token_ids[0]))
    assert seen <= allowed
    assert seen == allowed  # every allowed token shows up over 400 seeds


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=1.0)
    n = 6000
    reqs = requests([p] * n, seeds=list(range(n)))
    st = SamplingTensors.from_requests(reqs, 6, "cpu")
    counts = torch.bincount(sample(logits.expand(n, -1), st).token_ids, minlength=6).double()
    expected = torch.softmax(logits[0].double(), 0) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom: p ~ 0.001


def test_seeded_request_is_independent_of_its_batch_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    alone = draw(logits[2:3], [p], seeds=[42]).token_ids[0]
    mixed = draw(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
                          p, SamplingParams(temperature=2.0, top_k=2)],
                 seeds=[7, 8, 42, 9]).token_ids[2]
    assert alone == mixed


def test_noise_is_exponential_and_a_pure_function_of_seed_and_step():
    a = exponential_noise(torch.tensor([5]), torch.tensor([0]), torch.tensor([3]), 50000)
    b = exponential_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), torch.tensor([3, 3]),
                          50000)
    assert torch.equal(a[0], b[0]) and not torch.equal(b[0], b[1])
    assert abs(a.mean().item() - 1.0) < 0.03 and abs(a.var().item() - 1.0) < 0.06


def test_penalties_match_the_reference_formula():
    torch.manual_seed(2)
    logits = torch.randn(1, V, dtype=torch.float32) * 3
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.7)
    prompt, output = [1, 4], [4, 4, 7]
    ref = logits[0].double().clone()
    for t in range(V):
        c = output.count(t)
        ref[t] -= 0.3 * c + 0.5 * (c > 0)
        if t in prompt or t in output:
            ref[t] = ref[t] / 1.7 if ref[t] > 0 else ref[t] * 1.7
    out = draw(logits, [p], outputs=[output], prompts=[prompt])
    assert out.token_ids[0] == ref.argmax()
    from pagedserve.engine.sampler import apply_penalties
    st = SamplingTensors.from_requests(requests([p], outputs=[output], prompts=[prompt]), V,
                                       "cpu")
    assert torch.allclose(apply_penalties(logits, st)[0].double(), ref, atol=1e-5)


def test_logprobs_are_the_models_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    out = draw(logits, [SamplingParams(temperature=0.0, logprobs=3),
                        SamplingParams(temperature=1.0, logprobs=0)])
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(out.top_logprobs[0].double(), ref[0].topk(3).values, atol=1e-6)
    assert torch.equal(out.top_ids[0], ref[0].topk(3).indices)
    for i in range(2):
        assert abs(out.sampled_logprob[i].item() - ref[i, out.token_ids[i]].item()) < 1e-6


def test_noise_is_positive_and_finite_at_the_extreme_bits():
    """float64 oracle: the top 24-bit value maps just under 1 (float32 would round it to 1,
    a noise of 0, which wins the race for any token), the bottom one just over 0."""
    from pagedserve.engine.sampler import open_uniform
    bits = torch.tensor([0, 1, (1 << 23) + 1, (1 << 24) - 1])
    u = open_uniform(bits)
    assert u.tolist() == [(k + 0.5) / 2**24 for k in bits.tolist()]
    assert ((u > 0) & (u < 1)).all()
    noise = (-torch.log(u)).float()
    assert (noise > 0).all() and torch.isfinite(noise).all()


def test_masked_tokens_never_win_the_race():
    """Seeded draws over a wide vocabulary with all but two tokens masked (a grammar's
    mask): 64 steps of 8 rows of 2^18 tokens draw about 8 top-bit noises (one per 2^24),
    and every draw is still one of the two allowed tokens."""
    vocab, rows = 1 << 18, 8
    logits = torch.zeros(rows, vocab)
    words = torch.zeros(rows, vocab // 32, dtype=torch.int32)
    words[:, 0] = 0b110  # tokens 1 and 2 allowed
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(rows)]
    for step in range(64):
        st = SamplingTensors.from_requests(
            requests(params, seeds=list(range(rows)), outputs=[[0] * step] * rows), vocab,
            "cpu")
        assert set(sample(logits, st, words).token_ids.tolist()) <= {1, 2}, step


def test_logit_bias_shifts_the_distribution_draws_follow():
    """Draws follow softmax(logits + bias) (float64 reference), before temperature."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=0.8, logit_bias=((0, -2.0), (5, 4.5)))
    n = 6000
    reqs = requests([p] * n, seeds=list(range(n)))
    st = SamplingTensors.from_requests(reqs, 6, "cpu")
    counts = torch.bincount(sample(logits.expand(n, -1), st).token_ids, minlength=6).double()
    biased = logits[0].double() + torch.tensor([-2.0, 0, 0, 0, 0, 4.5], dtype=torch.float64)
    expected = torch.softmax(biased / 0.8, 0) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom: p ~ 0.001


def test_logit_bias_comes_before_the_penalties_and_leaves_logprobs_alone():
    torch.manual_seed(4)
    logits = torch.randn(2, V) * 2
    bias = ((3, 1.5), (7, -100.0))
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2, logit_bias=bias)
    output = [3, 9]
    ref = logits[0].double().clone()
    ref[3] += 1.5
    ref[7] -= 100.0
    for t in set(output) | {1, 2}:  # the prompt is [1, 2, 3]
        ref[t] = ref[t] / 1.5 if ref[t] > 0 else ref[t] * 1.5
    out = draw(logits, [p, SamplingParams(temperature=0.0, logprobs=2)],
               outputs=[output, output])
    assert out.token_ids[0] == ref.argmax() and out.token_ids[1] == logits[1].argmax()
    assert not plain_argmax(requests([p])) and plain_argmax(requests(
        [SamplingParams(temperature=0.0)]))
    own = torch.log_softmax(logits[0].double(), -1)
    assert abs(out.sampled_logprob[0].item() - own[out.token_ids[0]].item()) < 1e-6


def test_logit_bias_refuses_what_openai_refuses():
    for bias, match in (
            (((1, 100.5),), r"logit_bias of token 1 must be in \[-100, 100\], got 100.5"),
            (((1, math.inf),), "logit_bias of token 1"),
            (((-3, 1.0),), "token ids must be integers >= 0, got -3"),
            (((2, 1.0), (2, 3.0)), "names a token id twice")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(logit_bias=bias)
