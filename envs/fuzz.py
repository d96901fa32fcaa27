"""Random actions for checking envs: plausible and hostile tool calls and final answers.

Used by `envs.check` (random-action and long episodes); the property tests in tests/ use
hypothesis for the same classes of input.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from envs.types import Message, assistant, tool_call

STRINGS = ("", "1 + 1", "hello", "print(1)", "x" * 300, "é中→\n\t{}[]\"'", "\ud800", "0", "-1")
NUMBERS = (0, 1, -1, 7, 2**31, -(2**63), 10**30)
HOSTILE_ARGUMENTS = (
    "{",
    '{"a": ',
    "[1, 2]",
    "null",
    "not json at all",
    '{"x": 1}',
    "[" * 2000,
    json.dumps({"huge": "y" * 100_000}),
    "\udcff\udcfe",
)


def random_value(rng: np.random.Generator, prop: dict[str, Any]) -> Any:
    """A value for one parameter: usually of the declared type, sometimes not."""
    kind = prop.get("type")
    if rng.random() < 0.15:  # wrong type on purpose
        return [None, 3.5, "3", [1], {"a": 1}, True][int(rng.integers(6))]
    if kind == "integer":
        return int(NUMBERS[int(rng.integers(len(NUMBERS)))])
    if kind == "number":
        return float(rng.normal() * 100)
    if kind == "boolean":
        return bool(rng.integers(2))
    if kind == "array":
        return [random_value(rng, prop.get("items", {})) for _ in range(int(rng.integers(4)))]
    if "enum" in prop:
        return prop["enum"][int(rng.integers(len(prop["enum"])))]
    return STRINGS[int(rng.integers(len(STRINGS)))]


def random_call(rng: np.random.Generator, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call to a random tool with random arguments; 1 in 4 is malformed or unknown."""
    roll = rng.random()
    if not tools or roll < 0.08:
        return tool_call("no_such_tool", {})
    if roll < 0.16:
        return tool_call("", HOSTILE_ARGUMENTS[int(rng.integers(len(HOSTILE_ARGUMENTS)))])
    fn = tools[int(rng.integers(len(tools)))]["function"]
    if roll < 0.25:
        raw = HOSTILE_ARGUMENTS[int(rng.integers(len(HOSTILE_ARGUMENTS)))]
        return tool_call(fn["name"], raw)
    props = fn.get("parameters", {}).get("properties", {})
    args = {k: random_value(rng, p) for k, p in props.items() if rng.random() < 0.9}
    if rng.random() < 0.05:
        args["unexpected"] = 1
    return tool_call(fn["name"], args)


def random_action(
    rng: np.random.Generator, tools: list[dict[str, Any]], *, final: bool = True
) -> Message:
    """A random assistant turn: tool calls (1-3), or (if `final`) a random final answer.

    With `final=False` it never ends the episode itself: no final answer and no call to a tool
    named `answer` or `submit`.
    """
    if final and rng.random() < 0.25:
        return assistant(STRINGS[int(rng.integers(len(STRINGS)))])
    usable = (
        tools if final else [t for t in tools if t["function"]["name"] not in ("answer", "submit")]
    )
    calls = [random_call(rng, usable) for _ in range(int(rng.integers(1, 4)))]
    return assistant("", calls)
