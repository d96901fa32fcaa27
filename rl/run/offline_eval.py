"""`agentrl eval TARGET`: the held-out evaluation alone, in this process, without Ray or Redis.

TARGET is a run directory (the model: its final-model/, else its latest checkpoint, exported
to a temporary directory, else its sft-model/ or policy-init/) or a model directory (config.json
and weights; the env then comes from a run file). The evaluation is the run's (rl/run/evals.py):
the held-out seeds from EVAL_SEED_OFFSET, at the curriculum's longest stage, sampled at the
run's temperature with `samples` episodes per task and greedy, each with its 95% Wilson interval
clustered by task (rl/observe/evaluate.py), and per env for a mixture of envs (`env.mix`). One
rollout worker runs every episode, with the threads the run's workers had together (at most this
machine's cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from policy.sampling import SamplingParams
from rl.config.dataset import task_set
from rl.config.runfile import ConfigError, RunConfig
from rl.observe.console import PACKAGES
from rl.observe.evaluate import (
    EvalResult,
    eval_seeds,
    fit_tasks,
    held_out_eval,
    mixture_envs,
    warn_train_only,
)
from rl.run.build import build_worker, sampling
from rl.run.curriculum import staged
from rl.run.devices import local_gpus
from rl.run.export import checkpoint_steps, export_checkpoint, quiet_transformers

logger = logging.getLogger(__name__)
MODEL_FILES = ("config.json",)
"""What makes a directory a model directory (besides its weights)."""


@dataclass(frozen=True, slots=True)
class EvalModel:
    path: Path
    label: str
    """The name in the eval lines, as in the run's (`eval after GRPO`)."""
    source: str
    """Which model of the target this is, in words."""
    shown: Path | None = None
    """What to name as the model when `path` is a temporary export: its checkpoint."""

    @property
    def name(self) -> Path:
        return self.shown or self.path


@dataclass(slots=True)
class EvalReport:
    target: str
    model: EvalModel
    tasks: int
    results: dict[str, EvalResult] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The model evaluated, then one line per mode in the format of the run's eval lines."""
        return [f"model: {self.model.name} ({self.model.source})"] + [
            f"eval after {self.model.label}, {mode}: {result} on {self.tasks} held-out "
            f"tasks ({self.seconds[mode]:.0f} s){result.per_env_text()}"
            for mode, result in self.results.items()
        ]

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "model": str(self.model.name),
            "source": self.model.source,
            "label": self.model.label,
            "tasks": self.tasks,
            "results": {mode: r.to_dict() for mode, r in self.results.items()},
            "seconds": self.seconds,
        }


def run_file_of(target: Path, config: str | None) -> Path:
    """The run file whose env and eval settings apply: `--config`, else a run's config.yaml;
    a ConfigError for a model directory without `--config`, or a TARGET that is neither."""
    if not target.is_dir():
        why = "does not exist" if not target.exists() else "is a file"
        raise ConfigError("TARGET", f"{target} {why}; {TARGET_FIX}")
    if config is not None:
        return Path(config)
    if (target / "config.yaml").is_file():
        return target / "config.yaml"
    if _is_model_dir(target):
        raise ConfigError(
            "--config",
            f"{target} is a model directory, not a run: name the run file whose env and eval "
            "settings to use, e.g. --config configs/quickstart.yaml",
        )
    raise ConfigError("TARGET", f"{target} has neither config.yaml nor config.json; {TARGET_FIX}")


TARGET_FIX = "pass a run directory (runs/NAME) or a model directory (config.json and weights)"


def _is_model_dir(path: Path, *more: str) -> bool:
    return all((path / name).is_file() for name in (*MODEL_FILES, *more))


@contextlib.contextmanager
def eval_model(target: Path, cfg: RunConfig) -> Iterator[EvalModel]:
    """The model to evaluate (a checkpoint is exported into a temporary directory, removed
    afterwards)."""
    if not (target / "config.yaml").is_file() or _is_model_dir(target):
        yield EvalModel(target, target.name, "a model directory")
        return
    algo = cfg.trainer.algorithm.upper()
    if _is_model_dir(target / "final-model", "tokenizer_config.json"):  # (older runs: none)
        yield EvalModel(target / "final-model", algo, "the run's final-model/")
        return
    if checkpoint_steps(target):
        with tempfile.TemporaryDirectory(prefix="agentrl-eval-") as tmp:
            exported = export_checkpoint(target, None, Path(tmp) / "model")
            label, where = f"{algo} step {exported.step}", exported.checkpoint
            yield EvalModel(
                exported.path, label, "the run's latest checkpoint; no final-model/ yet", where
            )
        return
    for name, label in (("sft-model", "SFT"), ("policy-init", "INIT")):
        if _is_model_dir(target / name):
            yield EvalModel(target / name, label, f"the run's {name}/ (no RL checkpoint yet)")
            return
    raise ConfigError(
        "TARGET",
        f"{target} has no model yet (no final-model/, checkpoint, sft-model/ or policy-init/): "
        "evaluate it once its run has written one",
    )


def eval_config(cfg: RunConfig) -> RunConfig:
    """The run's config as the evaluation sees it: the curriculum's longest stage, the rollout
    device resolved for this machine, the run's rollout threads in one worker."""
    last = len(cfg.curriculum) - 1 if cfg.curriculum else None
    out = staged(cfg, last).model_copy(deep=True)
    gpus, device = local_gpus(), cfg.rollout.device
    if device == "cuda" and gpus == 0:
        raise ConfigError(
            "rollout.device",
            "cuda, but this machine has no CUDA GPU (torch.cuda.is_available() is False); "
            "set rollout.device: cpu or auto",
        )
    out.rollout.device = device if device != "auto" else ("cuda" if gpus else "cpu")
    out.rollout.resources.pop("GPU", None)  # one worker, no Ray: the GPU is its own
    threads = cfg.rollout.num_workers * cfg.rollout.threads_per_worker
    out.rollout.threads_per_worker = max(1, min(threads, os.cpu_count() or 1))
    return out


def evaluate_target(
    target: Path,
    cfg: RunConfig,
    *,
    tasks: int | None = None,
    samples: int | None = None,
    greedy: bool | None = None,
    json_output: bool = False,
) -> EvalReport:
    """`agentrl eval TARGET`: its model (eval_model) evaluated with the run file's `eval`
    settings where not given; with `json_output` every log and progress line goes to stderr,
    so that stdout holds the JSON alone."""
    e = cfg.eval
    key = "eval.tasks" if tasks is None else "--tasks"
    tasks = e.tasks if tasks is None else tasks
    samples = e.samples if samples is None else samples
    _check_counts(tasks, samples)  # before a checkpoint is exported for nothing
    quiet_transformers()
    quiet = _logs_to_stderr() if json_output else contextlib.nullcontext()
    with quiet, eval_model(target, cfg) as model:
        greedy = e.greedy if greedy is None else greedy
        return evaluate_model(
            cfg, model, tasks=tasks, samples=samples, greedy=greedy, target=str(target), key=key
        )


def _check_counts(tasks: int, samples: int) -> None:
    if tasks < 1:
        raise ConfigError(
            "--tasks", f"must be at least 1, got {tasks} (default: the run file's eval.tasks)"
        )
    if samples < 1:
        raise ConfigError("--samples", f"must be at least 1, got {samples}")


@contextlib.contextmanager
def _logs_to_stderr() -> Iterator[None]:
    """Our packages' console lines (rl/observe/console.py) and stray prints to stderr."""
    handlers = {
        h
        for name in PACKAGES
        for h in logging.getLogger(name).handlers
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout
    }
    for handler in handlers:
        handler.setStream(sys.stderr)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        for handler in handlers:
            handler.setStream(sys.stdout)


def evaluate_model(
    cfg: RunConfig,
    model: EvalModel,
    *,
    tasks: int,
    samples: int,
    greedy: bool,
    target: str = "",
    progress: Callable[[str], None] = logger.info,
    key: str = "eval.tasks",
) -> EvalReport:
    """Every mode of the held-out evaluation of `model`, with intervals (no metrics written);
    `tasks` at most the task file's distinct evaluation rows (`key`: the setting it came from)."""
    _check_counts(tasks, samples)
    cfg = eval_config(cfg)
    rows = task_set(cfg.env)
    warn_train_only(rows)
    tasks = fit_tasks(rows, tasks, key)
    progress(f"evaluating {model.name} ({model.source}) on {cfg.rollout.device}")
    worker = build_worker(cfg, model.path, None, "eval", 0)
    renderer = worker.renderer
    modes = {f"sampled (T={cfg.rollout.temperature:g}, {samples}/task)": (samples, False)}
    if greedy:
        modes["greedy"] = (1, True)
    report = EvalReport(target, model, tasks)
    try:
        for mode, (k, is_greedy) in modes.items():
            start = time.perf_counter()
            params = sampling(cfg.rollout, renderer, greedy=is_greedy)
            report.results[mode] = _run_mode(worker, cfg, mode, tasks, k, params, progress)
            report.seconds[mode] = time.perf_counter() - start
    finally:  # closes the worker's envs (their sandboxes, tool servers)
        worker.reconfigure(worker.limits, worker.env_factory)
    return report


def _run_mode(worker, cfg, mode: str, tasks: int, samples: int, params: SamplingParams, progress):
    """The seeds in chunks of about twice the live-episode limit, a progress line after each;
    per env for a mixture of envs, as in the run."""
    seeds = eval_seeds(tasks)
    size = max(1, 2 * cfg.rollout.max_episodes // samples)
    chunks = [seeds[i : i + size] for i in range(0, tasks, size)]

    def run(asked: list[list[int]]) -> list:
        answers, done, start = [], 0, time.perf_counter()
        for chunk in asked:
            answers.append(worker.evaluate(chunk, samples, params))
            done += len(chunk)
            progress(
                f"eval {mode}: {done * samples}/{tasks * samples} episodes "
                f"({time.perf_counter() - start:.0f} s)"
            )
        return answers

    return held_out_eval(mode, samples, chunks, run, env_of=mixture_envs(cfg))
