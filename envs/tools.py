"""`@tool`: a typed, documented Python function becomes a tool with a JSON schema.

The schema comes from `transformers.utils.get_json_schema` (type hints + Google-style docstring),
so it is the same schema Hugging Face chat templates and TRL render. Calls are validated against
the schema; every failure (unknown tool, bad JSON, missing or mistyped argument, oversized
arguments, the tool raising or hanging past its timeout) becomes an error *message* for the model,
never an exception for the caller. The one exception is `EnvBroken`: a tool raises it when the env
itself can no longer work (an MCP server died), and `Toolbox.call` lets it through, so `env.step`
raises and the rollout ends the episode as an env error instead of training on broken tools.

    @tool                      # sync, the env's default timeout
    def add(self, a: int, b: int) -> int: ...

    @tool(timeout_s=5.0)       # async tools work too; a hung call is an error observation
    async def fetch(self, url: str) -> str: ...

Tools from elsewhere (an MCP server, see `envs.mcp`) join an env's toolbox with
`env.toolbox.add(schema, fn)`: the schema is in the same format `@tool` produces, `fn(**arguments)`
is a plain (or async) callable, and `call` validates, times out and reports errors for it as for
any other tool.

A timed-out call cannot be stopped from the outside when it runs in-process: its thread is left to
finish in the background. Code the model wrote never runs in-process; it goes to `envs.sandbox`,
whose processes are killed at their limits.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.types import Message, tool_result

MAX_RESULT_CHARS = 4096
"""Tool results longer than this are cut, with a marker saying how much was dropped (the default;
an env whose tools return whole documents raises its `toolbox.max_result_chars`)."""
MAX_ARGUMENT_CHARS = 65536
"""Arguments (as JSON text) longer than this are refused before parsing."""
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


class EnvBroken(RuntimeError):
    """Raised by a tool when the env can no longer work at all (e.g. its MCP server died), so
    every later call would fail too. `Toolbox.call` re-raises it instead of making it an error
    observation: `env.step` raises, the rollout ends the episode as an env error (counted in
    rollout/env_error_rate) and the env should be replaced. Not for the model's mistakes: those
    are `ToolError`."""


def _schema_for(fn: Callable[..., Any]) -> dict[str, Any]:
    """JSON schema of `fn`, ignoring a leading `self` (tools are usually env methods)."""
    from transformers.utils import get_json_schema  # here: `import envs` stays fast (no hub)

    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        params = params[1:]

    def shim(*args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never called
        raise NotImplementedError

    shim.__name__ = fn.__name__
    shim.__doc__ = fn.__doc__
    shim.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    shim.__annotations__ = {k: v for k, v in resolved_hints(fn).items() if k != "self"}
    return get_json_schema(shim)


def resolved_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Type hints with string annotations (`from __future__ import annotations`) resolved."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable: let get_json_schema report the raw annotations
        return dict(getattr(fn, "__annotations__", {}))


@dataclass(frozen=True, slots=True)
class Tool:
    """A function plus its schema. As a class attribute it binds to the env like a method."""

    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float | None = None
    """Seconds a call may take; None uses the env's default (`ToolEnv.tool_timeout_s`)."""

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

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


def tool(fn: Callable[..., Any] | None = None, *, timeout_s: float | None = None) -> Any:
    """Decorator: `@tool def add(self, a: int, b: int) -> int` with a Google-style docstring.

    `@tool(timeout_s=2.0)` sets a per-call timeout for this tool. Sync and `async def` tools both
    work; the schema is built from the signature and docstring when the class is defined, so a
    missing docstring or type hint fails at import, not in the middle of a run.
    """
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(fn=f, schema=_schema_for(f), timeout_s=timeout_s)

    return wrap(fn) if fn is not None else wrap


def validate_arguments(schema: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """Check `arguments` against a tool's parameter schema; raise ToolError naming the problem."""
    name = schema["function"]["name"]
    params = schema["function"].get("parameters", {"properties": {}})
    if isinstance(arguments, str):
        if len(arguments) > MAX_ARGUMENT_CHARS:
            raise ToolError(
                f"arguments for {name} are too large ({len(arguments)} characters; "
                f"max {MAX_ARGUMENT_CHARS})"
            )
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ToolError(f"arguments for {name} are not valid JSON ({reason})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments for {name} must be a JSON object")
    props = params.get("properties", {})
    for key in arguments:
        if key not in props:
            raise ToolError(
                f"{name} has no argument {_short(key)} (expected: {', '.join(props) or 'none'})"
            )
    for key in params.get("required", []):
        if key not in arguments:
            raise ToolError(f"{name} is missing required argument {key!r}")
    for key, value in arguments.items():
        _check_type(name, repr(key), props[key], value)
    return arguments


def _check_type(
    tool_name: str, path: str, prop: dict[str, Any], value: Any, depth: int = 0
) -> None:
    """Raise ToolError if `value` (argument `path`, e.g. 'xs'[2]) does not fit `prop`."""
    where = f"argument {path} of {tool_name}"
    if value is None and prop.get("nullable"):
        return
    types = prop.get("type")
    if types is None:
        return
    types = types if isinstance(types, list) else [types]
    allowed = tuple(t for name in types for t in _JSON_TYPES.get(name, (object,)))
    is_bool = isinstance(value, bool)
    if not isinstance(value, allowed) or (is_bool and "boolean" not in types):
        raise ToolError(f"{where} must be {' or '.join(types)}, got {_json_type(value)}")
    if isinstance(value, float) and value != value:
        raise ToolError(f"{where} must be a finite number")
    if "enum" in prop and value not in prop["enum"]:
        raise ToolError(f"{where} must be one of {prop['enum']}")
    if isinstance(value, list) and "items" in prop and depth < 8:
        for i, item in enumerate(value):
            _check_type(tool_name, f"{path}[{i}]", prop["items"], item, depth + 1)


def _json_type(value: Any) -> str:
    for name, kinds in _JSON_TYPES.items():
        if isinstance(value, kinds) and not (isinstance(value, bool) and name != "boolean"):
            return name
    return type(value).__name__


def _short(text: Any, limit: int = 60) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else f"{shown[:limit]}...'"


class Toolbox:
    """The tools of one env instance, looked up by name; `call` raises only `EnvBroken`."""

    def __init__(
        self,
        tools: list[BoundTool],
        *,
        timeout_s: float | None = None,
        max_result_chars: int = MAX_RESULT_CHARS,
    ):
        self._tools = {t.name: t for t in tools}
        self._sources: dict[str, str] = {}
        """Where each tool added with `add` comes from (for the duplicate-name error)."""
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        """Results longer than this are cut (with a marker saying how much was dropped)."""
        self.late: list[threading.Thread] = []
        """Calls that timed out but still run (a Python thread cannot be stopped)."""

    @staticmethod
    def of(owner: Any, *, timeout_s: float | None = None) -> Toolbox:
        """Collect every `@tool` attribute of `owner`'s class, in definition order."""
        found = []
        for klass in reversed(type(owner).__mro__):
            for value in vars(klass).values():
                if isinstance(value, Tool):
                    found.append(BoundTool(value, owner))
        return Toolbox(found, timeout_s=timeout_s)

    def add(
        self,
        schema: dict[str, Any],
        fn: Callable[..., Any],
        *,
        timeout_s: float | None = None,
        source: str | None = None,
    ) -> None:
        """Register an external tool: `schema` as `@tool` makes it (`{"type": "function",
        "function": {"name", "description", "parameters"}}`), `fn(**arguments)` sync or async.

        `timeout_s` None uses `fn.timeout_s` if the callable has one, else this toolbox's
        default. `source` names where the tool comes from in errors (default: `fn.source` if
        set, else the function's qualified name). A name already taken raises ValueError naming
        both sources.
        """
        checked = _checked_schema(schema)
        name = checked["function"]["name"]
        if not callable(fn):
            raise ValueError(f"tool {name!r}: fn must be callable, got {type(fn).__name__}")
        if timeout_s is None:
            timeout_s = getattr(fn, "timeout_s", None)
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"tool {name!r}: timeout_s must be > 0 or None, got {timeout_s}")
        where = source or getattr(fn, "source", None) or _qualname(fn)
        if name in self._tools:
            raise ValueError(
                f"tool name {name!r} is taken twice: by {self._source(name)} and by {where}; "
                "rename one (an MCP server spec takes a `prefix`)"
            )
        tool_ = Tool(fn=_external(fn), schema=checked, timeout_s=timeout_s)
        self._tools[name] = BoundTool(tool_, None)
        self._sources[name] = str(where)

    def _source(self, name: str) -> str:
        if name in self._sources:
            return self._sources[name]
        bound = self._tools[name]
        return f"@tool {getattr(bound.tool.fn, '__qualname__', name)}"

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self._tools.values()]

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def get(self, name: str) -> BoundTool | None:
        return self._tools.get(name)

    def running_late(self) -> bool:
        """Whether a call that timed out still runs (on this env's state, which it may still
        change): such an env must not serve another episode."""
        self.late = [thread for thread in self.late if thread.is_alive()]
        return bool(self.late)

    def call(self, call: Any) -> tuple[Message, bool]:
        """Run one tool call; returns (tool message, ok). Every failure is the message, except
        `EnvBroken` (the env cannot work any more), which propagates."""
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            said = call.get("error") if isinstance(call, dict) else None
            why = 'malformed tool call; expected {"name": <tool>, "arguments": {...}}'
            return _error("", said if isinstance(said, str) and said else why), False
        if name not in self._tools:
            return _error(
                "", f"unknown tool {_short(name)} (available: {', '.join(self._tools)})"
            ), False
        bound = self._tools[name]
        timeout = bound.tool.timeout_s or self.timeout_s
        try:
            kwargs = validate_arguments(bound.schema, fn.get("arguments", {}))
            result = run_with_timeout(bound, kwargs, timeout, late=self.late)
        except ToolError as exc:
            return _error(name, str(exc)), False
        except EnvBroken:
            raise
        except Exception as exc:  # a tool bug is the model's observation, not our crash
            return _error(name, f"{type(exc).__name__}: {exc}"), False
        return tool_result(name, _render(result, self.max_result_chars)), True


def _checked_schema(schema: Any) -> dict[str, Any]:
    """A copy of an external tool's schema, checked; `parameters` defaults to no arguments."""
    fn = schema.get("function") if isinstance(schema, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(fn, dict):
        raise ValueError(
            'a tool schema must look like {"type": "function", "function": {"name": ..., '
            f'"description": ..., "parameters": {{...}}}}}}, got {_short(schema, 120)}'
        )
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool schema needs a non-empty string function.name, got {name!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or not isinstance(params.get("properties", {}), dict):
        raise ValueError(f"tool {name!r}: function.parameters must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"tool {name!r}: function.description must be a string")
    function = {**fn, "description": description, "parameters": params}
    try:
        return json.loads(json.dumps({"type": "function", "function": function}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"tool {name!r}: the schema is not JSON ({exc})") from None


def _external(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(**kwargs)` as a `Tool.fn`, which is called with its owner first (here: None)."""
    if inspect.iscoroutinefunction(fn):

        async def call_async(_owner: Any, **kwargs: Any) -> Any:
            return await fn(**kwargs)

        return call_async

    def call(_owner: Any, **kwargs: Any) -> Any:
        return fn(**kwargs)

    return call


def _qualname(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def run_with_timeout(
    bound: BoundTool,
    kwargs: dict[str, Any],
    timeout_s: float | None,
    *,
    late: list[threading.Thread] | None = None,
) -> Any:
    """Call a sync or async tool; raise ToolError if it takes longer than `timeout_s` (its
    thread, still running, is added to `late`)."""
    if timeout_s is None and not bound.tool.is_async:
        return bound(**kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            result = bound(**kwargs)
            if inspect.isawaitable(result):
                result = asyncio.run(asyncio.wait_for(_awaited(result), timeout_s))
            box["result"] = result
        except TimeoutError:
            box["error"] = ToolError(f"{bound.name} timed out after {timeout_s:g} s")
        except BaseException as exc:  # SystemExit from a tool must not end the worker thread
            box["error"] = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

    worker = threading.Thread(target=target, name=f"tool-{bound.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        if late is not None:
            late.append(worker)
        raise ToolError(f"{bound.name} timed out after {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("result")


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _render(result: Any, limit: int = MAX_RESULT_CHARS) -> str:
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(result)
    if len(text) > limit:
        dropped = len(text) - limit
        text = f"{text[:limit]}... [truncated {dropped} characters]"
    return clean_text(text)


def clean_text(text: str) -> str:
    """Text that encodes as UTF-8 (lone surrogates from broken input become U+FFFD)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def _error(name: str, text: str) -> Message:
    return tool_result(clean_text(name) or "error", clean_text(f"Error: {text}"))
