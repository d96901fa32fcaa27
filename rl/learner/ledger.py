"""Exactly-once bookkeeping: which trajectory groups a learner step trained, filtered or failed.

Every group that reaches the learner ends in exactly one ledger entry:

    trained    packed into an optimizer step
    filtered   {"duplicate": a group id already in the ledger (a retried task whose first
               attempt also arrived), "flat": DAPO's filter, all rewards equal}
    failed     {"no trainable trajectory": every episode ended in an env or grader error,
               "non-finite gradient": every optimizer step of its batch had a NaN/Inf gradient
               and was skipped (the weights did not change), "undecodable": its stream entry
               could not be decoded and went to the dead letters (rollout/stream.py)}

Every id with an entry joins the learner's trained set (`Learner.trained`, a
rl/learner/group_ids.py GroupIds: a watermark plus a sparse set per id family), which is saved
in every checkpoint, so a redelivered copy is never trained again.

The driver appends one line per step to `<run>/ledger.jsonl` (cut back to the checkpoint on
resume, like metrics.jsonl), so produced = trained + filtered + failed + still buffered can be
checked against the `produced` counts the workers write atomically with each group.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl.learner.batch import drop_flat_groups
from rl.learner.checkpoint import truncate_jsonl
from rollout.types import TrajectoryGroup


def new_entry() -> dict:
    return {"trained": [], "filtered": {}, "failed": {}}


def note(entry: dict, kind: str, reason: str, group_id: str) -> None:
    entry[kind].setdefault(reason, []).append(group_id)


def group_ids(entry: dict) -> list[str]:
    """Every group id the entry settles: trained, filtered or failed."""
    return [
        *entry["trained"],
        *(g for ids in entry["filtered"].values() for g in ids),
        *(g for ids in entry["failed"].values() for g in ids),
    ]


def sort_groups(
    groups: list[TrajectoryGroup], *, drop_flat: bool, entry: dict
) -> list[TrajectoryGroup]:
    """The groups to train on; the rest are noted in `entry` with their reason."""
    live = []
    for group in groups:
        if any(t.trainable for t in group.trajectories):
            live.append(group)
        else:
            note(entry, "failed", "no trainable trajectory", group.group_id)
    if drop_flat:
        kept, _ = drop_flat_groups(live)
        kept_ids = {g.group_id for g in kept}
        for group in live:
            if group.group_id not in kept_ids:
                note(entry, "filtered", "flat", group.group_id)
        live = kept
    entry["trained"] = [g.group_id for g in live]
    return live


def append(run_dir: Path, step: int, entry: dict) -> None:
    with (run_dir / "ledger.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, **entry}) + "\n")


def truncate(run_dir: Path, step: int) -> int:
    """Drop lines after `step` (their steps are redone after a resume); returns how many."""
    return truncate_jsonl(run_dir / "ledger.jsonl", step)


def read(run_dir: Path) -> list[dict]:
    """The ledger's lines ([] without a file; a torn last line left out)."""
    from rl.learner.checkpoint import read_jsonl

    return read_jsonl(Path(run_dir) / "ledger.jsonl")
