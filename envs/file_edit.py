"""`agentrl/FileEdit-v0`: fix a bug in a small generated repository.

Each seed generates a repository: modules of small functions (from `envs.codetasks`), unittest
files under tests/, and one planted bug that a visible test exposes. Tools: `read_file(path)`,
`write_file(path, content)` and `run_tests()` (unittest in the sandbox, over the files as the
model left them). The final answer is a plain message ("done").

Grading never trusts the workspace's tests: it takes the repository's module files as the model
left them (new files such as conftest.py, sitecustomize.py or edited tests are ignored) and calls
every function on held-out inputs in the sandbox, comparing type-exact results outside
(`envs.grading`). Whether tests were edited is reported as a fact (`tests_modified`).

Difficulty (`difficulty=1..3`): 1 = one module with one function, 2 = two modules of two,
3 = three modules of three; the planted bug's function is drawn from any level.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import numpy as np

from envs.base import ToolEnv
from envs.codetasks import FunctionTask, draw_task
from envs.grading import grade_calls
from envs.python_code import sandbox_for
from envs.tools import ToolError, tool
from envs.types import Message, Outcome, assistant, tool_call, user

MODULES = ("textutil", "numutil", "listutil", "helpers", "core", "tools", "utils", "misc")
SHAPES = {1: (1, 1), 2: (2, 2), 3: (3, 3)}
MAX_FILE_CHARS, MAX_FILES = 20000, 32
GRADING_CALLS = 12

_TIMING = re.compile(r"Ran (\d+ tests?) in [\d.]+s")


def module_source(tasks: list[FunctionTask], bug: str | None) -> str:
    parts = []
    for task in tasks:
        code = task.buggy if task.name == bug else task.solution
        parts.append(f"# {task.signature}: {task.spec}\n{code}")
    return "\n\n".join(parts)


def test_source(module: str, tasks: list[FunctionTask], rng: np.random.Generator, bug: str | None):
    lines = ["import unittest", "", f"from {module} import {', '.join(t.name for t in tasks)}", ""]
    lines += ["", f"class Test{module.capitalize()}(unittest.TestCase):"]
    for task in tasks:
        args = _revealing_args(task, rng) if task.name == bug else task.inputs(rng)
        want = task.reference()(*args)
        shown = ", ".join(repr(a) for a in args)
        lines += [
            f"    def test_{task.name}(self):",
            f"        self.assertEqual({task.name}({shown}), {want!r})",
            "",
        ]
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()"]
    return "\n".join(lines) + "\n"


def _revealing_args(task: FunctionTask, rng: np.random.Generator) -> list[Any]:
    """Inputs on which the planted bug gives a wrong answer (so a visible test fails)."""
    namespace: dict[str, Any] = {}
    exec(compile(task.buggy, f"<buggy {task.name}>", "exec"), namespace)  # our own source
    good, bad = task.reference(), namespace[task.name]
    for _ in range(1000):
        args = task.inputs(rng)
        if good(*args) != bad(*args):
            return args
    raise RuntimeError(f"no input exposes the bug of {task.name}")  # pragma: no cover


class FileEditEnv(ToolEnv):
    """Fix the failing test's bug; tools: read_file, write_file, run_tests; then say done."""

    expert = "envs.file_edit:FileEditExpert"

    def __init__(
        self,
        *,
        difficulty: int = 1,
        max_turns: int = 5,
        require_isolation: bool = False,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if difficulty not in SHAPES:
            raise ValueError(f"difficulty must be 1, 2 or 3, got {difficulty}")
        super().__init__(
            max_turns=max_turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode
        )
        self.difficulty = difficulty
        self.sandbox = sandbox_for(require_isolation=require_isolation, cpu_s=3.0, wall_s=8.0)
        self.modules: dict[str, list[FunctionTask]] = {}
        self.original: dict[str, str] = {}
        self.files: dict[str, str] = {}
        self.bug = ("", "")
        self._grading_seed = 0

    @tool
    def read_file(self, path: str) -> str:
        """Read a file of the repository.

        Args:
            path: A path relative to the repository root, e.g. "textutil.py".
        """
        path = _clean_path(path)
        if path not in self.files:
            raise ToolError(f"no file {path!r}; files: {', '.join(sorted(self.files))}")
        return self.files[path]

    @tool
    def write_file(self, path: str, content: str) -> str:
        """Replace (or create) a file of the repository.

        Args:
            path: A path relative to the repository root, e.g. "textutil.py".
            content: The complete new content of the file.
        """
        path = _clean_path(path)
        if len(content) > MAX_FILE_CHARS:
            raise ToolError(f"file too large ({len(content)} characters; max {MAX_FILE_CHARS})")
        if path not in self.files and len(self.files) >= MAX_FILES:
            raise ToolError(f"too many files (max {MAX_FILES})")
        self.files[path] = content
        return f"Wrote {len(content)} characters to {path}."

    @tool
    def run_tests(self) -> str:
        """Run the repository's unit tests (python -m unittest) and report the result."""
        command = [
            self.sandbox.python,
            "-I",
            "-m",
            "unittest",
            "discover",
            "-s",
            "tests",
            "-t",
            ".",
        ]
        result = self.sandbox.run(command, files=self.files)
        if result.status == "ok":
            return "All tests passed."
        text = _TIMING.sub(r"Ran \1", result.describe())  # timings would make replays differ
        return text if len(text) <= 700 else f"...{text[-700:]}"

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        count, per = SHAPES[int(options.get("difficulty", self.difficulty))]
        rng, used, self.modules = self.np_random, [], {}
        names = [MODULES[i] for i in rng.choice(len(MODULES), size=count, replace=False)]
        for name in names:
            tasks = []
            for _ in range(per):
                tasks.append(draw_task(rng, 3, exclude=tuple(used)))
                used.append(tasks[-1].name)
            self.modules[name] = tasks
        bug_module = names[int(rng.integers(count))]
        self.bug = (bug_module, self.modules[bug_module][int(rng.integers(per))].name)
        self.files = {}
        for name, tasks in self.modules.items():
            bug = self.bug[1] if name == bug_module else None
            self.files[f"{name}.py"] = module_source(tasks, bug)
            self.files[f"tests/test_{name}.py"] = test_source(name, tasks, rng, bug)
        self.files["tests/__init__.py"] = ""
        self.original = dict(self.files)
        self._grading_seed = int(rng.integers(2**63))
        listing = ", ".join(sorted(self.files))
        return [
            user(
                f"Files: {listing}. The test test_{self.bug[1]} in tests/test_{bug_module}.py "
                "fails. Find and fix the bug in the code (not in the tests), then reply done."
            )
        ]

    def _grade(self, answer: Message) -> Outcome:
        rng = np.random.default_rng(self._grading_seed)
        sources = {f"{m}.py": self.files.get(f"{m}.py", "") for m in self.modules}
        calls, expected = [], []
        for module, tasks in self.modules.items():
            for task in tasks:
                reference = task.reference()
                for name, args in task.calls(rng, GRADING_CALLS):
                    calls.append((f"{module}:{name}", args))
                    expected.append(reference(*args))
        verdict = grade_calls(self.sandbox, sources, calls, expected)
        tests_modified = any(
            self.files.get(p) != c for p, c in self.original.items() if p.startswith("tests/")
        )
        details = {
            **verdict.details(),
            "bug": f"{self.bug[0]}.{self.bug[1]}",
            "tests_modified": tests_modified,
            "files_added": sorted(set(self.files) - set(self.original)),
        }
        return Outcome(success=verdict.success, details=details)


def _clean_path(path: str) -> str:
    norm = posixpath.normpath(path.strip())
    if norm in ("", ".", "..") or norm.startswith(("/", "../")) or "\x00" in norm:
        raise ToolError(f"invalid path {path[:80]!r}: use a path inside the repository")
    return norm


class FileEditExpert:
    """Reads the buggy module, writes it back fixed, runs the tests, says done. With
    `error_rate`, that share of its episodes "fix" the wrong function (the bug stays)."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0, test_rate: float = 0.5):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate, self.test_rate = error_rate, test_rate
        self.rng = np.random.default_rng(seed)
        self._wrong = self._test = False

    def begin(self) -> None:
        self._wrong = bool(self.rng.random() < self.error_rate)
        self._test = bool(self.rng.random() < self.test_rate)

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        inner = env.unwrapped
        module, _ = inner.bug
        path = f"{module}.py"
        step = sum(m["role"] == "assistant" for m in history)
        if step == 0:
            return assistant("", [tool_call("read_file", {"path": path})])
        if step == 1:
            fixed = module_source(inner.modules[module], inner.bug[1] if self._wrong else None)
            return assistant("", [tool_call("write_file", {"path": path, "content": fixed})])
        if step == 2 and self._test:
            return assistant("", [tool_call("run_tests", {})])
        return assistant("done")
