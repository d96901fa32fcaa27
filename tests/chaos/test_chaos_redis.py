"""Chaos: the run's Redis is SIGKILLed during writes (reliability.md D1, D5). The embedded
server is started again from its AOF by the driver's watchdog (rl/run/launch.py) on the same port
and password; clients retry for about 30 s, so the run goes on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rl.run.launch import RedisWatchdog, connect, start_redis
from tests.chaos.books import account, check_books
from tests.chaos.runs import (
    CONFIG,
    metrics,
    overrides,
    process_named,
    run_dir_of,
    start,
    wait_for,
)

pytestmark = [pytest.mark.slow]


def test_acknowledged_writes_survive_a_sigkill_and_the_restart(tmp_path):
    """A writer XADDs in a loop through `connect`; the server is SIGKILLed under it and the
    watchdog restarts it from the AOF: every acknowledged entry is there, the writer never saw
    an error, and it kept writing after the restart."""
    server = start_redis(tmp_path / "redis")
    watchdog = RedisWatchdog(server)
    client, acked, stop = connect(server.url), [], threading.Event()

    def write() -> None:
        while not stop.is_set():
            acked.append(client.xadd("s", {"n": len(acked)}))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        while len(acked) < 200:
            time.sleep(0.01)
        before = len(acked)
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (watchdog.restarts < 1 or len(acked) < before + 200) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        writer.join(timeout=60)
        watchdog.stop()
    try:
        assert watchdog.restarts == 1 and watchdog.failure is None
        assert len(acked) >= before + 200  # it went on writing after the restart
        stored = {e for e, _ in server.client().xrange("s")}
        missing = [e for e in acked if e not in stored]
        print(
            f"[redis SIGKILL under writes] acknowledged {len(acked)}, stored {len(stored)}, "
            f"missing {len(missing)}, duplicates {len(stored) - len(acked)}"
        )
        assert not missing
    finally:
        server.stop()


@pytest.mark.distributed
def test_redis_sigkilled_during_a_run_is_restarted_from_its_aof(tmp_path):
    """redis-server is SIGKILLed right after the first checkpoint, while the workers write
    groups, snapshots and heartbeats: the driver restarts it from its AOF, every client
    reconnects, the run finishes its 8 steps, and the books balance."""
    steps = 8
    proc = start([CONFIG, *overrides(tmp_path, steps)])

    def redis_after_checkpoint():
        runs = list(tmp_path.glob("e2e-*"))
        if runs and (runs[0] / "checkpoints" / "latest").exists():
            return process_named(proc.pid, "redis-server")
        return None

    killed = wait_for(redis_after_checkpoint, proc, "the first checkpoint")
    os.kill(killed, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert "redis-server died (killed by signal 9); restarted from its AOF" in out, out[-4000:]
    run_dir = run_dir_of(tmp_path)
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, steps + 1))
    check_books(account(run_dir), steps, "SIGKILL Redis during writes, restart from its AOF")
