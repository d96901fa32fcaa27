"""HarnessEnv: a user's agent (the real `openai` client) driven by the env's caller, over HTTP."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from openai import OpenAI

import envs  # noqa: F401  (registers agentrl/Harness-v0)
from envs.harness import HarnessEnv
from envs.types import assistant, tool_call
from rollout.episode import restorable

CALC = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def calc_agent(base_url: str, task: dict) -> str:
    """A plain agent written against the openai client: call tools until a final answer."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": task["prompt"]},
    ]
    while True:
        reply = client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = str(args["a"] + args["b"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def failing_agent(base_url: str, task: dict) -> str:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("agent bug")


def numpy_reward_agent(base_url: str, task: dict):
    """Edits its task (a nested list) and returns a numpy float, as a harness computing its
    reward with numpy does."""
    import numpy as np

    task["tags"].append("seen")
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    return np.float32(0.75) if reply.choices[0].message.content == "good" else np.float32(0)


def retrying_agent(base_url: str, task: dict) -> float:
    """What an OpenAI client with a short timeout does: its first request gives up after 0.3 s
    and the same request is sent again. Reward 1 when that retry got the policy's reply."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    url, gave_up = f"{base_url}/chat/completions", 0
    for timeout in (0.3, 60):
        request = urllib.request.Request(
            url, data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                content = json.loads(response.read())["choices"][0]["message"]["content"]
                return 1.0 if content == "good" and gave_up == 1 else 0.5
        except (TimeoutError, urllib.error.URLError):
            gave_up += 1
    return 0.0


def reward_agent(base_url: str, task: dict) -> float:
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    return 0.75 if reply.choices[0].message.content == "good" else 0.0


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"prompt": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _terms(opening) -> tuple[int, int]:
    a, b = opening[-1]["content"].removeprefix("What is ").rstrip("?").split("+")
    return int(a), int(b)


def _sum(opening) -> int:
    return sum(_terms(opening))


def make(tasks: str, harness: str = "tests.envs.test_harness:calc_agent", **kwargs):
    return gymnasium.make(
        "agentrl/Harness-v0", harness=harness, path=tasks, grader="numeric", **kwargs
    )


def test_an_openai_client_agent_is_driven_turn_by_turn_and_graded(tasks):
    env = make(tasks)
    opening, info = env.reset(seed=3)
    assert [m["role"] for m in opening] == ["system", "user"]
    assert info["tools"][0]["function"]["name"] == "add"
    a, b = _terms(opening)
    obs, reward, terminated, truncated, info = env.step(
        assistant("", [tool_call("add", {"a": a, "b": b})])
    )
    assert obs == [{"role": "tool", "name": "add", "content": str(a + b)}]
    assert not terminated and not truncated and info["tool_calls"] == 1
    obs, reward, terminated, truncated, info = env.step(assistant(f"The sum is {a + b}."))
    assert terminated and reward == 1.0 and info["outcome"]["success"]
    env.reset(seed=4)  # the env is reused for the next episode
    obs, reward, terminated, _, info = env.step(assistant("-1"))
    assert terminated and reward == 0.0 and not info["outcome"]["success"]
    env.close()


def test_a_tool_call_that_does_not_parse_never_reaches_the_harness(tasks):
    env = make(tasks)
    opening, _ = env.reset(seed=0)
    broken = {"type": "function", "function": {"name": "", "arguments": {}}, "error": "no JSON"}
    obs, _, terminated, truncated, info = env.step(assistant("", [broken]))
    assert obs[0]["content"] == "Error: no JSON" and info["tool_errors"] == 1
    assert not terminated and not truncated
    obs, reward, terminated, _, _ = env.step(assistant(str(_sum(opening))))  # the same request
    assert terminated and reward == 1.0
    env.close()


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (tool_call("", {}), "malformed tool call"),
        (tool_call("mul", {"a": 1, "b": 2}), "unknown tool 'mul' (available: add)"),
        (tool_call("add", '": {"": {"8 - 5"}}'), "arguments for add are not valid JSON"),
        (tool_call("add", {"a": 1}), "add is missing required argument 'b'"),
    ],
)
def test_a_call_the_agent_cannot_run_is_answered_by_the_env(tasks, call, said):
    """Agents raise on such calls (the Agents SDK: ModelBehaviorError), which would make the
    policy's own mistake an env error, never trained on (a run drifted into it)."""
    env = make(tasks)
    opening, _ = env.reset(seed=0)
    obs, _, terminated, truncated, info = env.step(assistant("", [call]))
    assert said in obs[0]["content"] and info["tool_errors"] == 1
    assert not terminated and not truncated
    _, reward, terminated, _, _ = env.step(assistant(str(_sum(opening))))
    assert terminated and reward == 1.0
    env.close()


def test_free_form_tools_take_any_object_of_arguments():
    from envs.harness import call_problem

    free = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    loose = {
        "type": "function",
        "function": {
            "name": "q",
            "parameters": {
                "type": "object",
                "properties": {"x": True},
                "additionalProperties": True,
            },
        },
    }
    assert call_problem(tool_call("search", {"q": "x"}), [free]) is None
    assert call_problem(tool_call("q", {"x": 1, "y": 2}), [loose]) is None
    assert "JSON object" in call_problem(tool_call("search", "[1]"), [free])
    assert "not valid JSON" in call_problem(tool_call("search", "{"), [free])


def test_out_of_turns_truncates_and_releases_the_harness(tasks):
    env = make(tasks, max_turns=1)
    env.reset(seed=0)
    _, _, terminated, truncated, info = env.step(
        assistant("", [tool_call("add", {"a": 1, "b": 1})])
    )
    assert truncated and not terminated and info["outcome"]["details"]["reason"] == "out of turns"
    alive = [t for t in threading.enumerate() if t.name == "agentrl-harness"]
    for thread in alive:
        thread.join(timeout=10)  # its next request was refused: the agent raised and ended
    assert not any(t.is_alive() for t in alive)
    env.close()


def test_a_harness_that_raises_is_an_env_error_of_the_episode(tasks):
    env = make(tasks, harness="tests.envs.test_harness:failing_agent")
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="agent bug"):
        env.step(assistant("hello"))
    env.reset(seed=1)  # the env still works
    env.close()


def test_a_harness_may_return_its_own_reward(tasks):
    env = make(tasks, harness="tests.envs.test_harness:reward_agent")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(assistant("good"))
    assert terminated and reward == 0.75 and info["outcome"]["success"]
    env.close()


def test_a_numpy_reward_counts_and_a_harness_editing_its_task_edits_a_copy(tmp_path):
    """Before: np.float32 was refused ("return ... a reward (float)"), and the task a harness got
    shared its lists with the stored row, so an edit reached every later episode."""
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"prompt": "p", "answer": "1", "tags": []}) + "\n")
    env = make(str(path), harness="tests.envs.test_harness:numpy_reward_agent")
    for _ in range(2):
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(assistant("good"))
        assert terminated and reward == 0.75 and info["outcome"]["success"]
    assert env.unwrapped.row["tags"] == []
    env.close()


def test_a_request_the_client_sent_again_gets_the_same_reply(tasks):
    """The policy takes longer than the agent's client waits: the client sends the same request
    again. Before, the repeat was "does not extend its earlier messages": an env error on every
    slow turn. Now it gets the reply already sampled, and the episode goes on."""
    env = make(tasks, harness="tests.envs.test_harness:retrying_agent")
    env.reset(seed=0)
    time.sleep(1.0)  # the policy samples; the first request has given up meanwhile
    _, reward, terminated, _, info = env.step(assistant("good"))
    assert terminated and reward == 1.0, info  # 0.5: the first request was answered itself
    env.close()


def test_requests_of_an_earlier_episode_are_refused(tasks):
    env = make(tasks)
    env.reset(seed=0)
    stale = env.unwrapped.endpoint.open(env.unwrapped._token)  # this episode's base URL
    env.reset(seed=1)
    client = OpenAI(base_url=stale, api_key="x", max_retries=0)
    with pytest.raises(Exception, match=r"409|over"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    env.close()


def first_reply_agent(base_url: str, task: dict) -> None:
    """Asks once and lets the env grade the policy's reply (what gymnasium's checker needs)."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])


def test_gymnasium_check_env(tasks):
    env = make(tasks, harness="tests.envs.test_harness:first_reply_agent")
    check_env(env.unwrapped)
    env.close()


def test_the_expert_comes_from_the_kwargs_and_the_state_is_not_restorable(tasks):
    env = HarnessEnv(harness="tests.envs.test_harness:calc_agent", path=tasks, expert="x:Y")
    assert env.expert == "x:Y"
    assert not restorable(env)  # the rollout saves no turn boundaries for it
    with pytest.raises(RuntimeError, match="cannot be saved"):
        env.get_state()
    with pytest.raises(ValueError, match="cannot be saved"):
        env.set_state({})
    env.close()


def rewriting_agent(base_url: str, task: dict) -> str:
    """Changes its system prompt between requests: what the policy saw is not what it sends."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "v1"}, {"role": "user", "content": "q"}]
    reply = client.chat.completions.create(model="m", messages=messages, tools=[CALC])
    call = reply.choices[0].message.tool_calls[0]
    messages = [{"role": "system", "content": "v2"}, *messages[1:]]
    messages += [reply.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "2"}]
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content


def test_a_request_that_rewrites_the_history_is_an_env_error(tasks):
    env = make(tasks, harness="tests.envs.test_harness:rewriting_agent")
    env.reset(seed=0)
    with pytest.raises(ValueError, match="resend its history"):
        env.step(assistant("", [tool_call("add", {"a": 1, "b": 1})]))
    env.close()


def _calc_servers() -> set[int]:
    """This process's children that run the example calculator MCP server."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and b"calc_server.py" in command:
            found.add(int(stat.parent.name))
    return found


def test_the_example_agent_starts_one_mcp_server_however_many_episodes_start_at_once():
    """configs/harness/calc_agent.py: a worker starts its episodes side by side on threads, and
    each asks for the MCP server's URL at once; one server is started for all of them (a bare
    functools.cache started one per thread: 6 per worker, 12 processes on 2 cores)."""
    from configs.harness import calc_agent

    before = _calc_servers()
    with ThreadPoolExecutor(6) as pool:
        urls = set(pool.map(lambda _: calc_agent.calc_server_url(), range(6)))
    assert len(urls) == 1
    assert len(_calc_servers() - before) <= 1  # none if an earlier test of this process began it
