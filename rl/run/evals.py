"""Held-out evaluation during a run: seeds from the held-out range split over the rollout
workers, every mode (sampled at the training temperature, greedy) logged as a metrics record
with its 95% Wilson interval (rl/observe/evaluate.py) and printed."""

from __future__ import annotations

import logging
import time

import ray

from policy.sampling import SamplingParams
from rl.config.dataset import task_set
from rl.config.runfile import RunConfig
from rl.observe.evaluate import (
    EvalResult,
    eval_seeds,
    fit_tasks,
    held_out_eval,
    mixture_envs,
    warn_train_only,
)
from rl.observe.metrics import MetricsLogger, eval_record
from rl.run.build import sampling
from rl.run.curriculum import staged

logger = logging.getLogger(__name__)


def evaluate(
    workers,
    *,
    tasks: int,
    samples: int,
    sampling: SamplingParams,
    mode: str,
    env_of=None,
    skip: int = 0,
) -> EvalResult:
    """The held-out seeds split over the workers, evaluated at once; `env_of`: a mixture's
    seed -> env id (`mixture_envs`), for per-env results; `skip`: start after this many
    held-out seeds (a curriculum gate leaves the final evaluation's seeds alone)."""
    seeds = eval_seeds(skip + tasks)[skip:]
    chunks = [seeds[i :: len(workers)] for i in range(len(workers))]

    def run(asked: list[list[int]]) -> list:
        return ray.get(
            [w.evaluate.remote(c, samples, sampling) for w, c in zip(workers, asked, strict=False)]
        )

    return held_out_eval(mode, samples, chunks, run, env_of=env_of)


def fit_evals(cfg: RunConfig) -> RunConfig:
    """`cfg` with eval.tasks and each curriculum gate's tasks cut to the distinct rows of the
    task file they play (`fit_tasks`; the evaluation's at the longest stage, a gate's at its
    own), after a warning if that file holds no row out; `cfg` itself for any other env."""
    last = len(cfg.curriculum) - 1 if cfg.curriculum else None
    rows = task_set(staged(cfg, last).env)
    if rows is None:
        return cfg
    if cfg.eval.tasks or any(stage.gate for stage in cfg.curriculum):
        warn_train_only(rows)
    out = cfg.model_copy(deep=True)
    out.eval.tasks = fit_tasks(rows, cfg.eval.tasks, "eval.tasks")
    for i, stage in enumerate(out.curriculum):
        if stage.gate is not None:
            key, gate_rows = f"curriculum[{i}].gate.tasks", task_set(staged(cfg, i).env)
            stage.gate.tasks = fit_tasks(gate_rows, stage.gate.tasks, key)
    return out


def set_stage(cfg, workers, index: int | None) -> None:
    """Give every worker the limits and env settings of curriculum stage `index` (no-op without
    a curriculum)."""
    if index is not None:
        ray.get([w.set_stage.remote(staged(cfg, index)) for w in workers])


def run_evals(cfg, workers, renderer, log: MetricsLogger, *, step: int, label: str) -> dict:
    """Every evaluation mode of `cfg.eval` -> {mode: EvalResult}, each logged at `step`."""
    if cfg.eval.tasks == 0:
        return {}
    modes = {
        f"sampled (T={cfg.rollout.temperature:g}, {cfg.eval.samples}/task)": (
            cfg.eval.samples,
            sampling(cfg.rollout, renderer),
        )
    }
    if cfg.eval.greedy:
        modes["greedy"] = (1, sampling(cfg.rollout, renderer, greedy=True))
    out = {}
    for mode, (samples, params) in modes.items():
        start = time.perf_counter()
        result = evaluate(
            workers,
            tasks=cfg.eval.tasks,
            samples=samples,
            sampling=params,
            mode=mode,
            env_of=mixture_envs(cfg),
        )
        out[mode] = result
        record = eval_record(
            label, mode, result.success, result.ci_low, result.ci_high, result.per_env
        )
        log.log(step, record, phase="eval")
        logger.info(
            f"eval after {label.upper()}"
            + (f" step {step}" if step else "")
            + f", {mode}: {result} on {cfg.eval.tasks} held-out tasks "
            f"({time.perf_counter() - start:.0f} s){result.per_env_text()}"
        )
    return out


def gate_success(cfg, workers, params: SamplingParams, stage: int) -> float:
    """Held-out success of curriculum stage `stage`'s gate: `gate.tasks` tasks after the final
    evaluation's seeds, one sample each with the training `params`, at the stage's limits (the
    workers are at that stage already)."""
    gate = cfg.curriculum[stage].gate
    result = evaluate(
        workers, tasks=gate.tasks, samples=1, sampling=params, mode="gate", skip=cfg.eval.tasks
    )
    return result.success


def evals_at_longest(
    cfg, workers, renderer, log, *, step: int, label: str, stage: int | None = None
) -> dict:
    """run_evals at the curriculum's longest stage; then back to `stage` (the one training)."""
    last = len(cfg.curriculum) - 1 if cfg.curriculum else None
    set_stage(cfg, workers, last)
    out = run_evals(staged(cfg, last), workers, renderer, log, step=step, label=label)
    if stage is not None and stage != last:
        set_stage(cfg, workers, stage)
    return out
