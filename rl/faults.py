"""Fault injection for the chaos suite (tests/chaos): each fault sits behind one environment
variable and does nothing without it. Ray actors inherit the driver's environment, so setting
the variable for `agentrl train` reaches every worker and the learner.

    AGENTRL_FAULT_NAN_LOSS=2,5,6          the learner's loss is NaN at these steps
    AGENTRL_FAULT_REWARD_RAISES=K         the reward raises for every episode of a task whose
                                          seed is a multiple of K, and for the first episode of
                                          every other group (async runs)
    AGENTRL_FAULT_KILL_WORKER_ON_PUSH=I:V worker I (its first incarnation) is SIGKILLed when the
                                          push of version V reaches it
    AGENTRL_FAULT_DISK_FULL_AT=S          the checkpoint of step S fails with ENOSPC halfway
                                          through the learner's tensor file

Two older ones live where they act: AGENTRL_FAULT_KILL_WORKER (rl/run/serving.py) and
AGENTRL_FAULT_KILL_LEARNER_AT (rl/run/actors.py).
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path


def _value(name: str) -> str:
    return os.environ.get(f"AGENTRL_FAULT_{name}", "")


def nan_loss(step: int) -> bool:
    """True when the loss of learner step `step` (1-based: the version it will produce) must be
    NaN."""
    return str(step) in _value("NAN_LOSS").split(",")


class RaisingReward:
    """A scorer that raises for chosen trajectories and defers to `scorer` for the rest."""

    def __init__(self, scorer, every: int) -> None:
        self.scorer, self.every = scorer, every

    def __call__(self, traj):
        seed = traj.task_id.rpartition("#")[2]
        if (seed.isdigit() and int(seed) % self.every == 0) or traj.traj_id.endswith("/0"):
            raise RuntimeError("injected reward failure (AGENTRL_FAULT_REWARD_RAISES)")
        return self.scorer(traj)


def reward(scorer):
    """`scorer`, or a RaisingReward around it when AGENTRL_FAULT_REWARD_RAISES is set."""
    every = _value("REWARD_RAISES")
    return RaisingReward(scorer, int(every)) if every else scorer


def kill_on_push(index: int, starts: int, version: int) -> None:
    """SIGKILL this worker process when the chosen push reaches the chosen worker."""
    if starts == 1 and _value("KILL_WORKER_ON_PUSH") == f"{index}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def disk_full(directory: Path, step: int, rank: int) -> None:
    """At the chosen step, cut this rank's freshly written tensor file in half and raise ENOSPC,
    as a disk that filled up during the write would."""
    if _value("DISK_FULL_AT") != str(step):
        return
    shards = sorted((Path(directory) / "learner").glob(f"shard-{rank + 1:05d}-*.safetensors"))
    path = shards[0]  # this rank's weights and optimizer state (rl/learner/state.py, DCP)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
