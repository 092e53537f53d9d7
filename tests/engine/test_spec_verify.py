"""The rejection sampler emits the target's distribution, whatever the drafts' (chi-square
over many seeded draws on a six-token vocabulary), a draft head's over a vocabulary subset
(q zero outside it) included, and greedy verification keeps exactly the drafts plain
greedy decoding would choose."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.draft_vocab import scatter_to_vocab
from pagedserve.engine.spec_verify import DRAFT_STREAM, race, verify_greedy, verify_sampled

# The 0.999 quantile of chi-square with 5 degrees of freedom: a correct sampler fails this
# with probability 1e-3 for one random set of seeds; the seeds here are fixed, so the test
# is deterministic, and a sampler off by a few percent in any cell fails it.
CHI2_5_999 = 20.515
N = 3000

P = torch.tensor([[0.30, 0.05, 0.25, 0.0, 0.10, 0.30],
                  [0.10, 0.40, 0.10, 0.20, 0.10, 0.10],
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])  # [d + 1, V]
Q = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.20, 0.0],
                  [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])  # [d, V]
# A draft head over ids 0, 2 and 5 only: its logits [d, N'] at those ids, -inf elsewhere.
# P puts 0.15 (row 0) and 0.7 (row 1) of its mass outside them.
SUBSET = torch.tensor([0, 2, 5])
Q_SUBSET = torch.softmax(scatter_to_vocab(torch.tensor([[0.0, 1.5, -1.0], [2.0, 0.0, 0.5]]),
                                          SUBSET, 6), dim=-1)  # [d, V]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


def draw(seed: int, q: torch.Tensor | None) -> list[int]:
    index = torch.arange(3)
    if q is None:  # a deterministic drafter: always tokens 1 and 3
        drafts = [1, 3]
    else:
        drafts = race(q, seed, index[:2], DRAFT_STREAM).tolist()
        assert all(float(q[j, t]) > 0 for j, t in enumerate(drafts))  # in q's support
    bonus = race(P, seed, index, 0)
    return verify_sampled(P, q, drafts, seed, 0, bonus)


@pytest.mark.parametrize("q", [Q, Q_SUBSET, None],
                         ids=["sampled-drafts", "subset-drafts", "one-hot-drafts"])
def test_first_token_follows_the_target(q) -> None:
    counts = torch.zeros(6)
    second = torch.zeros(6)
    for seed in range(N):
        out = draw(seed, q)
        counts[out[0]] += 1
        if len(out) > 1:  # the first draft was kept: the next token also follows p_1
            second[out[1]] += 1
    assert chi_square(counts, P[0]) < CHI2_5_999
    assert second.sum() > N / 25
    assert chi_square(second, P[1]) < CHI2_5_999


def test_subset_drafts_never_leave_the_subset_but_the_output_does() -> None:
    """q is exactly 0 outside the subset: no draft lands there, while the emitted first
    tokens (checked against p above) do."""
    assert Q_SUBSET[:, [1, 3, 4]].eq(0).all()
    drafts, firsts = set(), set()
    for seed in range(300):
        drafts.update(race(Q_SUBSET, seed, torch.arange(2), DRAFT_STREAM).tolist())
        firsts.add(draw(seed, Q_SUBSET)[0])
    assert drafts == {0, 2, 5}
    assert firsts & {1, 4}


def test_sampler_is_not_the_draft_distribution() -> None:
    """The statistic can fail: the draft tokens alone are far from the target."""
    counts = torch.zeros(6)
    for seed in range(N):
        counts[int(race(Q[:1], seed, torch.tensor([0]), DRAFT_STREAM)[0])] += 1
    with pytest.raises(AssertionError):
        assert chi_square(counts, P[0]) < CHI2_5_999


def test_greedy_keeps_the_matching_prefix() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    assert verify_greedy(logits, [1, 0]) == [1, 0, 2]  # both kept, then the bonus
    assert verify_greedy(logits, [1, 2]) == [1, 0]  # second rejected: the target's 0
    assert verify_greedy(logits, [2, 0]) == [1]  # first rejected


def test_batched_rejection_sampling_follows_the_target() -> None:
    """``rejection_sample_rows`` (async speculative steps decide on the device, every
    sequence of a batch at once): over ``N`` sequences of one batch, each with its own
    seed, the first emitted token follows ``p_0``, and the second, where the first draft
    was kept, ``p_1``."""
    from pagedserve.engine.request import Request, SamplingParams
    from pagedserve.engine.sampler import SamplingTensors
    from pagedserve.engine.spec_async import rejection_sample_rows
    from pagedserve.engine.spec_verify import race_rows

    reqs = []
    for seed in range(N):
        req = Request(str(seed), [0], SamplingParams(temperature=1.0, seed=seed))
        req.sample_seed = seed
        reqs.append(req)
    st = SamplingTensors.from_requests(reqs, 6, "cpu")
    index = torch.zeros(N, dtype=torch.long)
    drafts = torch.stack([race_rows(Q[j].expand(N, 6), st.seed_lo, st.seed_hi, index + j,
                                    DRAFT_STREAM) for j in range(2)], dim=1)  # [N, 2]
    logits = P.log().repeat(N, 1)  # [N 3, 6]: each sequence's verify rows
    rows = st.rows_repeated(3, (index[:, None] + torch.arange(3)).reshape(-1))
    kept, chosen = rejection_sample_rows(logits, logits, drafts, Q.expand(N, 2, 6), rows,
                                         index)
    first = torch.where(kept >= 1, drafts[:, 0], chosen)
    second = torch.where(kept >= 2, drafts[:, 1], chosen)[kept >= 1]
    assert chi_square(torch.bincount(first, minlength=6).float(), P[0]) < CHI2_5_999
    assert len(second) > N / 25
    assert chi_square(torch.bincount(second, minlength=6).float(), P[1]) < CHI2_5_999
