"""The benchmark's requests: ragged prompt lengths from a seeded distribution, random
token-id prompts, and a fixed output length (``ignore_eos``), so every run of a given seed
sends the same work whatever the model says."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt lengths around ``mean`` tokens.

    ``fixed``: always ``mean``. ``uniform``: uniform in ``[mean * (1 - spread),
    mean * (1 + spread)]`` (vLLM's ``--random-range-ratio``). ``lognormal``: median ``mean``,
    ``spread`` the sigma of the log length (a long tail, like real chat traffic).
    """

    kind: str = "uniform"
    mean: int = 512
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"input distribution {self.kind!r} is not one of {DISTRIBUTIONS}")
        if self.mean < 1:
            raise ValueError(f"input length must be >= 1, got {self.mean}")
        if self.kind == "uniform" and not 0.0 <= self.spread < 1.0:
            raise ValueError(f"uniform spread must be in [0, 1), got {self.spread}")
        if self.kind == "lognormal" and self.spread < 0.0:
            raise ValueError(f"lognormal spread (sigma) must be >= 0, got {self.spread}")

    def sample(self, rng: random.Random, num: int, max_len: int) -> list[int]:
        """``num`` lengths, each clamped to ``[1, max_len]``."""
        if self.kind == "fixed":
            raw = [float(self.mean)] * num
        elif self.kind == "uniform":
            lo, hi = self.mean * (1 - self.spread), self.mean * (1 + self.spread)
            raw = [rng.uniform(lo, hi) for _ in range(num)]
        else:
            raw = [math.exp(rng.gauss(math.log(self.mean), self.spread)) for _ in range(num)]
        return [min(max_len, max(1, round(x))) for x in raw]


@dataclass(frozen=True)
class Workload:
    """What each concurrency level sends: ``num_prompts`` requests of ``output_len`` tokens."""

    lengths: LengthDistribution
    output_len: int
    vocab_size: int
    max_model_len: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output length must be >= 1, got {self.output_len}")
        if self.output_len >= self.max_model_len:
            raise ValueError(f"output length {self.output_len} leaves no room for a prompt "
                             f"within max_model_len {self.max_model_len}")

    def prompts(self, concurrency: int, num_prompts: int) -> list[list[int]]:
        """Token-id prompts for one level (seeded by the level: reruns send the same)."""
        rng = random.Random(f"{self.seed}-{concurrency}")
        max_len = self.max_model_len - self.output_len
        lengths = self.lengths.sample(rng, num_prompts, max_len)
        return [[rng.randrange(self.vocab_size) for _ in range(n)] for n in lengths]
