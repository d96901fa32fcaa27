"""Message and outcome types shared by every tool environment.

Environments speak chat messages (the Hugging Face / OpenAI shape), never tokens:

    {"role": "user", "content": "..."}
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
        "function": {"name": "calculate", "arguments": {"expression": "2+2"}}}]}
    {"role": "tool", "name": "calculate", "content": "4"}

`arguments` may be a dict or, as the model wrote it, a JSON string (possibly broken): the
environment validates it and answers with an error message rather than raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

HELDOUT_SEEDS = 1_000_000_000
"""Seeds at or above this draw held-out tasks: evaluation uses HELDOUT_SEEDS + 0, 1, 2, ... and
training seeds stay below it (an env with a fixed task list, envs/dataset.py, keeps its held-out
rows for these seeds)."""
DEMO_SEEDS = 2_000_000_000
"""Seeds at or above this are the SFT demonstrations' (rl/sft/warm_start.py): they draw training
tasks again, never held-out ones, so a warm start never sees an evaluation answer."""


class FunctionCall(TypedDict):
    name: str
    arguments: dict[str, Any] | str


class ToolCall(TypedDict):
    type: str
    function: FunctionCall
    error: NotRequired[str]
    """Set by the parser on a call it could not read: what was wrong, shown to the model."""


class Message(TypedDict):
    role: str
    content: str
    tool_calls: NotRequired[list[ToolCall]]
    name: NotRequired[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """The facts an episode ended with (reported by the env; `reward/` turns them into numbers)."""

    success: bool
    """Whether the task was solved."""
    details: dict[str, Any] = field(default_factory=dict)
    """Task-specific facts: expected and given answers, counts, reasons."""

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "details": dict(self.details)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Outcome:
        return Outcome(success=bool(data["success"]), details=dict(data.get("details", {})))


def user(content: str) -> Message:
    return {"role": "user", "content": content}


def assistant(content: str, tool_calls: list[ToolCall] | None = None) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def tool_call(name: str, arguments: dict[str, Any] | str) -> ToolCall:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}


def state_owner(env: Any) -> str:
    """ "module:Class" of an env, as its saved states name it."""
    return f"{type(env).__module__}:{type(env).__qualname__}"


def check_state_owner(state: dict[str, Any], env: Any, version: int) -> None:
    """Refuse a saved state (ValueError) made by another env class or state version."""
    expected = state_owner(env)
    if state.get("version") != version or state.get("env") != expected:
        raise ValueError(
            f"state is for {state.get('env')!r} (version {state.get('version')}); "
            f"this env is {expected!r} (version {version})"
        )
