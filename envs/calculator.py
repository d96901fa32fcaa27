"""`agentrl/Calculator-v0`: arithmetic word problems solved with a `calculate` tool.

The model reads a word problem, calls `calculate(expression)`, reads the result and answers with
the number. Success means the last number in the final answer equals the true result.

Difficulty (`difficulty=1..4`): 1 = one addition or subtraction of numbers up to 99; 2 = one of
+, -, * with larger numbers; 3 and 4 = chains of two and three operations.

`CalculatorExpert` is the scripted demonstrator. With `error_rate > 0` it is deliberately
imperfect: on that share of episodes it either skips the tool and guesses, or copies the
expression with one digit wrong. Imitating it plateaus below what the task reward can reach.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from envs.base import ToolEnv
from envs.tools import ToolError, tool
from envs.types import Message, Outcome, assistant, tool_call, user

_NAMES = [
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jo",
    "Kofi",
    "Lena",
]
_ITEMS = ["apples", "coins", "books", "stamps", "marbles", "shells", "cards", "pens"]
_PHRASES = {
    "+": ["Then they get {b} more.", "Then they find {b} more.", "A friend gives them {b} more."],
    "-": ["Then they give away {b}.", "Then they lose {b}.", "Then they sell {b}."],
    "*": ["Then the number grows {b} times.", "Then they end up with {b} times as many."],
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def evaluate_expression(expression: str) -> float:
    """Safely evaluate + - * / and parentheses over numbers (no names, no powers)."""
    if len(expression) > 200:
        raise ToolError("expression too long (max 200 characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse expression {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        result = _OPS[type(node.op)](left, right)
        if abs(result) > 1e15:
            raise ToolError("result too large")
        return result
    raise ToolError("only numbers, + - * / and parentheses are allowed")


def format_number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4f}".rstrip("0").rstrip(".")


@dataclass(slots=True)
class Problem:
    text: str
    expression: str
    answer: int
    operands: list[int] = field(default_factory=list)


def make_problem(rng: np.random.Generator, difficulty: int) -> Problem:
    n_ops = {1: 1, 2: 1, 3: 2, 4: 3}[difficulty]
    ops_allowed = ["+", "-"] if difficulty == 1 else ["+", "-", "*"]
    top = 99 if difficulty == 1 else 999
    name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
    value = int(rng.integers(2, top + 1))
    operands, expression = [value], str(value)
    sentences = [f"{name} has {value} {item}."]
    for _ in range(n_ops):
        op = ops_allowed[rng.integers(len(ops_allowed))]
        if op == "*":
            b = int(rng.integers(2, 10))
        elif op == "-":
            b = int(rng.integers(1, max(2, value)))
        else:
            b = int(rng.integers(1, (99 if difficulty == 1 else top) + 1))
        phrases = _PHRASES[op]
        sentences.append(phrases[rng.integers(len(phrases))].format(b=b))
        if op == "*" and ("+" in expression or "-" in expression):
            expression = f"({expression}) * {b}"
        else:
            expression = f"{expression} {op} {b}"
        value = {"+": value + b, "-": value - b, "*": value * b}[op]
        operands.append(b)
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(" ".join(sentences), expression, value, operands)


class CalculatorEnv(ToolEnv):
    """Arithmetic word problems; tool: `calculate(expression)`; answer with the number."""

    expert = "envs.calculator:CalculatorExpert"

    def __init__(
        self,
        *,
        difficulty: int = 1,
        max_turns: int = 4,
        tool_timeout_s: float | None = 30.0,
        render_mode: str | None = None,
    ):
        if difficulty not in (1, 2, 3, 4):
            raise ValueError(f"difficulty must be 1, 2, 3 or 4, got {difficulty}")
        super().__init__(
            max_turns=max_turns, tool_timeout_s=tool_timeout_s, render_mode=render_mode
        )
        self.difficulty = difficulty
        self.problem: Problem | None = None

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".
        """
        return format_number(evaluate_expression(expression))

    def _new_task(self, options: dict[str, Any]) -> list[Message]:
        difficulty = int(options.get("difficulty", self.difficulty))
        self.problem = make_problem(self.np_random, difficulty)
        return [user(self.problem.text)]

    def _grade(self, answer: Message) -> Outcome:
        assert self.problem is not None
        numbers = _NUMBER.findall(answer.get("content", ""))
        given = float(numbers[-1]) if numbers else None
        success = given is not None and abs(given - self.problem.answer) < 1e-6
        return Outcome(
            success=success,
            details={"expected": self.problem.answer, "given": given},
        )


class CalculatorExpert:
    """Scripted demonstrator; `error_rate` of its episodes go wrong on purpose."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
        self.error_rate = error_rate
        self.rng = np.random.default_rng(seed)
        self._mistake: str | None = None

    def begin(self) -> None:
        """Start a new episode: decide whether (and how) this one goes wrong."""
        self._mistake = None
        if self.rng.random() < self.error_rate:
            self._mistake = "skip_tool" if self.rng.random() < 0.5 else "miscopy"

    def act(self, env: ToolEnv, history: list[Message]) -> Message:
        problem = env.unwrapped.problem
        last = history[-1]
        if last["role"] == "tool":
            return assistant(last["content"].removeprefix("Error: "))
        if self._mistake == "skip_tool":
            offset = int(self.rng.integers(1, 11)) * (1 if self.rng.random() < 0.5 else -1)
            return assistant(str(problem.answer + offset))
        expression = problem.expression
        if self._mistake == "miscopy":
            expression = _miscopy(expression, self.rng)
        return assistant("", [tool_call("calculate", {"expression": expression})])


def _miscopy(expression: str, rng: np.random.Generator) -> str:
    """Change one digit of the expression to a different digit."""
    positions = [i for i, ch in enumerate(expression) if ch.isdigit()]
    i = positions[rng.integers(len(positions))]
    wrong = str((int(expression[i]) + int(rng.integers(1, 10))) % 10)
    return expression[:i] + wrong + expression[i + 1 :]
