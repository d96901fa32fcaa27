"""Tiny asynchronous runs through the CLI (real redis-server, real local Ray) for the chaos
suite and tests/rl/test_async.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.rl.test_e2e import ROOT, descendants, tiny_overrides

CONFIG = str(ROOT / "configs/quickstart.yaml")
TIMEOUT_S = 600  # generous: CI has 2 loaded cores


def overrides(out: Path, steps: int) -> list[str]:
    return [
        *tiny_overrides(out, steps=steps),
        "sft.enabled=false",
        "eval.tasks=0",
        "checkpoint_every=3",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "rollout.token_budget=40",  # workers pause and save mid-episode every version
    ]


def start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`agentrl train ARGS` in its own session, stdout and stderr merged."""
    return subprocess.Popen(
        [sys.executable, "-m", "rl.cli", "train", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def train(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `agentrl train ARGS` to the end; returns the process with its merged output."""
    proc = start(args, env)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"agentrl train ran past {TIMEOUT_S} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def resume(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return train(["--resume", str(run_dir), *extra])


def run_dir_of(out: Path) -> Path:
    (run_dir,) = out.glob("e2e-*")
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x and json.loads(x)["phase"] == "train"]


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT_S):
    """Poll `condition()` until it returns something truthy (returned); fail if the run ends
    first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def process_named(root: int, name: str) -> int | None:
    """A live process below `root` whose command name is `name` (e.g. redis-server)."""
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
        except OSError:
            continue
    return None
