"""Chaos: the learner's faults (reliability.md A6, B2, E6). Real local Ray and redis-server
through the CLI; each test prints its books and asserts 0 lost, none trained twice."""

from __future__ import annotations

import json

import pytest

from rl.learner.checkpoint import latest
from tests.chaos.books import account, check_books
from tests.chaos.runs import CONFIG, metrics, overrides, resume, run_dir_of, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_nan_loss_is_skipped_and_k_in_a_row_stop_the_run(tmp_path):
    """NaN loss at step 2 (skipped, counted, the run goes on), then at steps 5, 6 and 7: the
    third in a row stops the run (trainer.max_skipped_steps=3) with a message naming them."""
    # the slow driver gives a next step started early the time to train and ack its groups: the
    # async loop must start none after the step that stops the run (else 4 groups are lost)
    faults = ["testing.faults.nan_loss=[2,5,6,7]", "testing.faults.slow_driver_s=1"]
    proc = train([CONFIG, *overrides(tmp_path, steps=8), *faults])
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "FAULT INJECTION IS ON" in proc.stdout and "nan_loss=[2, 5, 6, 7]" in proc.stdout
    assert "skipped 3 steps in a row (steps 5 to 7)" in proc.stdout, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout
    run_dir = run_dir_of(tmp_path)
    records = {r["step"]: r for r in metrics(run_dir)}
    assert sorted(records) == list(range(1, 8))
    assert [records[s]["learner/skipped_steps"] for s in range(1, 8)] == [0, 1, 1, 1, 2, 3, 4]
    assert records[4]["learner/optimizer_steps"] == 1
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    for line in ledger:  # a skipped step trained nothing: its groups are failed, not trained
        nan = line["step"] in (2, 5, 6, 7)
        assert bool(line["trained"]) != nan
        assert len(line["failed"].get("non-finite gradient", [])) == 4 * nan
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000006"
    assert not (run_dir / "final-model").exists()
    check_books(account(run_dir), steps=7, scenario="NaN in the loss")


def test_a_sigkilled_learner_stops_the_run_and_resume_loses_nothing(tmp_path):
    """Only the learner actor's process is SIGKILLed (when step 5 begins; checkpoint at 3):
    the run stops at once with a message naming the learner; --resume trains steps 4 to 6."""
    steps = 6
    proc = train([CONFIG, *overrides(tmp_path, steps), "testing.faults.kill_learner_at=5"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "agentrl: the learner (process" in proc.stdout and "died" in proc.stdout
    assert "Traceback" not in proc.stdout
    run_dir = run_dir_of(tmp_path)
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-000003"
    assert f"agentrl train --resume {run_dir}" in proc.stdout
    resumed = resume(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from step-000003" in resumed.stdout
    assert "will be trained (none is lost)" in resumed.stdout
    assert "FAULT INJECTION" not in resumed.stdout  # faults are not in the run's config.yaml
    check_books(account(run_dir), steps, "SIGKILL the learner, resume")


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path):
    """The checkpoint of step 6 fails with ENOSPC halfway through the learner's tensor file:
    the run stops with a message saying so, step-000003 stays the latest and verifies, the
    half-written staging directory is never loaded, and --resume redoes steps 4 to 6."""
    steps = 6
    proc = train([CONFIG, *overrides(tmp_path, steps), "testing.faults.disk_full_at=6"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert "agentrl: the disk is full (No space left on device" in proc.stdout
    assert "Traceback" not in proc.stdout
    run_dir = run_dir_of(tmp_path)
    root = run_dir / "checkpoints"
    assert latest(root) == root / "step-000003"  # verified against its manifest
    assert (root / ".tmp-step-000006").is_dir() and not (root / "step-000006").exists()
    resumed = resume(run_dir)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from step-000003" in resumed.stdout
    assert latest(root) == root / "step-000006"
    check_books(account(run_dir), steps, "disk full during a checkpoint, resume")
