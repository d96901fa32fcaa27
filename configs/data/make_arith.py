"""Write configs/data/arith.jsonl: 300 arithmetic word problems with numeric answers, the same
every time (the example task file of configs/dataset.yaml and docs/environments.md).

    .venv/bin/python configs/data/make_arith.py      # from the repository root
"""

from __future__ import annotations

import json
from pathlib import Path

from envs.dataset import arithmetic_rows

ROWS = 300
OUT = Path(__file__).with_name("arith.jsonl")


def main() -> None:
    lines = [json.dumps(row) for row in arithmetic_rows(ROWS, seed=0)]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} tasks to {OUT}")


if __name__ == "__main__":
    main()
