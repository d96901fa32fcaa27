"""docs/environments.md's example trains through `agentrl train`, typed as the doc shows: the env
module and run file in a fresh directory, `agentrl train capitals.yaml` run from there (tiny
overrides added to keep it short)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.envs.test_docs_example import write_doc_files
from tests.rl.test_e2e import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_the_doc_example_trains(tmp_path):
    write_doc_files(tmp_path)
    agentrl = Path(sys.executable).with_name("agentrl")
    command = [str(agentrl)] if agentrl.exists() else [sys.executable, "-m", "rl.cli"]
    overrides = [
        *tiny_overrides(tmp_path / "runs"),
        "sft.demonstrations=32",
        "rollout.num_workers=1",
        "trainer.batch_size=8",
        "eval.tasks=4",
        "eval.samples=1",
        "eval.greedy=false",
    ]
    proc = subprocess.run(
        [*command, "train", "capitals.yaml", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").glob("e2e-*"))
    train = [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["phase"] == "train"
    ]
    assert [r["step"] for r in train] == [1, 2]
    assert all("env/demo/Capitals-v0/success_rate" in r for r in train)
    assert all("reward/invalid_tool_call" in r for r in train)  # the run file's reward section
