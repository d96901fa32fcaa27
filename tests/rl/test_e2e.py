"""End to end through the CLI: real redis-server, real local Ray, a tiny model, a few steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def tiny_overrides(out: Path, steps: int = 2) -> list[str]:
    model = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in TINY_MODEL.items()) + "}"
    return [
        f"output_dir={out}",
        "name=e2e",
        "policy.model_type=qwen3",  # the generic HF path (the K3 path has its own tests)
        f"policy.config={model}",
        "policy.vocab_size=512",
        "sft.demonstrations=48",
        "sft.epochs=1",
        "sft.batch_size=16",
        f"trainer.steps={steps}",
        "trainer.batch_size=16",
        "trainer.group_size=4",
        "eval.tasks=6",
        "eval.samples=2",
        "rollout.max_new_tokens=24",
        "rollout.max_turns=2",
        "ray.num_cpus=2",
    ]


def descendants(root: int) -> set[int]:
    """Every live process below `root` (read from /proc: parent links)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        children = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def run_cli(args: list[str], timeout: float = 600) -> tuple[subprocess.CompletedProcess, set[int]]:
    """Run `agentrl train` and collect every process it started (Ray, Redis, actors) meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "train", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    out = err = ""
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            seen |= descendants(proc.pid)
            if time.monotonic() > deadline:
                proc.kill()
                raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def test_train_runs_end_to_end(tmp_path):
    args = [str(ROOT / "configs/quickstart.yaml"), *tiny_overrides(tmp_path), "eval.every=1"]
    proc, started = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("e2e-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for key in (
        "reward/mean",
        "reward/std",
        "rollout/success_rate",
        "rollout/tool_call_rate",
        "rollout/tool_error_rate",
        "rollout/response_length",
        "learner/entropy",
        "learner/clip_fraction",
        "learner/approx_kl",
        "learner/grad_norm",
        "rollout/tokens_per_s",
        "learner/policy_lag",
        "weights/push_seconds",
    ):
        assert all(key in r for r in train), key
    assert train[-1]["learner/version"] == 2
    evals = [r for r in records if r["phase"] == "eval"]  # sampled and greedy: after SFT (step
    assert [r["step"] for r in evals] == [0, 0, 1, 1, 2, 2]  # 0), eval.every=1 (step 1), after RL
    assert all(any(k.startswith("eval/grpo/") for k in r) for r in evals[2:])
    assert "evaluation at step 1" in proc.stdout + proc.stderr
    (sft,) = [r for r in records if r["phase"] == "sft"]  # did SFT take? (it cannot, this tiny)
    assert 0 <= sft["sft/token_accuracy"] <= 1 and "sft/tool_call_ok" in sft
    assert 0 <= sft["sft/copy_accuracy"] <= 1  # random spans copied (the rehearsal's measure)
    assert "SFT did not fit the demonstrations" in proc.stdout + proc.stderr
    trajectories = [
        json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in trajectories] == [1] * 16 + [2] * 16  # batch 16 <= 32 recorded
    assert {r["fate"] for r in trajectories} <= {"trained", "failed: no trainable trajectory"}
    shown = subprocess.run(
        [sys.executable, "-m", "rl.cli", "show", str(run_dir), "--worst", "--step", "2"],
        cwd=ROOT,
        text=True,
        capture_output=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("trajectory 2-") and "turn 1 · sampled" in shown.stdout
    assert (run_dir / "reward_curve.png").stat().st_size > 1000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "config.yaml").exists() and (run_dir / "summary.json").exists()
    assert (run_dir / "final-model" / "model.safetensors").exists()
    assert list(
        (run_dir / "redis").glob("**/*.aof")
    )  # AOF was on (7.x: appendonlydir/, 6.x: one file)
    assert "Held-out evaluation" in proc.stdout
    assert len(started) >= 3, "expected Redis, Ray and actor processes"
    time.sleep(1)
    assert not alive(started), "processes outlived the run"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_leaves_no_ray_or_redis_behind(tmp_path, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rl.cli",
            "train",
            str(ROOT / "configs/quickstart.yaml"),
            *tiny_overrides(tmp_path, steps=500),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    seen = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        seen += line
        if "step   1/500" in line or proc.poll() is not None:
            break
    assert "step   1/500" in seen, seen[-3000:]
    started = descendants(proc.pid)
    assert len(started) >= 3, "expected the run's Redis, Ray and actor processes to be up"
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C sends: the whole process group
    else:
        os.kill(proc.pid, sig)  # what a scheduler or `kill` sends: the main process only
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, (seen + rest)[-3000:]
    assert "interrupted" in rest
    time.sleep(1)
    assert not alive(started), "processes outlived Ctrl-C"


# Every algorithm's step is tested in-process (tests/rl/test_learner.py
# test_every_algorithm_steps_and_changes_the_weights); through the CLI and Ray: grpo (the other
# tests here), dapo (it may skip a step) and ppo (a critic, and the broadcast transport).
@pytest.mark.parametrize("algorithm", ["dapo", "ppo"])
def test_a_run_file_switches_algorithms(tmp_path, algorithm):
    overrides = [
        *tiny_overrides(tmp_path),
        f"trainer.algorithm={algorithm}",
        "sft.enabled=false",
        "eval.tasks=0",
        "rollout.num_workers=1",
    ]
    if algorithm == "ppo":  # also covers the broadcast weight transport end to end
        overrides.append("weights.transport=broadcast")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl.cli",
            "train",
            str(ROOT / "configs/quickstart.yaml"),
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("e2e-*"))
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["learner/version"] for r in train] == [1, 2]
    grads = [r["learner/grad_norm"] for r in train if "learner/grad_norm" in r]  # dapo may skip
    assert all(g == g for g in grads)  # not NaN
    # the run file's algorithm is the one the learner ran: only PPO trains a value head
    assert any("learner/value_loss" in r for r in train) == (algorithm == "ppo")


def test_the_k3_policy_trains_through_the_cli(tmp_path):
    """The quickstart's own policy type: K3 (k3-debug here) with its engine and routing records."""
    overrides = [
        *tiny_overrides(tmp_path),
        "policy.model_type=agentrl_k3",
        "policy.config={preset: k3-debug}",
        "eval.tasks=4",
        "trainer.routing_replay=true",
    ]
    proc, _ = run_cli([str(ROOT / "configs/quickstart.yaml"), *overrides])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("e2e-*"))
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["phase"] == "train"]
    assert any(k.startswith("moe/layers.") for k in train[-1])  # per-layer expert load
    assert (run_dir / "final-model" / "config.json").read_text().count("agentrl_k3") == 1
