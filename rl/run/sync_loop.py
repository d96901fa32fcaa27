"""`trainer.mode: sync`: each step hands out B tasks, waits for their groups, trains on them
and pushes the new weights before the next step samples (bit-exactly reproducible)."""

from __future__ import annotations

import time

import ray
from tqdm import tqdm

from rl.config.runfile import RunConfig
from rl.observe.metrics import MetricsLogger, rollout_metrics
from rl.run.build import sampling
from rl.run.curriculum import describe, gate_due, stage_end, stage_ends, stage_index, staged
from rl.run.evals import gate_success, set_stage
from rl.run.interrupts import raise_if_interrupted
from rl.run.runstate import RunState, worker_seed
from rl.run.step import StepTail
from rollout.worker import Task


def sync_train(
    cfg: RunConfig, learner, workers, renderer, log: MetricsLogger, state: RunState, run_dir
) -> None:
    t, stage, ends = cfg.trainer, None, stage_ends(cfg)
    params = sampling(cfg.rollout, renderer)
    bar = tqdm(
        total=t.steps, initial=state.step, desc=t.algorithm.upper(), unit="step", dynamic_ncols=True
    )
    tail = StepTail(cfg, run_dir, learner, workers, renderer, log, state, bar)
    while state.step < t.steps:
        raise_if_interrupted()  # a Ctrl-C some library call swallowed (rl/run/interrupts.py)
        step, start = state.step + 1, time.perf_counter()
        if stage_index(cfg, step) != stage:  # a curriculum stage begins (or resumes)
            stage = stage_index(cfg, step)
            set_stage(cfg, workers, stage)
            params = sampling(staged(cfg, stage).rollout, renderer)
            bar.write(f"[agentrl] {describe(cfg, stage)}")
        tasks = [
            Task(seed=s, group_id=f"{step}-{i}")
            for i, s in enumerate(state.draw_tasks(t.tasks_per_step))
        ]
        chunks = [tasks[i :: len(workers)] for i in range(len(workers))]
        stats = ray.get(
            [
                w.collect.remote(c, t.group_size, params, worker_seed(cfg.seed, step, i))
                for i, (w, c) in enumerate(zip(workers, chunks, strict=True))
                if c
            ]
        )
        metrics = rollout_metrics(stats)
        metrics.update(ray.get(learner.step.remote()))
        metrics.update(tail.record(step))
        skip_to = _gate(cfg, workers, params, step, metrics, bar)
        metrics["step/seconds"] = time.perf_counter() - start
        if stage is not None:
            metrics["curriculum/stage"] = float(stage + 1)
        tail.finish(step, metrics, checkpoint=step in ends, stage=stage, skip_to=skip_to)
    bar.close()


def _gate(cfg: RunConfig, workers, params, step: int, metrics: dict, bar) -> int | None:
    """Run the stage's gate when due (rl/run/curriculum.py gate_due) -> the stage's last step
    number when it passes (the run jumps there), else None (the stage holds)."""
    if not gate_due(cfg, step):
        return None
    stage = stage_index(cfg, step)
    gate = cfg.curriculum[stage].gate
    success = gate_success(cfg, workers, params, stage)
    passed = success >= gate.success
    metrics.update({"curriculum/gate_success": success, "curriculum/gate_passed": float(passed)})
    verdict = "passes: the stage ends here" if passed else "holds the stage"
    bar.write(f"[agentrl] gate of stage {stage + 1}: {success:.0%} on {gate.tasks} held-out "
              f"tasks (needs {gate.success:.0%}) {verdict}")  # fmt: skip
    return stage_end(cfg, stage) if passed else None
