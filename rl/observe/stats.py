"""Intervals for success rates: one Wilson score interval, used wherever a rate gets an interval
(held-out evaluation, metrics.jsonl, the console, the plots, the before/after verdict).

The normal approximation p ± z·sqrt(p(1-p)/n) has zero width at 0% and 100% and undercovers
near them; Wilson's interval (Wilson 1927; Newcombe 1998 compares it with six others) inverts the
score test instead, so it stays inside [0, 1] and keeps a width at the ends.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054
"""The two-sided 95% normal quantile."""


def wilson_interval(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of `successes` out of `n` (n may be an effective, non-integer
    sample size). No observations: the whole of [0, 1]."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if p == 0 else max(0.0, centre - half)
    high = 1.0 if p == 1 else min(1.0, centre + half)
    return low, high


def effective_samples(per_task: list[list[bool]]) -> float:
    """How many independent samples `per_task` is worth: samples of one task correlate, so the
    binomial n is divided by the design effect (the variance of the mean over task means against
    the binomial variance), kept between the number of tasks (samples of a task agree) and the
    number of samples (independent). At 0% or 100% the design effect cannot be estimated: the
    number of tasks (the cautious end)."""
    tasks, total = len(per_task), sum(len(s) for s in per_task)
    means = [sum(s) / len(s) for s in per_task]
    p = sum(means) / tasks
    if p in (0.0, 1.0) or tasks < 2:
        return float(tasks)
    var_of_mean = sum((m - p) ** 2 for m in means) / (tasks - 1) / tasks
    if var_of_mean == 0:
        return float(total)
    return min(max(p * (1 - p) / var_of_mean, tasks), total)


def success_interval(per_task: list[list[bool]], z: float = Z95) -> tuple[float, float, float]:
    """Mean success over tasks and its Wilson interval at the effective sample size."""
    if not per_task:
        return 0.0, 0.0, 1.0
    mean = sum(sum(s) / len(s) for s in per_task) / len(per_task)
    n = effective_samples(per_task)
    low, high = wilson_interval(mean * n, n, z)
    return mean, low, high
