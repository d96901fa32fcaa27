"""Trajectories: every token with where it came from. Pure dataclasses, no torch.

Letters: T = tokens in the trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from envs.types import Message


class RolloutStatus(StrEnum):
    COMPLETED = "completed"
    """The env terminated the episode (it graded a final answer)."""
    TRUNCATED = "truncated"
    """Out of turns, out of tokens for a turn, or out of context."""
    ENV_ERROR = "env_error"
    """The env raised; the episode is recorded but never trained on."""
    GRADER_ERROR = "grader_error"
    """The reward function raised; counted and excluded from training."""


@dataclass(slots=True, kw_only=True)
class Trajectory:
    task_id: str
    """Identifies the task (env id and seed); a group shares it."""
    traj_id: str = ""
    """Unique per trajectory: `<group_id>/<index>` (the same across retries)."""
    attempt: int = 1
    """1 for the first try; a task retried after a worker crash produces attempt 2, ..."""
    resumed: int = 0
    """How many times this episode was continued from a saved state (partial rollouts)."""
    messages: list[Message] = field(default_factory=list)
    """The conversation as messages (for logs, reward functions and debugging)."""
    token_ids: list[int] = field(default_factory=list)
    """[T] every token, prompt included."""
    loss_mask: list[int] = field(default_factory=list)
    """[T] 1 = sampled by the policy, 0 = prompt, template or tool output."""
    sample_logprobs: list[float] = field(default_factory=list)
    """[T] logprob of each sampled token under the rollout policy; 0.0 where mask is 0."""
    token_versions: list[int] = field(default_factory=list)
    """[T] policy version that sampled each token; -1 where mask is 0."""
    prompt_length: int = 0
    status: RolloutStatus = RolloutStatus.TRUNCATED
    finish_detail: str = ""
    outcome: dict[str, Any] | None = None
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_parse_errors: int = 0
    env_reward: float = 0.0
    """Sum of the env's own Gymnasium step rewards. It counts toward training only through the
    `env_reward` term of `reward/` (a run file's `reward.env_reward` weight): `reward` below,
    the weighted sum of the configured terms, is the one number the learner trains on."""
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """MoE policies: int16 [T-1, M, K], the experts each of the M MoE layers chose at every
    position of the forward the rollout engine ran (routing replay and rollout/learner mismatch
    metrics). Left out of `==` (elementwise on an array): compare with np.array_equal."""

    def append(
        self, ids: list[int], *, sampled: bool, logprobs=None, version: int | list[int] = -1
    ) -> None:
        """Append tokens; `version` is one version for all of them or one per token."""
        self.token_ids.extend(ids)
        self.loss_mask.extend([int(sampled)] * len(ids))
        self.sample_logprobs.extend(logprobs if sampled else [0.0] * len(ids))
        if not sampled:
            self.token_versions.extend([-1] * len(ids))
        elif isinstance(version, int):
            self.token_versions.extend([version] * len(ids))
        else:
            if len(version) != len(ids):
                raise ValueError(f"{len(version)} versions for {len(ids)} tokens")
            self.token_versions.extend(version)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def success(self) -> bool:
        return bool(self.outcome and self.outcome.get("success"))

    @property
    def trainable(self) -> bool:
        return self.status in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


@dataclass(slots=True, kw_only=True)
class TrajectoryGroup:
    """The samples of one task (GRPO normalises rewards within a group)."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]


class Scored(Protocol):
    total: float
    parts: dict[str, float]


class Scorer(Protocol):
    """What the worker calls on a finished episode (the `reward` package implements it)."""

    def __call__(self, trajectory: Trajectory) -> Scored: ...
