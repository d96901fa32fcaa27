"""`trainer.mode: sync`: each step hands out B tasks, waits for their groups, trains on them
and pushes the new weights before the next step samples (bit-exactly reproducible)."""

from __future__ import annotations

import time

import ray
from tqdm import tqdm

from rl.config.runfile import RunConfig
from rl.observe.metrics import MetricsLogger, rollout_metrics
from rl.run.build import sampling
from rl.run.curriculum import describe, stage_ends, stage_index, staged
from rl.run.evals import set_stage
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
    for step in range(state.step + 1, t.steps + 1):
        start = time.perf_counter()
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
        metrics["step/seconds"] = time.perf_counter() - start
        if stage is not None:
            metrics["curriculum/stage"] = float(stage + 1)
        tail.finish(step, metrics, checkpoint=step in ends, stage=stage)
    bar.close()
