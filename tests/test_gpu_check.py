"""benchmarks/gpu_check.sh: without a GPU it says so and exits 0 at once; with one (here a fake
nvidia-smi and a stand-in virtualenv) it runs its four steps under timeouts within its budget
and prints a summary with the ratios."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"

FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *metrics.jsonl*) exec "{python}" "$@" ;;
  -) cat >/dev/null; echo "gpu_check: torch 2.13.0 (CUDA 12.8), 1 x Fake GPU"; exit 0 ;;
  *pytest*) echo "pytest ran: $*"; sleep "${FAKE_PYTEST_SECONDS:-0}"; exit 0 ;;
  *decode_speed*) echo "| 0 | 16 | Qwen3ForCausalLM.generate | 500 | 3.00x | 400 | 3.50x |" ;;
  *learner_speed*) echo "| agentrl Learner.step | 0.100 | 9,000 | 1.50x | 0.1 |"; exit 3 ;;
esac
"""
FAKE_AGENTRL = """#!/bin/bash
for a in "$@"; do case $a in output_dir=*) out=${a#output_dir=};; esac; done
mkdir -p "$out/quickstart-gpu-1"
for s in 1 2 3; do
  echo "{\\"phase\\": \\"train\\", \\"step\\": $s, \\"step/seconds\\": 1.415}"
done > "$out/quickstart-gpu-1/metrics.jsonl"
echo "[agentrl] devices: learner cuda (trainer.device: cuda), rollout workers cpu"
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/dev/nvidia0").exists()


@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU: the script would run the check")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    # "at once": it runs nothing (a stand-in virtualenv's python would leave a mark), not a clock
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    mark = tmp_path / "python-ran"
    executable(tmp_path / "venv" / "bin" / "python", f"#!/bin/sh\ntouch {mark}\n")
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ | {"VENV": str(tmp_path / "venv"), "GPU_CHECK_OUT": str(tmp_path / "out")},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: no GPU on this machine")
    assert not mark.exists()  # no step (not even the torch check) was started
    assert not (tmp_path / "out").exists()
    assert not list((ROOT / "runs").glob("gpu-check-*"))  # nothing written


def fake_gpu_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The script with a fake nvidia-smi on PATH and a stand-in virtualenv (VENV)."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    executable(bin_dir / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: Fake GPU (UUID: GPU-0)'\n")
    executable(venv / "bin" / "python", FAKE_PYTHON.replace("{python}", sys.executable))
    executable(venv / "bin" / "agentrl", FAKE_AGENTRL)
    env = os.environ | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "VENV": str(venv),
        "GPU_CHECK_OUT": str(tmp_path / "out"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=200, env=env
    )


def test_with_a_gpu_it_runs_every_step_and_sums_up(tmp_path):
    proc = fake_gpu_run(tmp_path)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr  # the (fake) learner benchmark failed
    assert "pytest ran: -m pytest -q -rs -p no:cacheprovider tests/gpu" in out
    assert "gpu-tests: ok" in out and "decode: ok" in out and "quickstart: ok" in out
    assert "learner: FAILED (exit 3)" in out
    assert "| 0 | 16 | Qwen3ForCausalLM.generate | 500 | 3.00x | 400 | 3.50x |" in out
    assert "1.42 s/step" in out and "2.83 s/step, 2.00x" in out
    assert (tmp_path / "out" / "decode.log").exists()


@pytest.mark.slow
def test_a_step_past_the_budget_is_stopped_and_the_rest_skipped(tmp_path):
    # a 6 s budget with steps of at least 5 s (the default 30 s minimum would make it 31 s)
    start = time.monotonic()
    proc = fake_gpu_run(
        tmp_path, GPU_CHECK_SECONDS="6", GPU_CHECK_MIN_STEP_S="5", FAKE_PYTEST_SECONDS="120"
    )
    assert proc.returncode == 1
    took = re.search(r"gpu-tests: TIMED OUT after (\d+) s", proc.stdout)
    assert took, proc.stdout
    # the step's share of the budget (5-6 s: `timeout` never fires early), not its own 200 s
    # limit nor the fake tests' 120 s; the upper bound leaves a loaded machine ~40 s of slack
    assert 5 <= int(took[1]) < 50, proc.stdout
    assert "decode: SKIPPED (the 6 s budget is spent)" in proc.stdout
    # nominal ~6 s; well under the 120 s the hung step would take if it were not cut
    assert time.monotonic() - start < 60
