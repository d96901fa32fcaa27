"""Gymnasium spaces for chat messages.

`gymnasium.spaces.Text` accepts alphanumerics only by default (and rejects the empty string),
so a chat env needs its own spaces: any Unicode text is valid content.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from envs.types import Message

ROLES = ("system", "user", "assistant", "tool")
_SAMPLE_ALPHABET = (
    *"abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?()+-*/=\"'{}[]\n",
    "é",
    "ß",
    "→",
    "中",
)


def is_message(value: Any, roles: tuple[str, ...] = ROLES) -> bool:
    """Structural check: a dict with a known role, str content, well-formed optional fields."""
    if not isinstance(value, dict) or value.get("role") not in roles:
        return False
    if not isinstance(value.get("content"), str):
        return False
    if "name" in value and not isinstance(value["name"], str):
        return False
    calls = value.get("tool_calls", [])
    if not isinstance(calls, list):
        return False
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            return False
        if not isinstance(fn.get("arguments"), dict | str):
            return False
    return True


class MessageSpace(gymnasium.Space[Message]):
    """One chat message with any text content; `roles` limits who may speak."""

    def __init__(self, roles: tuple[str, ...] = ROLES, max_sample_length: int = 32, seed=None):
        self.roles = tuple(roles)
        self.max_sample_length = max_sample_length
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> Message:
        length = int(self.np_random.integers(0, self.max_sample_length + 1))
        chars = self.np_random.choice(np.array(_SAMPLE_ALPHABET, dtype=object), size=length)
        role = self.roles[int(self.np_random.integers(len(self.roles)))]
        return {"role": role, "content": "".join(chars)}

    def contains(self, x: Any) -> bool:
        return is_message(x, self.roles)

    def __repr__(self) -> str:
        return f"MessageSpace(roles={self.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessageSpace) and other.roles == self.roles


class MessagesSpace(gymnasium.Space[list[Message]]):
    """A list of chat messages (what an env returns from `reset` and `step`)."""

    def __init__(self, roles: tuple[str, ...] = ROLES, max_sample_messages: int = 2, seed=None):
        self.message = MessageSpace(roles)
        self.max_sample_messages = max_sample_messages
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def seed(self, seed: int | None = None) -> list[int]:
        seeds = super().seed(seed)
        self.message.seed(int(self.np_random.integers(2**31)))
        return seeds

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        count = int(self.np_random.integers(0, self.max_sample_messages + 1))
        return [self.message.sample() for _ in range(count)]

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(self.message.contains(m) for m in x)

    def __repr__(self) -> str:
        return f"MessagesSpace(roles={self.message.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and other.message == self.message
