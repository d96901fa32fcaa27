"""A weighted sum of reward functions with a per-part breakdown.

`parts` holds each term's raw value (before its weight), so the metrics show, e.g., the mean
number of invalid tool calls next to the mean task success. A term that returns NaN or inf
raises: the worker records the trajectory as a grader error instead of training on it.
"""

from __future__ import annotations

import math

from reward.base import Reward
from rollout.types import Scorer, Trajectory


class Weighted:
    def __init__(self, terms: list[tuple[str, Scorer, float]]):
        if not terms:
            raise ValueError("Weighted needs at least one reward term")
        self.terms = terms

    def __call__(self, trajectory: Trajectory) -> Reward:
        total, parts = 0.0, {}
        for name, fn, weight in self.terms:
            value = float(fn(trajectory).total)
            if not math.isfinite(value):
                raise ValueError(f"reward term {name!r} returned {value}")
            parts[name] = value
            total += weight * value
        return Reward(total, parts)
