"""Scoring trajectories. `build_reward({"task_completion": 1.0, "invalid_tool_call": -0.1})`
makes the configured weighted sum (a run file's `reward:` section)."""

from reward.base import Reward
from reward.compose import Weighted
from reward.shaping import InvalidToolCall, LengthPenalty
from reward.task import EnvReward, TaskCompletion

REWARDS = {
    "task_completion": TaskCompletion,
    "env_reward": EnvReward,
    "invalid_tool_call": InvalidToolCall,
    "length": LengthPenalty,
}

__all__ = [
    "REWARDS",
    "EnvReward",
    "InvalidToolCall",
    "LengthPenalty",
    "Reward",
    "TaskCompletion",
    "Weighted",
    "build_reward",
]


def build_reward(weights: dict[str, float]) -> Weighted:
    """A weighted sum of the named terms; unknown names raise KeyError listing the known ones."""
    unknown = sorted(set(weights) - set(REWARDS))
    if unknown:
        raise KeyError(f"unknown reward terms {unknown}; known: {sorted(REWARDS)}")
    return Weighted([(name, REWARDS[name](), w) for name, w in weights.items()])
