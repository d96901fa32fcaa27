"""Run an env's scripted expert to produce demonstrations (for SFT and as proof of solvability)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from envs.base import ToolEnv
from envs.types import Message


class Expert(Protocol):
    def begin(self) -> None: ...
    def act(self, env: ToolEnv, history: list[Message]) -> Message: ...


@dataclass(slots=True, kw_only=True)
class Demonstration:
    messages: list[Message]
    """The whole conversation: opening messages, then assistant turns and tool results."""
    tools: list[dict[str, Any]]
    outcome: dict[str, Any]


def demonstrate(env: ToolEnv, expert: Expert, *, seed: int) -> Demonstration:
    """One expert episode on the task drawn by `reset(seed=seed)`."""
    observation, info = env.reset(seed=seed)
    history = list(observation)
    expert.begin()
    outcome: dict[str, Any] = {"success": False, "details": {"reason": "unfinished"}}
    for _ in range(env.unwrapped.max_turns):
        action = expert.act(env, history)
        history.append(action)
        observation, _, terminated, truncated, step_info = env.step(action)
        history.extend(observation)
        if terminated or truncated:
            outcome = step_info["outcome"]
            break
    return Demonstration(messages=history, tools=info["tools"], outcome=outcome)
