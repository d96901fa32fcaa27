"""An example MCP server: a safe calculator, plus two tools for testing timeouts and errors.

    python configs/mcp/calc_server.py               # stdio (an MCP client starts it as a child)
    python configs/mcp/calc_server.py --http 8765   # streamable HTTP at http://127.0.0.1:8765/mcp

Tools: `calculate(expression)` (numbers, + - * / and parentheses; parsed with `ast`, never
`eval`), `slow(seconds)` (sleeps, then answers: for timeouts) and `fail()` (always raises: for
error results). Use it from an env with `envs.mcp.use_mcp` (see docs/environments.md, "MCP tools").
It needs only the `mcp` package.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import operator
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

MAX_EXPRESSION_CHARS = 200
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}

server = MCPServer("calc", instructions="A calculator: call calculate with an expression.")


def evaluate(expression: str) -> float:
    """Evaluate + - * / and parentheses over numbers; raise ToolError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long (max {MAX_EXPRESSION_CHARS} characters)")
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


def _format(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


@server.tool(description="Evaluate an arithmetic expression.")
def calculate(
    expression: Annotated[
        str, Field(description='Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".')
    ],
) -> str:
    return _format(evaluate(expression))


@server.tool(description="Wait, then answer (for testing timeouts).")
async def slow(seconds: Annotated[float, Field(description="How long to wait.")]) -> str:
    await asyncio.sleep(max(0.0, min(seconds, 3600.0)))
    return f"waited {seconds:g} s"


@server.tool(description="Always fail (for testing error results).")
def fail() -> str:
    raise ToolError("this tool always fails")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP on PORT")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    args = parser.parse_args()
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host=args.host, port=args.http)


if __name__ == "__main__":
    main()
