"""The panels of `agentrl monitor`, drawn with rich from a `MonitorState`
(rl/observe/monitor_state.py)."""

from __future__ import annotations

import math

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rl.observe.metrics import eval_values
from rl.observe.monitor_state import EMA_ALPHA, PANELS, Curve, MonitorState

BARS = "▁▂▃▄▅▆▇█"
TRAIN = f"whole run; EMA {EMA_ALPHA} per step, averaged per column"


def sparkline(values: list[float | None], low: float, high: float) -> str:
    """One bar a value, from `low` (▁) to `high` (█); a blank where a value is None. A range
    within rounding of a constant (the means of a constant) is flat."""
    span = high - low
    if span <= 1e-9 * max(abs(low), abs(high)) or span == 0:
        span = math.inf
    top = len(BARS) - 1
    return "".join(
        " " if v is None else BARS[max(0, min(int((v - low) / span * len(BARS)), top))]
        for v in values
    )


class Chart:
    """The curves of one table drawn as sparklines on a shared step axis, as wide as their column:
    a row is `min ▁▃▅▇ max` (each column of bars the mean EMA of its steps, scaled from the row's
    min to its max), and the column's header is the axis, `min first ── steps ── last max`. Rich
    gives the header and every row the same width, so the layout is computed once per width."""

    def __init__(self, curves: list[tuple[Curve | None, str]], min_bars: int = 8):
        self.curves = [(c if c is not None and c.points else None, spec) for c, spec in curves]
        drawn = [c for c, _ in self.curves if c is not None]
        self.lo = min((c.lo_step for c in drawn), default=0.0)
        self.hi = max((c.hi_step for c in drawn), default=0.0)
        self.min_bars = min_bars
        self._layouts: dict[int, tuple] = {}

    def _labels(self, bars: int) -> list[tuple[str, str, str] | None]:
        rows: list[tuple[str, str, str] | None] = []
        for curve, spec in self.curves:
            if curve is None:
                rows.append(None)
                continue
            means = [c and c["smooth"] for c in curve.columns(bars, self.lo, self.hi)]
            low = min(m for m in means if m is not None)
            high = max(m for m in means if m is not None)
            rows.append((format(low, spec), sparkline(means, low, high), format(high, spec)))
        return rows

    def layout(self, width: int) -> tuple[int, int, list[tuple[str, str, str] | None]]:
        """(the width of the min labels, the bars drawn, each row's min, bars and max)."""
        if width not in self._layouts:
            steps = int(self.hi - self.lo + 1)
            side = 3  # "min", "max": the labels are as wide at least
            for curve, spec in self.curves:
                if curve is not None:  # the means lie between the extremes: as wide, mostly
                    for v in (min(curve.low), max(curve.high)):
                        side = max(side, len(format(v, spec)))
            bars = max(1, min(steps, width - 2 * side - 2))
            rows = self._labels(bars)
            side = max([side, *(len(r[0]) for r in rows if r)])
            self._layouts[width] = (side, bars, rows)
        return self._layouts[width]

    def measure(self, most: int) -> Measurement:
        side, _, _ = self.layout(most)
        steps = int(self.hi - self.lo + 1)
        return Measurement(2 * side + 2 + self.min_bars, 2 * side + 2 + max(steps, self.min_bars))

    def axis(self) -> ChartCell:
        return ChartCell(self, None)

    def row(self, index: int) -> ChartCell:
        return ChartCell(self, index)


class ChartCell:
    """One row of a `Chart` (or, for `index` None, its axis)."""

    def __init__(self, chart: Chart, index: int | None):
        self.chart, self.index = chart, index

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return self.chart.measure(options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        side, bars, rows = self.chart.layout(options.max_width)
        if self.index is None and not any(rows):
            yield Text("curve", style="dim")
        elif self.index is None:
            yield Text(f"{'min':>{side}} {self._axis(bars)} max", no_wrap=True, style="dim")
        elif rows[self.index] is None:
            yield Text(f"{'-':>{side}}")
        else:
            low, line, high = rows[self.index]
            yield Text(f"{low:>{side}} {line:<{bars}} {high}", no_wrap=True)

    def _axis(self, bars: int) -> str:
        """`first ── steps (n a column) ── last` in `bars` characters (more if they are few)."""
        first, last = f"{self.chart.lo:.0f}", f"{self.chart.hi:.0f}"
        room = bars - len(first) - len(last)
        per = (self.chart.hi - self.chart.lo + 1) / bars
        for middle in (f" steps, {per:.3g} a column ", " steps ", ""):
            if len(middle) + 4 <= room:
                dashes = room - len(middle) - 2
                return f"{first} {'─' * (dashes // 2)}{middle}{'─' * (dashes - dashes // 2)} {last}"
        return f"{first}{'─' * max(1, room)}{last}"


def _fmt(value: object, spec: str = ".3g") -> str:
    if isinstance(value, int | float):
        return format(value, spec)
    return "-" if value is None else str(value)


def _curves(state: MonitorState, rows: list[tuple[str, str, str]], title: str) -> Table:
    curves = [state.curve(key) for key, _, _ in rows]
    chart = Chart([(curve, spec) for curve, (_, _, spec) in zip(curves, rows, strict=True)])
    table = Table(title=f"{title} ({TRAIN})", expand=True)
    table.add_column("", no_wrap=True, min_width=14)
    table.add_column(chart.axis(), no_wrap=True, ratio=1)
    table.add_column("last", no_wrap=True, min_width=7, justify="right")
    table.add_column("smoothed", no_wrap=True, min_width=8, justify="right")
    for i, ((_, label, spec), curve) in enumerate(zip(rows, curves, strict=True)):
        if curve is None or curve.last is None:
            table.add_row(label, chart.row(i), "-", "-")
            continue
        table.add_row(label, chart.row(i), format(curve.last, spec), _fmt(curve.smoothed, spec))
    return table


def header(state: MonitorState, now: float) -> Text:
    last = state.latest()
    step = last.get("step", 0)
    total = f"/{state.total_steps}" if state.total_steps else ""
    status = "finished" if state.finished else ("STALLED" if state.stalled(now) else "live")
    names = "  ".join(
        f"[{i + 1}] {name}" if i != state.panel else f"[b reverse][{i + 1}] {name}[/]"
        for i, name in enumerate(PANELS)
    )
    return Text.from_markup(
        f"[b]agentrl monitor[/]  step {step}{total}  ({status}, {len(state.alarms)} alarms)"
        f"   keys: 1-{len(PANELS)}/tab switch, q quit\n{names}"
    )


def overview(state: MonitorState) -> RenderableType:
    rows = [
        ("reward/mean", "reward", ".2f"),
        ("rollout/success_rate", "success", ".0%"),
        ("rollout/tool_error_rate", "tool errors", ".0%"),
        ("rollout/response_length", "length (tok)", ".0f"),
        ("learner/entropy", "entropy", ".3f"),
        ("rollout/tokens_per_s", "rollout tok/s", ",.0f"),
        ("learner/tokens_per_s", "learner tok/s", ",.0f"),
        ("step/seconds", "step seconds", ".2f"),
    ]
    return Group(_curves(state, rows, "training"), evals(state, last_only=True))


def evals(state: MonitorState, last_only: bool = False) -> Table:
    table = Table(title="held-out evaluations (95% intervals)", expand=True)
    for name in ("step", "label", "mode", "success", "interval"):
        table.add_column(name)
    rows = state.evals[-4:] if last_only else state.evals
    for r in rows:
        success, low, high = eval_values(r)
        table.add_row(
            str(r["step"]),
            str(r.get("eval/label", "")),
            str(r.get("eval/mode", "")),
            _fmt(success, ".1%"),
            f"[{low:.1%}, {high:.1%}]",
        )
    return table


def envs_tools(state: MonitorState) -> RenderableType:
    last = state.latest(having="rollout/success_rate")
    envs = sorted(k for k in last if k.startswith("env/") and k.endswith("/success_rate"))
    chart = Chart([(state.curve(key), ".0%") for key in envs])
    per_env = Table(title=f"per env (step {last.get('step', '-')}; success curves)", expand=True)
    for name in ("env", "success", "episodes", "reward"):
        per_env.add_column(name)
    per_env.add_column(chart.axis(), no_wrap=True, ratio=1)
    for i, key in enumerate(envs):
        name = key.removeprefix("env/").removesuffix("/success_rate")
        per_env.add_row(
            name,
            _fmt(last[key], ".0%"),
            _fmt(last.get(f"env/{name}/episodes"), ".0f"),  # (none in older runs: -)
            _fmt(last.get(f"env/{name}/reward_mean"), ".2f"),
            chart.row(i),
        )
    names = sorted(
        k.removeprefix("tools/").removesuffix("/calls")
        for k in last
        if k.startswith("tools/") and k.endswith("/calls")
    )
    rates = [f"tools/{name}/failure_rate" for name in names]
    chart = Chart([(state.curve(rate), ".0%") for rate in rates])
    tools = Table(title=f"per tool (step {last.get('step', '-')}; failure curves)", expand=True)
    for name in ("tool", "calls", "failure rate"):
        tools.add_column(name)
    tools.add_column(chart.axis(), no_wrap=True, ratio=1)
    for i, (name, rate) in enumerate(zip(names, rates, strict=True)):
        calls = last[f"tools/{name}/calls"]
        tools.add_row(name, _fmt(calls, ".0f"), _fmt(last.get(rate), ".0%"), chart.row(i))
    counts = Text(
        f"parse errors {_fmt(last.get('rollout/parse_errors'), '.0f')}   env errors "
        f"{_fmt(last.get('rollout/env_errors'), '.0f')}   grader errors "
        f"{_fmt(last.get('rollout/grader_errors'), '.0f')}   truncated "
        f"{_fmt(last.get('rollout/truncated_rate'), '.0%')}"
    )
    return Group(per_env, tools, counts)


def async_weights(state: MonitorState) -> RenderableType:
    rows = [
        ("learner/policy_lag", "policy lag", ".1f"),
        ("learner/staleness_mean", "staleness mean", ".2f"),
        ("learner/staleness_max", "staleness max", ".0f"),
        ("learner/clip_fraction", "clip fraction", ".3f"),
        ("learner/wait_seconds", "learner waits (s)", ".2f"),
        ("learner/idle_share", "learner idle share", ".0%"),
        ("workers/idle_seconds", "workers idle (s)", ".2f"),
        ("workers/paused_seconds", "workers paused (s)", ".2f"),
        ("weights/push_seconds", "weight push (s)", ".3f"),
        ("weights/push_gb_per_s", "push GB/s", ".2f"),
    ]
    last = state.latest(having="learner/staleness_lag")
    lags = [k for k in last if k.startswith("learner/staleness_lag")]
    hist = "  ".join(f"{k.removeprefix('learner/staleness_')} {last[k]:.0f}" for k in lags)
    return Group(_curves(state, rows, "async and weights"), Text(f"staleness (tokens): {hist}"))


def moe(state: MonitorState) -> RenderableType:
    last = state.latest(having="/max_over_mean")
    table = Table(title=f"MoE load (step {last.get('step', '-')})", expand=True)
    for name in ("layer", "max/mean", "min/mean", "cv", "dead experts"):
        table.add_column(name)
    layers = sorted(
        k.removeprefix("moe/").removesuffix("/max_over_mean")
        for k in last
        if k.endswith("/max_over_mean")
    )
    for layer in layers:
        get = lambda s, layer=layer: last.get(f"moe/{layer}/{s}")  # noqa: E731
        table.add_row(
            layer,
            _fmt(get("max_over_mean"), ".2f"),
            _fmt(get("min_over_mean"), ".2f"),
            _fmt(get("cv"), ".2f"),
            _fmt(get("dead_experts"), ".0f"),
        )
    mismatch = _curves(state, [("moe/routing_mismatch", "routing mismatch", ".3f")], "replay")
    return Group(table if layers else Text("no MoE metrics (a dense policy)"), mismatch)


def workers(state: MonitorState, now: float) -> RenderableType:
    last = state.latest()
    table = Table(title="workers and Redis (this step)", expand=True)
    table.add_column("")
    table.add_column("value")
    for key, label in (
        ("workers/answering", "workers answering"),
        ("workers/restarted", "worker restarts"),
        ("workers/restored_episodes", "episodes restored"),
        ("workers/token_share_min", "least worker's share of sampled tokens"),
        ("rollout/errors", "rollout errors"),
        ("learner/skipped_steps", "skipped learner steps"),
        ("redis/stream_entries", "trajectory stream entries"),
        ("redis/used_memory_mb", "Redis memory (MB)"),
        ("stream/dead_letters", "dead letters (undecodable groups, run total)"),
    ):
        table.add_row(label, _fmt(last.get(key), ".4g"))
    alarms = [*state.alarms, *filter(None, [state.stalled(now)])]
    text = "\n".join(f"[b red]![/] {a}" for a in alarms) or "[green]no alarms[/]"
    return Group(table, Panel(Text.from_markup(text), title="alarms"))


def panel_body(state: MonitorState, index: int, now: float) -> RenderableType:
    bodies = (
        lambda: overview(state),
        lambda: evals(state),
        lambda: envs_tools(state),
        lambda: async_weights(state),
        lambda: moe(state),
        lambda: workers(state, now),
    )
    return bodies[index]()


def render(state: MonitorState, now: float) -> RenderableType:
    """The screen: header, the chosen panel, and the newest alarm."""
    parts = [header(state, now), panel_body(state, state.panel, now)]
    alarms = [*state.alarms, *filter(None, [state.stalled(now)])]
    if alarms and state.panel != len(PANELS) - 1:
        parts.append(Text.from_markup(f"[b red]! {alarms[-1]}[/] (panel {len(PANELS)}: all)"))
    return Group(*parts)


def render_all(state: MonitorState, now: float) -> RenderableType:
    """Every panel one under another (`--once`, and the headless test)."""
    return Group(
        header(state, now),
        *(Panel(panel_body(state, i, now), title=PANELS[i]) for i in range(len(PANELS))),
    )
