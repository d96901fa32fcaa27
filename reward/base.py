"""The reward seam: a `RewardFn` turns a finished trajectory into a number with a breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rollout.types import Trajectory


@dataclass(frozen=True, slots=True)
class Reward:
    total: float
    parts: dict[str, float] = field(default_factory=dict)


class RewardFn(Protocol):
    def __call__(self, trajectory: Trajectory) -> Reward: ...
