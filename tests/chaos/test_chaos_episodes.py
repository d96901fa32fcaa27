"""Chaos: faults inside episodes (reliability.md C2, E4): a tool that hangs forever, a reward
function that raises. Real local Ray and redis-server through the CLI; each test prints its
books and asserts 0 lost, none trained twice, and that the run went on to its last step."""

from __future__ import annotations

import json

import pytest

from tests.chaos.books import account, check_books
from tests.chaos.runs import CONFIG, metrics, overrides, run_dir_of, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def failed(run_dir, reason: str) -> int:
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return sum(len(line["failed"].get(reason, [])) for line in lines)


def test_a_tool_that_hangs_forever(tmp_path, stopping_policy):
    """tests/chaos/faulty_env.py: on a quarter of the tasks a tool never returns (the env's
    tool timeout, 1 s, makes it an error observation and the episode goes on); on another
    quarter the env step itself never returns (rollout.tool_timeout_s, 3 s, ends the episode
    as an env error: its group fails). Hung threads are never freed; the run finishes. The
    policy ends its turns after a few tokens (conftest.py), so env steps happen at all."""
    steps = 5
    proc = train(
        [
            CONFIG,
            *overrides(tmp_path, steps),
            f"policy.path={stopping_policy}",
            "env.id=chaos/HangingCalculator-v0",
            "env.entry_point=tests.chaos.faulty_env:HangingCalculator",
            "env.kwargs.tool_timeout_s=1",
            "rollout.tool_timeout_s=3",
            "rollout.max_env_error_rate=1",  # a quarter of the tasks err: never stop for that
        ]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    hung_calls = sum(r.get("tools/lookup/calls", 0) for r in records)
    assert hung_calls > 0
    assert all(r.get("tools/lookup/failure_rate", 1.0) == 1.0 for r in records)
    env_errors = sum(r.get("rollout/env_errors", 0) for r in records)
    assert env_errors > 0 and failed(run_dir, "no trainable trajectory") > 0
    print(
        f"[a tool that hangs forever] {hung_calls:.0f} lookup timeouts, {env_errors:.0f} env errors"
    )
    check_books(account(run_dir), steps, "a tool that hangs forever")


def test_a_reward_function_that_raises(tmp_path):
    """testing.faults.reward_raises=3: the reward raises for every episode of a task whose seed
    is a multiple of 3 (its group fails: nothing to train) and for the first episode of every
    other group (marked grader_error and excluded; the group trains on the other three)."""
    steps = 4
    # about half the episodes err, so a step can pass the default rate (0.5): never stop here
    over = ["testing.faults.reward_raises=3", "rollout.max_grader_error_rate=1"]
    proc = train([CONFIG, *overrides(tmp_path, steps), *over])
    assert proc.returncode == 0, proc.stdout[-4000:]
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    grader_errors = sum(r.get("rollout/grader_errors", 0) for r in records)
    assert grader_errors > 0
    books = account(run_dir)
    assert books["trained"] and failed(run_dir, "no trainable trajectory") > 0
    print(f"[a reward function that raises] {grader_errors:.0f} grader errors")
    check_books(books, steps, "a reward function that raises")


def test_a_reward_that_always_raises_stops_the_run_after_its_first_step(tmp_path):
    """testing.faults.reward_raises=1: every episode is a grader error, so nothing would ever
    train; step 1's rate (100%) passes rollout.max_grader_error_rate (0.5) and the run stops
    with one message naming the key, no traceback (before, it ran every step training nothing)."""
    proc = train([CONFIG, *overrides(tmp_path, 3), "testing.faults.reward_raises=1"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    out = proc.stdout
    assert "ended in a grader error (100% > rollout.max_grader_error_rate=0.5)" in out, out[-4000:]
    assert "Traceback" not in out
    records = metrics(run_dir_of(tmp_path))
    assert [r["step"] for r in records] == [1]
    assert records[0]["rollout/grader_error_rate"] == 1.0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_env_errors_past_the_limit_stop_the_run(tmp_path, mode):
    """tests/chaos/faulty_env.py BrokenResetCalculator: every training episode's reset raises.
    Each is an env error of its episode (the workers live on and log the error once; Ray
    forwards that line to the driver's output asynchronously, so it is not asserted); the first
    step's rate (100%) passes rollout.max_env_error_rate (0.5) and the run stops there
    with one message naming the key, no traceback. Async: the learner has started step 2
    before the driver reads the workers' counters (made slower by 1 s), and the failed groups
    are there to read at once: the stop must leave that step's groups pending, or write the
    ledger line of a step that acked them before it saw the stop (else the books lose them)."""
    proc = train(
        [
            CONFIG,
            *overrides(tmp_path, 4),
            f"trainer.mode={mode}",
            *(["rollout.token_budget=null"] if mode == "sync" else []),  # partial: async only
            *(["testing.faults.slow_driver_s=1"] if mode == "async" else []),
            "env.id=chaos/BrokenResetCalculator-v0",
            "env.entry_point=tests.chaos.faulty_env:BrokenResetCalculator",
        ]
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "episodes of step 1 ended in an env error (100% > rollout.max_env_error_rate=0.5)" in (
        proc.stdout
    ), proc.stdout[-4000:]
    assert "agentrl envs check chaos/BrokenResetCalculator-v0" in proc.stdout
    assert "Traceback" not in proc.stdout
    run_dir = run_dir_of(tmp_path)
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1]
    assert records[0]["rollout/env_error_rate"] == 1.0 and records[0]["rollout/env_errors"] > 0
    if mode == "async":  # (sync mode issues no task stream to account)
        books = account(run_dir)
        assert books["steps"] in ([1], [1, 2])  # step 2's line only if it acked before the stop
        check_books(books, len(books["steps"]), "env errors stop the async run")
