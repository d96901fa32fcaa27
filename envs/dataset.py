"""`agentrl/Dataset-v0`: train on a JSONL or Parquet file of prompts and reference answers.

    env = gymnasium.make("agentrl/Dataset-v0", path="tasks.jsonl", grader="numeric")

or, in a run file, `env: {dataset: tasks.jsonl, grader: numeric}` (rl/config/sections.py maps it
onto this env). Each episode plays one row of the file (envs/taskset.py: training seeds draw
training rows, evaluation's seeds enumerate the held-out rows): the opening is the optional
`system` message and the row's prompt as the user message; the first assistant message without
tool calls is the answer, graded by `grader` (envs/graders.py: exact, numeric, judge or
"package.module:function").

Tools: none of its own. `mcp` (a list of MCP server specs, envs/mcp.py) adds the servers' tools
to the env's toolbox on the first reset (the connection is made lazily, in the process that
plays the episodes, and closed by `close()`); the model may call them before it answers, within
`max_turns` turns. Saving and continuing an episode replays its tool calls, so it needs tools
that answer the same way twice.

`DatasetExpert` (the env's scripted expert, for SFT warm starts) answers every task with its
reference answer and never calls a tool; with `error_rate` it answers a share of them wrongly on
purpose. With a "module:function" or judge grader the reference is not guaranteed to pass.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from envs.base import ToolEnv
from envs.graders import checked_grader, normalise, references
from envs.taskset import TaskSet
from envs.types import HELDOUT_SEEDS, Message, Outcome, assistant, user

SAMPLE_ROWS = 64
"""Rows of the built-in arithmetic sample played when no `path` is given (for `agentrl envs
check` and demos; a run file always names its data with env.dataset)."""


def arithmetic_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` arithmetic word problems with numeric answers (the calculator env's generator,
    difficulties 1 and 2 alternating), the same for the same arguments."""
    from envs.calculator import make_problem

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        problem = make_problem(rng, 1 + i % 2)
        rows.append({"prompt": f"{problem.text} Answer with the number.", "answer": problem.answer})
    return rows


class DatasetEnv(ToolEnv):
    """One task per episode from a JSONL or Parquet file; see the module docstring."""

    expert = "envs.dataset:DatasetExpert"

    def __init__(
        self,
        *,
        path: str | None = None,
        grader: str = "exact",
        judge: dict[str, Any] | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        heldout_fraction: float = 0.2,
        split_seed: int = 0,
        system: str | None = None,
        max_turns: int = 2,
        tool_timeout_s: float | None = 30.0,
        mcp: list[dict[str, Any]] | None = None,
        render_mode: str | None = None,
    ):
        super().__init__(
            max_turns=max_turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode
        )
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string or null, got {type(system).__name__}")
        if mcp is not None and not isinstance(mcp, list):
            raise ValueError(f"mcp must be a list of MCP server specs, got {type(mcp).__name__}")
        if mcp:  # the specs are checked now (agentrl check); the servers start on first reset
            from envs.mcp import parse_server

            for i, spec in enumerate(mcp):
                try:
                    parse_server(spec, i)
                except ValueError as exc:
                    raise ValueError(f"mcp[{i}]: {exc}") from None
        split = {"heldout_fraction": heldout_fraction, "split_seed": split_seed}
        keys = {"prompt_key": prompt_key, "answer_key": answer_key}
        if path is None:
            if keys != {"prompt_key": "prompt", "answer_key": "answer"}:
                raise ValueError("prompt_key and answer_key need a task file: set path")
            self.taskset = _sample(**split)
        else:
            self.taskset = TaskSet.load(path, **keys, **split)
        self.grader = checked_grader(grader, self.taskset, judge=judge, **keys)
        self.prompt_key, self.answer_key, self.system = prompt_key, answer_key, system
        self.tool_timeout_s = tool_timeout_s
        self.mcp_servers = list(mcp or [])
        self.row: dict[str, Any] = {}
        self._mcp: Any = None
        # an abandoned reset (a restore past its timeout) may still be starting the servers
        # on the tool pool when the rollout closes the env on another thread
        self._mcp_lock = threading.Lock()
        self._closes = 0  # close() calls so far: one during a start makes that start void

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """As ToolEnv.reset; the seed itself picks the row, so it is kept in the options (which
        get_state saves and set_state replays) as `task_seed`."""
        options = dict(options or {})
        if seed is not None:
            options.setdefault("task_seed", int(seed))
        return super().reset(seed=seed, options=options)

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        self._connect_tools()
        seed = options.get("task_seed")
        if seed is None:  # an unseeded reset: a training row, drawn with the env's RNG
            seed = int(self.np_random.integers(HELDOUT_SEEDS))
        self.row = self.taskset.row_for(int(seed))
        opening = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*opening, user(self.row[self.prompt_key])]

    def _grade(self, answer: Message) -> Outcome:
        return self.grader(answer.get("content") or "", self.row)

    def _connect_tools(self) -> None:
        """Start the MCP servers' clients once and add their tools to the toolbox."""
        if not self.mcp_servers or self._mcp is not None:
            return
        from envs.mcp import MCPTools, attach  # here: an env without MCP never imports the SDK

        closes = self._closes
        client = MCPTools(self.mcp_servers, timeout_s=self.tool_timeout_s or 30.0).start()
        with self._mcp_lock:
            closed = self._closes != closes
            if not closed:
                self._mcp = client
        if closed:  # closed while the servers started: stop them now, not at garbage collection
            client.close()
            raise RuntimeError("the env was closed while its MCP servers were starting")
        try:
            attach(self.toolbox, client)
        except BaseException:
            with self._mcp_lock:
                self._mcp = None
            client.close()  # idempotent (a close() meanwhile may have closed it too)
            raise

    def close(self) -> None:
        with self._mcp_lock:
            self._closes += 1
            client, self._mcp = self._mcp, None
        if client is not None:
            client.close()
        super().close()


def _sample(*, heldout_fraction: float, split_seed: int) -> TaskSet:
    """The built-in arithmetic sample, split as a file of the same rows would be."""
    rows = [(f"row {i}", row) for i, row in enumerate(arithmetic_rows(SAMPLE_ROWS), start=1)]
    return TaskSet.from_rows(
        rows,
        source="<built-in arithmetic sample>",
        heldout_fraction=heldout_fraction,
        split_seed=split_seed,
    )


class DatasetExpert:
    """Answers with the task's reference answer (the first, for a list); on `error_rate` of the
    episodes it answers wrongly on purpose: the reference with one digit changed, or (with no
    digit in it) another task's reference. It never calls tools."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self._wrong = False

    def begin(self) -> None:
        """Start a new episode: decide whether this one goes wrong."""
        self._wrong = bool(self.rng.random() < self.error_rate)

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        inner: Any = env.unwrapped
        reference = str(references(inner.row, inner.answer_key)[0])
        if not self._wrong:
            return assistant(reference)
        return assistant(self._wrong_answer(reference, inner.taskset, inner.answer_key))

    def _wrong_answer(self, reference: str, taskset: TaskSet, answer_key: str) -> str:
        digits = [i for i, ch in enumerate(reference) if ch.isdigit()]
        if digits:
            i = digits[int(self.rng.integers(len(digits)))]
            wrong = str((int(reference[i]) + int(self.rng.integers(1, 10))) % 10)
            return reference[:i] + wrong + reference[i + 1 :]
        rows = taskset.train
        for _ in range(8):
            row = rows[int(self.rng.integers(len(rows)))]
            other = str(references(row, answer_key)[0])
            if normalise(other) != normalise(reference):
                return other
        return f"not {reference}"
