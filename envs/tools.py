"""`@tool`: a typed, documented Python function becomes a tool with a JSON schema.

The schema comes from `transformers.utils.get_json_schema` (type hints + Google-style docstring),
so it is the same schema Hugging Face chat templates and TRL render. Calls are validated against
the schema; every failure (unknown tool, bad JSON, missing or mistyped argument, the tool raising)
becomes an error *message* for the model, never an exception for the caller.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers.utils import get_json_schema

from envs.types import Message, tool_result

MAX_RESULT_CHARS = 4096
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolError(Exception):
    """Raised inside a tool (or by validation) to send a clean error message to the model."""


def _schema_for(fn: Callable[..., Any]) -> dict[str, Any]:
    """JSON schema of `fn`, ignoring a leading `self` (tools are usually env methods)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]

    def shim(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise NotImplementedError

    shim.__name__ = fn.__name__
    shim.__doc__ = fn.__doc__
    shim.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    shim.__annotations__ = {
        k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != "self"
    }
    return get_json_schema(shim)


@dataclass(frozen=True, slots=True)
class Tool:
    """A function plus its schema. As a class attribute it binds to the env like a method."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return BoundTool(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class BoundTool:
    tool: Tool
    owner: Any

    @property
    def name(self) -> str:
        return self.tool.name

    @property
    def schema(self) -> dict[str, Any]:
        return self.tool.schema

    def __call__(self, **kwargs: Any) -> Any:
        return self.tool.fn(self.owner, **kwargs)


def tool(fn: Callable[..., Any]) -> Tool:
    """Decorator: `@tool def add(self, a: int, b: int) -> int` with a Google-style docstring."""
    return Tool(fn=fn, schema=_schema_for(fn))


def validate_arguments(schema: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """Check `arguments` against a tool's parameter schema; raise ToolError naming the problem."""
    name = schema["function"]["name"]
    params = schema["function"].get("parameters", {"properties": {}})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolError(f"arguments for {name} are not valid JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments for {name} must be a JSON object")
    props = params.get("properties", {})
    for key in arguments:
        if key not in props:
            raise ToolError(f"{name} has no argument {key!r} (expected: {', '.join(props)})")
    for key in params.get("required", []):
        if key not in arguments:
            raise ToolError(f"{name} is missing required argument {key!r}")
    for key, value in arguments.items():
        _check_type(name, key, props[key], value)
    return arguments


def _check_type(tool_name: str, key: str, prop: dict[str, Any], value: Any) -> None:
    types = prop.get("type")
    if types is None:
        return
    types = types if isinstance(types, list) else [types]
    allowed = tuple(t for name in types for t in _JSON_TYPES.get(name, (object,)))
    is_bool = isinstance(value, bool)
    if not isinstance(value, allowed) or (is_bool and "boolean" not in types):
        raise ToolError(
            f"argument {key!r} of {tool_name} must be {' or '.join(types)}, "
            f"got {type(value).__name__}"
        )
    if "enum" in prop and value not in prop["enum"]:
        raise ToolError(f"argument {key!r} of {tool_name} must be one of {prop['enum']}")


class Toolbox:
    """The tools of one env instance, looked up by name; `call` never raises."""

    def __init__(self, tools: list[BoundTool]):
        self._tools = {t.name: t for t in tools}

    @staticmethod
    def of(owner: Any) -> Toolbox:
        """Collect every `@tool` attribute of `owner`'s class, in definition order."""
        found = []
        for klass in reversed(type(owner).__mro__):
            for value in vars(klass).values():
                if isinstance(value, Tool):
                    found.append(BoundTool(value, owner))
        return Toolbox(found)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def call(self, call: Any) -> tuple[Message, bool]:
        """Run one tool call; returns (tool message, ok)."""
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            return _error(
                "", 'malformed tool call; expected {"name": <tool>, "arguments": {...}}'
            ), False
        if name not in self._tools:
            return _error(
                name, f"unknown tool {name!r} (available: {', '.join(self._tools)})"
            ), False
        bound = self._tools[name]
        try:
            kwargs = validate_arguments(bound.schema, fn.get("arguments", {}))
            result = bound(**kwargs)
        except ToolError as exc:
            return _error(name, str(exc)), False
        except Exception as exc:  # a tool bug is the model's observation, not our crash
            return _error(name, f"{type(exc).__name__}: {exc}"), False
        return tool_result(name, _render(result)), True


def _render(result: Any) -> str:
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        dropped = len(text) - MAX_RESULT_CHARS
        text = f"{text[:MAX_RESULT_CHARS]}... [truncated {dropped} characters]"
    return text


def _error(name: str, text: str) -> Message:
    return tool_result(name or "error", f"Error: {text}")
