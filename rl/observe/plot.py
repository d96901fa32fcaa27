"""`agentrl plot RUN_DIR [--output PATH]`: the reward and success curves of a run as a PNG;
the held-out evaluations with their 95% Wilson intervals (rl/observe/stats.py; read with
rl.observe.metrics.eval_values)."""

from __future__ import annotations

import json
from pathlib import Path

from rl.config.errors import ConfigError
from rl.observe.metrics import eval_values


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of `<run>/metrics.jsonl`; a live run's last line may be half written (left
    out), any other line that is not JSON is a ConfigError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break
            raise ConfigError(
                "RUN_DIR", f"{path} line {number} is not a JSON record ({exc.msg})"
            ) from None
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    # (an async step in which no group finished carries no rollout metrics)
    train = [r for r in records if r.get("phase") == "train" and "reward/mean" in r]
    evals = [r for r in records if r.get("phase") == "eval"]
    if not train and not evals:
        raise ConfigError(
            "RUN_DIR", f"{run_dir} has no finished training step yet; plot it after the first one"
        )
    steps = [r["step"] for r in train]
    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    mean = [r["reward/mean"] for r in train]
    std = [r["reward/std"] for r in train]
    ax_r.plot(steps, mean, label="reward mean")
    ax_r.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        alpha=0.2,
        label="± std",
    )
    ax_r.set(title="Training reward", xlabel="step", ylabel="reward")
    ax_s.plot(steps, [r["rollout/success_rate"] for r in train], label="training success")
    for r in evals:
        success, low, high = eval_values(r)
        ax_s.errorbar(
            [r["step"]],
            [success],
            yerr=[[success - low], [high - success]],
            fmt="o",
            capsize=4,
            label=f"eval {r['eval/label']} ({r['eval/mode']})",
        )
    ax_s.set(title="Success rate", xlabel="step", ylabel="success", ylim=(0, 1.02))
    for ax in (ax_r, ax_s):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(out or Path(run_dir) / "reward_curve.png")
    try:
        fig.savefig(out, dpi=110)
    except (OSError, ValueError) as exc:  # a path it cannot write, a format it does not know
        raise ConfigError("--output", f"cannot write {out}: {exc}") from None
    finally:
        plt.close(fig)
    return out
