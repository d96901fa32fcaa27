"""Chaos: rollout workers die (reliability.md A1, A10). Real local Ray and redis-server through
the CLI; each test prints its books and asserts 0 lost, none trained twice."""

from __future__ import annotations

import pytest

from tests.chaos.books import account, check_books
from tests.chaos.runs import CONFIG, metrics, overrides, run_dir_of, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_killed_worker_is_restarted_and_its_episodes_retried(tmp_path):
    """A worker is SIGKILLed mid-episode (the first to hold live episodes, saved first): Ray
    restarts it, its own pending tasks are reclaimed, episodes continue from their snapshots.
    The kill lands at step 1 whichever worker claims the tasks, so that the restart shows before
    the run ends on any machine (CI twice saw worker 0 claim nothing in the whole 8-step run
    while worker 1 took every task, so a kill aimed at worker 0 never fired)."""
    steps = 8
    proc = train(
        [
            CONFIG,
            *overrides(tmp_path, steps),
            "rollout.tool_timeout_s=30",
            "testing.faults.kill_worker=any:0",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    seen = [
        (r["step"], r.get("workers/restarted"), r.get("workers/restored_episodes")) for r in records
    ]
    print(f"[kill a rollout worker] (step, restarted, restored episodes): {seen}")
    assert max(r.get("workers/restarted", 0) for r in records) >= 1, (seen, proc.stdout[-4000:])
    assert sum(r.get("workers/restored_episodes", 0) for r in records) > 0, seen
    check_books(account(run_dir), steps, "kill a rollout worker")


def test_a_weight_push_to_a_killed_worker_reaches_its_restart(tmp_path):
    """Worker 1 is SIGKILLed when the push of version 2 reaches it: Ray restarts it and retries
    the push on the new incarnation (max_task_retries=-1), which has version 2 or newer by then
    (it fetches the latest from the weight board itself when it starts serving; the driver
    checks every worker reports at least the pushed version); its tasks are reclaimed; the run
    finishes."""
    steps = 5
    proc = train([CONFIG, *overrides(tmp_path, steps), "testing.faults.kill_worker_on_push='1:2'"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert max(r.get("workers/restarted", 0) for r in records) >= 1
    push = {r["step"]: r.get("weights/push_seconds") for r in records}
    print(f"[a weight push to a dead worker] push seconds by step: {push}")
    assert all(push[s] is not None for s in range(2, steps + 1))  # push s-1 settles in step s
    check_books(account(run_dir), steps, "a weight push to a dead worker")
