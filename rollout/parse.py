"""Parse a model's turn (Hermes / ChatML layout) into an assistant message. Never raises.

    some text<tool_call>
    {"name": "calculate", "arguments": {"expression": "2 + 2"}}
    </tool_call>

A block that cannot be parsed still becomes a tool call (with an empty name, or its raw argument
text), so the env answers it with an error observation and the episode continues.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from envs.types import Message, ToolCall, tool_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,128})"')


@dataclass(slots=True)
class ParsedTurn:
    message: Message
    errors: list[str] = field(default_factory=list)


def parse_turn(text: str) -> ParsedTurn:
    """Split text into content and tool calls; malformed calls are kept and reported."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    content = _BLOCK.sub(lambda m: _take_call(m.group(1), calls, errors), text)
    if OPEN in content:  # an unclosed block: everything after it is the call
        content, _, rest = content.partition(OPEN)
        errors.append("unclosed <tool_call>")
        calls.append(_malformed(rest))
    message: Message = {"role": "assistant", "content": content.strip()}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


def _take_call(body: str, calls: list[ToolCall], errors: list[str]) -> str:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        errors.append("tool call is not valid JSON")
        calls.append(_malformed(body))
        return ""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        errors.append('tool call needs a string "name"')
        calls.append(_malformed(body))
        return ""
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict | str):
        errors.append("tool call arguments must be an object")
        arguments = json.dumps(arguments)
    calls.append(tool_call(data["name"], arguments))
    return ""


def _malformed(body: str) -> ToolCall:
    """Keep what can be recovered: the name if visible, the raw text as arguments."""
    match = _NAME.search(body)
    raw = body.strip()[:2000]
    return tool_call(match.group(1) if match else "", raw or "{}")
