"""The MCP server side of `envs.mcp`: server specs, the connections and their event loop.

`Connections` owns one asyncio event loop in a daemon thread. Each server's session lives in its
own task on that loop (entered and left in that task, as anyio requires) until `shutdown`; calls
come from any thread with `call`, which waits for the answer and raises `ToolError` for every
failure of the call, or `MCPServerGone` (an `EnvBroken`) once the server itself is gone. Users go
through `envs.mcp.MCPTools`; this module is its machinery.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shlex
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2  # the HTTP client of the MCP SDK
from mcp import Client, MCPError
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

from envs.tools import EnvBroken, ToolError

STDIO_KEYS = ("command", "args", "env", "cwd")
HTTP_KEYS = ("url", "headers")
COMMON_KEYS = ("name", "tools", "prefix")
STDERR_TAIL_BYTES = 2000
"""How much of a failed stdio server's stderr an MCPStartError shows."""
CALL_GRACE_S = 2.0
"""How much longer than `timeout_s` the toolbox and the waiting thread allow, so that the MCP
request timeout (which also cancels the request on the server) fires first."""
STOP_TIMEOUT_S = 15.0
"""Longest wait for the servers to stop on close (a stdio child gets 2 s after stdin closes,
then SIGTERM, then SIGKILL 2 s later)."""
MAX_LIST_PAGES = 100


class MCPStartError(RuntimeError):
    """An MCP server could not be started, reached or listed (the message says which and why)."""


class MCPServerGone(EnvBroken):
    """An MCP server stopped during the run (its process died, its connection closed): every
    later call would fail, so the env step raises (the episode ends as an env error) instead of
    the model seeing "not running" observations forever. `server` is its label, `reason` what
    happened."""

    def __init__(self, server: str, reason: str):
        super().__init__(
            f"{server} stopped during the run ({reason}); this env's MCP tools cannot work any "
            "more: the episode ends as an env error, and a new env starts the server again"
        )
        self.server = server
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.server, self.reason))


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One checked server spec (see the module docstring for the keys)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] | None = None
    tools: tuple[str, ...] | None = None
    prefix: str = ""

    @property
    def label(self) -> str:
        """How errors name the server: its name and its command line or URL."""
        if self.url is not None:
            return f"MCP server {self.name!r} at {self.url}"
        return f"MCP server {self.name!r} ({shlex.join([self.command or '', *self.args])})"


def parse_server(spec: Any, index: int = 0) -> ServerSpec:
    """Check one server spec; raise ValueError naming the key at fault."""
    where = f"MCP server spec #{index}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a mapping, got {type(spec).__name__}")
    if ("command" in spec) == ("url" in spec):
        raise ValueError(
            f"{where} needs exactly one of 'command' (a stdio server) or 'url' (streamable HTTP)"
        )
    allowed = (STDIO_KEYS if "command" in spec else HTTP_KEYS) + COMMON_KEYS
    for key in spec:
        if key not in allowed:
            raise ValueError(f"{where} has unknown key {key!r} (allowed: {', '.join(allowed)})")
    strings = _strings(where, spec, "args", "tools")
    env = _string_map(where, spec, "env")
    headers = _string_map(where, spec, "headers")
    for key in ("command", "url", "cwd", "name", "prefix"):
        if key in spec and not isinstance(spec[key], str | os.PathLike):
            raise ValueError(f"{where}: {key!r} must be a string, got {spec[key]!r}")
    command = spec.get("command")
    if command in ("python", "python3"):
        command = sys.executable  # the servers see the packages this interpreter sees
    args = strings.get("args", ())
    name = spec.get("name") or _default_name(spec.get("url"), spec.get("command"), args)
    return ServerSpec(
        name=str(name),
        command=None if command is None else str(command),
        args=args,
        env=env,
        cwd=None if spec.get("cwd") is None else str(spec["cwd"]),
        url=spec.get("url"),
        headers=headers,
        tools=strings.get("tools"),
        prefix=str(spec.get("prefix", "")),
    )


def _strings(where: str, spec: dict[str, Any], *keys: str) -> dict[str, tuple[str, ...]]:
    out = {}
    for key in keys:
        if key in spec:
            value = spec[key]
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{where}: {key!r} must be a list of strings, got {value!r}")
            out[key] = tuple(value)
    return out


def _string_map(where: str, spec: dict[str, Any], key: str) -> dict[str, str] | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{where}: {key!r} must map strings to strings, got {value!r}")
    return dict(value)


def _default_name(url: str | None, command: str | None, args: tuple[str, ...]) -> str:
    if url is not None:
        return urlsplit(url).netloc or url
    scripts = [a for a in args if not a.startswith("-")]
    return Path(scripts[0]).stem if scripts else Path(command or "server").name


def result_text(result: Any) -> str:
    """A CallToolResult as text; raise ToolError with that text when it is an error."""
    blocks = list(getattr(result, "content", None) or [])
    parts = [_block_text(block) for block in blocks]
    structured = getattr(result, "structured_content", None)
    if structured is not None and not any(getattr(b, "type", "") == "text" for b in blocks):
        parts.insert(0, json.dumps(structured, ensure_ascii=False, default=str))
    text = "\n".join(part for part in parts if part)
    if getattr(result, "is_error", False):
        raise ToolError(text or "the MCP tool reported an error without a message")
    return text


def _block_text(block: Any) -> str:
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind in ("image", "audio"):
        return f"[{kind} {getattr(block, 'mime_type', '') or ''}]".replace(" ]", "]")
    if kind == "resource_link":
        return f"[resource {block.uri}]"
    if kind == "resource":
        inner = block.resource
        text = getattr(inner, "text", None)
        return f"[resource {inner.uri}]" + (f"\n{text}" if isinstance(text, str) else "")
    return f"[{kind or type(block).__name__}]"


def _connection_closed(exc: MCPError) -> bool:
    """The SDK's own "the transport closed" error (a server's error answer may reuse the code
    -32000, so the message is checked too)."""
    return exc.code == CONNECTION_CLOSED and exc.message == "Connection closed"


def _reason(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups, as one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class Connections:
    """The event loop thread and the server connections of one MCPTools (no reference back to
    it, so a garbage-collected MCPTools can still be shut down by its finalizer)."""

    def __init__(self, specs: list[ServerSpec], timeout_s: float):
        self.specs = specs
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="mcp-tools", daemon=True)
        self.clients: dict[int, Any] = {}
        self.stopped: dict[int, str] = {}
        self.errlogs = [_errlog() if s.command else None for s in specs]
        self.holders: list[asyncio.Task[None]] = []
        self.stop_event: asyncio.Event | None = None
        self.lock = threading.Lock()
        self.closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, startup_timeout_s: float) -> list[list[Any]]:
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(self._connect_all(startup_timeout_s), self.loop)
        try:
            return future.result(startup_timeout_s + STOP_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise MCPStartError(
                f"MCP servers did not start within {startup_timeout_s:g} s (startup_timeout_s)"
            ) from None

    async def _connect_all(self, startup_timeout_s: float) -> list[list[Any]]:
        self.stop_event = asyncio.Event()
        readies = [self.loop.create_future() for _ in self.specs]
        for index, ready in enumerate(readies):
            self.holders.append(self.loop.create_task(self._hold(index, ready)))
        if readies:
            await asyncio.wait(readies, timeout=startup_timeout_s)
        failures = []
        for index, ready in enumerate(readies):
            if not ready.done():
                failures.append(
                    f"{self.specs[index].label} did not answer within {startup_timeout_s:g} s "
                    f"(startup_timeout_s){self._tail(index)}"
                )
            elif ready.cancelled():
                failures.append(f"{self.specs[index].label} stopped while starting")
            elif ready.exception() is not None:
                failures.append(str(ready.exception()))
        if failures:
            raise MCPStartError("; ".join(failures))
        return [ready.result() for ready in readies]

    async def _hold(self, index: int, ready: asyncio.Future[list[Any]]) -> None:
        """Connect server `index`, list its tools, and keep the session open until stop."""
        spec = self.specs[index]
        assert self.stop_event is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                transport = await self._transport(stack, index)
                client = await stack.enter_async_context(Client(transport, cache=None))
                listed = await _list_tools(client)
                self.clients[index] = client
                ready.set_result(listed)
                await self.stop_event.wait()
        except Exception as exc:
            reason = _reason(exc)
            self.stopped[index] = reason
            if not ready.done():
                verb = "could not be reached" if spec.url else "failed to start"
                ready.set_exception(
                    MCPStartError(f"{spec.label} {verb}: {reason}{self._tail(index)}")
                )
        finally:
            self.clients.pop(index, None)
            self.stopped.setdefault(index, "it stopped")
            if not ready.done():
                ready.cancel()

    async def _transport(self, stack: contextlib.AsyncExitStack, index: int) -> Any:
        spec = self.specs[index]
        if spec.url is not None:
            http = None
            if spec.headers:
                timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's defaults
                client = httpx2.AsyncClient(headers=spec.headers, timeout=timeout)
                http = await stack.enter_async_context(client)
            return streamable_http_client(spec.url, http_client=http)
        assert spec.command is not None
        params = StdioServerParameters(
            command=spec.command, args=list(spec.args), env=spec.env, cwd=spec.cwd
        )
        return stdio_client(params, errlog=self.errlogs[index])  # type: ignore[arg-type]

    def _tail(self, index: int) -> str:
        """The end of a stdio server's stderr, as a suffix for an error message."""
        log = self.errlogs[index]
        if log is None or log.closed:
            return ""
        size = os.fstat(log.fileno()).st_size
        data = os.pread(log.fileno(), STDERR_TAIL_BYTES, max(0, size - STDERR_TAIL_BYTES))
        text = data.decode("utf-8", "replace").strip()
        return f"; its stderr ended with:\n{text}" if text else ""

    def call(self, server: int, remote: str, local: str, arguments: dict[str, Any]) -> str:
        with self.lock:
            if self.closed:
                raise ToolError(f"{local}: the MCP servers were closed")
            future = asyncio.run_coroutine_threadsafe(
                self._call(server, remote, local, arguments), self.loop
            )
        try:
            return future.result(self.timeout_s + CALL_GRACE_S)
        except TimeoutError:
            future.cancel()
            raise ToolError(f"{local} timed out after {self.timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise ToolError(f"{local}: the MCP servers were closed during the call") from None

    async def _call(self, server: int, remote: str, local: str, arguments: dict[str, Any]) -> str:
        spec = self.specs[server]
        client = self.clients.get(server)
        if client is None and self.closed:
            raise ToolError(f"{local}: the MCP servers were closed")
        if client is None:
            raise MCPServerGone(spec.label, self.stopped.get(server, "it is not connected"))
        try:
            result = await client.call_tool(remote, arguments, read_timeout_seconds=self.timeout_s)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise ToolError(f"{local} timed out after {self.timeout_s:g} s") from None
            if _connection_closed(exc) and self.closed:  # close() ran during the call
                raise ToolError(f"{local}: the MCP servers were closed during the call") from None
            if _connection_closed(exc):
                raise MCPServerGone(
                    spec.label, f"its connection closed{self._tail(server)}"
                ) from None
            raise ToolError(f"{spec.label}: {exc.message}") from None
        except Exception as exc:
            raise ToolError(f"{spec.label}: {_reason(exc)}") from None
        return result_text(result)

    def shutdown(self) -> None:
        """Stop the sessions, the servers and the loop (idempotent; the finalizer of MCPTools)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if self.thread.is_alive():
            future = asyncio.run_coroutine_threadsafe(self._stop_all(), self.loop)
            with contextlib.suppress(Exception):
                future.result(STOP_TIMEOUT_S + 5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(STOP_TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()
        for log in self.errlogs:
            if log is not None:
                log.close()

    async def _stop_all(self) -> None:
        if self.stop_event is not None:
            self.stop_event.set()
        for index, task in enumerate(self.holders):
            if index not in self.clients:  # still connecting: cancel (stdio shutdown is shielded)
                task.cancel()
        if self.holders:
            _, pending = await asyncio.wait(self.holders, timeout=STOP_TIMEOUT_S)
            for task in pending:  # stuck on the way out
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        current = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        for task in leftovers:
            task.cancel()
        if leftovers:
            await asyncio.wait(leftovers, timeout=1.0)


def _errlog() -> Any:
    """An anonymous file for a stdio server's stderr (read back only for error messages)."""
    return tempfile.TemporaryFile()  # closed by Connections.shutdown


async def _list_tools(client: Any) -> list[Any]:
    tools: list[Any] = []
    cursor = None
    for _ in range(MAX_LIST_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools
