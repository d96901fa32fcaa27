"""`ToolEnv`: a real `gymnasium.Env` whose observations and actions are chat messages.

    obs, info = env.reset(seed=0)              # obs: [user message]; info["tools"]: schemas
    obs, reward, terminated, truncated, info = env.step(assistant_message)

An assistant message with `tool_calls` runs the tools and returns their results as `tool`
messages. One without tool calls is the final answer: the env grades it, `terminated` is True and
`info["outcome"]` holds the facts (`{"success": bool, "details": {...}}`). Running out of turns
sets `truncated` (never both). `reward` is the env's native signal (1.0 on success, else 0.0);
`reward/` decides what a trajectory is worth.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import gymnasium

from envs.spaces import MessageSpace, MessagesSpace, is_message
from envs.tools import Toolbox
from envs.types import Message, Outcome


class ToolEnv(gymnasium.Env[list[Message], Message]):
    """Subclasses implement `_new_task` and `_grade`, and define tools with `@tool`."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, *, max_turns: int = 4, render_mode: str | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = MessagesSpace(roles=("system", "user", "tool"))
        self.action_space = MessageSpace(roles=("assistant",))
        self.toolbox = Toolbox.of(self)
        self._turn = 0
        self._done = True
        self._transcript: list[Message] = []

    # --- to implement -------------------------------------------------------------------
    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        """Draw a task with `self.np_random`; return the opening messages."""
        raise NotImplementedError

    def _grade(self, answer: Message) -> Outcome:
        """Grade the final answer."""
        raise NotImplementedError

    # --- gymnasium API ----------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        """JSON schemas of this env's tools (what a chat template renders)."""
        return copy.deepcopy(self.toolbox.schemas)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._turn = 0
        self._done = False
        opening = self._new_task(dict(options or {}))
        self._transcript = copy.deepcopy(opening)
        return copy.deepcopy(opening), {"tools": self.tools}

    def step(self, action: Message):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        if isinstance(action, str):
            action = {"role": "assistant", "content": action}
        self._transcript.append(copy.deepcopy(action))
        self._turn += 1
        calls = (action.get("tool_calls") or []) if is_message(action, ("assistant",)) else None
        if calls is None:
            return self._finish(Outcome(success=False, details={"reason": "invalid action"}))
        if not calls:
            return self._finish(self._grade(action))
        observations, errors = [], 0
        for call in calls:
            message, ok = self.toolbox.call(call)
            observations.append(message)
            errors += not ok
        self._transcript.extend(copy.deepcopy(observations))
        info = {"tool_calls": len(calls), "tool_errors": errors}
        if self._turn >= self.max_turns:
            self._done = True
            info["outcome"] = Outcome(success=False, details={"reason": "out of turns"}).to_dict()
            return observations, 0.0, False, True, info
        return observations, 0.0, False, False, info

    def _finish(self, outcome: Outcome):
        self._done = True
        info = {"tool_calls": 0, "tool_errors": 0, "outcome": outcome.to_dict()}
        return [], float(outcome.success), True, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        lines = []
        for m in self._transcript:
            calls = "".join(f" -> {c['function']}" for c in m.get("tool_calls", []))
            lines.append(f"[{m['role']}] {m['content']}{calls}")
        return "\n".join(lines)
