"""The state of `agentrl monitor`: metric records folded into curves, evaluations and alarms.

`MonitorState` is what the panels (rl/observe/monitor_view.py) draw; rl/observe/monitor.py feeds it
records from a run directory or a Redis stream. Every number a training record carries becomes a
`Curve`: the whole run, in at most `max_points` buckets of consecutive steps (adjacent buckets merge
two by two when a curve outgrows the cap), so a run of any length takes bounded memory and the
panels draw it from the first step to the last at their width.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from rl.observe.metrics import CollapseDetector

PANELS = ("overview", "evals", "envs & tools", "async & weights", "moe", "workers & alarms")
MAX_POINTS = 2048  # buckets a curve keeps at most (a terminal row is ~200 columns)
EMA_ALPHA = 0.3  # the smoothing of the curves, per step


class Curve:
    """One metric over a whole run, in at most `cap` buckets of consecutive points.

    Every bucket but the newest holds `per` points; when a new bucket would make `cap + 1`,
    neighbours merge two by two and `per` doubles. A bucket keeps its first and last step, its
    count, sum, min and max, and the sum of the EMA (alpha `alpha`, taken per point as it arrives),
    so the mean of any run of buckets is exact, the first step is never lost, and the smoothing
    spans the same number of steps however far the curve is downsampled. Non-finite values (an
    alarm of their own) count only as `last`.
    """

    FIELDS = ("first", "final", "count", "total", "low", "high", "smooth")

    def __init__(self, cap: int = MAX_POINTS, alpha: float = EMA_ALPHA):
        if cap < 2:
            raise ValueError(f"a curve keeps at least 2 buckets, not {cap}")
        self.cap, self.alpha, self.per = cap, alpha, 1
        self.first, self.final = array("d"), array("d")  # each bucket's first and last step
        self.count, self.total, self.smooth = array("d"), array("d"), array("d")
        self.low, self.high = array("d"), array("d")
        self.points = 0  # finite values seen
        self.last: float | None = None  # the newest value as logged (NaN included)
        self.smoothed: float | None = None  # the EMA now
        self.lo_step = self.hi_step = 0.0  # the steps the curve spans (once it has points)

    def __len__(self) -> int:
        return len(self.count)

    def add(self, step: float, value: float) -> None:
        self.last = value
        if not math.isfinite(value):
            return
        old = self.smoothed
        self.smoothed = ema = value if old is None else self.alpha * value + (1 - self.alpha) * old
        if not self.points:
            self.lo_step = self.hi_step = step
        elif step < self.lo_step:
            self.lo_step = step
        elif step > self.hi_step:
            self.hi_step = step
        self.points += 1
        count = self.count
        if count and count[-1] < self.per:
            self.final[-1] = step
            count[-1] += 1
            self.total[-1] += value
            self.smooth[-1] += ema
            if value < self.low[-1]:
                self.low[-1] = value
            if value > self.high[-1]:
                self.high[-1] = value
            return
        self.first.append(step)
        self.final.append(step)
        count.append(1)
        self.total.append(value)
        self.low.append(value)
        self.high.append(value)
        self.smooth.append(ema)
        if len(count) > self.cap:
            self._halve()

    def _halve(self) -> None:
        """Merge buckets 0+1, 2+3, ...; an odd newest bucket stays alone."""
        n = len(self.count)
        pairs = range(0, n - 1, 2)
        merged = {
            "first": [self.first[i] for i in pairs],
            "final": [self.final[i + 1] for i in pairs],
            "count": [self.count[i] + self.count[i + 1] for i in pairs],
            "total": [self.total[i] + self.total[i + 1] for i in pairs],
            "smooth": [self.smooth[i] + self.smooth[i + 1] for i in pairs],
            "low": [min(self.low[i], self.low[i + 1]) for i in pairs],
            "high": [max(self.high[i], self.high[i + 1]) for i in pairs],
        }
        for name in self.FIELDS:
            column = array("d", merged[name])
            if n % 2:
                column.append(getattr(self, name)[-1])
            setattr(self, name, column)
        self.per *= 2

    def columns(self, width: int, lo: float | None = None, hi: float | None = None) -> list[dict]:
        """The curve on `width` columns of equal step ranges from step `lo` to `hi` (its own
        range by default), one column a step when the range is narrower: per column the mean,
        min and max of its points and the mean of their EMA, or None where no point falls."""
        lo = self.lo_step if lo is None else lo
        hi = self.hi_step if hi is None else hi
        if not self.points or width < 1:
            return []
        span = hi - lo + 1
        width = int(max(1, min(width, span)))
        sums = [[0.0, 0.0, 0.0, math.inf, -math.inf] for _ in range(width)]
        for i in range(len(self.count)):
            middle = (self.first[i] + self.final[i]) / 2
            c = min(width - 1, max(0, int((middle - lo) / span * width)))
            acc = sums[c]
            acc[0] += self.count[i]
            acc[1] += self.total[i]
            acc[2] += self.smooth[i]
            acc[3] = min(acc[3], self.low[i])
            acc[4] = max(acc[4], self.high[i])
        return [
            {"mean": t / n, "smooth": s / n, "min": low, "max": high, "count": int(n)}
            if n
            else None
            for n, t, s, low, high in sums
        ]


@dataclass
class MonitorState:
    """Everything the panels show, folded from metrics records in order."""

    total_steps: int | None = None
    collapse_window: int = 10
    collapse_drop: float = 0.2
    stall_after_s: float = 120.0
    max_points: int = MAX_POINTS  # buckets a curve keeps at most
    curves: dict[str, Curve] = field(default_factory=dict)  # every number of the train records
    newest: dict[str, tuple[int, dict]] = field(default_factory=dict)  # key: (seq, newest record)
    train_records: int = 0
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
        self.train_records += 1
        step = record.get("step")
        at = step if isinstance(step, int | float) else self.train_records
        seen, curves = (self.train_records, record), self.curves
        for key, value in record.items():
            self.newest[key] = seen
            if not isinstance(value, int | float) or key in ("step", "time"):
                continue
            curve = curves.get(key)
            if curve is None:
                curve = curves[key] = Curve(self.max_points)
            curve.add(at, value)
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

    def curve(self, key: str) -> Curve | None:
        return self.curves.get(key)

    def latest(self, having: str = "") -> dict:
        """The newest training record (with a key that contains `having`): an async step whose
        workers finished no episode has no rollout figures, for example."""
        found = [seq_record for key, seq_record in self.newest.items() if having in key]
        return max(found, key=lambda seq_record: seq_record[0])[1] if found else {}

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


def ema(values: list[float], alpha: float = EMA_ALPHA) -> list[float]:
    """Exponential moving average (the smoothed curve)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else alpha * v + (1 - alpha) * out[-1])
    return out
