"""Per-trajectory records of a run, `<run>/trajectories.jsonl`, for `agentrl show`.

The learner keeps the groups of its last step; after each step the driver asks it for up to
`metrics.trajectories` of them (whole groups, spread over the batch: a few KiB each, one Ray
call) and appends one line per trajectory:

    {"step": 12, "id": "12-3/5", "group": "12-3", "task": "agentrl/Calculator-v0#4821",
     "env": "agentrl/Calculator-v0", "fate": "trained", "status": "completed",
     "finish": "env terminated", "success": true, "reward": 1.0,
     "parts": {"task_completion": 1.0}, "advantage": 0.93, "turns": 2, "tool_calls": 1,
     "tool_errors": 0, "parse_errors": 0, "attempt": 1, "resumed": 0,
     "tokens": [...], "mask": [[0, 57], [1, 12], ...], "versions": [[-1, 57], [11, 12], ...]}

`fate` is the ledger's verdict on the group (`trained`, `filtered: flat`, `failed: no trainable
trajectory`); `advantage` is the group-relative advantage the loss used (null for PPO, whose
advantages come from its value head, and for untrainable trajectories); `mask` (1 = sampled by
the policy and trained on) and `versions` (the policy version that sampled each token, -1 where
none did) are run-length encoded as [value, count] pairs over `tokens`. On resume the file is
cut back to the checkpoint, like metrics.jsonl.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.types import Trajectory, TrajectoryGroup

FILE = "trajectories.jsonl"


def run_lengths(values: list[int]) -> list[list[int]]:
    """[value, count] pairs: [0, 0, 1] -> [[0, 2], [1, 1]]."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def expand(runs: list[list[int]]) -> list[int]:
    return [v for v, count in runs for _ in range(count)]


def spread(groups: list[TrajectoryGroup], limit: int) -> list[TrajectoryGroup]:
    """Whole groups, evenly spaced over the batch, until `limit` trajectories are covered."""
    if limit <= 0 or not groups:
        return []
    size = max(1, max(len(g.trajectories) for g in groups))
    want = min(len(groups), -(-limit // size))
    return [groups[i * len(groups) // want] for i in range(want)]


def fates(entry: dict) -> dict[str, str]:
    """Group id -> the ledger's verdict (rl/learner/ledger.py)."""
    out = {gid: "trained" for gid in entry.get("trained", [])}
    for kind in ("filtered", "failed"):
        for reason, ids in entry.get(kind, {}).items():
            out.update({gid: f"{kind}: {reason}" for gid in ids})
    return out


def records(
    groups: list[TrajectoryGroup], entry: dict, *, limit: int, advantages: str
) -> list[dict]:
    """Up to `limit` trajectories of a step's groups as records (without the step)."""
    from rl.learner.batch import (
        group_advantages,  # torch: only where records are built (the learner)
    )

    chosen = spread(groups, limit)
    verdict = fates(entry)
    out = []
    for group in chosen:
        adv, valid = group_advantages([group], advantages)
        for j, traj in enumerate(group.trajectories):
            a = float(adv[0, j]) if advantages != "none" and bool(valid[0, j]) else None
            out.append(record(traj, group, j, fate=verdict.get(group.group_id, ""), advantage=a))
    return out[: max(limit, 0)]


def record(
    traj: Trajectory, group: TrajectoryGroup, index: int, *, fate: str, advantage: float | None
) -> dict:
    return {
        "id": traj.traj_id or f"{group.group_id}/{index}",
        "group": group.group_id,
        "task": traj.task_id,
        "env": traj.task_id.rsplit("#", 1)[0],
        "fate": fate,
        "status": str(traj.status),
        "finish": traj.finish_detail,
        "success": traj.success,
        "reward": traj.reward,
        "parts": dict(traj.reward_parts),
        "advantage": advantage,
        "turns": traj.num_turns,
        "tool_calls": traj.num_tool_calls,
        "tool_errors": traj.num_tool_errors,
        "parse_errors": traj.num_parse_errors,
        "attempt": traj.attempt,
        "resumed": traj.resumed,
        "tokens": list(traj.token_ids),
        "mask": run_lengths(list(traj.loss_mask)),
        "versions": run_lengths(list(traj.token_versions)),
    }


def append(run_dir: Path, step: int, recs: list[dict]) -> None:
    if not recs:
        return
    with (Path(run_dir) / FILE).open("a") as f:
        f.writelines(json.dumps({"step": step, **r}) + "\n" for r in recs)


def truncate(run_dir: Path, step: int) -> int:
    """Drop records after `step` (their steps are redone after a resume); returns how many."""
    from rl.learner.checkpoint import truncate_jsonl

    return truncate_jsonl(Path(run_dir) / FILE, step)


def read(run_dir: Path) -> list[dict]:
    """The records ([] without a file); a torn last line is left out, any other bad line raises
    ValueError naming it (rl/learner/checkpoint.py read_jsonl)."""
    from rl.learner.checkpoint import read_jsonl

    return read_jsonl(Path(run_dir) / FILE)
