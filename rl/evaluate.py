"""Held-out evaluation across the rollout workers, with 95% intervals clustered by task."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import ray

from policy.sampling import SamplingParams

EVAL_SEED_OFFSET = 1_000_000_000  # training seeds stay below this


@dataclass(frozen=True, slots=True)
class EvalResult:
    mode: str
    tasks: int
    samples: int
    success: float
    ci_low: float
    ci_high: float

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.success:6.1%} [{self.ci_low:.1%}, {self.ci_high:.1%}]"


def success_interval(per_task: list[list[bool]]) -> tuple[float, float, float]:
    """Mean success and a 95% normal interval over task means (samples of a task correlate)."""
    means = [sum(s) / len(s) for s in per_task]
    n = len(means)
    mean = sum(means) / n
    sd = math.sqrt(sum((m - mean) ** 2 for m in means) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def evaluate(
    workers, *, tasks: int, samples: int, sampling: SamplingParams, mode: str
) -> EvalResult:
    seeds = [EVAL_SEED_OFFSET + i for i in range(tasks)]
    chunks = [seeds[i :: len(workers)] for i in range(len(workers))]
    results = ray.get(
        [w.evaluate.remote(c, samples, sampling) for w, c in zip(workers, chunks, strict=True) if c]
    )
    per_task = [task for chunk in results for task in chunk]
    mean, low, high = success_interval(per_task)
    return EvalResult(mode, tasks, samples, mean, low, high)
