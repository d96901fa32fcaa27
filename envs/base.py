"""`ToolEnv`: a real `gymnasium.Env` whose observations and actions are chat messages.

    obs, info = env.reset(seed=0)              # obs: [user message]; info["tools"]: schemas
    obs, reward, terminated, truncated, info = env.step(assistant_message)

An assistant message with `tool_calls` runs the tools and returns their results as `tool`
messages. One without tool calls is the final answer: the env grades it, `terminated` is True and
`info["outcome"]` holds the facts (`{"success": bool, "details": {...}}`). A tool may also end the
episode by calling `self.submit(answer)` (an `answer` tool, say). Running out of turns sets
`truncated` (never both). `reward` is the env's native signal (1.0 on success, else 0.0); the
rollout sums it into `Trajectory.env_reward`, and `reward/` decides what a trajectory is worth
(the native signal counts only through its `env_reward` term).

`get_state()` / `set_state(state)` save an unfinished episode as plain JSON-able data and continue
it elsewhere: the state is the RNG state the task was drawn with plus the actions so far, and
`set_state` replays them (tools must be deterministic for this; it checks that the replayed
transcript matches and raises if not). Subclasses may override both with a cheaper snapshot.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any, ClassVar

import gymnasium

from envs.spaces import MessageSpace, MessagesSpace, is_message
from envs.tools import Toolbox
from envs.types import Message, Outcome, assistant, check_state_owner, state_owner

STATE_VERSION = 1


class ToolEnv(gymnasium.Env[list[Message], Message]):
    """Subclasses implement `_new_task` and `_grade`, and define tools with `@tool`.

    Class attributes a subclass may set:
        expert: the scripted expert, a class or "module:Class" string taking
            `(error_rate=..., seed=...)` (see `envs.make_expert`).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    expert: ClassVar[Any] = None

    def __init__(
        self,
        *,
        max_turns: int = 4,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if tool_timeout_s is not None and not tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0 or None, got {tool_timeout_s}")
        self.max_turns = max_turns
        self.render_mode = render_mode
        self.observation_space = MessagesSpace(roles=("system", "user", "tool"))
        self.action_space = MessageSpace(roles=("assistant",))
        self.toolbox = Toolbox.of(self, timeout_s=tool_timeout_s)
        self._turn = 0
        self._done = True
        self._submitted: str | None = None
        self._transcript: list[Message] = []
        self._replay: dict[str, Any] = {}

    # --- to implement -------------------------------------------------------------------
    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        """Draw a task with `self.np_random`; return the opening messages."""
        raise NotImplementedError

    def _grade(self, answer: Message) -> Outcome:
        """Grade the final answer."""
        raise NotImplementedError

    # --- helpers for tools ------------------------------------------------------------------
    def submit(self, answer: str) -> str:
        """Called by a tool to end the episode with `answer` (graded after this turn's calls)."""
        if self._submitted is None:
            self._submitted = answer
        return "Answer submitted."

    # --- gymnasium API ----------------------------------------------------------------------
    @property
    def tools(self) -> list[dict[str, Any]]:
        """JSON schemas of this env's tools (what a chat template renders)."""
        return copy.deepcopy(self.toolbox.schemas)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        self._replay = {
            "rng": copy.deepcopy(self.np_random.bit_generator.state),
            "options": copy.deepcopy(options),
            "actions": [],
        }
        return self._begin(options)

    def _begin(self, options: dict[str, Any]):
        self._turn = 0
        self._done = False
        self._submitted = None
        opening = self._new_task(options)
        self._transcript = copy.deepcopy(opening)
        return copy.deepcopy(opening), {"tools": self.tools}

    def step(self, action: Message):
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        if isinstance(action, str):
            action = {"role": "assistant", "content": action}
        self._replay.setdefault("actions", []).append(_plain(action))
        self._transcript.append(copy.deepcopy(action))
        self._turn += 1
        calls = (action.get("tool_calls") or []) if is_message(action, ("assistant",)) else None
        if calls is None:
            return self._finish([], Outcome(success=False, details={"reason": "invalid action"}))
        if not calls:
            return self._finish([], self._grade(action))
        observations, errors = [], 0
        for call in calls:
            message, ok = self.toolbox.call(call)
            observations.append(message)
            errors += not ok
            if self._submitted is not None:
                break
        self._transcript.extend(copy.deepcopy(observations))
        counts = {"tool_calls": len(observations), "tool_errors": errors}
        if self._submitted is not None:
            return self._finish(observations, self._grade(assistant(self._submitted)), counts)
        info: dict[str, Any] = dict(counts)
        if self._turn >= self.max_turns:
            self._done = True
            info["outcome"] = Outcome(success=False, details={"reason": "out of turns"}).to_dict()
            return observations, 0.0, False, True, info
        return observations, 0.0, False, False, info

    def _finish(self, observations: list[Message], outcome: Outcome, counts=None):
        self._done = True
        info = {"tool_calls": 0, "tool_errors": 0, **(counts or {}), "outcome": outcome.to_dict()}
        return observations, float(outcome.success), True, False, info

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        lines = []
        for m in self._transcript:
            calls = "".join(f" -> {c['function']}" for c in m.get("tool_calls", []))
            lines.append(f"[{m['role']}] {m['content']}{calls}")
        return "\n".join(lines)

    # --- save and continue ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True before the first reset and after an episode ended."""
        return self._done

    def get_state(self) -> dict[str, Any]:
        """The unfinished episode as JSON-able data (see the module docstring)."""
        if not self._replay:
            raise RuntimeError("get_state() before reset(): there is no episode to save")
        return {
            "version": STATE_VERSION,
            "env": state_owner(self),
            **copy.deepcopy(self._replay),
            "transcript_sha256": _digest(self._transcript),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue the episode saved by `get_state()` (on this or another process or machine)."""
        check_state_owner(state, self, STATE_VERSION)
        self.np_random.bit_generator.state = copy.deepcopy(state["rng"])
        self._replay = {"rng": copy.deepcopy(state["rng"]), "options": state["options"]}
        self._replay["actions"] = []
        self._begin(dict(state["options"]))
        for action in state["actions"]:
            self.step(copy.deepcopy(action))
        if _digest(self._transcript) != state["transcript_sha256"]:
            raise ValueError("replaying the saved actions gave a different transcript")


def _plain(action: Any) -> Any:
    """A JSON round trip of the action (what get_state() stores and set_state() replays)."""
    try:
        return json.loads(json.dumps(action))
    except (TypeError, ValueError):
        return {"role": "assistant", "content": str(action)}


def _digest(messages: list[Message]) -> str:
    text = json.dumps(messages, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
