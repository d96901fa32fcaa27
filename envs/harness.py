"""Train an agent you already wrote: `HarnessEnv` runs your agent code against agentrl's policy.

A harness is your agent, unchanged, as one function (sync or async) in your module:

    async def run(base_url: str, task: dict) -> str | float | bool | None:
        client = AsyncOpenAI(base_url=base_url, api_key="agentrl", max_retries=0)  # or an SDK
        ...                                   # call tools (your own, MCP servers) as you do now
        return final_answer                   # graded against the task's reference answer

and a run file names it with a task file: `env: {harness: "my_agent:run", dataset:
tasks.jsonl, grader: numeric}` (rl/config/sections.py maps it onto this env's kwargs).

How an episode runs: `reset(seed)` draws the task row (envs/taskset.py: train rows below
HELDOUT_SEEDS, held-out rows at and above), starts the harness in its own thread with a fresh
base URL of this env's OpenAI-compatible endpoint (envs/endpoint.py) and the row without its
answer, and waits for the harness's first chat request: its messages are the episode's
opening, its tools the tools rendered into the prompt. Each `step(assistant_message)` is the
policy's reply to the pending request (tool calls get OpenAI ids); the env then waits until
the harness either sends its next request, whose messages after our reply (the tool results
the harness computed, a user follow-up) are the observation, or returns, which ends the
episode: a string (or None: the policy's last reply) is graded by the task's grader
(envs/graders.py), a bool is the success, a number is the native reward (success when it is
at least `success_threshold`). A harness that raises, or that sends no request in time, ends
the episode as an env error.

Nothing is re-tokenized: the env speaks messages, and the rollout's agent loop keeps the exact
sampled tokens, their logprobs, policy versions and routes, appending only the tokens of each
observation to the episode's cache. The harness may change what it sends but must extend its
earlier messages: a request that drops or rewrites any of them is an env error (the trajectory
would not match what the agent saw). A tool call the agent could not run (unparsable, an
unknown tool, arguments its schema refuses) never reaches the harness: the env answers it with
an error observation and the request stays open (`call_problem`).

A harness episode cannot be saved and continued elsewhere (the agent's own state lives in its
process): `set_state` refuses, so a task retried after a worker crash restarts its episodes.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import numbers
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import gymnasium
import numpy as np

from envs.endpoint import Endpoint, Request
from envs.graders import checked_grader
from envs.registry import load_object
from envs.spaces import MessageSpace, MessagesSpace
from envs.taskset import TaskSet
from envs.tools import ToolError, validate_arguments
from envs.types import HELDOUT_SEEDS, Message, Outcome

_NOT_RESTORABLE = (
    "a harness episode cannot be saved and continued (the agent's own state lived in its "
    "process); a retried task starts its episodes again"
)


@dataclass(frozen=True, slots=True)
class Finished:
    """The harness returned (or raised) for the episode with `token`."""

    token: str
    result: Any
    error: BaseException | None


class HarnessEnv(gymnasium.Env[list[Message], Message]):
    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}

    def __init__(
        self,
        *,
        harness: str,
        path: str,
        grader: str = "exact",
        judge: dict[str, Any] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        heldout_fraction: float = 0.2,
        split_seed: int = 0,
        max_turns: int = 4,
        success_threshold: float = 0.5,
        first_request_timeout_s: float = 30.0,
        step_timeout_s: float = 50.0,
        expert: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        fn = load_object(harness)
        if not callable(fn):
            raise ValueError(f"harness {harness!r} is not a function")
        self.harness, self.max_turns = fn, max_turns
        keys = {"prompt_key": prompt_key, "answer_key": answer_key}
        self.taskset = TaskSet.load(
            path, **keys, heldout_fraction=heldout_fraction, split_seed=split_seed
        )
        self.grade_answer = checked_grader(grader, self.taskset, judge=judge, **keys)
        self.answer_key, self.success_threshold = answer_key, success_threshold
        self.first_request_timeout_s, self.step_timeout_s = first_request_timeout_s, step_timeout_s
        self.expert = expert
        """The scripted expert ("module:Class") for SFT demonstrations (envs.make_expert)."""
        self.observation_space = MessagesSpace(roles=("system", "user", "tool"))
        self.action_space = MessageSpace(roles=("assistant",))
        self.endpoint = Endpoint(reply_timeout_s=None)  # reset, close and _abandon answer all
        self._token = ""
        self._pending: Request | None = None
        self._sent: list[dict[str, Any]] = []
        self._turn = 0
        self._row: dict[str, Any] = {}
        self._last_answer = ""

    @property
    def row(self) -> dict[str, Any]:
        """The current episode's task row, answer included (for scripted experts)."""
        return dict(self._row)

    # --- gymnasium API ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._abandon()
        index = seed if seed is not None else int(self.np_random.integers(HELDOUT_SEEDS))
        self._row = self.taskset.row_for(index)
        self._token, self._turn, self._last_answer = uuid.uuid4().hex[:16], 0, ""
        task = copy.deepcopy({k: v for k, v in self._row.items() if k != self.answer_key})
        task["seed"] = index  # a copy: a harness that edits its task never edits the task file's
        base_url = self.endpoint.open(self._token)
        threading.Thread(
            target=_run_harness,
            args=(self.harness, base_url, task, self._token, self.endpoint.inbox),
            name="agentrl-harness",
            daemon=True,
        ).start()
        event = self._next_event(self.first_request_timeout_s)
        if isinstance(event, Finished):
            raise RuntimeError(
                "the harness returned before it called the model"
                + (f": {type(event.error).__name__}: {event.error}" if event.error else "")
            )
        self._pending, self._sent = event, event.messages
        opening = [_plain(m) for m in event.messages]
        return opening, {"tools": event.tools}

    def step(self, action: Message):
        if self._pending is None:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        self._turn += 1
        calls = action.get("tool_calls") or []
        problems = [p for p in (call_problem(c, self._pending.tools) for c in calls) if p]
        if problems:  # never reaches the harness: the policy reads what was wrong, retries
            observation = [_error(text) for text in problems]
            counts = {"tool_calls": len(calls), "tool_errors": len(problems)}
            return self._continue(observation, counts)
        self._last_answer = action.get("content") or ""
        sent = self._pending.reply(action)
        names = {c["id"]: c["function"]["name"] for c in _calls(sent)}
        self._pending = None
        event = self._next_event(self.step_timeout_s)
        while isinstance(event, Request) and self._resent(event):  # the client's own retry
            event.repeat(sent)  # the same reply: the policy's turn is already sampled
            event = self._next_event(self.step_timeout_s)
        if isinstance(event, Finished):
            return self._finish(event, len(calls))
        observation = self._observation(event, names)
        self._pending = event
        return self._continue(observation, {"tool_calls": len(calls), "tool_errors": 0})

    def close(self) -> None:
        self._abandon()
        while not self.endpoint.inbox.empty():  # requests no episode will answer: refused
            event = self.endpoint.inbox.get_nowait()
            if isinstance(event, Request):
                event.fail(409, "this env is closed")
        self.endpoint.close()

    # --- save and continue --------------------------------------------------------------------
    restorable: ClassVar[bool] = False
    """A harness episode cannot be saved and continued elsewhere: the agent's own state lives
    in its process. The rollout saves no turn boundaries for it (rollout/serve.py), so a task
    retried after a worker crash starts its episodes again."""

    def get_state(self) -> dict[str, Any]:
        raise RuntimeError(_NOT_RESTORABLE)

    def set_state(self, state: dict[str, Any]) -> None:
        raise ValueError(_NOT_RESTORABLE)

    # --- internals ------------------------------------------------------------------------------
    def _continue(self, observation: list[Message], counts: dict[str, int]):
        info: dict[str, Any] = dict(counts)
        if self._turn >= self.max_turns:
            self._abandon()
            info["outcome"] = Outcome(success=False, details={"reason": "out of turns"}).to_dict()
            return observation, 0.0, False, True, info
        return observation, 0.0, False, False, info

    def _finish(self, event: Finished, calls: int):
        if event.error is not None:
            raise RuntimeError(f"the harness raised {type(event.error).__name__}: {event.error}")
        outcome, reward = self._outcome(event.result)
        info = {"tool_calls": calls, "tool_errors": 0, "outcome": outcome.to_dict()}
        return [], reward, True, False, info

    def _outcome(self, result: Any) -> tuple[Outcome, float]:
        if isinstance(result, bool | np.bool_):
            return Outcome(success=bool(result), details={"harness": bool(result)}), float(result)
        if isinstance(result, numbers.Real):  # numpy's float32, int64 ... too
            value = float(result)
            success = value >= self.success_threshold
            return Outcome(success=success, details={"harness_reward": value}), value
        if result is None:
            result = self._last_answer
        if not isinstance(result, str):
            raise TypeError(
                f"the harness returned {type(result).__name__}; return the final answer (str), "
                "a reward (float), a success (bool) or None (grade the policy's last reply)"
            )
        outcome = self.grade_answer(result, self._row)
        return outcome, float(outcome.success)

    def _observation(self, request: Request, names: dict[str, str]) -> list[Message]:
        """The messages of `request` after our last reply, as observation messages; ValueError
        (the episode's env error) when the request does not extend what the agent sent before
        with our reply: the trajectory would not be what the agent saw."""
        messages, seen = request.messages, len(self._sent)
        kept = len(messages) > seen and messages[seen]["role"] == "assistant"
        if not kept or not all(_same(a, b) for a, b in zip(self._sent, messages, strict=False)):
            request.fail(400, "the request must resend the episode's messages and our reply")
            raise ValueError(
                f"the harness's request ({len(messages)} messages) does not extend its earlier "
                f"{seen} messages and the policy's reply: a harness must resend its history "
                "unchanged, one request at a time"
            )
        self._sent = messages
        return [_observed(m, names) for m in messages[seen + 1 :]]

    def _resent(self, request: Request) -> bool:
        """`request` repeats the one just answered (an OpenAI client whose timeout passed while
        the policy sampled sends the same messages again: `max_retries`)."""
        messages = request.messages
        return len(messages) == len(self._sent) and all(
            _same(a, b) for a, b in zip(self._sent, messages, strict=True)
        )

    def _next_event(self, timeout_s: float) -> Request | Finished:
        """The next request or the harness's return for this episode (stale ones are refused)."""
        deadline = _Deadline(timeout_s)
        while True:
            try:
                event = self.endpoint.inbox.get(timeout=deadline.left())
            except queue.Empty:
                self._abandon()
                raise TimeoutError(
                    f"the harness neither sent a request nor returned within {timeout_s:g} s"
                ) from None
            if event.token == self._token:
                return event
            if isinstance(event, Request):
                event.fail(409, "this episode is over")

    def _abandon(self) -> None:
        """End the episode for the harness: its open request fails, later ones get 409."""
        if self._pending is not None:
            self._pending.fail(409, "this episode is over (out of turns, tokens or time)")
            self._pending = None
        self._token = ""
        self.endpoint.open("")


class _Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def _run_harness(fn, base_url: str, task: dict[str, Any], token: str, inbox: queue.Queue) -> None:
    try:
        result = fn(base_url, task)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        inbox.put(Finished(token, result, None))
    except BaseException as exc:  # the harness's failure is the episode's, reported in step
        inbox.put(Finished(token, None, exc))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _calls(completion: dict[str, Any]) -> list[dict[str, Any]]:
    return completion["choices"][0]["message"].get("tool_calls") or []


def _same(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """The same message resent (our replies may come back reformatted: roles only for them)."""
    if before["role"] != now["role"]:
        return False
    return before["role"] == "assistant" or before.get("content") == now.get("content")


def _plain(message: dict[str, Any]) -> Message:
    out: Message = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _observed(message: dict[str, Any], names: dict[str, str]) -> Message:
    """A message the harness added: tool results named by the call they answer."""
    if message["role"] == "tool":
        name = names.get(message.get("tool_call_id", ""), message.get("name", ""))
        return {"role": "tool", "name": name, "content": message.get("content") or ""}
    if message["role"] == "assistant":
        text = message.get("content") or json.dumps(message.get("tool_calls", []))
        return {"role": "user", "content": text}  # a turn the harness made itself
    return _plain(message)


def call_problem(call: dict[str, Any], tools: list[dict[str, Any]]) -> str | None:
    """What is wrong with a tool call the policy wrote, checked against the request's tools as
    a ToolEnv's Toolbox checks its own (envs/tools.py): unparsable, an unknown tool, arguments
    that are not the tool's; None when the call may go to the agent. Agents (and agent SDKs)
    often raise on such calls, which would end the episode as an env error that is never
    trained on: the policy would learn nothing from its own mistake, and could drift into it."""
    if call.get("error"):
        return str(call["error"])
    fn = call.get("function") if isinstance(call.get("function"), dict) else {}
    name = fn.get("name")
    schemas = {t["function"]["name"]: t for t in tools}
    if not isinstance(name, str) or not name:
        return 'malformed tool call; expected {"name": <tool>, "arguments": {...}}'
    if name not in schemas:
        return f"unknown tool {name[:60]!r} (available: {', '.join(schemas) or 'none'})"
    params = schemas[name]["function"].get("parameters") or {}
    closed = isinstance(params.get("properties"), dict) and not params.get("additionalProperties")
    arguments = fn.get("arguments", {})
    try:  # the agent's own schema: names and types checked only where it lists them all
        if closed:
            validate_arguments(schemas[name], arguments)
        elif isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        if not isinstance(arguments, dict):
            return f"arguments for {name} must be a JSON object"
    except ToolError as exc:
        return str(exc)
    except json.JSONDecodeError as exc:
        return f"arguments for {name} are not valid JSON ({exc.msg})"
    except Exception:  # a schema our checker does not read: the agent decides
        return None
    return None


def _error(text: str) -> Message:
    return {"role": "tool", "name": "", "content": f"Error: {text}"}
