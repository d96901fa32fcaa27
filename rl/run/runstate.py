"""The driver's part of a run's state, and checkpoints of the whole run.

A run checkpoint is the learner's state (weights, optimizer, RNG, counters, the last acked stream
entry) plus the driver's (`driver.json`: step, task sampler state, where the policy started, the
warm-start evaluation), committed atomically by `rl/learner/checkpoint.py`. Rollouts need no saved
state: each step's sampling seeds are a function of (run seed, step, worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

from rl.learner import checkpoint as ckpt
from rl.learner.checkpoint import truncate_jsonl
from rl.observe.evaluate import EVAL_SEED_OFFSET


@dataclass(slots=True)
class RunState:
    step: int
    model_dir: str
    base_label: str
    sampler: np.random.Generator
    base_evals: dict = field(default_factory=dict)
    """The warm-start evaluation (mode -> EvalResult fields), for the final report."""

    @staticmethod
    def start(seed: int, model_dir: Path, base_label: str) -> RunState:
        return RunState(0, str(model_dir), base_label, np.random.default_rng(seed))

    def draw_tasks(self, n: int) -> list[int]:
        """Training task seeds (below the evaluation range, so evaluation stays held out)."""
        return self.sampler.integers(0, EVAL_SEED_OFFSET, size=n).tolist()

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "model_dir": self.model_dir,
            "base_label": self.base_label,
            "sampler": self.sampler.bit_generator.state,
            "base_evals": self.base_evals,
        }

    @staticmethod
    def from_json(data: dict, *, rng: bool = True) -> RunState:
        sampler = np.random.default_rng(0)
        if rng:
            sampler.bit_generator.state = data["sampler"]
        return RunState(
            data["step"], data["model_dir"], data["base_label"], sampler, data["base_evals"]
        )


def worker_seed(run_seed: int, step: int, worker: int) -> int:
    return (run_seed * 1_000_003 + step * 1_009 + worker) % (1 << 62)


def save_checkpoint(run_dir: Path, state: RunState, learner, *, keep_last: int = 0) -> Path:
    """Write and commit a checkpoint, then trim the stream entries it has consumed (only after
    the commit: a crash in between leaves them for the previous checkpoint) and delete the
    checkpoints older than the newest `keep_last` (0: none)."""
    root = run_dir / "checkpoints"
    tmp = ckpt.staging_dir(root, state.step)
    last_acked = ray.get(learner.save_checkpoint.remote(str(tmp)))
    ckpt.write_json(tmp / "driver.json", state.to_json())
    path = ckpt.commit(root, tmp, state.step)
    ray.get(learner.trim.remote(last_acked))
    ckpt.prune(root, keep_last)
    return path


def load_latest(run_dir: Path, *, rng: bool = True) -> tuple[Path, RunState]:
    path = ckpt.latest(run_dir / "checkpoints")
    return path, RunState.from_json(ckpt.read_json(path / "driver.json"), rng=rng)


def truncate_metrics(run_dir: Path, step: int, *, final: int | None = None) -> int:
    """Drop records written after `step` (a resumed run writes them again), and the evaluation
    records at step `final` (the run's last: a resume from it runs its final evaluation again);
    returns how many."""

    def final_eval(record: dict) -> bool:
        return record["step"] == final and record.get("phase") == "eval"

    return truncate_jsonl(run_dir / "metrics.jsonl", step, drop=final_eval)
