"""Held-out evaluation across the rollout workers, with 95% Wilson intervals at the effective
sample size of the task clustering (rl/stats.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import ray

from policy.sampling import SamplingParams
from rl.stats import success_interval

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
