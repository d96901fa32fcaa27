"""An example MCP server: a safe calculator, plus two tools for testing timeouts and errors.

    python configs/mcp/calc_server.py               # stdio (an MCP client starts it as a child)
    python configs/mcp/calc_server.py --http 8765   # streamable HTTP at http://127.0.0.1:8765/mcp

Tools: `calculate(expression)` (numbers, + - * / and parentheses; parsed with `ast`, never
`eval`), `slow(seconds)` (sleeps, then answers: for timeouts) and `fail()` (always raises: for
error results). Use it from an env with `envs.mcp.use_mcp` (see docs/environments.md, "MCP tools").
It needs the `mcp` package and agentrl (the calculator env's arithmetic, envs/calculator.py).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from envs.calculator import evaluate_expression, format_number
from envs.tools import ToolError as CalcError

server = MCPServer("calc", instructions="A calculator: call calculate with an expression.")


def evaluate(expression: str) -> str:
    """The calculator env's own arithmetic (envs/calculator.py: + - * / and parentheses, parsed
    with `ast`), its errors as MCP tool errors."""
    try:
        return format_number(evaluate_expression(expression))
    except CalcError as exc:
        raise ToolError(str(exc)) from None


@server.tool(description="Evaluate an arithmetic expression.")
def calculate(
    expression: Annotated[
        str, Field(description='Numbers with + - * / and parentheses, e.g. "(12 + 7) * 3".')
    ],
) -> str:
    return evaluate(expression)


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
