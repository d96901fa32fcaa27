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


K3 = (  # the K3 policy (k3-debug) with routes recorded and replayed: they cross the stream,
    # saves and restores (tests/chaos/test_chaos_fleet.py, tests/rl/test_async.py)
    "policy.model_type=agentrl_k3",
    "policy.config={preset: k3-debug}",
    "trainer.routing_replay=true",
)


def replayed_everywhere(records: list[dict]) -> dict[int, float]:
    """The steps whose share of sampled tokens trained on a replayed route (moe/replayed_share)
    is not 1: each trajectory's routes must cover every sampled token, across every save,
    restore and restart (empty when all are)."""
    return {r["step"]: r.get("moe/replayed_share") for r in records
            if "learner/trajectories" in r and r.get("moe/replayed_share") != 1.0}  # fmt: skip


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


def last_step(out: Path) -> int:
    """The last train step in metrics.jsonl of the run under `out` so far (0: none yet); a line
    still being written is skipped."""
    runs = list(out.glob("e2e-*"))
    path = runs[0] / "metrics.jsonl" if runs else None
    if path is None or not path.exists():
        return 0
    steps = [0]
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("phase") == "train":
            steps.append(int(record["step"]))
    return max(steps)


def actor_pids(root: int, actor: str) -> list[int]:
    """The live processes below `root` that host a Ray actor of class `actor` (e.g.
    "WorkerHost"), sorted. Ray titles an actor's process "ray::<class>" once the actor is built
    and "ray::<class>.<method>" while a method runs: setproctitle writes the title over the
    process's argv, which /proc/<pid>/cmdline shows (/proc/<pid>/comm, when Ray also sets it,
    holds the first 15 characters: read only where argv was not rewritten). A process the
    actor forked without exec inherits its title: only the topmost one counts."""
    title = f"ray::{actor}"
    found: dict[int, int] = {}  # pid -> parent pid
    for pid in descendants(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        name = argv[0].decode(errors="replace") if argv else ""
        named = name == title or name.startswith(f"{title}.")
        if not name.startswith("ray::"):
            named = comm == title
        if named and stat[0] != "Z":
            found[pid] = int(stat[1])
    return sorted(pid for pid, parent in found.items() if parent not in found)


def command_line(pid: int) -> str:
    """/proc/<pid>/cmdline as text ("" once the process is gone), for failure messages."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()
