"""MCP tools against a real MCP server (configs/mcp/calc_server.py) over stdio and streamable
HTTP, plus `Toolbox.add` for external tools."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mcp_types
import psutil
import pytest

from envs import Outcome, ToolEnv, tool
from envs.mcp import (
    MCPServerGone,
    MCPStartError,
    MCPTools,
    attach,
    parse_server,
    result_text,
    use_mcp,
)
from envs.tools import EnvBroken, Toolbox, ToolError
from envs.types import Message, assistant, tool_call, user

SERVER = Path(__file__).resolve().parents[2] / "configs" / "mcp" / "calc_server.py"
STDIO = {"command": "python", "args": [str(SERVER)], "name": "calc"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def http_url(tmp_path_factory):
    """The calculator served over streamable HTTP by a child process, once it answers."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("mcp") / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", str(port)], stdout=log, stderr=log
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the HTTP MCP server did not come up (exit code {proc.poll()})")
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)
    log.close()


@pytest.fixture(scope="module", params=["stdio", "http"])
def box(request) -> Toolbox:
    """A toolbox holding the calculator's tools (calls time out after 0.5 s)."""
    if request.param == "stdio":
        spec = STDIO
    else:
        spec = {"url": request.getfixturevalue("http_url"), "headers": {"X-Test": "yes"}}
    tools = MCPTools([spec], timeout_s=0.5).start()
    toolbox = Toolbox([], timeout_s=30.0)
    for schema, fn in tools.tools:
        toolbox.add(schema, fn)
    yield toolbox
    tools.close()


def _call(toolbox: Toolbox, name: str, arguments: Any) -> tuple[Message, bool]:
    return toolbox.call(tool_call(name, arguments))


def test_tools_are_listed_with_mapped_schemas(box):
    assert box.names == ["calculate", "slow", "fail"]
    schema = box.get("calculate").schema
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "calculate"
    assert function["description"] == "Evaluate an arithmetic expression."
    params = function["parameters"]
    assert params["type"] == "object" and params["required"] == ["expression"]
    assert params["properties"]["expression"]["type"] == "string"
    assert "parentheses" in params["properties"]["expression"]["description"]
    fail = box.get("fail").schema["function"]["parameters"]
    assert fail["type"] == "object" and fail["properties"] == {}


def test_a_call_returns_text(box):
    assert _call(box, "calculate", {"expression": "(12 + 7) * 3"}) == (
        {"role": "tool", "name": "calculate", "content": "57"},
        True,
    )
    assert _call(box, "calculate", '{"expression": "7 / 2"}')[0]["content"] == "3.5"


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        ({"expression": 5}, "argument 'expression' of calculate must be string, got integer"),
        ({}, "missing required argument 'expression'"),
        ({"expression": "1", "x": 1}, "calculate has no argument 'x'"),
        ('{"expression": ', "not valid JSON"),
        ({"expression": "__import__('os')"}, "only numbers"),  # refused by the server
        ({"expression": "1 / 0"}, "division by zero"),
    ],
)
def test_bad_arguments_are_error_observations(box, arguments, fragment):
    message, ok = _call(box, "calculate", arguments)
    assert not ok and message["role"] == "tool" and message["name"] == "calculate"
    assert message["content"].startswith("Error: ") and fragment in message["content"]


def test_an_mcp_error_is_an_error_observation(box):
    message, ok = _call(box, "fail", {})
    assert not ok and message["content"].startswith("Error: ")
    assert "this tool always fails" in message["content"]


def test_a_slow_call_times_out_and_the_server_keeps_working(box):
    start = time.monotonic()
    message, ok = _call(box, "slow", {"seconds": 60})
    assert not ok and message["content"] == "Error: slow timed out after 0.5 s"
    # nominal 0.5 s (timeout_s; the backstop fires at 2.5 s); far under the 60 s the call takes
    # when nothing cuts it
    assert time.monotonic() - start < 10
    assert _call(box, "slow", {"seconds": 0.01}) == (
        {"role": "tool", "name": "slow", "content": "waited 0.01 s"},
        True,
    )
    assert _call(box, "calculate", {"expression": "2 + 2"})[0]["content"] == "4"


def _server_children() -> list[psutil.Process]:
    """The stdio calculator servers this process started (not the HTTP one)."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            line = child.cmdline()
            if str(SERVER) in line and "--http" not in line:
                found.append(child)
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_close_stops_the_stdio_child_and_is_idempotent():
    before = {p.pid for p in _server_children()}
    threads = set(threading.enumerate())
    tools = MCPTools([STDIO]).start()
    [child] = [p for p in _server_children() if p.pid not in before]
    [loop_thread] = [t for t in threading.enumerate() if t not in threads and t.name == "mcp-tools"]
    assert loop_thread.daemon
    fn = dict((s["function"]["name"], f) for s, f in tools.tools)["calculate"]
    assert fn(expression="1 + 1") == "2"
    tools.close()
    assert _gone(child.pid)
    tools.close()  # again: nothing happens
    with pytest.raises(ToolError, match="closed"):
        fn(expression="1 + 1")
    assert not loop_thread.is_alive()


def test_the_context_manager_closes():
    before = {p.pid for p in _server_children()}
    with MCPTools([{**STDIO, "tools": ["calculate"], "prefix": "calc_"}]) as tools:
        assert [s["function"]["name"] for s, _ in tools.tools] == ["calc_calculate"]
        [child] = [p for p in _server_children() if p.pid not in before]
    assert _gone(child.pid)


def test_a_server_that_died_breaks_the_env_instead_of_failing_every_call():
    before = {p.pid for p in _server_children()}
    with MCPTools([STDIO], timeout_s=5.0) as tools:
        toolbox = Toolbox([], timeout_s=30.0)
        attach(toolbox, tools)
        assert _call(toolbox, "calculate", {"expression": "1 + 1"})[0]["content"] == "2"
        [child] = [p for p in _server_children() if p.pid not in before]
        child.kill()
        child.wait(10)
        for _ in range(2):  # and every later call: the env is broken, not the model's call
            with pytest.raises(MCPServerGone, match=r"MCP server 'calc' .* stopped") as caught:
                _call(toolbox, "calculate", {"expression": "1 + 1"})
            assert isinstance(caught.value, EnvBroken) and not isinstance(caught.value, ToolError)
            assert caught.value.server.startswith("MCP server 'calc'")
        assert _call(toolbox, "calculate", {"expression": 5})[1] is False  # still validated first


def test_the_garbage_collector_on_an_mcp_loop_thread_does_not_block_it():
    # MCPTools is in a reference cycle (its tools point back at it): cyclic GC may finalize it on
    # any thread, its own event-loop thread included, where a blocking shutdown would deadlock
    before = {p.pid for p in _server_children()}
    tools = MCPTools([STDIO]).start()
    [child] = [p for p in _server_children() if p.pid not in before]
    connections = tools._connections
    del tools

    async def collect() -> int:
        return gc.collect()

    gc.disable()  # the collection must happen on the loop thread, not here by chance
    try:
        future = asyncio.run_coroutine_threadsafe(collect(), connections.loop)
        assert future.result(timeout=5) > 0
    finally:
        gc.enable()
    deadline = time.monotonic() + 20
    while not (_gone(child.pid) and not connections.thread.is_alive()):
        assert time.monotonic() < deadline, "the finalizer did not stop the server"
        time.sleep(0.05)
    assert connections.closed


def test_a_server_that_cannot_start_gives_a_clear_error():
    crash = "import sys; sys.stderr.write('boom: missing config file\\n'); sys.exit(3)"
    spec = {"command": "python", "args": ["-c", crash], "name": "broken"}
    with pytest.raises(MCPStartError) as caught:
        MCPTools([spec], startup_timeout_s=20).start()
    text = str(caught.value)
    assert "MCP server 'broken'" in text and "failed to start" in text
    assert "sys.exit(3)" in text  # the command line
    assert "boom: missing config file" in text  # the stderr tail
    with pytest.raises(MCPStartError, match="No such file or directory"):
        MCPTools([{"command": "no-such-mcp-server-command"}]).start()
    with pytest.raises(MCPStartError, match="could not be reached"):
        MCPTools([{"url": f"http://127.0.0.1:{_free_port()}/mcp"}]).start()


@pytest.mark.slow
def test_a_server_that_never_answers_times_out_at_start_and_is_stopped():
    mute = {"command": "python", "args": ["-c", "import time; time.sleep(120)"], "name": "mute"}
    start = time.monotonic()
    with pytest.raises(MCPStartError, match=r"'mute'.*did not answer within 0.5 s"):
        MCPTools([mute], startup_timeout_s=0.5).start()
    # nominal ~3 s (0.5 s, then stopping the child); far under the mute server's own 120 s
    assert time.monotonic() - start < 60
    assert not [p for p in psutil.Process().children() if "time.sleep(120)" in p.cmdline()]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"command": "python", "port": 1}, "unknown key 'port'"),
        ({"url": "http://x/mcp", "args": []}, "unknown key 'args'"),
        ({"command": "python", "url": "http://x/mcp"}, "exactly one of 'command'"),
        ({"name": "x"}, "exactly one of 'command'"),
        ({"command": "python", "args": "server.py"}, "'args' must be a list of strings"),
        ({"url": "http://x/mcp", "headers": {"a": 1}}, "'headers' must map strings"),
        ("python server.py", "must be a mapping"),
    ],
)
def test_bad_server_specs_name_the_key(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        MCPTools([spec])


def test_spec_defaults():
    stdio = parse_server({"command": "python", "args": ["-u", "srv/calc.py"]})
    assert stdio.name == "calc" and stdio.command == sys.executable
    assert parse_server({"url": "http://127.0.0.1:9/mcp"}).name == "127.0.0.1:9"


def test_an_allow_list_naming_a_missing_tool_is_refused():
    with pytest.raises(ValueError, match=r"offers no tool 'add' \(it offers: calculate, slow"):
        MCPTools([{**STDIO, "tools": ["calculate", "add"]}]).start()


class MCPCalc(ToolEnv):
    """A word problem; the calculator comes from the MCP server."""

    def __init__(self, servers: list[dict[str, Any]] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.mcp = use_mcp(self, servers or [STDIO], timeout_s=5.0)

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        self.a, self.b = (int(x) for x in self.np_random.integers(10, 99, size=2))
        return [user(f"What is {self.a} * {self.b}?")]

    def _grade(self, answer: Message) -> Outcome:
        expected = str(self.a * self.b)
        return Outcome(success=answer["content"].strip() == expected, details={})


def test_a_tool_env_runs_an_episode_with_an_mcp_tool():
    env = MCPCalc(max_turns=3)
    try:
        assert [t["function"]["name"] for t in env.tools] == ["calculate", "slow", "fail"]
        obs, info = env.reset(seed=1)
        assert info["tools"] == env.tools
        expression = f"{env.a} * {env.b}"
        obs, reward, terminated, truncated, info = env.step(
            assistant("", [tool_call("calculate", {"expression": expression})])
        )
        assert obs == [{"role": "tool", "name": "calculate", "content": str(env.a * env.b)}]
        assert (reward, terminated, truncated, info["tool_errors"]) == (0.0, False, False, 0)
        state = env.get_state()
        obs, reward, terminated, truncated, info = env.step(assistant(obs[0]["content"]))
        assert terminated and reward == 1.0 and info["outcome"]["success"]
    finally:
        children = _server_children()
        env.close()
    assert all(_gone(p.pid) for p in children)
    other = MCPCalc(max_turns=3)  # save and continue: set_state calls the tool again
    try:
        other.set_state(state)
        *_, info = other.step(assistant(str(other.a * other.b)))
        assert info["outcome"]["success"]
    finally:
        other.close()


def test_a_name_clash_names_both_sources_and_stops_the_servers():
    class Clash(MCPCalc):
        @tool
        def calculate(self, expression: str) -> str:
            """Local calculator.

            Args:
                expression: Arithmetic.
            """
            return expression

    before = {p.pid for p in _server_children()}
    with pytest.raises(ValueError) as caught:
        Clash()
    text = str(caught.value)
    assert "'calculate' is taken twice" in text and "Clash.calculate" in text
    assert "MCP server 'calc'" in text and "prefix" in text
    assert all(_gone(p.pid) for p in _server_children() if p.pid not in before)
    env = Clash(servers=[{**STDIO, "prefix": "mcp_"}])
    try:
        assert env.toolbox.names == ["calculate", "mcp_calculate", "mcp_slow", "mcp_fail"]
    finally:
        env.close()


def test_content_blocks_become_text():
    def result(content, structured=None, is_error=False):
        return mcp_types.CallToolResult(
            content=content, structured_content=structured, is_error=is_error
        )

    image = mcp_types.ImageContent(data="AAAA", mime_type="image/png")
    link = mcp_types.ResourceLink(uri="memory://notes/a.txt", name="a")
    embedded = mcp_types.EmbeddedResource(
        resource=mcp_types.TextResourceContents(uri="memory://notes/b.txt", text="bee")
    )
    text = mcp_types.TextContent(text="hello")
    assert result_text(result([text, image, link, embedded])) == (
        "hello\n[image image/png]\n[resource memory://notes/a.txt]\n[resource memory://notes/b.txt]\nbee"
    )
    assert result_text(result([], {"x": 1})) == '{"x": 1}'
    assert result_text(result([text], {"x": 1})) == "hello"
    with pytest.raises(ToolError, match=r"^nope$"):
        result_text(result([mcp_types.TextContent(text="nope")], is_error=True))


def test_toolbox_add_registers_external_tools():
    schema = {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Echo.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
    toolbox = Toolbox([], timeout_s=0.3)
    toolbox.add(schema, lambda text: text.upper())
    assert toolbox.schemas == [schema]
    assert _call(toolbox, "echo", {"text": "hi"}) == (
        {"role": "tool", "name": "echo", "content": "HI"},
        True,
    )
    assert "must be string" in _call(toolbox, "echo", {"text": 1})[0]["content"]

    async def nap(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"

    def boom() -> str:
        raise RuntimeError("kaput")

    seconds = {"type": "object", "properties": {"seconds": {"type": "number"}}}
    nap_schema = {"type": "function", "function": {"name": "nap", "parameters": seconds}}
    toolbox.add(nap_schema, nap, timeout_s=0.1)
    assert _call(toolbox, "nap", {"seconds": 0.0})[0]["content"] == "rested"
    assert _call(toolbox, "nap", {"seconds": 1.0})[0]["content"] == (
        "Error: nap timed out after 0.1 s"
    )
    toolbox.add({"type": "function", "function": {"name": "boom"}}, boom, source="the test")
    assert toolbox.get("boom").schema["function"] == {
        "name": "boom",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    }
    assert _call(toolbox, "boom", {}) == (
        {"role": "tool", "name": "boom", "content": "Error: RuntimeError: kaput"},
        False,
    )
    with pytest.raises(ValueError, match=r"taken twice: by the test and by .*test_mcp"):
        toolbox.add({"type": "function", "function": {"name": "boom"}}, boom)

    def broken() -> str:  # the env cannot work any more: not an observation, the step raises
        raise EnvBroken("the database is gone")

    toolbox.add({"type": "function", "function": {"name": "broken"}}, broken)
    with pytest.raises(EnvBroken, match="the database is gone"):
        _call(toolbox, "broken", {})


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"name": "x"}, "must look like"),
        ({"type": "function", "function": {"name": ""}}, "non-empty string function.name"),
        ({"type": "function", "function": {"name": "x", "parameters": []}}, "JSON schema"),
        ({"type": "function", "function": {"name": "x", "description": 3}}, "description"),
    ],
)
def test_toolbox_add_refuses_bad_schemas(schema, fragment):
    with pytest.raises(ValueError, match=fragment):
        Toolbox([]).add(schema, lambda: "x")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        Toolbox([]).add({"type": "function", "function": {"name": "x"}}, print, timeout_s=0)
