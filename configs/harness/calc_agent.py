"""An agent written with the OpenAI Agents SDK that calls tools from an MCP server: the kind of
agent a user already has, trained by agentrl unchanged (`configs/harness.yaml`).

`run(base_url, task)` is the harness: agentrl calls it once per episode with the base URL of
its OpenAI-compatible endpoint (the policy being trained answers there) and the task row
without its answer; it returns the agent's final answer, which agentrl grades against the
row's answer. The tools come from `configs/mcp/calc_server.py`, one streamable-HTTP MCP
server per process, started on first use. `Expert` is the scripted demonstrator agentrl's SFT
warm start plays through the same agent (`env.kwargs.expert`).
"""

from __future__ import annotations

import atexit
import functools
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.mcp import MCPServerStreamableHttp, create_static_tool_filter
from openai import AsyncOpenAI

from envs.types import assistant, tool_call

INSTRUCTIONS = "Call calculate with the problem's arithmetic, then answer with the number."
SERVER = Path(__file__).resolve().parents[1] / "mcp" / "calc_server.py"


async def run(base_url: str, task: dict) -> str:
    set_tracing_disabled(True)  # no traces leave the machine
    only_calculate = create_static_tool_filter(allowed_tool_names=["calculate"])
    async with (
        AsyncOpenAI(base_url=base_url, api_key="agentrl", max_retries=0) as client,
        MCPServerStreamableHttp(
            params={"url": calc_server_url()}, cache_tools_list=True, tool_filter=only_calculate
        ) as calc,
    ):
        model = OpenAIChatCompletionsModel(model="agentrl", openai_client=client)
        agent = Agent(name="calc", instructions=INSTRUCTIONS, model=model, mcp_servers=[calc])
        result = await Runner.run(agent, task["prompt"], max_turns=8)
    return str(result.final_output)


def calc_server_url() -> str:
    """The URL of this process's calculator MCP server (streamable HTTP), started on first use.
    Episodes run side by side on threads: the lock makes the first ones wait for one server
    instead of each starting its own (a bare cache would start one per thread that got there
    first: 6 per worker, ~3 CPU-s each)."""
    with _STARTING:
        return _start_calc_server()


_STARTING = threading.Lock()


@functools.cache
def _start_calc_server() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, str(SERVER), "--http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    atexit.register(child.terminate)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"http://127.0.0.1:{port}/mcp"
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the calculator MCP server did not start on port {port}")


class Expert:
    """Calls calculate with the task's expression, then answers with the result; `error_rate`
    of its episodes skip the tool (a guess) or miscopy one digit of the expression."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        self.error_rate, self.rng = error_rate, np.random.default_rng(seed)
        self._mistake: str | None = None

    def begin(self) -> None:
        self._mistake = None
        if self.rng.random() < self.error_rate:
            self._mistake = "guess" if self.rng.random() < 0.5 else "miscopy"

    def act(self, env, history: list[dict]) -> dict:
        row = env.unwrapped.row
        if history[-1]["role"] == "tool":
            return assistant(history[-1]["content"].removeprefix("Error: "))
        if self._mistake == "guess":
            return assistant(str(int(row["answer"]) + int(self.rng.integers(1, 10))))
        expression = row["expression"]
        if self._mistake == "miscopy":
            digits = [i for i, c in enumerate(expression) if c.isdigit()]
            i = int(self.rng.choice(digits))
            expression = expression[:i] + str((int(expression[i]) + 1) % 10) + expression[i + 1 :]
        return assistant("", [tool_call("calculate", {"expression": expression})])
