"""Held-out evaluation results, with 95% Wilson intervals at the effective sample size of the
task clustering (rl/observe/stats.py), per env for a mixture of envs. `held_out_eval` is the one
way to run an evaluation mode: rl/run/evals.py (the run's workers, through Ray) and
rl/run/offline_eval.py (`agentrl eval`, one worker in process) both go through it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from envs.mixture import MIX_ID, env_of_seed
from envs.taskset import TaskSet
from envs.types import HELDOUT_SEEDS
from rl.observe.stats import success_interval

logger = logging.getLogger(__name__)
EVAL_SEED_OFFSET = HELDOUT_SEEDS  # training seeds stay below this (envs/types.py)


@dataclass(frozen=True, slots=True)
class EvalResult:
    mode: str
    tasks: int
    samples: int
    success: float
    ci_low: float
    ci_high: float
    tool_calls: int = 0
    """Tool calls the policy attempted in the evaluation's episodes (unparsable ones too)."""
    bad_tool_calls: int = 0
    """Of those, calls that failed: unparsable, unknown tool, bad arguments, or the tool
    raised."""
    truncated: float = 0.0
    """Share of the episodes that ended truncated (out of turns, tokens or context)."""
    per_env: dict[str, list[float]] = field(default_factory=dict)
    """A mixture of envs (envs/mixture.py): [success, ci_low, ci_high] over each env's held-out
    tasks, by env id (empty for one env)."""

    @property
    def tool_call_ok(self) -> float:
        """Share of tool calls that ran without an error (1.0 when there were none)."""
        return 1.0 - self.bad_tool_calls / self.tool_calls if self.tool_calls else 1.0

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.success:6.1%} [{self.ci_low:.1%}, {self.ci_high:.1%}]"

    def per_env_text(self) -> str:
        """`; per env: <id> 80.0% [70.1%, 87.2%]; ...` for the eval line ("" for one env)."""
        parts = [f"{env} {s:.1%} [{lo:.1%}, {hi:.1%}]" for env, (s, lo, hi) in self.per_env.items()]
        return f"; per env: {'; '.join(parts)}" if parts else ""


def eval_seeds(tasks: int) -> list[int]:
    """The held-out seeds of an evaluation on `tasks` tasks (the same ones in every run)."""
    return [EVAL_SEED_OFFSET + i for i in range(tasks)]


def fit_tasks(rows: TaskSet | None, tasks: int, key: str) -> int:
    """`tasks`, or the task file's distinct evaluation rows (`rows.eval_rows`) when it has
    fewer: seeds past them replay the same rows, which would count as other tasks (an interval
    too narrow). A line says so, naming the setting `key`; `rows` None: any other env."""
    if rows is None or tasks <= len(rows.eval_rows):
        return tasks
    n, kind = len(rows.eval_rows), "held-out" if rows.heldout else "training"
    logger.warning(
        f"{key}={tasks}, but {rows.source} has {n} {kind} rows: evaluating on those {n}, each "
        "once (more would replay rows as if they were other tasks)"
    )
    return n


def warn_train_only(rows: TaskSet | None) -> None:
    """A warning when the task file holds no row out: evaluation then plays training rows."""
    if rows is None or rows.heldout:
        return
    fix = "give some rows split: heldout"
    if any(row.get("split") is None for row in rows.train):
        fix = f"set env.kwargs.heldout_fraction above 0, or {fix}"
    logger.warning(
        f"!!! {rows.source} holds out no row: evaluation plays training rows, which measures "
        f"fit, not generalisation; to hold some out, {fix}"
    )


def mixture_envs(cfg: Any) -> Callable[[int], str] | None:
    """seed -> env id for a run whose env is a mixture of envs (envs/mixture.py; `env.mix`),
    None for one env."""
    mix = cfg.env.kwargs.get("envs") if cfg.env.id == MIX_ID else None
    return None if mix is None else env_of_seed(mix)


def held_out_eval(
    mode: str,
    samples: int,
    chunks: Sequence[Sequence[int]],
    run: Callable[[list[list[int]]], list],
    *,
    env_of: Callable[[int], str] | None = None,
) -> EvalResult:
    """One evaluation mode over the held-out seeds `eval_seeds(tasks)`, split into `chunks` (in
    any split; empty chunks are dropped). `run(chunks)` evaluates them, `samples` episodes per
    seed, and returns one worker answer per chunk, in order (`RolloutWorker.evaluate`'s
    (per-task successes, counters)). With `env_of` (`mixture_envs`), also the result per env."""
    asked = [list(chunk) for chunk in chunks if chunk]
    answers = run(asked)
    if len(answers) != len(asked):
        raise ValueError(f"{len(answers)} evaluation answers for {len(asked)} chunks of seeds")
    seeds = [seed for chunk in asked for seed in chunk]
    return eval_result(mode, len(seeds), samples, answers, seeds=seeds, env_of=env_of)


def eval_result(
    mode: str,
    tasks: int,
    samples: int,
    answers: list,
    *,
    seeds: Sequence[int] = (),
    env_of: Callable[[int], str] | None = None,
) -> EvalResult:
    """One EvalResult from the workers' answers: (per-task successes, counters) each. With
    `env_of` (a mixture's seed -> env id) and the answers' `seeds` in order, also per env."""
    per_task = [task for chunk, _ in answers for task in chunk]
    by_env: dict[str, list] = {}
    if env_of is not None:
        for seed, task in zip(seeds, per_task, strict=True):
            by_env.setdefault(env_of(seed), []).append(task)
    counts = {k: sum(c[k] for _, c in answers) for k in answers[0][1]}
    mean, low, high = success_interval(per_task)
    return EvalResult(
        mode,
        tasks,
        samples,
        mean,
        low,
        high,
        tool_calls=counts["tool_calls"] + counts["parse_errors"],
        bad_tool_calls=counts["tool_errors"] + counts["parse_errors"],
        truncated=counts["truncated"] / max(counts["episodes"], 1),
        per_env={env: list(success_interval(t)) for env, t in sorted(by_env.items())},
    )
