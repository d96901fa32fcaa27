"""Async training loses nothing and trains nothing twice, on real Redis and a real local Ray.

(a) the whole job (driver, learner, workers, Redis) is SIGKILLed at a random moment while
    unfinished episodes are saved, then resumed with --resume;
(b) one rollout worker process is SIGKILLed mid-episode: Ray restarts it, its tasks continue
    under a new attempt, the run finishes.
Each checks the ledger: produced = trained + filtered + failed + still buffered, 0 lost, every
group id trained at most once, and every issued task is produced or still in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from rl.launch import start_redis
from rollout.codec import decode_episode, decode_group
from tests.rl.test_e2e import ROOT, alive, descendants, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
CONFIG = str(ROOT / "configs/quickstart.yaml")


def overrides(out: Path, steps: int) -> list[str]:
    return [
        *tiny_overrides(out, steps=steps),
        "sft.enabled=false",
        "eval.tasks=0",
        "checkpoint_every=3",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "rollout.token_budget=40",  # workers pause and save mid-episode every version
    ]


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "train", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def live_client(run_dir: Path) -> redis.Redis | None:
    conf = run_dir / "redis" / "redis.conf"
    if not conf.exists():
        return None
    settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if " " in line)
    return redis.Redis(port=int(settings["port"]), password=settings["requirepass"])


def unfinished_saved(client: redis.Redis) -> int:
    count = 0
    for key in client.keys("agentrl:*:episodes:*"):
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


def account(run_dir: Path) -> dict:
    """Read the run's Redis (from its AOF) and ledger; return the books."""
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines() if x]
    trained = [g for line in lines for g in line["trained"]]
    filtered = [g for line in lines for ids in line["filtered"].values() for g in ids]
    failed = [g for line in lines for ids in line["failed"].values() for g in ids]
    server = start_redis(run_dir / "redis")
    try:
        c = server.client()
        prefix = next(k.decode() for k in c.keys("agentrl:*:produced")).rsplit(":", 1)[0]
        produced = {k.decode(): int(v) for k, v in c.hgetall(f"{prefix}:produced").items()}
        stream = f"{prefix}:trajectories"
        (learner,) = [g for g in c.xinfo_groups(stream) if g["name"] == b"learner"]
        last = learner["last-delivered-id"].decode()
        pending = c.xpending_range(stream, "learner", min="-", max="+", count=10**6)
        buffered_ids = {p["message_id"] for p in pending}
        buffered_ids |= {e for e, _ in c.xrange(stream, min=f"({last}", max="+")}
        buffered = [
            decode_group(f[b"group"]).group_id for _, f in c.xrange(stream) if _ in buffered_ids
        ]
        issued = int(c.get(f"{prefix}:issued"))
        tasks = f"{prefix}:tasks"
        held = {p["message_id"] for p in c.xpending_range(tasks, "workers", "-", "+", 10**6)}
        unread = _id(c.xinfo_groups(tasks)[0]["last-delivered-id"])
        in_flight = {
            f[b"group_id"].decode() for e, f in c.xrange(tasks) if e in held or _id(e) > unread
        }
    finally:
        server.stop()
    return {
        "produced": produced,
        "trained": trained,
        "filtered": filtered,
        "failed": failed,
        "buffered": buffered,
        "issued": issued,
        "in_flight": in_flight,
        "steps": [line["step"] for line in lines],
    }


def _id(entry: bytes) -> tuple[int, int]:
    ms, _, seq = entry.decode().partition("-")
    return int(ms), int(seq or 0)


def check_books(books: dict, steps: int) -> None:
    produced = sum(books["produced"].values())
    kept = len(books["trained"]) + len(books["filtered"]) + len(books["failed"])
    lost = produced - kept - len(books["buffered"])
    print(
        f"produced {produced} = trained {len(books['trained'])} + filtered "
        f"{len(books['filtered'])} + failed {len(books['failed'])} + buffered "
        f"{len(books['buffered'])}; lost {lost}; issued {books['issued']}, "
        f"in flight {len(books['in_flight'])}"
    )
    assert books["steps"] == list(range(1, steps + 1))
    assert not [g for g, n in Counter(books["trained"]).items() if n > 1]  # never twice
    assert lost == 0
    accounted = set(books["trained"]) | set(books["filtered"]) | set(books["failed"])
    assert set(books["produced"]) == accounted | set(books["buffered"])
    issued = {f"t{i}" for i in range(books["issued"])}
    assert issued == set(books["produced"]) | books["in_flight"]  # every task is somewhere


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x and json.loads(x)["phase"] == "train"]


def test_whole_job_sigkilled_then_resumed_loses_nothing(tmp_path):
    steps = 12
    proc = start([CONFIG, *overrides(tmp_path, steps)])
    run_dir = kill_when_saved_mid_episode(proc, tmp_path)
    assert not (run_dir / "final-model").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", "--resume", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "will be trained (none is lost)" in resumed.stdout
    assert sum(r.get("workers/restored_episodes", 0) for r in metrics(run_dir)) > 0
    check_books(account(run_dir), steps)


def test_a_killed_worker_is_restarted_and_its_episodes_retried(tmp_path):
    steps = 8
    proc = start(
        [CONFIG, *overrides(tmp_path, steps), "rollout.tool_timeout_s=30"],
        env={"AGENTRL_FAULT_KILL_WORKER": "0:2"},
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    (run_dir,) = tmp_path.glob("e2e-*")
    records = metrics(run_dir)
    assert max(r.get("workers/restarted", 0) for r in records) >= 1
    assert sum(r.get("workers/restored_episodes", 0) for r in records) > 0
    check_books(account(run_dir), steps)
