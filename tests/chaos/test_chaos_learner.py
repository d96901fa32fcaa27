"""Chaos: the learner's faults (reliability.md A6, B2, E6). Real local Ray and redis-server
through the CLI; each test prints its books and asserts 0 lost, none trained twice."""

from __future__ import annotations

import json

import pytest

from tests.chaos.books import account, check_books
from tests.chaos.runs import CONFIG, metrics, overrides, run_dir_of, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_a_nan_loss_is_skipped_and_k_in_a_row_stop_the_run(tmp_path):
    """NaN loss at step 2 (skipped, counted, the run goes on), then at steps 5, 6 and 7: the
    third in a row stops the run (trainer.max_skipped_steps=3) with a message naming them."""
    proc = train([CONFIG, *overrides(tmp_path, steps=8)], env={"AGENTRL_FAULT_NAN_LOSS": "2,5,6,7"})
    assert proc.returncode == 1, proc.stdout[-4000:]
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
