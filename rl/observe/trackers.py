"""Optional experiment trackers: Weights & Biases (`metrics.wandb: true`) and MLflow
(`metrics.mlflow: true`). Off by default and never needed by the tests; `agentrl check` and
`agentrl train` refuse a run file that turns one on when its package is not installed, and the
run starts them before SFT (`open_trackers`: one that cannot start is a ConfigError naming it).

rl/observe/metrics.py's MetricsLogger hands each record to every tracker after metrics.jsonl: the
numeric metrics of a training step under their own keys, an evaluation's as
`eval/<label>/<kind>/success`, `.../ci_low`, `.../ci_high` (`<label>`: sft, grpo, ...; `<kind>`:
sampled or greedy; rl.observe.metrics.eval_record), at the same step.

- W&B: project `WANDB_PROJECT` or the run's `name`; the W&B run's id and name are the run
  directory's name, so `--resume` continues it (W&B's steps only go forward: the steps a resume
  redoes are kept as first logged). The resolved config is the W&B config. Account, entity and
  offline mode are wandb's own settings (`wandb login`, `WANDB_ENTITY`, `WANDB_MODE=offline`).
- MLflow: experiment `MLFLOW_EXPERIMENT_NAME` or the run's `name`, on the tracking server of
  `MLFLOW_TRACKING_URI` (default: `./mlruns`); the MLflow run id is kept in
  `<run>/mlflow_run_id`, so `--resume` continues that run; the config is logged as params once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from rl.config.runfile import ConfigError, RunConfig

TRACKERS = ("wandb", "mlflow")


def enabled(cfg: RunConfig) -> list[str]:
    return [name for name in TRACKERS if getattr(cfg.metrics, name)]


def check_installed(cfg: RunConfig) -> None:
    """A ConfigError naming the pip install for a tracker that is on but not installed."""
    for name in enabled(cfg):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"metrics.{name}",
                f"is on but the {name} package is not installed: pip install {name} "
                f"(or set metrics.{name}=false)",
            )


TRACKER_ADVICE = {
    "wandb": "run `wandb login` (or set WANDB_API_KEY, or WANDB_MODE=offline)",
    "mlflow": "check MLFLOW_TRACKING_URI and that its server is up",
}


def open_trackers(cfg: RunConfig, run_dir: Path) -> list:
    """One started tracker per `metrics.<name>: true`. The run opens them before SFT, so a
    tracker that cannot start (no W&B login, an MLflow server down) fails the run at once: a
    ConfigError naming the key, the tracker's own message and the usual fix; the trackers
    already started are closed."""
    check_installed(cfg)
    kinds = {"wandb": WandbTracker, "mlflow": MlflowTracker}
    started: list = []
    for name in enabled(cfg):
        try:
            started.append(kinds[name](cfg, Path(run_dir)))
        except Exception as exc:
            close_all(started, failed=True)
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ConfigError(
                f"metrics.{name}",
                f"{name} did not start: {message}; {TRACKER_ADVICE[name]}, "
                f"or set metrics.{name}=false",
            ) from exc
    return started


@contextlib.contextmanager
def closed_on_error(trackers: list) -> Iterator[list]:
    """`trackers`, closed as failed if the block raises (the run's start before MetricsLogger
    owns them: SFT, the actors, a resume), so a run that fails early leaves no W&B or MLflow run
    open, nor one marked finished."""
    try:
        yield trackers
    except BaseException:
        close_all(trackers, failed=True)
        raise


def close_all(trackers: list, *, failed: bool) -> None:
    """Close every tracker (failed: marked so); one that raises does not keep the rest open."""
    for tracker in trackers:
        with contextlib.suppress(Exception):
            tracker.close(failed=failed)


def tracker_metrics(metrics: dict, phase: str) -> dict[str, float]:
    """The numeric metrics of one record, keyed for a tracker (see the module doc)."""
    numbers = {
        k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)
    }
    if phase == "train":
        return numbers
    return {k if k.startswith(f"{phase}/") else f"{phase}/{k}": v for k, v in numbers.items()}


class WandbTracker:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or cfg.name,
            id=run_dir.name,
            name=run_dir.name,
            resume="allow",
            dir=str(run_dir),
            config=cfg.model_dump(),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run: exit code 1 when the run failed (else W&B marks it finished)."""
        self.run.finish(exit_code=1 if failed else None)


class MlflowTracker:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.name)
        saved = run_dir / "mlflow_run_id"
        previous = saved.read_text().strip() if saved.exists() else None
        run = mlflow.start_run(run_id=previous, run_name=None if previous else run_dir.name)
        if previous is None:
            saved.write_text(run.info.run_id)
            params = flat_params(cfg.model_dump())
            names = sorted(params)
            for i in range(0, len(names), 100):  # MLflow takes at most 100 params per call
                mlflow.log_params({k: params[k] for k in names[i : i + 100]})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # MLflow keys take letters, digits, _ - . space : / only (e.g. not "tools/(invalid)")
        clean = {re.sub(r"[^\w\-. :/]", "_", k): v for k, v in metrics.items()}
        self.mlflow.log_metrics(clean, step=step)

    def close(self, failed: bool = False) -> None:
        """End the MLflow run as FAILED when the run failed, else FINISHED."""
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


def flat_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"trainer": {"lr": 0.1}} -> {"trainer.lr": "0.1"} (values cut to MLflow's 500 chars)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = str(value)[:500]
    return out
