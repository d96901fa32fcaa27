"""Task completion: 1 when the env's outcome says the task was solved, else 0."""

from __future__ import annotations

from reward.base import Reward
from rollout.types import Trajectory


class TaskCompletion:
    name = "task_completion"

    def __call__(self, trajectory: Trajectory) -> Reward:
        value = 1.0 if trajectory.success else 0.0
        return Reward(value, {self.name: value})
