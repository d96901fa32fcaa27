"""Hardened grading of model-written functions: held-out calls in the sandbox, comparison outside.

The naive grader (run the tests in the workspace, reward = exit code 0) is fooled by `os._exit(0)`,
`sys.exit(0)`, objects whose `__eq__` always returns True, edited test files and `conftest.py`.
Here:
- the expected values never enter the sandbox; the inputs are drawn at grading time from a seed
  the model never sees, and the tests the model can read or edit play no part in the grade;
- inside, a harness imports the candidate module and calls each function on the inputs, with
  stdout redirected so the candidate cannot print over it; each call's value is encoded strictly
  (`type(x) is int`, no subclasses, no custom objects) and written as ONE line,
  `RESULT <nonce> <json>`; the nonce is read from stdin before the candidate runs;
- outside, the grade requires exactly one such line with every call present and equal to the
  reference's own encoding. The exit code is ignored: exiting early just means no RESULT line.
"""

from __future__ import annotations

import inspect
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from envs.sandbox import RunResult, Sandbox

MAX_DEPTH = 6


def encode(value: Any, depth: int = 0) -> Any:
    """Tagged, type-exact JSON form of a result; raises TypeError for anything else."""
    kind = type(value)
    if depth > MAX_DEPTH:
        raise TypeError("result nested too deeply")
    if value is None or kind in (bool, int, str):
        return [kind.__name__, value]
    if kind is float:
        return ["float", repr(value)]
    if kind in (list, tuple):
        return [kind.__name__, [encode(v, depth + 1) for v in value]]
    if kind is dict:
        pairs = [(json.dumps(encode(k, depth + 1)), encode(v, depth + 1)) for k, v in value.items()]
        return ["dict", sorted(pairs)]
    raise TypeError(f"unsupported result type {kind.__name__}")


_HARNESS = """from __future__ import annotations
import importlib, json, os, sys
_dumps, _write, _exit = json.dumps, os.write, os._exit
nonce = sys.stdin.readline().strip()
sys.stdin.close()
with open("calls.json") as fh:
    spec = json.load(fh)
os.remove("calls.json")
out = os.dup(1)
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
os.dup2(devnull, 2)
sys.path.append(os.getcwd())
MAX_DEPTH = %(depth)d
%(encode)s
def report(payload):
    _write(out, ("RESULT " + nonce + " " + _dumps(payload) + "\\n").encode())
    _exit(0)
modules = {}
results = []
for target, args in spec["calls"]:
    name, _, function = target.partition(":")
    try:
        if name not in modules:
            modules[name] = importlib.import_module(name)
        value = getattr(modules[name], function)(*args)
        results.append(["ok", encode(value)])
    except BaseException as exc:
        results.append(["raised", type(exc).__name__])
report({"results": results})
"""


def harness_source() -> str:
    return _HARNESS % {"depth": MAX_DEPTH, "encode": inspect.getsource(encode)}


@dataclass(slots=True, kw_only=True)
class Verdict:
    """What grading found (facts for `info["outcome"]["details"]`)."""

    passed: int = 0
    total: int = 0
    status: str = "ok"
    """ok | no_result (exited before reporting) | bad_report (not exactly one well-formed
    report) | wall_timeout | cpu_limit | killed (the run died at a limit)."""
    raised: list[str] = field(default_factory=list)
    """Exception types the calls raised (SystemExit shows an exit attempt)."""

    @property
    def success(self) -> bool:
        return self.status == "ok" and self.total > 0 and self.passed == self.total

    def details(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "total": self.total,
            "status": self.status,
            "raised": sorted(set(self.raised)),
        }


def grade_calls(
    sandbox: Sandbox,
    files: dict[str, str],
    calls: list[tuple[str, list[Any]]],
    expected: list[Any],
) -> Verdict:
    """Run `calls` (("module:function", args) pairs) on the modules in `files`, in the sandbox,
    and compare each result with `expected` (reference values, compared by strict encoding)."""
    nonce = secrets.token_hex(16)
    staged = {**files, "__main__.py": harness_source()}
    staged["calls.json"] = json.dumps({"calls": [list(c) for c in calls]})
    result = sandbox.run(
        [sandbox.python, "-I", "__main__.py"], files=staged, stdin=f"{nonce}\n".encode()
    )
    return _verdict(result, nonce, [json.loads(json.dumps(encode(v))) for v in expected])


def _verdict(result: RunResult, nonce: str, expected: list[Any]) -> Verdict:
    verdict = Verdict(total=len(expected))
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith(f"RESULT {nonce} ")]
    if len(lines) != 1:
        verdict.status = "no_result" if not lines else "bad_report"
        if result.status != "ok" and not lines:
            verdict.status = result.status
        return verdict
    try:
        payload = json.loads(lines[0].split(" ", 2)[2])
        results = payload["results"]
        if not isinstance(results, list) or len(results) != len(expected):
            raise ValueError("wrong number of results")
        for (kind, value), want in zip(results, expected, strict=True):
            if kind == "raised":
                verdict.raised.append(str(value)[:80])
            verdict.passed += kind == "ok" and value == want
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        verdict.status, verdict.passed = "bad_report", 0  # the candidate tampered with it
    return verdict
