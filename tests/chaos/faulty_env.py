"""A Calculator-v0 whose tools hang forever on some tasks, for the chaos suite's real runs
(`env.entry_point: tests.chaos.faulty_env:HangingCalculator`).

A training task's kind comes from its seed (rollout workers reset an env with the task's seed
before they continue a saved episode, so a replay hangs the same way); the expert's
demonstrations (seeds from 2e9, rl/sft/warm_start.py) and evaluation tasks (from 1e9) never hang:

    crc32 % 4 == 0  "tool": every turn calls `lookup`, which never returns; the env's own tool
                    timeout (env kwarg tool_timeout_s) answers with an error observation and
                    the episode goes on
    crc32 % 4 == 1  "step": the env step itself never returns (no tool timeout can apply); the
                    rollout's rollout.tool_timeout_s ends the episode as an env error
    otherwise       the plain calculator

The tiny untrained policy of these runs rarely writes a well-formed tool call, so on the hanging
tasks every turn is taken as a call to `lookup`, whatever the model wrote.
"""

from __future__ import annotations

import threading
import zlib
from typing import Any

from envs.calculator import CalculatorEnv
from envs.tools import tool
from envs.types import Message, tool_call
from rl.observe.evaluate import EVAL_SEED_OFFSET


class HangingCalculator(CalculatorEnv):
    kind = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.kind = ""
        if seed is not None and seed < EVAL_SEED_OFFSET:
            self.kind = {0: "tool", 1: "step"}.get(zlib.crc32(str(seed).encode()) % 4, "")
        return super().reset(seed=seed, options=options)

    @tool
    def lookup(self, key: str) -> str:
        """Look a value up (on the hanging tasks it never answers).

        Args:
            key: What to look up.
        """
        if self.kind == "tool":
            threading.Event().wait()  # forever
        return key

    def step(self, action: Message):
        if self.kind == "step":
            threading.Event().wait()  # forever
        if self.kind == "tool" and isinstance(action, dict):
            action = {**action, "tool_calls": [tool_call("lookup", {"key": "x"})]}
        return super().step(action)


class BrokenResetCalculator(CalculatorEnv):
    """A Calculator-v0 whose `reset` raises on every training task (its task database is
    unreachable): every episode is an env error, past any rollout.max_env_error_rate."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None and seed < EVAL_SEED_OFFSET:
            raise RuntimeError("task database unreachable")
        return super().reset(seed=seed, options=options)
