"""`TaskSet`: the rows of a JSONL or Parquet file of tasks, split into train and held-out rows.

    tasks = TaskSet.load("tasks.jsonl")              # {"prompt": "...", "answer": "..."} per line
    row = tasks.row_for(seed)                        # the row an episode with this seed plays

Every row needs a prompt and an answer column (`prompt_key`, `answer_key`); other columns are
kept and reach the grader (a "module:fn" grader may read them). A row's optional `split` column
("train", or "heldout" / "test" / "eval") puts it on that side; the others are split by a stable
hash of their position in the file and `split_seed`: about `heldout_fraction` of them are held
out, the same ones on every machine and in every run (appending rows moves none of the old ones).

Seeds choose rows the way the trainer's seed ranges expect (envs/types.py): a seed below
HELDOUT_SEEDS draws a training row at random (`numpy.random.default_rng(seed)`); seeds
HELDOUT_SEEDS + 0, 1, 2, ... (evaluation's) enumerate the held-out rows in file order, wrapping
around; seeds from DEMO_SEEDS on (SFT demonstrations') draw training rows again.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from envs.types import DEMO_SEEDS, HELDOUT_SEEDS

TRAIN_SPLITS = frozenset({"train"})
HELDOUT_SPLITS = frozenset({"heldout", "test", "eval"})


@dataclass(frozen=True, slots=True)
class TaskSet:
    """Rows of a task file: `train` for training seeds, `heldout` for evaluation seeds."""

    train: tuple[dict[str, Any], ...]
    heldout: tuple[dict[str, Any], ...]
    source: str
    """The file the rows came from (what error messages name)."""

    @staticmethod
    def load(
        path: str | Path,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        heldout_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> TaskSet:
        """Read a .jsonl or .parquet file of tasks and split it (see the module docstring).

        `heldout_fraction=0` holds nothing out: evaluation then plays the training rows (in
        file order), which measures fit, not generalisation. With two rows or more and a
        fraction above 0, at least one row is held out and at least one trains.
        """
        return TaskSet.from_rows(
            read_rows(path),
            source=str(path),
            prompt_key=prompt_key,
            answer_key=answer_key,
            heldout_fraction=heldout_fraction,
            split_seed=split_seed,
        )

    @staticmethod
    def from_rows(
        rows: list[tuple[str, Any]],
        *,
        source: str,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        heldout_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> TaskSet:
        """As `load`, from (where, row) pairs already read ("line 3": what errors name)."""
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        if not rows:
            raise ValueError(f"{source}: no tasks in the file")
        for where, row in rows:
            check_row(source, where, row, (prompt_key, answer_key))
        held = _split([row for _, row in rows], heldout_fraction, split_seed)
        train = tuple(row for (_, row), out in zip(rows, held, strict=True) if not out)
        heldout = tuple(row for (_, row), out in zip(rows, held, strict=True) if out)
        if not train:
            raise ValueError(f"{source}: every row is held out (its split column); none trains")
        return TaskSet(train=train, heldout=heldout, source=source)

    def row_for(self, seed: int) -> dict[str, Any]:
        """The row an episode reset with `seed` plays (see the module docstring)."""
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if HELDOUT_SEEDS <= seed < DEMO_SEEDS:
            pool = self.eval_rows
            return pool[(seed - HELDOUT_SEEDS) % len(pool)]
        return self.train[int(np.random.default_rng(seed).integers(len(self.train)))]

    @property
    def eval_rows(self) -> tuple[dict[str, Any], ...]:
        """The rows evaluation's seeds enumerate: the held-out rows, else (none held out) the
        training rows. More evaluation seeds than these replay them."""
        return self.heldout or self.train

    def __len__(self) -> int:
        return len(self.train) + len(self.heldout)


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """(where, row) pairs of a .jsonl or .parquet file; `where` is "line N" or "row N"."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"{path}: a task file must be .jsonl or .parquet, not {suffix or '?'}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such task file")
    if suffix == ".jsonl":
        return _read_jsonl(path)
    return _read_parquet(path)


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if number == 1:  # a byte-order mark (Windows editors, PowerShell 5) is not JSON
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path} line {number}: not UTF-8 text ({exc.reason} at byte {exc.start} of "
                    f"the line); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
    return rows


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's own errors: a truncated or foreign file
        raise ValueError(f"{path}: cannot read as Parquet ({exc})") from None
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]


def check_row(source: str, where: str, row: Any, keys: tuple[str, str]) -> None:
    """Raise ValueError naming the file, the line or row, and the key at fault."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{source} {where}: a task must be a JSON object, got {type(row).__name__}"
        )
    prompt_key, answer_key = keys
    for key in keys:
        if row.get(key) is None:
            have = ", ".join(map(repr, row)) or "none"
            raise ValueError(f"{source} {where}: no {key!r} value (its keys: {have})")
    if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
        raise ValueError(f"{source} {where}: {prompt_key!r} must be a non-empty string")
    answer = row[answer_key]
    if isinstance(answer, list) and not answer:
        raise ValueError(f"{source} {where}: {answer_key!r} is an empty list")
    for ref in answer if isinstance(answer, list) else [answer]:
        if isinstance(ref, str) and not ref.strip(" \t\n."):  # exact: an empty reply would pass
            raise ValueError(f"{source} {where}: {answer_key!r} is blank ({ref!r})")
    split = row.get("split")
    if split is not None and split not in TRAIN_SPLITS | HELDOUT_SPLITS:
        raise ValueError(
            f"{source} {where}: split must be train, heldout, test or eval, got {split!r}"
        )


def _split(rows: list[dict[str, Any]], fraction: float, seed: int) -> list[bool]:
    """Whether each row is held out: its split column, else its position's hash vs `fraction`."""
    scores = [_unit_hash(i, seed) for i in range(len(rows))]
    fixed = [row.get("split") for row in rows]
    held = [
        (split in HELDOUT_SPLITS) if split is not None else score < fraction
        for split, score in zip(fixed, scores, strict=True)
    ]
    free = [i for i, split in enumerate(fixed) if split is None]
    if fraction > 0 and free:
        if len(rows) >= 2 and not any(held):  # one held out at least: the lowest-hash free row
            held[min(free, key=scores.__getitem__)] = True
        if all(held):  # one trains at least: the highest-hash free row
            held[max(free, key=scores.__getitem__)] = False
    return held


def _unit_hash(position: int, seed: int) -> float:
    """A number in [0, 1) from the row's position and the split seed, the same everywhere."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
