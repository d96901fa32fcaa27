"""Fault injection for agentrl's own tests (tests/chaos, the resume tests): each fault fires at
one fixed point when the run file's `testing.faults` section sets it (FaultsConfig in
rl/config/sections.py; refused outside pytest, announced by a warning at the start of the run)
and does nothing otherwise. The config travels to the actors with the rest of the run config.

    nan_loss: [2, 5, 6]          the learner's loss is NaN at these steps
    reward_raises: K             the reward raises for every episode of a task whose seed is a
                                 multiple of K, and for the first episode of every other group
    kill_worker: "I:G"           worker I (its first incarnation; `any`: the first to get there)
                                 is SIGKILLed after G groups, holding saved live episodes
    kill_worker_on_push: "I:V"   worker I (its first incarnation) is SIGKILLed when the push of
                                 version V reaches it
    poison_saved: true           with kill_worker: the killed worker's saved episodes are
                                 overwritten with garbage in Redis just before the kill (their
                                 restore fails: each ends as an env error)
    kill_learner_at: S           the learner is SIGKILLed when step S begins
    disk_full_at: S              the checkpoint of step S fails with ENOSPC halfway through the
                                 learner's tensor file
    slow_learner: "S:X"          learner step S sleeps X s after reading its batch
    slow_driver_s: X             async mode: the driver's bookkeeping of each step sleeps X s

Every function takes the FaultsConfig (None: no fault). A leaf module: it imports nothing of
agentrl's at run time.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.config.sections import FaultsConfig

POISON = b"\xc1 poisoned by testing.faults.poison_saved"
"""What poison_saved writes: 0xc1 is the one byte msgpack never uses, so decoding fails."""


def banner(faults: FaultsConfig) -> str | None:
    """The warning a run with faults prints at its start (None: no fault is set)."""
    active = faults.active()
    if not active:
        return None
    listed = ", ".join(f"{name}={value}" for name, value in active.items())
    return f"FAULT INJECTION IS ON (testing.faults, for agentrl's test suite only): {listed}"


def nan_loss(faults: FaultsConfig | None, step: int) -> bool:
    """True when the loss of learner step `step` (1-based: the version it will produce) must be
    NaN."""
    return faults is not None and step in faults.nan_loss


class RaisingReward:
    """A scorer that raises for chosen trajectories and defers to `scorer` for the rest."""

    def __init__(self, scorer, every: int) -> None:
        self.scorer, self.every = scorer, every

    def __call__(self, traj):
        seed = traj.task_id.rpartition("#")[2]
        if (seed.isdigit() and int(seed) % self.every == 0) or traj.traj_id.endswith("/0"):
            raise RuntimeError("injected reward failure (testing.faults.reward_raises)")
        return self.scorer(traj)


def reward(scorer, faults: FaultsConfig | None):
    """`scorer`, or a RaisingReward around it when testing.faults.reward_raises is set."""
    every = faults.reward_raises if faults is not None else None
    return RaisingReward(scorer, every) if every else scorer


def kill_worker(faults: FaultsConfig | None, index: int, starts: int) -> tuple[int, bool] | None:
    """(groups, any) when worker `index` (incarnation `starts`) may be the one killed
    mid-episode after `groups` groups (`any`: the first worker to get there; rl/run/serving.py
    picks it with a Redis SET NX), else None."""
    if faults is None or not faults.kill_worker or starts != 1:
        return None
    who, _, groups = faults.kill_worker.partition(":")
    if who not in (str(index), "any"):
        return None
    return int(groups or 1), who == "any"


def kill_on_push(faults: FaultsConfig | None, index: int, starts: int, version: int) -> None:
    """SIGKILL this worker process when the chosen push reaches the chosen worker."""
    chosen = faults.kill_worker_on_push if faults is not None else None
    if starts == 1 and chosen == f"{index}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def poison_saved(faults: FaultsConfig | None, client, keys: Iterable[str]) -> int:
    """When testing.faults.poison_saved is set, overwrite every saved episode in the Redis hashes
    `keys` (`RunKeys.episodes(group id)`, one per group: the groups of the worker about to be
    killed, its live snapshots and its finished episodes alike) with POISON, which no decoder
    reads: the worker that claims a task again ends each such episode as an env error. Returns
    how many were overwritten (0: the fault is off)."""
    if faults is None or not faults.poison_saved:
        return 0
    count = 0
    for key in keys:
        fields = client.hkeys(key)
        if fields:
            client.hset(key, mapping=dict.fromkeys(fields, POISON))
            count += len(fields)
    return count


def kill_learner(faults: FaultsConfig | None, step: int) -> None:
    """SIGKILL this learner process when step `step` (1-based) is the chosen one."""
    if faults is not None and faults.kill_learner_at == step:
        os.kill(os.getpid(), signal.SIGKILL)


def disk_full(faults: FaultsConfig | None, directory: Path, step: int, rank: int) -> None:
    """At the chosen step, cut this rank's freshly written tensor file in half and raise ENOSPC,
    as a disk that filled up during the write would."""
    if faults is None or faults.disk_full_at != step:
        return
    shards = sorted((Path(directory) / "learner").glob(f"shard-{rank + 1:05d}-*.safetensors"))
    path = shards[0]  # this rank's weights and optimizer state (rl/learner/state.py, DCP)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def slow_learner(faults: FaultsConfig | None, step: int) -> None:
    """At the chosen learner step (1-based), sleep its seconds (after the batch was read)."""
    if faults is None or faults.slow_learner is None:
        return
    chosen, seconds = faults.slow_learner.split(":")
    if int(chosen) == step:
        time.sleep(float(seconds))


def slow_driver(faults: FaultsConfig | None) -> None:
    """Sleep `slow_driver_s` in the async driver's bookkeeping of a step (0: no delay)."""
    if faults is not None and faults.slow_driver_s:
        time.sleep(faults.slow_driver_s)
