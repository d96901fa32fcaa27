"""`agentrl monitor`: follow a run's metrics live in the terminal.

Two sources, one record format (the lines of `metrics.jsonl`, which the loop also adds to the
Redis stream `agentrl:<run>:metrics`, rollout/keys.py):
- `RUN_DIR`: tail `RUN_DIR/metrics.jsonl` (a live run on this machine, or a finished run, which
  is replayed at once);
- `--redis URL --run NAME`: read the run's Redis stream from any machine that reaches its Redis.

`MonitorState` folds records into curves, evaluations and alarms; `rl/observe/monitor_view.py` draws
them; `run_monitor` refreshes the screen with rich's Live and reads single keys (1-6 or
tab switch panels, q quits) with the terminal in cbreak mode, restored on exit.
"""

from __future__ import annotations

import json
import select
import sys
import termios
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from rl.observe.monitor_state import MonitorState
from rl.observe.monitor_view import render, render_all
from rollout.keys import RunKeys


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
    """New entries of a run's metrics stream (`RunKeys(run).metrics`) since the last poll."""

    def __init__(self, client: redis.Redis, run: str):
        self.client, self.stream, self.last = client, RunKeys(run).metrics, "0-0"

    def poll(self, timeout: float = 0.0) -> list[dict]:
        block = max(int(timeout * 1000), 1) if timeout else None
        reply = self.client.xread({self.stream: self.last}, count=1000, block=block)
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self.last = entry_id
                out.append(json.loads(fields[b"data"]))
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
