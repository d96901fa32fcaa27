"""What every RL step does once the learner has updated, in both modes (rl/run/sync_loop.py and
rl/run/async_loop.py show only what differs): the ledger and trajectory records, the weight
push, the collapse alarm, the metrics record, the stop checks, the checkpoint, the console line
and, every `eval.every` steps, a held-out evaluation."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from tqdm import tqdm

from rl.config.runfile import RunConfig
from rl.learner import ledger
from rl.observe import trajlog
from rl.observe.metrics import (
    CollapseDetector,
    MetricsLogger,
    console_line,
    push_metrics,
    redis_metrics,
)
from rl.run.evals import evals_at_longest
from rl.run.failures import check_env_errors, check_grader_errors, check_skipped
from rl.run.runstate import RunState, save_checkpoint
from rl.run.weights import push_weights
from rollout.keys import RunKeys


@dataclass
class StepTail:
    """The shared end of a step. `record` right after the learner's update (ledger lines,
    trajectories, push); `finish` once the loop has added what it alone measures."""

    cfg: RunConfig
    run_dir: Path
    learner: object
    workers: list
    renderer: object
    log: MetricsLogger
    state: RunState
    bar: tqdm
    on_checkpoint: Callable[[Path], object] | None = None
    """Called with each committed checkpoint's directory (async mode trims its books)."""
    detector: CollapseDetector = field(init=False)

    def __post_init__(self) -> None:
        m = self.cfg.metrics
        self.detector = CollapseDetector(window=m.collapse_window, drop=m.collapse_drop)

    def record(self, step: int) -> dict[str, float]:
        """Ledger and trajectory records of the step, then the weight push -> push metrics."""
        recs = []
        if self.cfg.metrics.trajectories:
            recs = ray.get(self.learner.trajectories.remote(self.cfg.metrics.trajectories))
        self.write_records(step, ray.get(self.learner.ledger.remote()), recs)
        w = self.cfg.weights
        push = push_weights(
            self.learner, self.workers, timeout_s=w.push_timeout_s, transport=w.transport
        )
        return push_metrics(push)

    def write_records(self, step: int, entry: dict, records: list[dict]) -> None:
        """The step's ledger line and trajectory records (async mode gets them with the step)."""
        ledger.append(self.run_dir, step, entry)
        if self.cfg.metrics.trajectories:
            trajlog.append(self.run_dir, step, records)

    def finish(
        self,
        step: int,
        metrics: dict,
        *,
        checkpoint: bool = False,
        stage: int | None = None,
        skip_to: int | None = None,
    ) -> None:
        """Log, check, evaluate and checkpoint step `step`; `checkpoint`: also save now (a
        curriculum stage ends); `stage`: the curriculum stage training (evaluations run at the
        longest one, then training goes on at this one); `skip_to`: a curriculum gate passed,
        the run continues after this step number (saved now, under that number)."""
        cfg, alarm = self.cfg, None
        if "rollout/success_rate" in metrics:
            alarm = self.detector.update(metrics["rollout/success_rate"])
        metrics["health/collapsed"] = float(self.detector.collapsed)
        trajectories = RunKeys(self.run_dir.name).trajectories
        metrics.update(redis_metrics(self.log.client, trajectories))
        self.log.log(step, metrics)
        check_skipped(step, metrics, cfg.trainer.max_skipped_steps, self.run_dir)
        check_env_errors(step, metrics, cfg.rollout.max_env_error_rate, cfg.env.id, self.run_dir)
        check_grader_errors(step, metrics, cfg.rollout.max_grader_error_rate, self.run_dir)
        self.state.step = skip_to or step
        self.bar.write(
            console_line(step, cfg.trainer.steps, metrics) + (f"\n!!! {alarm}" * bool(alarm))
        )
        if self._evaluates(step, self.state.step):
            self.evaluate(step, stage)
        if self._saves(step) or checkpoint or skip_to:
            path = save_checkpoint(
                self.run_dir, self.state, self.learner, keep_last=cfg.checkpoint.keep_last
            )
            if self.on_checkpoint is not None:
                self.on_checkpoint(path)
        if "rollout/success_rate" in metrics:
            self.bar.set_postfix(success=f"{metrics['rollout/success_rate']:.0%}")
        self.bar.update(self.state.step - step + 1)

    def pauses_after(self, step: int) -> bool:
        """Whether `finish(step)` will use the learner or the workers as they are after this
        step (a checkpoint or an evaluation), so the next step must not start before it."""
        return step >= self.cfg.trainer.steps or self._saves(step) or self._evaluates(step, step)

    def _saves(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return step == self.cfg.trainer.steps or bool(every and step % every == 0)

    def _evaluates(self, step: int, reached: int) -> bool:
        """An `eval.every` boundary crossed on the way from step - 1 to `reached` (a curriculum
        jump may skip one), before the run's last step."""
        evals = self.cfg.eval.every
        crossed = evals and reached // evals > (step - 1) // evals
        return bool(crossed) and reached < self.cfg.trainer.steps

    def evaluate(self, step: int, stage: int | None) -> None:
        """The held-out evaluation of `eval.every`, logged at `step` under the algorithm's
        label (the monitor and `agentrl plot` show them as a curve)."""
        start = time.perf_counter()
        label = self.cfg.trainer.algorithm
        evals_at_longest(
            self.cfg, self.workers, self.renderer, self.log, step=step, label=label, stage=stage
        )
        self.bar.write(f"[agentrl] evaluation at step {step}: {time.perf_counter() - start:.0f} s")
