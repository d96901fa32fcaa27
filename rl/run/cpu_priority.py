"""The async workers yield the CPU to the learner (`rollout.cpu_priority`).

In async mode the learner's step is the run's critical path: the workers only have to keep a
batch ahead of it. Where the two share CPUs (every CPU run on one machine), the OS scheduler
gives three runnable processes on two cores two thirds of a core each, so the learner's step
grows by a third while the workers run ahead into the staleness bound. A worker's serve thread
at SCHED_IDLE runs only on cycles nothing else wants: the learner keeps a whole core and the
workers take what it leaves (docs/benchmarks.md, "Async vs sync"). Linux applies a scheduling
class per thread, and threads inherit their creator's, so the serve thread's agent loop and
the tool threads it starts follow it; Ray's own threads (pushes, counters) keep theirs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def wants_idle(setting: str, mode: str, device: str) -> bool:
    """Whether a run's workers serve at idle priority: async only; `auto` when they decode on
    the CPU (`device`: rollout.device resolved)."""
    if mode != "async" or setting == "normal":
        return False
    return setting == "idle" or device == "cpu"


def idle_supported() -> bool:
    return hasattr(os, "SCHED_IDLE") and hasattr(os, "sched_setscheduler")


@contextmanager
def idle_thread(on: bool) -> Iterator[bool]:
    """The calling thread (and the threads it starts) at SCHED_IDLE while inside -> whether it
    is; back to its own class after (allowed to an unprivileged thread whose nice value its
    RLIMIT_NICE permits; a refusal is logged, never raised)."""
    if not (on and idle_supported()):
        yield False
        return
    before = os.sched_getscheduler(0)  # pid 0: the calling thread, on Linux
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield True
    finally:
        try:
            os.sched_setscheduler(0, before, os.sched_param(0))
        except OSError as err:
            logger.warning(f"the serve thread stays at idle CPU priority ({err})")
