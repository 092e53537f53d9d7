"""A random workload over shared prefixes, for the prefix-cache leak tests: prompts cut
from a few long bases (plus a few tokens of their own), half of them sent again
identically, with aborts, greedy and seeded sampling, driven step by step."""

from __future__ import annotations

import random
from collections.abc import Callable

from pagedserve.engine.request import Request, SamplingParams


def drive_shared_prefixes(engine, rng: random.Random,
                          prompt_ids: Callable[[int, int], list[int]],
                          num_requests: int = 60) -> list[Request]:
    """Run ``num_requests`` requests to their end (or abort) on ``engine``; returns them."""
    bases = [prompt_ids(30 + i, 60) for i in range(4)]
    live: list[str] = []
    sent: list[list[int]] = []
    reqs = []
    submitted = 0
    while submitted < num_requests or engine.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if submitted < num_requests:
                prompt = rng.choice(bases)[:rng.randrange(1, 60)] + prompt_ids(
                    submitted, rng.randrange(4))
                if sent and rng.random() < 0.5:
                    prompt = rng.choice(sent)  # sent again, identical
                sent.append(prompt)
                reqs.append(engine.add_request(f"r{submitted}", prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 16), temperature=rng.choice([0.0, 0.8]),
                    seed=rng.randrange(1000))))
                live.append(f"r{submitted}")
                submitted += 1
        if live and rng.random() < 0.15:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():  # check_integrity runs inside every step
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    return reqs
