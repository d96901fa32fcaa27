"""Small function-writing tasks shared by PythonCode-v0 and FileEdit-v0.

Each task is drawn from a template with its parameters baked in (so the answer differs from task
to task): a function name and signature, a one-sentence spec, the canonical solution, a variant
with one planted bug, and an input generator for held-out grading calls. The reference values
come from the canonical solution: our own source, compiled here; model-written code is only ever
run in the sandbox.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Inputs = Callable[[np.random.Generator], list[Any]]


@dataclass(frozen=True, slots=True)
class FunctionTask:
    name: str
    signature: str
    spec: str
    """What the function returns, as a sentence ending in a period."""
    solution: str
    buggy: str
    inputs: Inputs

    def reference(self) -> Callable[..., Any]:
        namespace: dict[str, Any] = {}
        exec(compile(self.solution, f"<reference {self.name}>", "exec"), namespace)  # our code
        return namespace[self.name]

    def calls(self, rng: np.random.Generator, count: int) -> list[tuple[str, list[Any]]]:
        return [(self.name, self.inputs(rng)) for _ in range(count)]

    def example(self, rng: np.random.Generator) -> str:
        args = self.inputs(rng)
        shown = ", ".join(repr(a) for a in args)
        return f"{self.name}({shown}) == {self.reference()(*args)!r}"


def _ints(rng: np.random.Generator, lo: int = -20, hi: int = 40, n: tuple = (0, 9)) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi, size=int(rng.integers(*n)))]


def _word(rng: np.random.Generator, letters: str = "abcde", n: tuple = (0, 12)) -> str:
    return "".join(letters[i] for i in rng.integers(0, len(letters), size=int(rng.integers(*n))))


def sum_multiples(rng: np.random.Generator) -> FunctionTask:
    k = int(rng.integers(2, 6))
    body = f"return sum(x for x in xs if x % {k} == 0)"
    return FunctionTask(
        "sum_multiples",
        "sum_multiples(xs)",
        f"the sum of the numbers in the list xs that are multiples of {k}.",
        f"def sum_multiples(xs):\n    {body}\n",
        f"def sum_multiples(xs):\n    {body.replace('== 0', '== 1')}\n",
        lambda r: [_ints(r)],
    )


def count_letter(rng: np.random.Generator) -> FunctionTask:
    letter = "abcde"[int(rng.integers(5))]
    return FunctionTask(
        "count_letter",
        "count_letter(s)",
        f"how many times the letter {letter!r} occurs in the string s.",
        f"def count_letter(s):\n    return s.count({letter!r})\n",
        f"def count_letter(s):\n    return s.count({letter!r}) - 1\n",
        lambda r: [_word(r)],
    )


def digit_sum(rng: np.random.Generator) -> FunctionTask:
    base = int(rng.choice([10, 10, 2, 8]))
    solution = (
        "def digit_sum(n):\n    n, total = abs(n), 0\n    while n:\n"
        f"        total += n % {base}\n        n //= {base}\n    return total\n"
    )
    return FunctionTask(
        "digit_sum",
        "digit_sum(n)",
        f"the sum of the base-{base} digits of abs(n).",
        solution,
        solution.replace("n, total = abs(n), 0", "n, total = abs(n), 1"),
        lambda r: [int(r.integers(-5000, 5000))],
    )


def clip_list(rng: np.random.Generator) -> FunctionTask:
    lo = int(rng.integers(-5, 5))
    hi = lo + int(rng.integers(3, 15))
    body = f"return [min(max(x, {lo}), {hi}) for x in xs]"
    return FunctionTask(
        "clip_list",
        "clip_list(xs)",
        f"a new list with each number of xs clipped to the range [{lo}, {hi}].",
        f"def clip_list(xs):\n    {body}\n",
        f"def clip_list(xs):\n    {body.replace(f'max(x, {lo})', f'max(x, {lo + 1})')}\n",
        lambda r: [_ints(r)],
    )


def shift_letters(rng: np.random.Generator) -> FunctionTask:
    k = int(rng.integers(1, 26))
    solution = (
        "def shift_letters(s):\n    return ''.join(\n"
        f"        chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s\n    )\n"
    )
    return FunctionTask(
        "shift_letters",
        "shift_letters(s)",
        f"s with every lowercase letter a-z shifted {k} places forward in the alphabet "
        "(wrapping from z to a); other characters unchanged.",
        solution,
        solution.replace("% 26", "% 25"),
        lambda r: [_word(r, "abcxyz -")],
    )


def second_largest(rng: np.random.Generator) -> FunctionTask:
    solution = (
        "def second_largest(xs):\n    values = sorted(set(xs))\n"
        "    return values[-2] if len(values) > 1 else None\n"
    )
    return FunctionTask(
        "second_largest",
        "second_largest(xs)",
        "the second largest distinct number in the list xs, or None if there is none.",
        solution,
        solution.replace("sorted(set(xs))", "sorted(xs)"),
        lambda r: [_ints(r, -3, 4, (0, 7))],
    )


def longest_run(rng: np.random.Generator) -> FunctionTask:
    solution = (
        "def longest_run(xs):\n    best = run = 0\n    for i, x in enumerate(xs):\n"
        "        run = run + 1 if i and xs[i - 1] == x else 1\n        best = max(best, run)\n"
        "    return best\n"
    )
    return FunctionTask(
        "longest_run",
        "longest_run(xs)",
        "the length of the longest run of equal adjacent elements in the list xs (0 if empty).",
        solution,
        solution.replace("best = max(best, run)", "best = max(best, run - 1)"),
        lambda r: [_ints(r, 0, 3, (0, 12))],
    )


def run_length(rng: np.random.Generator) -> FunctionTask:
    solution = (
        "def run_length(s):\n    out = []\n    for c in s:\n"
        "        if out and out[-1][0] == c:\n            out[-1][1] += 1\n"
        "        else:\n            out.append([c, 1])\n"
        "    return ''.join(f'{c}{n}' for c, n in out)\n"
    )
    return FunctionTask(
        "run_length",
        "run_length(s)",
        "the run-length encoding of s: each run of one character c repeated n times becomes "
        "c followed by n, e.g. 'aab' -> 'a2b1'.",
        solution,
        solution.replace("out[-1][1] += 1", "out[-1][1] = 2"),
        lambda r: [_word(r, "ab", (0, 10))],
    )


def balanced(rng: np.random.Generator) -> FunctionTask:
    solution = (
        "def balanced(s):\n    pairs, stack = {')': '(', ']': '['}, []\n    for c in s:\n"
        "        if c in '([':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return not stack\n"
    )
    return FunctionTask(
        "balanced",
        "balanced(s)",
        "True if the brackets () and [] in s are balanced and properly nested, else False.",
        solution,
        solution.replace("return not stack", "return True"),
        lambda r: [_word(r, "(()[[]", (0, 8))],
    )


TEMPLATES: tuple[tuple[int, Callable[[np.random.Generator], FunctionTask]], ...] = (
    (1, sum_multiples),
    (1, count_letter),
    (1, digit_sum),
    (2, clip_list),
    (2, shift_letters),
    (2, second_largest),
    (3, longest_run),
    (3, run_length),
    (3, balanced),
)
"""(difficulty level, template): a task of difficulty d draws from the levels <= d."""


def draw_task(
    rng: np.random.Generator, difficulty: int, exclude: tuple[str, ...] = ()
) -> FunctionTask:
    """A task of level <= difficulty, parameters drawn from `rng`; `exclude` names templates."""
    pool = [f for level, f in TEMPLATES if level <= difficulty and f.__name__ not in exclude]
    if not pool:
        raise ValueError(f"no task template at difficulty {difficulty} (excluding {exclude})")
    return pool[int(rng.integers(len(pool)))](rng)
