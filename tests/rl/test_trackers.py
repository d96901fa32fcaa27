"""W&B and MLflow through the metrics logger, against small fakes of the two third-party
packages injected into sys.modules (neither package is needed by the tests)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import pytest

from rl.cli import main
from rl.config.runfile import load_config
from rl.observe.metrics import MetricsLogger, eval_record
from rl.observe.trackers import open_trackers, tracker_metrics

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

        def finish(self):
            calls.append(("finish",))

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
