"""SIGKILL the learner mid-run, resume, and the final weights equal an uninterrupted run's.

The negative controls resume the same crashed run without restoring the RNG state, or without
restoring the stream position, and must NOT reproduce the weights: proof the test can fail.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.rl.test_e2e import ROOT, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
CONFIG = str(ROOT / "configs/quickstart.yaml")


def overrides(out: Path) -> list[str]:
    # an untrained model's episodes all score the same (zero advantages, zero policy gradient);
    # the entropy bonus makes every step move the weights, so the test cannot pass vacuously
    return [
        *tiny_overrides(out, steps=5),
        "sft.enabled=false",
        "eval.tasks=0",
        "checkpoint_every=2",
        "trainer.micro_batch_size=5",
        "trainer.entropy_coef=0.05",
    ]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def weights_hash(run_dir: Path) -> str:
    tensors = load_file(str(run_dir / "final-model" / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_sigkilled_learner_resumes_exactly(tmp_path):
    straight = cli(CONFIG, *overrides(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    (run_a,) = (tmp_path / "a").glob("e2e-*")
    expected = weights_hash(run_a)
    # not vacuous: the run really trained (its final weights differ from the initial ones)
    initial = load_file(str(run_a / "policy-init" / "model.safetensors"))
    final = load_file(str(run_a / "final-model" / "model.safetensors"))
    assert any(not initial[k].equal(final[k]) for k in initial)

    crashed = cli(CONFIG, *overrides(tmp_path / "b"), "testing.faults.kill_learner_at=4")
    assert crashed.returncode != 0 and "died" in (crashed.stdout + crashed.stderr).lower()
    (run_b,) = (tmp_path / "b").glob("e2e-*")
    assert (run_b / "checkpoints" / "latest").read_text() == "step-000002"
    assert not (run_b / "final-model").exists()
    copies = {skip: tmp_path / f"b-{skip}" / run_b.name for skip in ("rng", "stream")}
    for copy in copies.values():
        shutil.copytree(run_b, copy)

    resumed = cli("--resume", str(run_b))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step-000002" in resumed.stdout
    assert weights_hash(run_b) == expected
    steps = [
        line for line in (run_b / "metrics.jsonl").read_text().splitlines() if '"train"' in line
    ]
    assert len(steps) == 5  # no gap, no duplicate after the resume
    recorded = (run_b / "trajectories.jsonl").read_text()  # cut back to step 2, steps redone
    assert recorded == (run_a / "trajectories.jsonl").read_text() and recorded.count("\n") == 80

    for skip, copy in copies.items():
        control = cli("--resume", str(copy), "--resume-skip", skip)
        assert control.returncode == 0, control.stderr[-3000:]
        assert weights_hash(copy) != expected, f"resuming without the {skip} state still matched"


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    proc = cli("--resume", str(tmp_path / "run"))
    assert (
        proc.returncode == 2 and "cannot resume" in proc.stderr and "no checkpoint" in proc.stderr
    )
    assert "devices:" not in proc.stdout  # refused before Redis and Ray were started
