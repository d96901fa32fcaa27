"""Write configs/data/sums.jsonl: every "What is a + b?" for a, b in 0..24 with its answer (625
rows, the same every time): the task file of configs/dataset.yaml. A held-out row is a sum the
policy never trained on, so held-out success measures addition, not recall.

    .venv/bin/python configs/data/make_sums.py      # from the repository root
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("sums.jsonl")


def main() -> None:
    rows = [
        {"prompt": f"What is {a} + {b}?", "answer": a + b} for a in range(25) for b in range(25)
    ]
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} tasks to {OUT}")


if __name__ == "__main__":
    main()
