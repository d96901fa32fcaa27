"""Terms read from the env: task completion (1 when the env's outcome says the task was solved,
else 0) and the env's own step rewards, summed (`EnvReward`)."""

from __future__ import annotations

from reward.base import Reward
from rollout.types import Trajectory


class TaskCompletion:
    name = "task_completion"

    def __call__(self, trajectory: Trajectory) -> Reward:
        value = 1.0 if trajectory.success else 0.0
        return Reward(value, {self.name: value})


class EnvReward:
    """The env's own Gymnasium step rewards, summed over the episode (`Trajectory.env_reward`):
    how an env with a dense or shaped native reward trains on it (`reward.env_reward: 1.0`)."""

    name = "env_reward"

    def __call__(self, trajectory: Trajectory) -> Reward:
        value = float(trajectory.env_reward)
        return Reward(value, {self.name: value})
