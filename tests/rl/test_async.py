"""Async training loses nothing and trains nothing twice, on real Redis and a real local Ray:
the whole job (driver, learner, workers, Redis) is SIGKILLed at a random moment while
unfinished episodes are saved, then resumed with --resume. The ledger is checked as in the
chaos suite (tests/chaos/books.py; the one-fault scenarios live in tests/chaos/):
produced = trained + filtered + failed + still buffered, 0 lost, every group id trained at most
once, and every issued task is produced or still in flight.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from rollout.codec import decode_episode
from rollout.keys import RunKeys
from tests.chaos.books import account, check_books
from tests.chaos.runs import (
    CONFIG,
    K3,
    metrics,
    overrides,
    replayed_everywhere,
    resume,
    run_dir_of,
    start,
    train,
)
from tests.rl.test_e2e import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def live_client(run_dir: Path) -> redis.Redis | None:
    conf = run_dir / "redis" / "redis.conf"
    if not conf.exists():
        return None
    settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if " " in line)
    return redis.Redis(port=int(settings["port"]), password=settings["requirepass"])


def unfinished_saved(client: redis.Redis) -> int:
    count = 0
    for key in client.keys(RunKeys("*").episodes("*")):  # every run's saved episodes
        for data in client.hgetall(key).values():
            count += not decode_episode(data)[1].get("final")
    return count


def kill_when_saved_mid_episode(proc: subprocess.Popen, tmp: Path, timeout: float = 300) -> Path:
    """SIGKILL the whole job at a random moment after the first checkpoint, while at least one
    unfinished episode is saved in Redis. Everyone but Redis is frozen (SIGSTOP) while Redis is
    read again, so the episode seen saved is still saved when the job dies (a worker could
    otherwise finish its group in between)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = list(tmp.glob("e2e-*"))
        if runs and (runs[0] / "checkpoints" / "latest").exists():
            client = live_client(runs[0])
            try:
                if client is not None and unfinished_saved(client):
                    time.sleep(random.uniform(0, 0.2))
                    if kill_if_still_saved(proc, client):
                        return runs[0]
            except redis.RedisError:
                pass
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("no unfinished episode was ever saved")


def kill_if_still_saved(proc: subprocess.Popen, client: redis.Redis) -> bool:
    everyone = descendants(proc.pid) | {proc.pid}
    frozen = {pid for pid in everyone if _comm(pid) != "redis-server"}
    _signal(frozen, signal.SIGSTOP)
    try:
        still = unfinished_saved(client)
    except redis.RedisError:
        still = 0
    if not still:
        _signal(frozen, signal.SIGCONT)
        return False
    _signal(everyone, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while alive(everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@pytest.mark.parametrize("policy", ["qwen3", "k3"])
def test_whole_job_sigkilled_then_resumed_loses_nothing(tmp_path, policy):
    """The whole job SIGKILLed while an episode is saved mid-way, then resumed: nothing is lost
    or trained twice. With the K3 policy (routing replay on) the routes recorded before the
    kill cross the stream, the save and the restore: every step trains every sampled token on
    its recorded route."""
    steps = 12
    extra = K3 if policy == "k3" else ()
    proc = start([CONFIG, *overrides(tmp_path, steps), *extra])
    run_dir = kill_when_saved_mid_episode(proc, tmp_path)
    assert not (run_dir / "final-model").exists()
    resumed = resume(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "will be trained (none is lost)" in resumed.stdout
    assert sum(r.get("workers/restored_episodes", 0) for r in metrics(run_dir)) > 0
    check_books(account(run_dir), steps, f"whole job SIGKILLed, resumed ({policy})")
    if policy == "k3":
        assert not replayed_everywhere(metrics(run_dir)), resumed.stdout[-3000:]


def test_the_learner_trains_the_next_step_while_the_driver_books_this_one(tmp_path):
    """No barrier between async steps: with the driver's bookkeeping of every step made 1 s
    longer (testing.faults.slow_driver_s), the learner starts step k + 1 before the driver has
    logged step k, unless step k saved a checkpoint (step 3 of checkpoint_every=3): then it
    starts after."""
    proc = train([CONFIG, *overrides(tmp_path, steps=5), "testing.faults.slow_driver_s=1.0"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = {r["step"]: r for r in metrics(run_dir_of(tmp_path))}
    assert sorted(records) == [1, 2, 3, 4, 5]
    ahead = {k: records[k]["time"] - records[k + 1]["learner/started_at"] for k in range(1, 5)}
    assert all(ahead[k] > 0.5 for k in (1, 2, 4)), ahead  # started during the 1 s of k
    assert ahead[3] < 0, ahead  # after the checkpoint of step 3 was logged
    assert all(records[k]["learner/between_steps_seconds"] >= 0 for k in range(2, 6))


def test_a_second_ctrl_c_leaves_a_stopping_run_at_once_and_resume_loses_nothing(tmp_path):
    """Ctrl-C while the learner is mid-step: the driver stops the step and waits for it, saying
    so ("Ctrl-C again: leave now"); a second Ctrl-C leaves within seconds, not after the step
    (testing.faults.slow_learner makes step 4 two minutes long), with no Ray or Redis process
    left; a resume from the step-2 checkpoint then trains every group once and loses none."""
    steps = 5
    proc = start([CONFIG, *overrides(tmp_path, steps), "checkpoint_every=2",
                  "testing.faults.slow_learner='4:120'"])  # fmt: skip
    seen = ""
    deadline = time.monotonic() + 300
    while "step   3/5" not in seen and proc.poll() is None and time.monotonic() < deadline:
        seen += proc.stdout.readline()  # step 3 is booked while step 4 trains ahead
    assert "step   3/5" in seen, seen[-3000:]
    started = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the driver's process group
    while "Ctrl-C again: leave now" not in seen and proc.poll() is None:
        seen += proc.stdout.readline()
    assert "stopping: waiting for learner step 4" in seen, seen[-3000:]
    second = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, (seen + rest)[-3000:]
    assert time.monotonic() - second < 60, "the second Ctrl-C waited for the step (120 s)"
    time.sleep(1)
    assert not alive(started), "processes outlived the second Ctrl-C"
    run_dir = run_dir_of(tmp_path)
    resumed = resume(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from step-000002" in resumed.stdout
    check_books(account(run_dir), steps, "a second Ctrl-C, resumed")
