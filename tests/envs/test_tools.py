"""The env API: @tool (sync, async, timeouts, validation), episode endings, save and continue."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from gymnasium.utils.env_checker import check_env

from envs import Outcome, ToolEnv, tool
from envs.tools import MAX_ARGUMENT_CHARS, ToolError, validate_arguments
from envs.types import assistant, tool_call, user


class Toy(ToolEnv):
    """Every kind of tool, for the tests."""

    def __init__(self, **kwargs):
        kwargs.setdefault("tool_timeout_s", 0.3)
        super().__init__(**kwargs)
        self.target = 0

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    @tool
    async def slow_echo(self, text: str, delay: float = 0.0) -> str:
        """Echo text after a delay.

        Args:
            text: What to echo.
            delay: Seconds to wait first.
        """
        await asyncio.sleep(delay)
        return text

    @tool(timeout_s=0.2)
    def hang(self) -> str:
        """Never answer in time."""
        time.sleep(60)  # on a daemon thread, left behind when the call times out
        return "late"

    @tool
    def total(self, values: list[int], label: str | None = None) -> str:
        """Sum a list.

        Args:
            values: Integers to add.
            label: Optional label.
        """
        return f"{label or 'sum'}={sum(values)}"

    @tool
    def quit(self) -> str:
        """Exit the process (a badly behaved tool)."""
        raise SystemExit(0)

    @tool
    def answer(self, answer: str) -> str:
        """Submit the final answer.

        Args:
            answer: The answer.
        """
        return self.submit(answer)

    def _new_task(self, options):
        self.target = int(self.np_random.integers(100))
        return [user(f"say {self.target}")]

    def _grade(self, answer):
        return Outcome(success=answer["content"].strip() == str(self.target))


def call(name, arguments):
    return assistant("", [tool_call(name, arguments)])


def test_toy_env_passes_the_gymnasium_checker():
    check_env(Toy(), skip_render_check=True)


def test_sync_async_and_list_arguments():
    env = Toy()
    env.reset(seed=0)
    obs, *_ = env.step(
        assistant(
            "",
            [
                tool_call("add", {"a": 2, "b": 3}),
                tool_call("slow_echo", '{"text": "hé"}'),
                tool_call("total", {"values": [1, 2, 3], "label": None}),
            ],
        )
    )
    assert [m["content"] for m in obs] == ["5", "hé", "sum=6"]


@pytest.mark.parametrize(
    ("name", "arguments", "fragment"),
    [
        ("hang", {}, "hang timed out after 0.2 s"),
        ("slow_echo", {"text": "x", "delay": 60}, "timed out after 0.3 s"),
        ("total", {"values": [1, "2"]}, "values'[1] of total must be integer"),
        ("total", {"values": [1], "label": 3}, "must be string"),
        ("add", {"a": True, "b": 1}, "must be integer, got boolean"),
        ("add", {"a": 1.5, "b": 1}, "must be integer, got number"),
        ("add", "x" * (MAX_ARGUMENT_CHARS + 1), "too large"),
        ("add", "[" * 5000, "not valid JSON"),
        ("quit", {}, "SystemExit"),
        ("no\ud800pe", {}, "unknown tool"),
    ],
)
def test_failures_become_error_observations_and_the_episode_continues(name, arguments, fragment):
    env = Toy()
    env.reset(seed=0)
    start = time.monotonic()
    obs, reward, terminated, truncated, info = env.step(call(name, arguments))
    # nominal <= 0.3 s (the timeouts); far under the 60 s the hung tools would take uncut
    assert time.monotonic() - start < 10
    assert obs[0]["content"].startswith("Error: ") and fragment in obs[0]["content"]
    obs[0]["content"].encode("utf-8")  # always valid text
    assert (reward, terminated, truncated, info["tool_errors"]) == (0.0, False, False, 1)
    obs, *_ = env.step(call("add", {"a": 1, "b": 1}))
    assert obs[0]["content"] == "2"


def test_an_answer_tool_ends_the_episode_with_the_outcome():
    env = Toy()
    env.reset(seed=1)
    _obs, reward, terminated, truncated, info = env.step(
        assistant("", [tool_call("answer", {"answer": str(env.target)}), tool_call("add", {})])
    )
    assert terminated and not truncated and reward == 1.0
    assert info["outcome"]["success"] is True and info["tool_calls"] == 1
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step(assistant("again"))


def test_out_of_turns_truncates_and_reports_facts():
    env = Toy(max_turns=2)
    env.reset(seed=0)
    assert env.step(call("add", {"a": 1, "b": 2}))[2:4] == (False, False)
    _, reward, terminated, truncated, info = env.step(call("add", {"a": 1, "b": 2}))
    assert (terminated, truncated, reward) == (False, True, 0.0)
    assert info["outcome"] == {"success": False, "details": {"reason": "out of turns"}}


def test_state_saves_and_continues_in_another_env():
    env = Toy(max_turns=6)
    env.reset(seed=3)
    env.step(call("add", {"a": 1, "b": 2}))
    env.step(call("nope", "{"))
    state = json.loads(json.dumps(env.get_state()))
    other = Toy(max_turns=6)
    other.set_state(state)
    assert other.target == env.target and other.render() == env.render()
    assert other.step(assistant(str(env.target)))[1] == env.step(assistant(str(env.target)))[1]


def test_state_refuses_another_env_and_a_diverging_replay():
    env = Toy()
    env.reset(seed=3)
    state = env.get_state()
    with pytest.raises(ValueError, match="state is for"):
        Other().set_state(state)
    state["transcript_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="different transcript"):
        Toy().set_state(state)


class Other(Toy):
    pass


def test_validation_against_the_schema_directly():
    schema = Toy.add.schema
    assert validate_arguments(schema, '{"a": 1, "b": 2}') == {"a": 1, "b": 2}
    for bad in ("", "[]", '{"a": 1}', '{"a": 1, "b": 2, "c": 3}', '{"a": "1", "b": 2}'):
        with pytest.raises(ToolError):
            validate_arguments(schema, bad or "null")


def test_a_tool_without_docs_fails_at_class_definition():
    with pytest.raises(Exception, match=r"docstring|description"):

        class Broken(ToolEnv):
            @tool
            def nodoc(self, x: int) -> int:
                return x


class Napping(Toy):
    @tool(timeout_s=0.1)
    def nap(self) -> str:
        """Answer after the timeout."""
        time.sleep(0.5)
        return "late"


def test_a_call_that_timed_out_and_still_runs_is_reported_until_it_ends():
    """A Python thread cannot be stopped: `nap` goes on after its timeout, on the env's state.
    The toolbox says so (the rollout then does not reuse the env) until the thread has ended."""
    env = Napping()
    env.reset(seed=0)
    env.step(assistant("", [tool_call("add", {"a": 2, "b": 3})]))
    assert not env.toolbox.running_late()
    obs, *_ = env.step(assistant("", [tool_call("nap", {})]))
    assert "nap timed out after 0.1 s" in obs[0]["content"]
    assert env.toolbox.running_late()
    env.toolbox.late[0].join(5)
    assert not env.toolbox.running_late() and env.toolbox.late == []
