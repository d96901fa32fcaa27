"""The messages a stopped run prints (rl/run/failures.py) and the Redis watchdog's limit, without a
run: the chaos runs check the same messages end to end."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest
import ray
import redis

from rl.run.failures import (
    RunAborted,
    check_env_errors,
    check_grader_errors,
    check_skipped,
    explain,
)
from rl.run.launch import RedisLost, RedisWatchdog, start_redis


def run_dir_with_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-000003")
    return tmp_path


def test_k_skipped_steps_in_a_row_stop_the_run(tmp_path):
    check_skipped(5, {"learner/nonfinite_in_a_row": 2.0}, 3, tmp_path)
    check_skipped(5, {"learner/nonfinite_in_a_row": 9.0}, 0, tmp_path)  # 0: never stop
    with pytest.raises(RunAborted, match=r"skipped 3 steps in a row \(steps 3 to 5\)"):
        check_skipped(5, {"learner/nonfinite_in_a_row": 3.0}, 3, tmp_path)


def test_env_errors_past_the_rate_stop_the_run(tmp_path):
    def step(errors: float, episodes: float) -> dict:
        rate = errors / episodes
        return {"rollout/env_errors": errors, "rollout/episodes": episodes,
                "rollout/env_error_rate": rate}  # fmt: skip

    check_env_errors(2, {}, 0.5, "a/B-v0", tmp_path)  # a step with no episodes (async)
    check_env_errors(2, step(8, 16), 0.5, "a/B-v0", tmp_path)  # at the limit: goes on
    check_env_errors(2, step(16, 16), 1.0, "a/B-v0", tmp_path)  # 1: never stop
    with pytest.raises(RunAborted, match=r"9 of 16 episodes of step 2 .* \(56% > rollout\.max_"):
        check_env_errors(2, step(9, 16), 0.5, "a/B-v0", tmp_path)


def test_grader_errors_past_the_rate_stop_the_run(tmp_path):
    def step(errors: float, episodes: float) -> dict:
        rate = errors / episodes
        return {"rollout/grader_errors": errors, "rollout/episodes": episodes,
                "rollout/grader_error_rate": rate}  # fmt: skip

    run_dir = run_dir_with_checkpoint(tmp_path)
    check_grader_errors(2, {}, 0.5, run_dir)  # a step with no episodes (async)
    check_grader_errors(2, step(8, 16), 0.5, run_dir)  # at the limit: goes on
    check_grader_errors(2, step(16, 16), 1.0, run_dir)  # 1: never stop
    with pytest.raises(
        RunAborted, match=r"16 of 16 episodes of step 2 ended in a grader error"
    ) as e:
        check_grader_errors(2, step(16, 16), 0.5, run_dir)
    assert "(100% > rollout.max_grader_error_rate=0.5)" in str(e.value)
    assert f"agentrl train --resume {run_dir}" in str(e.value)


def test_the_faults_we_know_get_one_message_naming_the_checkpoint(tmp_path):
    run_dir = run_dir_with_checkpoint(tmp_path)
    disk = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/r/learner-rank0.safetensors")
    wrapped = ray.exceptions.RayTaskError("save_checkpoint", "tb", disk).as_instanceof_cause()
    for exc, start in (
        (wrapped, "the disk is full (No space left on device: /r/learner-rank0.safetensors)"),
        (RedisLost("the run's redis-server died (killed by signal 9) after 3 restarts"), "the"),
        (redis.ConnectionError("Connection refused"), "lost the connection to Redis"),
    ):
        message = explain(exc, run_dir)
        assert message.startswith(start), message
        assert "step-000003" in message and f"agentrl train --resume {run_dir}" in message
    assert explain(ValueError("a bug"), run_dir) is None  # the CLI shows its traceback


@pytest.mark.slow
def test_the_watchdog_gives_up_after_its_restarts(tmp_path):
    server = start_redis(tmp_path / "redis")
    watchdog = RedisWatchdog(server, max_restarts=1)
    try:
        for kill in range(2):
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait()
            deadline = time.monotonic() + 30
            # the restart is done when the watchdog saw the new server answer
            while watchdog.failure is None and watchdog.completed <= kill:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert watchdog.restarts == 1
        assert (
            watchdog.failure == "the run's redis-server died (killed by signal 9) after 1 restart"
        )
    finally:
        watchdog.stop()
        server.stop()


def test_a_restart_that_fails_in_any_way_is_the_watchdogs_failure():
    """A redis-server that died and whose restart cannot even fork (ENOMEM, EMFILE: an OSError,
    not our LaunchError) is reported as lost, with the cause: the run stops with RedisLost and
    its resume hint instead of a generic connection error half a minute later."""

    class DeadServer:  # the watchdog's view of a RedisServer
        process = type("Exited", (), {"poll": staticmethod(lambda: -9)})()

        def restart(self):
            raise OSError(errno.EAGAIN, "fork failed")

    watchdog = RedisWatchdog(DeadServer())
    try:
        deadline = time.monotonic() + 10
        while watchdog.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watchdog.failure is not None, "the watchdog's thread died without a word"
        assert "did not restart" in watchdog.failure and "fork failed" in watchdog.failure
    finally:
        watchdog.stop()
