"""W&B and MLflow through the metrics logger, against small fakes of the two third-party
packages injected into sys.modules (neither package is needed by the tests)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from rl.cli import main
from rl.config.errors import ConfigError
from rl.config.runfile import load_config
from rl.observe.metrics import MetricsLogger, eval_record
from rl.observe.trackers import closed_on_error, open_trackers, tracker_metrics

QUICKSTART = "configs/quickstart.yaml"


def fake_module(name: str) -> types.ModuleType:
    """An empty module with a spec (libraries such as accelerate probe with find_spec)."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def fake_wandb(calls: list) -> types.ModuleType:
    """The slice of wandb's API the tracker uses: init() -> run with log() and finish()."""
    module = fake_module("wandb")

    class Run:
        def log(self, data, step=None):
            calls.append(("log", dict(data), step))

        def finish(self, exit_code=None):
            calls.append(("finish",) if exit_code is None else ("finish", exit_code))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module.init = init
    return module


def fake_mlflow(calls: list) -> types.ModuleType:
    module = fake_module("mlflow")
    run = types.SimpleNamespace(info=types.SimpleNamespace(run_id="abc123"))

    def record(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs))

    def start_run(**kwargs):
        calls.append(("start_run", kwargs))
        return run

    module.start_run = start_run
    for name in ("set_experiment", "log_params", "log_metrics", "end_run"):
        setattr(module, name, record(name))
    return module


EVAL_NUMBERS = {
    "eval/grpo/sampled/success": 0.9,
    "eval/grpo/sampled/ci_low": 0.8,
    "eval/grpo/sampled/ci_high": 0.95,
}


def log_two_records(tmp_path, cfg):
    log = MetricsLogger(
        tmp_path, client=None, stream="", tensorboard=False, trackers=open_trackers(cfg, tmp_path)
    )
    log.log(1, {"reward/mean": 0.5, "tools/(invalid)/calls": 2, "learner/kl": float("nan")})
    log.log(1, eval_record("grpo", "sampled (T=1, 4/task)", 0.9, 0.8, 0.95), phase="eval")
    log.close()


def test_wandb_gets_each_step_and_finishes(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    cfg = load_config(QUICKSTART, ["metrics.wandb=true"])
    log_two_records(tmp_path, cfg)
    (_, init), *rest = calls
    assert init["project"] == "quickstart" and init["id"] == tmp_path.name
    assert init["resume"] == "allow" and init["config"]["trainer"]["algorithm"] == "grpo"
    assert rest == [
        ("log", {"reward/mean": 0.5, "tools/(invalid)/calls": 2.0}, 1),  # NaN left out
        ("log", EVAL_NUMBERS, 1),
        ("finish",),
    ]


def test_mlflow_gets_each_step_and_ends_the_run(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp")
    cfg = load_config(QUICKSTART, ["metrics.mlflow=true"])
    log_two_records(tmp_path, cfg)
    names = [c[0] for c in calls]
    assert names[:2] == ["set_experiment", "start_run"] and calls[0][1] == ("exp",)
    assert calls[1][1] == {"run_id": None, "run_name": tmp_path.name}
    params = {k: v for c in calls if c[0] == "log_params" for k, v in c[1][0].items()}
    assert params["trainer.algorithm"] == "grpo" and params["env.kwargs.difficulty"] == "1"
    metrics = [(c[1][0], c[2]["step"]) for c in calls if c[0] == "log_metrics"]
    assert metrics == [
        ({"reward/mean": 0.5, "tools/_invalid_/calls": 2.0}, 1),
        (EVAL_NUMBERS, 1),
    ]
    assert names[-1] == "end_run" and (tmp_path / "mlflow_run_id").read_text() == "abc123"
    calls.clear()  # a resumed run continues the same MLflow run and logs no params again
    open_trackers(cfg, tmp_path)
    assert calls[1] == ("start_run", {"run_id": "abc123", "run_name": None})
    assert "log_params" not in [c[0] for c in calls]


def test_eval_keys_name_the_label_and_the_kind():
    records = [
        eval_record(label, mode, 0.5, 0.4, 0.6)
        for label in ("sft", "grpo")
        for mode in ("sampled (T=1, 4/task)", "greedy")
    ]
    keys = [k for r in records for k in tracker_metrics(r, "eval")]
    assert len(keys) == len(set(keys)) == 12
    assert "eval/sft/greedy/ci_low" in keys and "eval/grpo/sampled/success" in keys


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_fails_the_config_check(name, capsys, monkeypatch):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    assert main(["check", QUICKSTART]) == 0  # off by default
    capsys.readouterr()
    assert main(["check", QUICKSTART, f"metrics.{name}=true"]) == 2
    err = capsys.readouterr().err
    assert (
        f"metrics.{name}: is on but the {name} package is not installed: pip install {name}" in err
    )
    monkeypatch.setitem(sys.modules, name, fake_module(name))
    assert main(["check", QUICKSTART, f"metrics.{name}=true"]) == 0


def test_a_tracker_that_cannot_start_is_a_config_error_naming_its_key(tmp_path, monkeypatch):
    """wandb.init without a login raised from deep inside the run (a traceback); now one error
    names metrics.wandb, wandb's own first line and the fix. A tracker that had started before
    the one that failed is closed again."""
    calls: list = []
    wandb = fake_wandb(calls)

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=...)\nmore")

    wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with pytest.raises(ConfigError) as info:
        open_trackers(load_config(QUICKSTART, ["metrics.wandb=true"]), tmp_path)
    assert info.value.key == "metrics.wandb"
    assert info.value.message == (
        "wandb did not start: api_key not configured (no-tty). call wandb.login(key=...); "
        "run `wandb login` (or set WANDB_API_KEY, or WANDB_MODE=offline), "
        "or set metrics.wandb=false"
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    mlflow = fake_mlflow(calls)

    def start_run(**kwargs):
        raise ConnectionError("Max retries exceeded with url: /api/2.0/mlflow/runs/create")

    mlflow.start_run = start_run
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    both = load_config(QUICKSTART, ["metrics.wandb=true", "metrics.mlflow=true"])
    with pytest.raises(ConfigError, match=r"mlflow did not start: Max retries exceeded") as info:
        open_trackers(both, tmp_path)
    assert info.value.key == "metrics.mlflow" and "MLFLOW_TRACKING_URI" in info.value.message
    assert [c[0] for c in calls] == ["init", "set_experiment", "finish"]  # W&B's run closed


def test_the_run_opens_its_trackers_before_sft(tmp_path):
    """A W&B login failure surfaced only after SFT (minutes into the quickstart); now the run
    stops before the policy is even built."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "wandb.py").write_text(
        "def init(**kwargs):\n    raise RuntimeError('api_key not configured (no-tty)')\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", str(root / QUICKSTART), "metrics.wandb=true"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(fake)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "config error: metrics.wandb: wandb did not start: api_key not configured" in proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert not (run_dir / "policy-init").exists()  # stopped before the policy was built


def test_trackers_opened_before_a_start_that_fails_are_closed(tmp_path, monkeypatch):
    """The run opens its trackers before SFT; a start that fails after (SFT, the actors, a
    resume) closes them, where it left a W&B run open; a start that succeeds hands them on."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    cfg = load_config(QUICKSTART, ["metrics.wandb=true"])
    with (
        pytest.raises(RuntimeError, match="SFT failed"),
        closed_on_error(open_trackers(cfg, tmp_path)),
    ):
        raise RuntimeError("SFT failed")
    assert calls[1:] == [("finish", 1)]  # marked failed (finish() alone says it finished)
    calls.clear()
    with closed_on_error(open_trackers(cfg, tmp_path)) as trackers:
        pass
    assert [c[0] for c in calls] == ["init"] and len(trackers) == 1  # still open, for the run


def test_a_run_that_fails_after_its_start_marks_its_trackers_failed(tmp_path, monkeypatch):
    """The run's metrics logger closed its trackers only at a normal end: a crash or a Ctrl-C
    during training left the W&B and MLflow runs open (or marked finished by their exit hooks).
    As a context manager it closes them either way, marked failed after an error."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    monkeypatch.setitem(sys.modules, "mlflow", fake_mlflow(calls))
    cfg = load_config(QUICKSTART, ["metrics.wandb=true", "metrics.mlflow=true"])
    log = MetricsLogger(
        tmp_path, client=None, stream="", tensorboard=False, trackers=open_trackers(cfg, tmp_path)
    )
    with pytest.raises(KeyboardInterrupt), log:
        log.log(1, {"reward/mean": 0.5})
        raise KeyboardInterrupt
    assert ("finish", 1) in calls and ("end_run", (), {"status": "FAILED"}) in calls
    calls.clear()
    with MetricsLogger(
        tmp_path, client=None, stream="", tensorboard=False, trackers=open_trackers(cfg, tmp_path)
    ):
        pass
    assert ("finish",) in calls and ("end_run", (), {"status": "FINISHED"}) in calls
