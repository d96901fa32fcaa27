"""The run-file shorthand `env: {dataset: FILE, grader: ...}` (rl/config/dataset.py): what it
expands to, what it refuses (naming the key), `agentrl check` on it, and the seed ranges the
trainer and the task-file env share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from envs.types import DEMO_SEEDS, HELDOUT_SEEDS
from rl.cli import main
from rl.config.errors import ConfigError
from rl.config.runfile import build_config

ROOT = Path(__file__).resolve().parents[2]
GRADER_MODULE = """
def close_enough(answer, row):
    return abs(float(answer) - row["answer"]) <= row.get("tolerance", 0)
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A current directory holding tasks.jsonl and a grader module, my_grader.py."""
    rows = [{"prompt": f"{i} + 1 = ?", "answer": i + 1, "tolerance": 0.5} for i in range(20)]
    (tmp_path / "tasks.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "my_grader.py").write_text(GRADER_MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def env_of(**env):
    return build_config({"env": env}).env


def test_dataset_expands_to_the_dataset_env(workdir):
    env = env_of(dataset="tasks.jsonl", grader="numeric", kwargs={"heldout_fraction": 0.25})
    path = str(workdir / "tasks.jsonl")
    assert env.id == "agentrl/Dataset-v0" and env.entry_point is None
    assert env.dataset == path  # absolute: Ray workers find it from any directory
    assert env.kwargs == {"heldout_fraction": 0.25, "path": path, "grader": "numeric"}
    assert env_of(dataset="tasks.jsonl").kwargs == {"path": path}  # grader: the env's default


def test_a_saved_config_loads_again(workdir):
    cfg = build_config({"env": {"dataset": "tasks.jsonl", "grader": "exact"}})
    saved = yaml.safe_load(yaml.safe_dump(cfg.model_dump(exclude={"testing"})))
    assert build_config(saved).env == cfg.env
    assert build_config({"env": {"id": "agentrl/Dataset-v0", "dataset": "tasks.jsonl"}}).env


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"dataset": "absent.jsonl"}, "env.dataset: no such file 'absent.jsonl' (looked for "),
        (  # configs/dataset.yaml checked from outside the repository root named no cause
            {"dataset": "data/absent.jsonl"},
            "absent.jsonl: a relative path is read from the current directory; run from the",
        ),
        ({"dataset": "my_grader.py"}, "env.dataset: must be a .jsonl or .parquet file"),
        ({"dataset": 3}, "env.dataset: expected a string, got 3 (int)"),
        (
            {"dataset": "tasks.jsonl", "id": "agentrl/Calculator-v0"},
            "env.id: env.dataset trains on agentrl/Dataset-v0, not 'agentrl/Calculator-v0'",
        ),
        (
            {"dataset": "tasks.jsonl", "entry_point": "acme.echo:EchoEnv"},
            "env.entry_point: env.dataset trains on agentrl/Dataset-v0; remove env.dataset or",
        ),
        ({"grader": "numeric"}, "env.grader: grades a task file's answers: set env.dataset too"),
        (
            {"dataset": "tasks.jsonl", "grader": "fuzzy"},
            'env.grader: must be exact, numeric, judge or "package.module:function"; got',
        ),
        (
            {"dataset": "tasks.jsonl", "kwargs": {"path": "other.jsonl"}},
            "env.kwargs.path: is 'other.jsonl' but env.dataset says",
        ),
        (
            {"dataset": "tasks.jsonl", "grader": "exact", "kwargs": {"grader": "numeric"}},
            "env.kwargs.grader: is 'numeric' but env.grader says 'exact'; set it once",
        ),
        (
            {"id": "agentrl/Dataset-v0"},
            "env.dataset: agentrl/Dataset-v0 needs a task file: env: {dataset: FILE}",
        ),
    ],
)
def test_mistakes_name_the_key(workdir, env, message):
    with pytest.raises(ConfigError) as caught:
        build_config({"env": env})
    assert message in str(caught.value)


def write_run_file(workdir: Path, env: dict) -> str:
    run = {"env": env, "sft": {"enabled": False}, "eval": {"tasks": 4}}
    (workdir / "run.yaml").write_text(yaml.safe_dump(run))
    return "run.yaml"


def test_agentrl_check_builds_the_env(workdir, capsys):
    good = {"dataset": "tasks.jsonl", "grader": "my_grader:close_enough"}
    assert main(["check", write_run_file(workdir, good)]) == 0
    assert "config ok" in capsys.readouterr().out
    bad = {"dataset": "tasks.jsonl", "grader": "my_grader:far_enough"}
    assert main(["check", write_run_file(workdir, bad)]) == 2
    err = capsys.readouterr().err
    assert "config error: env.grader: agentrl/Dataset-v0 refused grader=" in err
    assert "has no attribute 'far_enough'" in err
    typo = {"dataset": "tasks.jsonl", "kwargs": {"answer_key": "solution"}}
    assert main(["check", write_run_file(workdir, typo)]) == 2
    assert "config error: env.dataset: agentrl/Dataset-v0 refused" in capsys.readouterr().err
    judge = {"dataset": "tasks.jsonl", "grader": "judge", "kwargs": {"judge": {"url": "x"}}}
    assert main(["check", write_run_file(workdir, judge)]) == 2
    assert "env.kwargs.judge.url must be an http(s):// base URL" in capsys.readouterr().err


def test_the_example_run_file_checks(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["check", "configs/dataset.yaml"]) == 0, capsys.readouterr().err
    cfg = build_config(yaml.safe_load((ROOT / "configs/dataset.yaml").read_text()))
    assert cfg.env.kwargs["path"] == str(ROOT / "configs/data/sums.jsonl")
    import gymnasium

    env = gymnasium.make(cfg.env.id, **cfg.env.kwargs)
    assert cfg.eval.tasks == len(env.unwrapped.taskset.heldout)  # each held-out row once


def test_the_seed_ranges_are_shared():
    from rl.observe.evaluate import EVAL_SEED_OFFSET
    from rl.sft.warm_start import DEMO_SEED_OFFSET

    assert EVAL_SEED_OFFSET == HELDOUT_SEEDS
    assert DEMO_SEED_OFFSET == DEMO_SEEDS  # demonstrations never play held-out rows


def warnings_of(monkeypatch) -> list[str]:
    """The warnings rl/observe/evaluate.py gives from now on (an in-process `main` sets up the
    console, after which our loggers no longer propagate to caplog)."""
    said: list[str] = []
    monkeypatch.setattr("rl.observe.evaluate.logger.warning", said.append)
    return said


def test_evaluation_plays_each_held_out_row_once(workdir, monkeypatch):
    """Seeds past the held-out rows replay them (they wrap around), and each replay counted as
    another task: eval.tasks 50 on 5 held-out rows gave an interval as if 50 were evaluated.
    The run cuts eval.tasks, and a gate's tasks, to the rows, saying so."""
    from rl.run.evals import fit_evals

    gate = {"success": 0.5, "every": 2, "tasks": 8}
    stages = [{"name": "only", "steps": 4, "max_seq_len": 1024, "gate": gate}]
    cfg = build_config(
        {
            "env": {"dataset": "tasks.jsonl"},
            "eval": {"tasks": 50},
            "trainer": {"steps": 4},
            "curriculum": stages,
        }
    )
    said = warnings_of(monkeypatch)
    fitted = fit_evals(cfg)
    assert (fitted.eval.tasks, fitted.curriculum[0].gate.tasks) == (5, 5)  # 5 of 20 held out
    assert (cfg.eval.tasks, cfg.curriculum[0].gate.tasks) == (50, 8)  # the run file's, as saved
    eval_line, gate_line = said  # one line each; no warning about training rows
    assert eval_line.startswith("eval.tasks=50, but ") and "has 5 held-out rows" in eval_line
    assert gate_line.startswith("curriculum[0].gate.tasks=8, but ")
    few = build_config({"env": {"dataset": "tasks.jsonl"}, "eval": {"tasks": 4}})
    assert fit_evals(few).eval.tasks == 4


def test_a_file_that_holds_out_no_row_warns_that_eval_plays_training_rows(workdir, monkeypatch):
    """Every row `split: train` (or heldout_fraction 0): evaluation silently played training
    rows. Now a warning at start says so, and how to hold some out."""
    from rl.run.evals import fit_evals

    rows = [{"prompt": f"{i} + 2 = ?", "answer": i + 2, "split": "train"} for i in range(6)]
    (workdir / "train.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    said = warnings_of(monkeypatch)
    assert fit_evals(build_config({"env": {"dataset": "train.jsonl"}})).eval.tasks == 6
    warning, cut = said
    assert "train.jsonl holds out no row: evaluation plays training rows" in warning
    assert warning.endswith("give some rows split: heldout")  # their split column decides
    assert cut.startswith("eval.tasks=200, but ") and "has 6 training rows" in cut
    said.clear()
    env = {"dataset": "tasks.jsonl", "kwargs": {"heldout_fraction": 0.0}}
    assert fit_evals(build_config({"env": env, "eval": {"tasks": 4}})).eval.tasks == 4
    (warning,) = said
    assert "set env.kwargs.heldout_fraction above 0, or give some rows split" in warning
