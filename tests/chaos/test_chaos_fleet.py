"""Chaos: rollout workers killed from outside, after several weight pushes (reliability.md A1,
A10). Unlike testing.faults.kill_worker, nothing picks the moment: the test SIGKILLs the worker
processes (found by their Ray process title) once step 3 is in metrics.jsonl, wherever they
are (decoding, in a tool, paused by their token budget, installing a push), with no save made
for the occasion. Each run goes through the real CLI (real redis-server, real local Ray), prints
its figures and books, and asserts 0 lost, none trained twice.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.chaos.books import account, check_books
from tests.chaos.runs import (
    CONFIG,
    K3,
    TIMEOUT_S,
    actor_pids,
    command_line,
    last_step,
    metrics,
    overrides,
    replayed_everywhere,
    run_dir_of,
    start,
    train,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

KILL_AT = 3
"""The kill waits for this step in metrics.jsonl: the pushes of versions 1 and 2 have reached
the workers by then (a restart that came back with its first weights would be 2+ versions
behind, past trainer.max_staleness=1)."""
RESTORE = "rollout.tool_timeout_s=30"  # restores run under it: generous on 2 loaded cores


def sigkill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_workers_after_pushes(
    out: Path, steps: int, *extra: str, workers: int, kill: int, board: bool = False
) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """Start a `steps`-step async run with `workers` rollout workers (and the `extra`
    overrides); once step KILL_AT is logged, SIGKILL `kill` of the worker processes (and the
    run's weight board with `board`) back to back (the same instant, to the run), then let it
    finish. Returns the finished run, the last step logged at the kill, and the killed pids."""
    args = [CONFIG, *overrides(out, steps), f"rollout.num_workers={workers}", RESTORE, *extra]
    proc = start(args)
    try:
        wait_for(lambda: last_step(out) >= KILL_AT, proc, f"step {KILL_AT}")

        def hosts() -> list[int] | None:
            pids = actor_pids(proc.pid, "WorkerHost")
            return pids if len(pids) >= workers else None

        pids = wait_for(hosts, proc, f"{workers} WorkerHost processes")
        titles = {pid: command_line(pid) for pid in pids}
        assert len(pids) == workers, f"more WorkerHost processes than workers: {titles}"
        at, killed = last_step(out), pids[:kill]
        if board:
            (board_pid,) = actor_pids(proc.pid, "WeightBoard")
            titles[board_pid] = command_line(board_pid)
            killed.append(board_pid)
        sigkill(killed)
        if board:  # Ray restarts the board (max_restarts): a new process takes its name

            def new_board() -> list[int] | None:
                return [p for p in actor_pids(proc.pid, "WeightBoard") if p != board_pid] or None

            wait_for(new_board, proc, "a restarted weight board")
        try:
            stdout, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
            raise AssertionError(
                f"the run went on past {TIMEOUT_S} s after the kill:\n{stdout[-4000:]}"
            ) from None
    finally:
        if proc.poll() is None:  # a failed wait: leave nothing running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"killed {[titles[p] for p in killed]} (pids {killed}) after step {at}")
    assert at < steps, f"the kill came after the last step ({at})"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""), at, killed


def restarts(records: list[dict]) -> float:
    """Worker restarts so far: each worker reports its own count since the run started
    (rl/run/actors.py WorkerHost.drain), summed over the workers at each step."""
    return max(r.get("workers/restarted", 0) for r in records)


@pytest.mark.parametrize("policy", ["qwen3", "k3"])
def test_a_worker_killed_at_a_natural_moment_after_several_pushes(tmp_path, policy):
    """One of two workers is SIGKILLed from outside after step 3 (it holds version >= 2): Ray
    restarts it, its tasks are reclaimed and go on from their last snapshots (turn boundaries,
    token-budget pauses) or from the start, the run logs every step and ends well, and the
    books balance: an unplanned crash loses no group and trains none twice. With the K3 policy
    (routing replay on) every sampled token of every step trains on its recorded route."""
    steps = 8
    extra = K3 if policy == "k3" else ()
    proc, at, _ = kill_workers_after_pushes(tmp_path, steps, *extra, workers=2, kill=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    if policy == "k3":
        assert not replayed_everywhere(metrics(run_dir_of(tmp_path))), proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    seen = [
        (r["step"], r.get("workers/restarted"), r.get("workers/restored_episodes")) for r in records
    ]
    print(f"[a worker killed after step {at}] (step, restarted, restored episodes): {seen}")
    assert restarts(records) >= 1, (seen, proc.stdout[-4000:])
    check_books(account(run_dir), steps, "a worker killed after several pushes")


def test_the_only_worker_killed_after_several_pushes_catches_up_by_itself(tmp_path):
    """The run's only worker is SIGKILLed after step 3. Nothing else produces groups, so the
    learner waits and no push comes; Ray's restart builds the worker with its first weights
    (version 0), which the staleness gate (max_staleness=0: no batch is ever buffered ahead)
    keeps paused for ever. Unless the kill lands while a push is in flight (Ray retries it on
    the restart), the run can only end if the restarted worker fetches the latest weights
    itself (the weight board): it must, and the later steps train on its groups with a finite
    policy lag. (Without the board this run stalled until trainer.read_timeout_s.)"""
    steps = 8
    proc, at, _ = kill_workers_after_pushes(
        tmp_path, steps, "trainer.max_staleness=0", workers=1, kill=1
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    lags = {r["step"]: r.get("learner/policy_lag") for r in records if r["step"] > at}
    caught_up = sum(r.get("workers/caught_up", 0) for r in records)
    print(
        f"[the only worker killed after step {at}] restarted {restarts(records):.0f}, fetched "
        f"weights by itself {caught_up:.0f} time(s); policy lag of the later steps: {lags}"
    )
    assert restarts(records) >= 1, proc.stdout[-4000:]
    assert lags and all(v is not None and math.isfinite(v) for v in lags.values()), lags
    check_books(account(run_dir), steps, "the only worker killed, caught up by itself")


def test_a_worker_killed_after_several_pushes_with_the_broadcast_transport(tmp_path):
    """weights.transport=broadcast: a worker SIGKILLed after step 3 breaks the gloo group the
    pushes go through (a push in flight fails for every member). The restarted worker fetches
    the latest weights itself, the group is formed again, and every later step logs a
    successful push (weights/push_seconds); the run ends well and the books balance."""
    steps = 8
    proc, at, _ = kill_workers_after_pushes(
        tmp_path, steps, "weights.transport=broadcast", workers=2, kill=1
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    push = {r["step"]: r.get("weights/push_seconds") for r in records if r["step"] > at}
    missed = {
        r["step"]: r["weights/missed_pushes"] for r in records if "weights/missed_pushes" in r
    }
    regrouped = [r["step"] for r in records if r.get("weights/regrouped")]
    print(
        f"[broadcast, a worker killed after step {at}] push seconds of the later steps: {push}; "
        f"missed pushes by step: {missed}; group formed again at steps {regrouped}"
    )
    assert push and all(v is not None and math.isfinite(v) for v in push.values()), push
    # the driver's wait for a push the kill broke ends when the restart shows, not at
    # weights.push_timeout_s (120 s; 8 s measured): the wait alone, not the step it spans
    waits = {r["step"]: r.get("weights/settle_wait_seconds") for r in records if r["step"] > at}
    print(f"[broadcast] the driver's wait for each push: {waits}")
    assert max(waits.values()) < 90, waits
    assert restarts(records) >= 1, proc.stdout[-4000:]
    check_books(account(run_dir), steps, "broadcast, a worker killed after several pushes")


def test_the_weight_board_killed_with_a_worker(tmp_path):
    """The run's weight board (rl/run/fleet.py) and one of two workers are SIGKILLed in the
    same instant after step 3. The board is restarted empty and the learner posts to it again;
    a post or a fetch that meets it down is a warning, never the run's end (before, the
    learner's next post raised "a Ray actor died" and the run stopped: what CI saw when the
    board sat on a lost worker node). Every step is logged and the books balance."""
    steps = 7
    proc, at, killed = kill_workers_after_pushes(tmp_path, steps, workers=2, kill=1, board=True)
    assert len(killed) == 2
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    caught_up = sum(r.get("workers/caught_up", 0) for r in records)
    print(f"[the board and a worker killed after step {at}] caught up {caught_up:.0f} time(s)")
    assert restarts(records) >= 1, proc.stdout[-4000:]
    check_books(account(run_dir), steps, "the weight board killed with a worker")


@pytest.mark.parametrize("policy", ["qwen3", "k3"])
def test_all_workers_killed_at_once(tmp_path, policy):
    """Both workers are SIGKILLed in the same instant after step 3: no worker is left to take
    over the tasks, so the run rests on Ray restarting both (each catching up on the weights by
    itself) and on them reclaiming their own tasks. Both restarts show, every step is logged,
    and the books balance. With the K3 policy every sampled token trains on its recorded route."""
    steps = 8
    extra = K3 if policy == "k3" else ()
    proc, at, killed = kill_workers_after_pushes(tmp_path, steps, *extra, workers=2, kill=2)
    assert len(killed) == 2
    assert proc.returncode == 0, proc.stdout[-4000:]
    if policy == "k3":
        assert not replayed_everywhere(metrics(run_dir_of(tmp_path))), proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    seen = [(r["step"], r.get("workers/restarted"), r.get("workers/answering")) for r in records]
    print(f"[both workers killed after step {at}] (step, restarted, answering): {seen}")
    assert restarts(records) >= 2, (seen, proc.stdout[-4000:])
    check_books(account(run_dir), steps, "all workers killed at once")


def test_a_poisoned_saved_episode_ends_as_an_env_error(tmp_path):
    """testing.faults.kill_worker=any:0 with poison_saved: the first worker holding live
    episodes saves them, overwrites every saved episode of its groups in Redis with garbage,
    and is SIGKILLed. Whoever claims those tasks again cannot decode them: each such episode
    ends as an env error (workers/restore_failures), never the worker, and its group is still
    produced (trained on its other episodes, or failed when none is trainable), so the books
    balance. A poisoned group can be most of a step: rollout.max_env_error_rate=1."""
    steps = 6
    proc = train(
        [
            CONFIG,
            *overrides(tmp_path, steps),
            "rollout.num_workers=2",
            RESTORE,
            "rollout.max_env_error_rate=1",
            "testing.faults.kill_worker=any:0",
            "testing.faults.poison_saved=true",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    failures = sum(r.get("workers/restore_failures", 0) for r in records)
    restored = sum(r.get("workers/restored_episodes", 0) for r in records)
    env_errors = sum(r.get("rollout/env_errors", 0) for r in records)
    print(
        f"[poisoned saved episodes] restarted {restarts(records):.0f}, restore failures "
        f"{failures:.0f}, restored episodes {restored:.0f}, env errors {env_errors:.0f}"
    )
    assert restarts(records) >= 1, proc.stdout[-4000:]
    assert failures >= 1, proc.stdout[-4000:]
    check_books(account(run_dir), steps, "poisoned saved episodes")
