"""Write configs/harness/tasks.jsonl: arithmetic word problems with their answer and the
expression the scripted expert types (the calculator env's generator; the same every time).

    .venv/bin/python configs/harness/make_tasks.py      # from the repository root
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from envs.calculator import make_problem

ROWS = 1000
OUT = Path(__file__).with_name("tasks.jsonl")


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(ROWS):
        p = make_problem(rng, 1)
        rows.append({"prompt": p.text, "answer": p.answer, "expression": p.expression})
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} tasks to {OUT}")


if __name__ == "__main__":
    main()
