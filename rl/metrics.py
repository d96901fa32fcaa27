"""Per-step metrics to metrics.jsonl, TensorBoard, a Redis stream and the console; collapse
detection; the compact console line."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

import redis


class MetricsLogger:
    def __init__(
        self, run_dir: Path, *, client: redis.Redis | None, stream: str, tensorboard: bool
    ):
        self.path = run_dir / "metrics.jsonl"
        self.client, self.stream = client, stream
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float], *, phase: str = "train") -> None:
        record = {"step": step, "phase": phase, "time": round(time.time(), 3), **metrics}
        line = json.dumps(record)
        with self.path.open("a") as fh:
            fh.write(line + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self.writer.add_scalar(
                        f"{phase}/{key}" if phase != "train" else key, value, step
                    )
            self.writer.flush()
        if self.client is not None:
            self.client.xadd(self.stream, {"data": line}, maxlen=100_000, approximate=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class CollapseDetector:
    """Flags a training-reward collapse: the rolling mean falls `drop` below its best."""

    def __init__(self, *, window: int, drop: float):
        self.values: deque[float] = deque(maxlen=window)
        self.best = float("-inf")
        self.drop = drop
        self.collapsed = False

    def update(self, value: float) -> str | None:
        self.values.append(value)
        if len(self.values) < self.values.maxlen:
            return None
        mean = sum(self.values) / len(self.values)
        self.best = max(self.best, mean)
        if not self.collapsed and self.best - mean >= self.drop:
            self.collapsed = True
            return (
                f"REWARD COLLAPSE: the rolling mean success fell from {self.best:.2f} to "
                f"{mean:.2f}; lower trainer.lr or raise trainer.batch_size"
            )
        return None


def rollout_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """Add up the workers' counters into rates."""
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    n = max(total["episodes"], 1)
    mean = total["reward_sum"] / n
    var = max(total["reward_sq_sum"] / n - mean**2, 0.0)
    seconds = max(s["seconds"] for s in stats)
    return {
        "reward/mean": mean,
        "reward/std": var**0.5,
        "rollout/success_rate": total["successes"] / n,
        "rollout/tool_call_rate": total["episodes_with_tool_call"] / n,
        "rollout/tool_error_rate": total["tool_errors"] / max(total["tool_calls"], 1),
        "rollout/parse_errors": total["parse_errors"],
        "rollout/response_length": total["generated_tokens"] / n,
        "rollout/turns": total["turns"] / n,
        "rollout/truncated_rate": total["truncated"] / n,
        "rollout/errors": total["errors"],
        "rollout/tokens_per_s": total["generated_tokens"] / max(seconds, 1e-9),
        "rollout/seconds": seconds,
    }


def console_line(step: int, steps: int, m: dict[str, float]) -> str:
    return (
        f"step {step:>3}/{steps} | reward {m['reward/mean']:.2f}±{m['reward/std']:.2f} "
        f"| success {m['rollout/success_rate']:.0%} | tools {m['rollout/tool_call_rate']:.0%} "
        f"(err {m['rollout/tool_error_rate']:.0%}) | len {m['rollout/response_length']:.0f} "
        f"| ent {m['learner/entropy']:.3f} | clip {m['learner/clip_fraction']:.3f} "
        f"| kl {m['learner/approx_kl']:.1e} | gnorm {m['learner/grad_norm']:.2f} "
        f"| {m['rollout/tokens_per_s']:,.0f} tok/s | lag {m['learner/policy_lag']:.0f} "
        f"| push {m['weights/push_seconds']:.2f}s"
    )
