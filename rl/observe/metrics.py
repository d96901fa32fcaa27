"""Per-step metrics to metrics.jsonl, TensorBoard, a Redis stream, the optional W&B / MLflow
trackers (rl/observe/trackers.py) and the console; collapse detection; the compact console line."""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import redis

from rl.observe.trackers import close_all, tracker_metrics
from rollout.stream import dead_letter_total


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        client: redis.Redis | None,
        stream: str,
        tensorboard: bool,
        purge_step: int | None = None,
        trackers: Sequence = (),
    ):
        """`purge_step`: on resume, TensorBoard events from this step on are dropped (rewritten).
        `trackers`: rl/observe/trackers.py's W&B / MLflow loggers, each given every record."""
        self.path = run_dir / "metrics.jsonl"
        self.client, self.stream = client, stream
        self.trackers = list(trackers)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, float], *, phase: str = "train") -> None:
        record = {"step": step, "phase": phase, "time": round(time.time(), 3), **metrics}
        line = json.dumps(record)
        with self.path.open("a") as fh:
            fh.write(line + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    plain = phase == "train" or key.startswith(f"{phase}/")
                    self.writer.add_scalar(key if plain else f"{phase}/{key}", value, step)
            self.writer.flush()
        if self.client is not None:
            self.client.xadd(self.stream, {"data": line}, maxlen=100_000, approximate=True)
        for tracker in self.trackers:
            tracker.log(step, tracker_metrics(metrics, phase))

    def close(self, failed: bool = False) -> None:
        """Close TensorBoard and the trackers (failed: W&B and MLflow mark the run failed)."""
        if self.writer is not None:
            self.writer.close()
        close_all(self.trackers, failed=failed)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.close(failed=kind is not None)


def eval_record(
    label: str, mode: str, success: float, low: float, high: float, per_env: dict | None = None
) -> dict:
    """One evaluation's metrics, under names distinct for each label (sft, grpo, ...) and kind
    (sampled, greedy): `eval/<label>/<kind>/success`, `.../ci_low`, `.../ci_high`, plus the
    label and the full mode text; a mixture of envs also `.../env/<id>/success` (and its
    interval) from `per_env` ({env id: (success, ci_low, ci_high)})."""
    base = f"eval/{label}/{mode.split(' ')[0]}"
    record = {
        "eval/label": label,
        "eval/mode": mode,
        f"{base}/success": success,
        f"{base}/ci_low": low,
        f"{base}/ci_high": high,
    }
    for env, (env_success, env_low, env_high) in (per_env or {}).items():
        record[f"{base}/env/{env}/success"] = env_success
        record[f"{base}/env/{env}/ci_low"] = env_low
        record[f"{base}/env/{env}/ci_high"] = env_high
    return record


def eval_values(record: dict) -> tuple[float, float, float]:
    """(success, ci_low, ci_high) of an evaluation record (also one written before the names
    became distinct, with plain `eval/success`)."""
    base = f"eval/{record.get('eval/label')}/{str(record.get('eval/mode', '')).split(' ')[0]}"
    if f"{base}/success" not in record:
        base = "eval"
    return record[f"{base}/success"], record[f"{base}/ci_low"], record[f"{base}/ci_high"]


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


def push_metrics(push: dict) -> dict[str, float]:
    """A weight push's figures (rl.run.weights.push_weights' result) as metrics."""
    return {
        "weights/push_seconds": push["seconds"],
        "weights/push_gb_per_s": push["gb_per_s"],
        "weights/push_mb": push["bytes"] / 2**20,
        "weights/missed_pushes": float(push.get("missed", 0)),
    }


def redis_metrics(client, stream: str) -> dict[str, float]:
    """Entries left in the trajectory stream (bounded: consumed entries are trimmed after each
    checkpoint), the Redis server's memory, and the run's dead letters so far (entries the
    learner could not decode, rollout/stream.py; trimmed ones included)."""
    if client is None:
        return {}
    return {
        "redis/stream_entries": float(client.xlen(stream)),
        "redis/used_memory_mb": client.info("memory")["used_memory"] / 2**20,
        "stream/dead_letters": float(dead_letter_total(client, stream)),
    }


def rollout_metrics(stats: list[dict[str, float]]) -> dict[str, float]:
    """Add up the workers' counters into rates.

    The reward mean and std are over scored trajectories (env and grader errors are counted in
    `rollout/env_errors` and `rollout/grader_errors`, and excluded). Per reward term:
    `reward/<term>` (its raw mean); per env: `env/<id>/success_rate`, `env/<id>/episodes` and
    `env/<id>/reward_mean` (over its scored trajectories; a mixture of envs has one per env);
    per tool: `tools/<name>/calls` and `tools/<name>/failure_rate`.
    """
    total: dict[str, float] = {}
    for s in stats:
        for key, value in s.items():
            total[key] = total.get(key, 0) + value
    n = max(total["episodes"], 1)
    scored = max(total.get("scored", total["episodes"]), 1)
    mean = total["reward_sum"] / scored
    var = max(total["reward_sq_sum"] / scored - mean**2, 0.0)
    seconds = max(s["seconds"] for s in stats)
    out = {
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
        "rollout/env_errors": total.get("env_errors", 0),
        "rollout/env_error_rate": total.get("env_errors", 0) / n,
        "rollout/episodes": total["episodes"],
        "rollout/grader_errors": total.get("grader_errors", 0),
        "rollout/grader_error_rate": total.get("grader_errors", 0) / n,
        "rollout/tokens_per_s": total["generated_tokens"] / max(seconds, 1e-9),
        "rollout/seconds": seconds,
    }
    for key, value in total.items():
        kind, _, rest = key.partition("/")
        if kind == "reward_part":
            out[f"reward/{rest}"] = value / scored
        elif kind == "env" and rest.endswith("/episodes"):
            env_id = rest.removesuffix("/episodes")
            out[f"env/{env_id}/success_rate"] = total[f"env/{env_id}/successes"] / max(value, 1)
            out[f"env/{env_id}/episodes"] = value
            if total.get(f"env/{env_id}/scored"):
                scored_here = total[f"env/{env_id}/scored"]
                out[f"env/{env_id}/reward_mean"] = total[f"env/{env_id}/reward_sum"] / scored_here
        elif kind == "tool" and rest.endswith("/calls"):
            name = rest.removesuffix("/calls")
            out[f"tools/{name}/calls"] = value
            out[f"tools/{name}/failure_rate"] = total[f"tool/{name}/failures"] / max(value, 1)
    return out


def console_line(step: int, steps: int, m: dict[str, float]) -> str:
    nan = float("nan")
    g = lambda key: m.get(key, nan)  # noqa: E731  (a skipped update has no learner metrics)
    if "rollout/success_rate" in m or "learner/success_rate" not in m:
        outcome = (
            f"reward {g('reward/mean'):.2f}±{g('reward/std'):.2f} "
            f"| success {g('rollout/success_rate'):.0%}{per_env_success(m)}"
        )
    else:  # no episode finished during the step (async, right after a resume): what it trained
        outcome = (
            f"trained reward {g('learner/reward_mean'):.2f}±{g('learner/reward_std'):.2f} "
            f"| trained success {g('learner/success_rate'):.0%}"
        )
    line = (
        f"step {step:>3}/{steps} | {outcome} | tools {g('rollout/tool_call_rate'):.0%} "
        f"(err {g('rollout/tool_error_rate'):.0%}) | len {g('rollout/response_length'):.0f} "
        f"| ent {g('learner/entropy'):.3f} | clip {g('learner/clip_fraction'):.3f} "
        f"| kl {g('learner/approx_kl'):.1e} | gnorm {g('learner/grad_norm'):.2f} "
        f"| {g('rollout/tokens_per_s'):,.0f} tok/s | lag {g('learner/policy_lag'):.0f}"
    )
    push = m.get("weights/push_seconds")  # async: the push settled during this step, if any
    line += " | push -" if push is None else f" | push {push:.2f}s"
    if "learner/idle_share" in m:
        line += f" | learner idle {m['learner/idle_share']:.0%}"
    if m.get("learner/dropped_groups"):
        line += f" | dropped {m['learner/dropped_groups']:.0f} flat groups"
    return line


def per_env_success(m: dict[str, float]) -> str:
    """` (Calculator 80% Retrieval 40%)`: each env's success rate in a step of several envs
    (a mixture, envs/mixture.py), by short name (`acme/Echo-v0` -> Echo) unless two would
    clash; "" for a step of one env."""
    rates = {
        k.removeprefix("env/").removesuffix("/success_rate"): v
        for k, v in sorted(m.items())
        if k.startswith("env/") and k.endswith("/success_rate")
    }
    if len(rates) < 2:
        return ""
    short = {env: re.sub(r"-v\d+(?=\[|$)", "", env.rpartition("/")[2]) for env in rates}
    if len(set(short.values())) < len(short):
        short = {env: env for env in rates}
    return " (" + " ".join(f"{short[env]} {rate:.0%}" for env, rate in rates.items()) + ")"
