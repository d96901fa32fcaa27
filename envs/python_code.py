"""`agentrl/PythonCode-v0`: write a Python function; graded by hidden calls run in the sandbox.

The model reads a spec ("Write `sum_multiples(xs)`: return the sum of ..."), may try code with
`run_python(code)` (sandboxed), and answers with the function's source (a ```python block or bare
code). Grading (`envs.grading`) calls the function on held-out inputs drawn at grading time and
compares type-exact results outside the sandbox, so `sys.exit(0)`, `os._exit(0)`, always-equal
objects, `conftest.py` and test edits all score 0 (there are no tests to edit: the examples in the
prompt are all the model sees).

Difficulty (`difficulty=1..3`): which templates are drawn (see `envs.codetasks`): 1 = one-liners
(sums, counts, digit sums), 2 = + clipping, Caesar shifts, second largest, 3 = + runs, run-length
encoding, bracket matching.

`PythonCodeExpert` answers with the canonical solution; on half of its episodes it first tries the
function on the prompt's example with `run_python`. With `error_rate > 0` that share of its
answers is the planted-bug variant instead.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from envs.base import ToolEnv
from envs.codetasks import FunctionTask, draw_task
from envs.grading import grade_calls
from envs.sandbox import Limits, Sandbox, SandboxConfig
from envs.tools import ToolError, tool
from envs.types import Message, Outcome, assistant, tool_call, user

MAX_CODE_CHARS = 20000
GRADING_CALLS = 30
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of `text`, else the whole text."""
    blocks = _FENCE.findall(text)
    return (blocks[-1] if blocks else text).strip() + "\n"


def sandbox_for(
    *, require_isolation: bool, cpu_s: float = 2.0, wall_s: float = 5.0, memory_mb: int = 256
) -> Sandbox:
    """The sandbox code-running envs use (small limits: tasks are tiny)."""
    limits = Limits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, output_bytes=16384)
    return Sandbox(SandboxConfig(limits=limits, require_isolation=require_isolation))


class PythonCodeEnv(ToolEnv):
    """Write the function the user asks for; tool: `run_python(code)`; answer with the code."""

    expert = "envs.python_code:PythonCodeExpert"

    def __init__(
        self,
        *,
        difficulty: int = 1,
        max_turns: int = 3,
        require_isolation: bool = False,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if difficulty not in (1, 2, 3):
            raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
        super().__init__(
            max_turns=max_turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode
        )
        self.difficulty = difficulty
        self.sandbox = sandbox_for(require_isolation=require_isolation)
        self.task: FunctionTask | None = None
        self.example = ""
        self._grading_seed = 0

    @tool
    def run_python(self, code: str) -> str:
        """Run Python code in a sandbox (no network, no files kept) and return what it printed.

        Args:
            code: A complete Python program; use print() to see values.
        """
        if len(code) > MAX_CODE_CHARS:
            raise ToolError(f"code too long ({len(code)} characters; max {MAX_CODE_CHARS})")
        result = self.sandbox.run_python(code)
        return result.describe()[:1500]

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        difficulty = int(options.get("difficulty", self.difficulty))
        self.task = draw_task(self.np_random, difficulty)
        self.example = self.task.example(self.np_random)
        self._grading_seed = int(self.np_random.integers(2**63))
        return [
            user(
                f"Write a Python function `{self.task.signature}` that returns {self.task.spec} "
                f"Example: {self.example}. Answer with the code of the function."
            )
        ]

    def _grade(self, answer: Message) -> Outcome:
        assert self.task is not None
        code = extract_code(answer.get("content", ""))
        if len(code) > MAX_CODE_CHARS:
            return Outcome(success=False, details={"status": "too_long", "passed": 0})
        rng = np.random.default_rng(self._grading_seed)
        calls = self.task.calls(rng, GRADING_CALLS)
        reference = self.task.reference()
        expected = [reference(*args) for _, args in calls]
        targets = [(f"solution:{name}", args) for name, args in calls]
        verdict = grade_calls(self.sandbox, {"solution.py": code}, targets, expected)
        details = {"function": self.task.name, **verdict.details()}
        return Outcome(success=verdict.success, details=details)


class PythonCodeExpert:
    """Scripted demonstrator: the canonical solution (the buggy one in `error_rate` of episodes)."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0, try_rate: float = 0.5):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate, self.try_rate = error_rate, try_rate
        self.rng = np.random.default_rng(seed)
        self._wrong = False
        self._try = False

    def begin(self) -> None:
        self._wrong = bool(self.rng.random() < self.error_rate)
        self._try = bool(self.rng.random() < self.try_rate)

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        inner = env.unwrapped
        task = inner.task
        code = task.buggy if self._wrong else task.solution
        if self._try and history[-1]["role"] == "user":
            call = inner.example.split(" == ")[0]
            program = f"{code}\nprint({call})\n"
            return assistant("", [tool_call("run_python", {"code": program})])
        return assistant(f"```python\n{code}```")
