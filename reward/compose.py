"""A weighted sum of reward functions with a per-part breakdown."""

from __future__ import annotations

from reward.base import Reward, RewardFn
from rollout.types import Trajectory


class Weighted:
    def __init__(self, terms: list[tuple[str, RewardFn, float]]):
        if not terms:
            raise ValueError("Weighted needs at least one reward term")
        self.terms = terms

    def __call__(self, trajectory: Trajectory) -> Reward:
        total, parts = 0.0, {}
        for name, fn, weight in self.terms:
            value = fn(trajectory).total
            parts[name] = value
            total += weight * value
        return Reward(total, parts)
