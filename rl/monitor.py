"""`agentrl monitor`: follow a run's metrics live in the terminal.

Two sources, one record format (the lines of `metrics.jsonl`, which the loop also adds to the
Redis stream `agentrl:<run>:metrics`):
- `RUN_DIR`: tail `RUN_DIR/metrics.jsonl` (a live run on this machine, or a finished run, which
  is replayed at once);
- `--redis URL --run NAME`: read the run's Redis stream from any machine that reaches its Redis.

`MonitorState` folds records into curves, evaluations and alarms; `rl/monitor_view.py` draws
them; `run_monitor` refreshes the screen with rich's Live and reads single keys (1-6 or
tab switch panels, q quits) with the terminal in cbreak mode, restored on exit.
"""

from __future__ import annotations

import json
import math
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rl.metrics import CollapseDetector

PANELS = ("overview", "evals", "envs & tools", "async & weights", "moe", "workers & alarms")


class JsonlSource:
    """New complete lines of a metrics.jsonl since the last poll."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def poll(self, timeout: float = 0.0) -> list[dict]:
        if not self.path.exists():
            time.sleep(timeout)
            return []
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if not lines:
            time.sleep(timeout)
        return [json.loads(line) for line in lines if line.strip()]


class RedisSource:
    """New entries of a run's metrics stream (`agentrl:<run>:metrics`) since the last poll."""

    def __init__(self, client: redis.Redis, run: str):
        self.client, self.stream, self.last = client, f"agentrl:{run}:metrics", "0-0"

    def poll(self, timeout: float = 0.0) -> list[dict]:
        block = max(int(timeout * 1000), 1) if timeout else None
        reply = self.client.xread({self.stream: self.last}, count=1000, block=block)
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.last = entry_id
                out.append(json.loads(fields[b"data"]))
        return out


@dataclass
class MonitorState:
    """Everything the panels show, folded from metrics records in order."""

    total_steps: int | None = None
    collapse_window: int = 10
    collapse_drop: float = 0.2
    stall_after_s: float = 120.0
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    alarms: list[str] = field(default_factory=list)
    last_seen: float | None = None  # monotonic time of the last record received
    finished: bool = False
    workers_seen: int = 0
    restarts_seen: float = 0.0
    idle_after: int = 3  # steps in a row in which one worker sampled nothing: an alarm
    idle_streak: int = 0
    panel: int = 0
    detector: CollapseDetector | None = None

    def __post_init__(self) -> None:
        self.detector = CollapseDetector(window=self.collapse_window, drop=self.collapse_drop)

    def add(self, records: list[dict], now: float) -> None:
        for record in records:
            self.last_seen = now
            if record.get("phase") == "eval":
                self.evals.append(record)
            elif record.get("phase") == "train":
                self._add_train(record)

    def _add_train(self, record: dict) -> None:
        self.train.append(record)
        step = record.get("step")
        bad = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:
            self._alarm(f"NaN/inf at step {step}: {', '.join(bad[:4])}")
        if "rollout/success_rate" in record:
            text = self.detector.update(record["rollout/success_rate"])
            if text:
                self._alarm(f"step {step}: {text}")
        answering = int(record.get("workers/answering", 0))
        if answering < self.workers_seen:
            self._alarm(f"step {step}: {self.workers_seen - answering} rollout worker(s) silent")
        self.workers_seen = max(self.workers_seen, answering)
        self._watch_idle(record, step)
        restarts = record.get("workers/restarted", 0.0)  # the count since the run started
        if restarts > self.restarts_seen:
            self._alarm(f"step {step}: a rollout worker restarted ({restarts:.0f} so far)")
            self.restarts_seen = restarts

    def _watch_idle(self, record: dict, step) -> None:
        """Async runs: a worker that answers but samples nothing, step after step, is stuck on
        tools, held back by the staleness gate, or gets no tasks."""
        share = record.get("workers/token_share_min")
        if share is None:
            return
        self.idle_streak = self.idle_streak + 1 if share == 0 else 0
        if self.idle_streak == self.idle_after:
            self._alarm(
                f"step {step}: a rollout worker sampled nothing for {self.idle_after} steps in a "
                "row (waiting on tools, held back by trainer.max_staleness, or given no tasks)"
            )

    def _alarm(self, text: str) -> None:
        if text not in self.alarms:
            self.alarms.append(text)

    def stalled(self, now: float) -> str | None:
        """An alarm when a run that is not finished sent nothing for `stall_after_s`."""
        if self.finished or self.last_seen is None or now - self.last_seen < self.stall_after_s:
            return None
        return f"no metrics for {now - self.last_seen:.0f} s: is the run stalled?"

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.train if isinstance(r.get(key), int | float)]

    def latest(self, having: str = "") -> dict:
        """The newest training record (with a key that contains `having`): an async step whose
        workers finished no episode has no rollout figures, for example."""
        for record in reversed(self.train):
            if any(having in key for key in record):
                return record
        return {}

    def key(self, key: str) -> bool:
        """Apply one key press; False means quit."""
        if key in ("q", "Q", "\x03", "\x1b"):
            return False
        if key.isdigit() and 1 <= int(key) <= len(PANELS):
            self.panel = int(key) - 1
        elif key in ("\t", "n", "l"):
            self.panel = (self.panel + 1) % len(PANELS)
        elif key in ("p", "h"):
            self.panel = (self.panel - 1) % len(PANELS)
        return True


def ema(values: list[float], alpha: float = 0.3) -> list[float]:
    """Exponential moving average (the smoothed curve)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out


class Keys:
    """Single key presses from a terminal (cbreak mode, restored on exit); none otherwise."""

    def __enter__(self) -> Keys:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        if self.fd is not None:
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def read(self, timeout: float) -> str | None:
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], timeout)
        return sys.stdin.read(1) if ready else None

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


def run_monitor(
    source: JsonlSource | RedisSource,
    state: MonitorState,
    *,
    finished: Callable[[], bool] = lambda: False,
    refresh_s: float = 0.5,
    once: bool = False,
) -> None:
    """Follow `source` until q (or Ctrl-C); `once`: print the current panels and return."""
    from rich.console import Console
    from rich.live import Live

    from rl.monitor_view import render, render_all

    console = Console()
    state.add(source.poll(), time.monotonic())
    state.finished = finished()
    if once:
        console.print(render_all(state, time.monotonic()))
        return
    with Keys() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                now = time.monotonic()
                live.update(render(state, now), refresh=True)
                key = keys.read(refresh_s)
                if key is not None and not state.key(key):
                    return
                state.add(source.poll(), time.monotonic())
                state.finished = state.finished or finished()
        except KeyboardInterrupt:
            return
