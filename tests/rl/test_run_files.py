"""What a resume and `agentrl show` read back from a run directory after a crash, how a
resumed run's before/after comparison and `train --strict` treat what they find, and a
`--resume` path given relative to the current directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.cli import strict_exit
from rl.config.runfile import load_config
from rl.learner.checkpoint import CheckpointError, read_jsonl, truncate_jsonl
from rl.observe.evaluate import EvalResult
from rl.run.runstate import truncate_metrics
from rl.run.train import report, rerun_final_eval

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, *lines: str) -> None:
    path.write_text("".join(f"{line}\n" for line in lines))


def test_a_torn_last_line_is_left_out_and_a_torn_middle_line_named(tmp_path):
    """A full disk or a SIGKILL can stop a run mid-line: before, the resume it told the user to
    run failed on that line with a traceback, and `agentrl show` could no longer read the run."""
    path = tmp_path / "trajectories.jsonl"
    write(path, '{"step": 1, "id": "a"}', '{"step": 2, "id": "b"}', '{"step": 3, "id"')
    assert [r["id"] for r in read_jsonl(path)] == ["a", "b"]
    assert truncate_jsonl(path, 1) == 2  # step 2 and the torn line went
    assert path.read_text() == '{"step": 1, "id": "a"}\n'
    assert not path.with_name(path.name + ".tmp").exists()  # written aside, then renamed
    write(path, '{"step": 1}', "{not json", '{"step": 2}')
    with pytest.raises(ValueError, match=r"trajectories.jsonl line 2 is not a JSON record"):
        read_jsonl(path)
    with pytest.raises(CheckpointError, match=r"cannot cut .* back to step 1"):
        truncate_jsonl(path, 1)
    assert path.read_text().count("\n") == 3  # left as it was
    assert read_jsonl(tmp_path / "missing.jsonl") == [] and truncate_jsonl(tmp_path / "x", 1) == 0


def test_a_resume_from_the_last_step_runs_its_final_evaluation_once_more_not_twice(tmp_path):
    """A run resumed from its last step's checkpoint (it had finished, or stopped during its
    final evaluation) evaluates again: before, the earlier final-evaluation records stayed and
    the new ones were appended, so the run showed two final evaluations at that step."""
    lines = (
        '{"step": 0, "phase": "eval", "eval/label": "sft"}',
        '{"step": 1, "phase": "train"}',
        '{"step": 1, "phase": "eval", "eval/label": "grpo"}',  # eval.every
        '{"step": 2, "phase": "train"}',
        '{"step": 2, "phase": "eval", "eval/label": "grpo", "eval/mode": "sampled"}',
        '{"step": 2, "phase": "eval", "eval/label": "grpo", "eval/mode": "greedy"}',
    )
    path = tmp_path / "metrics.jsonl"
    write(path, *lines)
    assert truncate_metrics(tmp_path, 2, final=2) == 2
    kept = [(r["step"], r["phase"]) for r in read_jsonl(path)]
    assert kept == [(0, "eval"), (1, "train"), (1, "eval"), (2, "train")]  # step 2 is not redone
    write(path, *lines)
    assert truncate_metrics(tmp_path, 1, final=2) == 3  # an earlier step: as before
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 1]
    write(path, *lines)
    assert truncate_metrics(tmp_path, 2) == 0  # without `final`, nothing at the step goes
    resumed = load_config(str(ROOT / "configs" / "quickstart.yaml"), ["trainer.steps=2"])
    assert rerun_final_eval(resumed) == 2
    no_eval = resumed.model_copy(update={"eval": resumed.eval.model_copy(update={"tasks": 0})})
    assert rerun_final_eval(no_eval) is None  # it would not run again: its records stay


def result(mode: str, success: float) -> EvalResult:
    return EvalResult(mode, 20, 80, success, success - 0.05, success + 0.05)


def test_a_resume_with_other_eval_settings_still_reports(tmp_path):
    """The warm start was evaluated with 4 samples a task; the resumed run's final evaluation
    with 8 (`--resume DIR eval.samples=8`): before, report() raised KeyError after training."""
    evals = {
        "sft": {"sampled (T=1, 4/task)": result("sampled (T=1, 4/task)", 0.30)},
        "grpo": {"sampled (T=1, 8/task)": result("sampled (T=1, 8/task)", 0.60)},
    }
    summary = report(evals, "sft", "grpo", tmp_path)
    assert summary["rl_beats_base_beyond_intervals"] is True
    assert json.loads((tmp_path / "summary.json").read_text())["rl_beats_base_beyond_intervals"]


def test_strict_fails_when_nothing_was_compared():
    assert strict_exit({"rl_beats_base_beyond_intervals": True}) == 0
    assert strict_exit({"rl_beats_base_beyond_intervals": False}) == 3
    assert strict_exit({}) == 3  # eval.tasks 0: before, --strict passed


def test_resume_dot_names_the_run_directory(tmp_path):
    """`cd runs/RUN; agentrl train --resume .`: the run id is the directory's name (before: '',
    and an async resume would have read another run's Redis keys)."""
    run = tmp_path / "q-20261207-000000"
    run.mkdir()
    (run / "config.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", "--resume", "."],
        cwd=run, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"no checkpoint in {run}/checkpoints" in proc.stderr, proc.stderr
