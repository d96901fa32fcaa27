"""Episodes and rollout workers: token-in/token-out agent loops over tool envs."""

from rollout.episode import EpisodeLimits, run_episodes
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from rollout.worker import RolloutWorker, Task

__all__ = [
    "ChatRenderer",
    "EpisodeLimits",
    "RolloutStatus",
    "RolloutWorker",
    "Task",
    "Trajectory",
    "TrajectoryGroup",
    "run_episodes",
]
