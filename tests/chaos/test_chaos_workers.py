"""Chaos: rollout workers die (reliability.md A1, A10). Real local Ray and redis-server through
the CLI; each test prints its books and asserts 0 lost, none trained twice."""

from __future__ import annotations

import pytest

from tests.chaos.books import account, check_books
from tests.chaos.runs import CONFIG, metrics, overrides, run_dir_of, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_killed_worker_is_restarted_and_its_episodes_retried(tmp_path):
    """Worker 0 is SIGKILLed mid-episode (after its 2nd group, holding saved unfinished
    episodes): Ray restarts it, its own pending tasks are reclaimed, episodes continue from
    their snapshots."""
    steps = 8
    proc = train(
        [CONFIG, *overrides(tmp_path, steps), "rollout.tool_timeout_s=30"],
        env={"AGENTRL_FAULT_KILL_WORKER": "0:2"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert max(r.get("workers/restarted", 0) for r in records) >= 1
    assert sum(r.get("workers/restored_episodes", 0) for r in records) > 0
    check_books(account(run_dir), steps, "kill a rollout worker")


def test_a_weight_push_to_a_killed_worker_reaches_its_restart(tmp_path):
    """Worker 1 is SIGKILLed when the push of version 2 reaches it: Ray restarts it and retries
    the push on the new incarnation (max_task_retries=-1), which installs version 2 (the driver
    checks every worker reports it); its tasks are reclaimed; the run finishes."""
    steps = 5
    proc = train(
        [CONFIG, *overrides(tmp_path, steps)], env={"AGENTRL_FAULT_KILL_WORKER_ON_PUSH": "1:2"}
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert max(r.get("workers/restarted", 0) for r in records) >= 1
    push = {r["step"]: r["weights/push_seconds"] for r in records}
    print(f"[a weight push to a dead worker] push seconds by step: {push}")
    check_books(account(run_dir), steps, "a weight push to a dead worker")
