"""Shaping terms: small penalties a run file can weight (`reward: {invalid_tool_call: -0.1}`).

Each returns the raw count; `Weighted` multiplies by the configured weight.
"""

from __future__ import annotations

from reward.base import Reward
from rollout.types import Trajectory


class InvalidToolCall:
    """Tool calls that failed validation or execution, plus turns that did not parse."""

    name = "invalid_tool_call"

    def __call__(self, trajectory: Trajectory) -> Reward:
        value = float(trajectory.num_tool_errors + trajectory.num_parse_errors)
        return Reward(value, {self.name: value})


class LengthPenalty:
    """Thousands of tokens the policy generated in the episode."""

    name = "length"

    def __call__(self, trajectory: Trajectory) -> Reward:
        value = trajectory.num_generated / 1000.0
        return Reward(value, {self.name: value})
