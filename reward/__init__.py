"""Scoring trajectories. `build_reward({"task_completion": 1.0})` makes the configured function."""

from reward.base import Reward, RewardFn
from reward.compose import Weighted
from reward.task import TaskCompletion

REWARDS = {"task_completion": TaskCompletion}

__all__ = ["REWARDS", "Reward", "RewardFn", "TaskCompletion", "Weighted", "build_reward"]


def build_reward(weights: dict[str, float]) -> Weighted:
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise KeyError(f"unknown reward terms {unknown}; known: {sorted(REWARDS)}")
    return Weighted([(name, REWARDS[name](), w) for name, w in weights.items()])
