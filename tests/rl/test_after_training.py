"""After training: `agentrl eval` (the held-out evaluation alone, with Wilson intervals) and
`agentrl export` (a checkpoint as a model directory) on a real tiny run, and the run's own
final-model/, which a process without agentrl loads with transformers and `trust_remote_code`
and whose greedy tokens are agentrl's engine's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.policy.test_export import clean_generate, engine_tokens
from tests.rl.test_cli_rough_edges import refused

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
INTERVAL = r"\d+\.\d%\s\[\d+\.\d%, \d+\.\d%\]"


def agentrl(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """Two GRPO steps of the K3 policy (k3-debug), a checkpoint after each; the entropy bonus
    makes every step move the weights, so an export cannot pass by returning the start."""
    out = tmp_path_factory.mktemp("runs")
    proc = agentrl(
        "train",
        str(ROOT / "configs/quickstart.yaml"),
        f"output_dir={out}",
        "name=after",
        "policy.model_type=agentrl_k3",
        "policy.config={preset: k3-debug}",
        "policy.vocab_size=400",
        "policy.tokenizer_demonstrations=50",
        "sft.enabled=false",
        "trainer.steps=2",
        "trainer.batch_size=8",
        "trainer.group_size=4",
        "trainer.entropy_coef=0.05",
        "checkpoint_every=1",
        "checkpoint.keep_last=0",
        "eval.tasks=3",
        "eval.samples=1",
        "rollout.max_new_tokens=16",
        "rollout.max_turns=2",
        "rollout.num_workers=1",
        "ray.num_cpus=2",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = out.glob("after-*")
    return run


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_the_final_model_loads_without_agentrl_and_generates_like_the_engine(run_dir, tmp_path):
    final = run_dir / "final-model"
    assert (final / "tokenizer_config.json").is_file() and (final / "modeling.py").is_file()
    assert json.loads((final / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"]
    clean = clean_generate(final, tmp_path, remote=True)
    prompt, tokens = engine_tokens(final)
    assert clean["prompt"] == prompt and clean["tokens"] == tokens


def test_export_writes_a_checkpoint_as_a_model_directory(run_dir, tmp_path):
    proc = agentrl("export", str(run_dir))  # the latest: step 2, the final model's weights
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported step 2" in proc.stdout
    latest = run_dir / "export-step-2"
    assert same(weights(latest), weights(run_dir / "final-model"))
    assert not same(weights(latest), weights(run_dir / "policy-init"))
    assert (latest / "tokenizer.json").is_file() and (latest / "configuration.py").is_file()

    proc = agentrl("export", str(run_dir), "1", "-o", str(tmp_path / "step-1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not same(weights(tmp_path / "step-1"), weights(latest))
    refused(agentrl("export", str(run_dir), "7"), "STEP", "no checkpoint of step 7", "1, 2")


def test_eval_of_a_run_prints_each_mode_with_its_interval(run_dir):
    proc = agentrl("eval", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "model: " in proc.stdout and "final-model" in proc.stdout
    assert "[agentrl] eval greedy: 3/3 episodes" in proc.stdout  # progress
    for mode in ("sampled (T=1, 1/task)", "greedy"):
        line = f"eval after GRPO, {re.escape(mode)}: +{INTERVAL} on 3 held-out tasks"
        assert re.search(line, proc.stdout), proc.stdout

    proc = agentrl("eval", str(run_dir), "--json", "--no-greedy", "--samples", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout is the JSON alone (progress went to stderr)
    assert list(report["results"]) == ["sampled (T=1, 2/task)"] and report["label"] == "GRPO"
    assert "episodes" in proc.stderr


def test_greedy_eval_repeats_the_runs_final_evaluation(run_dir):
    proc = agentrl("eval", str(run_dir), "--json", "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert json.loads(proc.stdout)["results"]["greedy"] == summary["grpo"]["greedy"]


def test_eval_of_a_model_directory_needs_a_run_file(run_dir):
    final = str(run_dir / "final-model")
    refused(agentrl("eval", final), "--config", "is a model directory")
    proc = agentrl("eval", final, "--config", str(run_dir / "config.yaml"), "--tasks", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval after final-model, greedy" in proc.stdout and "on 2 held-out tasks" in proc.stdout


def test_eval_without_a_final_model_takes_the_latest_checkpoint_then_the_start(run_dir, tmp_path):
    run = tmp_path / run_dir.name
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("final-model", "export-*"))
    proc = agentrl("eval", str(run), "--tasks", "2", "--no-greedy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "latest checkpoint" in proc.stdout and "step-000002" in proc.stdout
    assert "eval after GRPO step 2, sampled" in proc.stdout
    shutil.rmtree(run / "checkpoints")
    proc = agentrl("eval", str(run), "--tasks", "2", "--no-greedy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval after INIT, sampled" in proc.stdout
