"""Tools from MCP servers (Model Context Protocol) for any `ToolEnv`.

    class MyEnv(ToolEnv):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            use_mcp(self, [{"command": "python", "args": ["configs/mcp/calc_server.py"]}])

`use_mcp(env, servers, timeout_s=...)` starts the servers, adds their tools to `env.toolbox` and
makes `env.close()` stop them. The same by hand (what `envs.dataset` does):

    tools = MCPTools(servers, timeout_s=30.0)
    tools.start()
    for schema, fn in tools.tools:
        env.toolbox.add(schema, fn)
    ...
    tools.close()                            # in env.close()

A server spec is a dict: `{"command", "args", "env", "cwd"}` runs a stdio server as a child
process (`command: python` means this interpreter; the child gets only the SDK's safe environment,
HOME, PATH, USER..., plus `env`), `{"url", "headers"}` connects to a streamable HTTP server. Either
may add `name` (shown in errors), `tools` (an allow-list of the server's tool names) and `prefix`
(prepended to every tool name, to keep two servers' names apart). Unknown keys are refused.

What is mapped: each MCP tool becomes `{"type": "function", "function": {"name": prefix + name,
"description": ..., "parameters": <its inputSchema>}}` (no inputSchema: no arguments), so the env
validates arguments against the server's own schema before calling. A result's content blocks are
joined into text: text blocks as they are, others summarised (`[image image/png]`,
`[resource file:///x]`; an embedded text resource adds its text); with no text block the
structured content is JSON. A result with `isError` and an MCP error become `ToolError`, so the
model sees an error observation and the episode goes on. A server that stopped during the run (its
process died, its connection closed) raises `MCPServerGone`, an `envs.tools.EnvBroken` that
`Toolbox.call` lets through: `env.step` raises, the rollout ends the episode as an env error
(rollout/env_error_rate), rather than the policy training on tools that only say "not running".

Timeouts: `startup_timeout_s` bounds connecting to every server and listing its tools; a server
that fails raises MCPStartError naming it, its command or URL, the reason and the tail of its
stderr. Each call waits at most `timeout_s`; then the request is cancelled on the server and the
call is the error observation "<tool> timed out after N s" (the toolbox's own timeout, set a
little longer, is only a backstop).

Lifecycle: `start()` runs one asyncio event loop in a daemon thread owned by the instance; every
server connection lives in a task on that loop, and the sync tool functions submit calls to it.
`close()` closes the sessions, stops stdio children (stdin closed, then SIGTERM, then SIGKILL)
and the loop; it is idempotent, runs when the instance is garbage-collected or the interpreter
exits, and `with MCPTools(...) as tools:` calls it. The garbage-collection finalizer only starts
the shutdown, in a new daemon thread: cyclic GC may run it on any thread, an MCP event-loop thread
included, where a blocking shutdown would deadlock. Each env instance starts its own servers.

Save and continue: `ToolEnv.set_state` replays the saved actions, so it calls the MCP tools
again. They must be deterministic (same arguments, same result; no side effects that a second
call would see) for a saved episode to continue, or `set_state` raises because the replayed
transcript differs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from envs.mcp_servers import (
    CALL_GRACE_S,
    Connections,
    MCPServerGone,
    MCPStartError,
    ServerSpec,
    parse_server,
    result_text,
)
from envs.tools import Toolbox, ToolError

__all__ = [
    "MCPCall",
    "MCPServerGone",
    "MCPStartError",
    "MCPTools",
    "ServerSpec",
    "attach",
    "parse_server",
    "result_text",
    "tool_schema",
    "use_mcp",
]


class MCPTools:
    """The tools of some MCP servers, as `(schema, fn)` pairs for `Toolbox.add`."""

    def __init__(
        self,
        servers: list[dict[str, Any]],
        *,
        timeout_s: float = 30.0,
        startup_timeout_s: float = 60.0,
    ):
        if not isinstance(servers, list | tuple):
            raise ValueError(
                f"servers must be a list of server specs, got {type(servers).__name__}"
            )
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError(
                f"timeout_s and startup_timeout_s must be > 0, got {timeout_s}, {startup_timeout_s}"
            )
        self.specs = [parse_server(spec, i) for i, spec in enumerate(servers)]
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._connections: Connections | None = None
        self._tools: list[tuple[dict[str, Any], MCPCall]] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def start(self) -> MCPTools:
        """Start every server and list its tools (raises MCPStartError if one fails)."""
        if self._connections is not None:
            raise RuntimeError("MCPTools.start() was already called; make a new MCPTools")
        connections = Connections(self.specs, self.timeout_s)
        self._connections = connections
        self._finalizer = weakref.finalize(self, _shutdown_soon, connections)
        try:
            listings = connections.start(self.startup_timeout_s)
            self._tools = self._map(listings)
        except BaseException:
            self.close()
            raise
        return self

    def _map(self, listings: list[list[Any]]) -> list[tuple[dict[str, Any], MCPCall]]:
        out = []
        for index, (spec, listed) in enumerate(zip(self.specs, listings, strict=True)):
            offered = [t.name for t in listed]
            missing = [n for n in spec.tools or () if n not in offered]
            if missing:
                raise ValueError(
                    f"{spec.label} offers no tool {', '.join(map(repr, missing))} "
                    f"(it offers: {', '.join(offered) or 'none'}); fix the spec's 'tools' list"
                )
            for item in listed:
                if spec.tools is not None and item.name not in spec.tools:
                    continue
                local = spec.prefix + item.name
                call = MCPCall(self, index, item.name, local)
                out.append((tool_schema(local, item.description, item.input_schema), call))
        return out

    @property
    def tools(self) -> list[tuple[dict[str, Any], Callable[..., str]]]:
        """`(schema, fn)` per tool; `fn(**arguments) -> str` is synchronous (see `MCPCall`)."""
        if self._connections is None:
            raise RuntimeError("MCPTools.tools before start(): call start() first")
        return list(self._tools)

    def call(self, server: int, remote: str, local: str, arguments: dict[str, Any]) -> str:
        """Call tool `remote` of server number `server`; raise ToolError on any failure."""
        if self._connections is None:
            raise ToolError(f"{local}: the MCP servers were never started")
        return self._connections.call(server, remote, local, arguments)

    def close(self) -> None:
        """Close the sessions, stop the servers and the event loop (here, before returning).
        Safe to call again."""
        if self._finalizer is not None and self._finalizer.detach() is not None:
            assert self._connections is not None
            self._connections.shutdown()

    def __enter__(self) -> MCPTools:
        return self if self._connections is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class MCPCall:
    """The sync function of one MCP tool: `fn(**arguments) -> str`, raising ToolError."""

    owner: MCPTools
    server: int
    remote: str
    name: str

    @property
    def source(self) -> str:
        """Where the tool comes from (`Toolbox.add` names it when two tools share a name)."""
        return f"{self.owner.specs[self.server].label}, tool {self.remote!r}"

    @property
    def timeout_s(self) -> float:
        """The toolbox's backstop timeout (`Toolbox.add` reads it)."""
        return self.owner.timeout_s + CALL_GRACE_S

    def __call__(self, **arguments: Any) -> str:
        return self.owner.call(self.server, self.remote, self.name, arguments)


def _shutdown_soon(connections: Connections) -> None:
    """The finalizer of a garbage-collected MCPTools. Cyclic GC runs it on whatever thread
    allocates at the time, even an MCP event-loop thread (this instance's, where `shutdown`
    waiting on its own loop would deadlock, or another's, which it would block), so it stops the
    servers from a new daemon thread. At interpreter exit (the main thread has finished and
    atexit runs finalizers) a new thread may never run: then it shuts down in place."""
    if not threading.main_thread().is_alive():
        connections.shutdown()
        return
    stopper = threading.Thread(target=connections.shutdown, name="mcp-tools-stop", daemon=True)
    try:
        stopper.start()
    except RuntimeError:  # no new threads at interpreter shutdown
        connections.shutdown()


def attach(toolbox: Toolbox, tools: MCPTools) -> None:
    """Add every tool of started `tools` to `toolbox` (ValueError on a name already taken)."""
    for schema, fn in tools.tools:
        toolbox.add(schema, fn)


def use_mcp(
    env: Any,
    servers: list[dict[str, Any]],
    *,
    timeout_s: float = 30.0,
    startup_timeout_s: float = 60.0,
) -> MCPTools:
    """Give a `ToolEnv` (after its `__init__` ran) the tools of `servers`; `env.close()` then
    also stops them. Returns the started MCPTools."""
    toolbox = getattr(env, "toolbox", None)
    if not isinstance(toolbox, Toolbox):
        raise TypeError(
            f"use_mcp needs a ToolEnv whose __init__ has run (no toolbox on {type(env).__name__}); "
            "call it after super().__init__(...)"
        )
    tools = MCPTools(servers, timeout_s=timeout_s, startup_timeout_s=startup_timeout_s).start()
    try:
        attach(toolbox, tools)
    except BaseException:
        tools.close()
        raise
    env_close = env.close

    def close() -> None:
        try:
            env_close()
        finally:
            tools.close()

    env.close = close
    return tools


def tool_schema(name: str, description: str | None, input_schema: Any) -> dict[str, Any]:
    """Our tool schema for an MCP tool (its inputSchema is the parameters' JSON schema)."""
    params = dict(input_schema) if isinstance(input_schema, dict) and input_schema else {}
    params.setdefault("type", "object")
    params.setdefault("properties", {})
    return {
        "type": "function",
        "function": {"name": name, "description": description or "", "parameters": params},
    }
