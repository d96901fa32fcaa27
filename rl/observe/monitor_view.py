"""The panels of `agentrl monitor`, drawn with rich from a `MonitorState`
(rl/observe/monitor_state.py)."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rl.observe.metrics import eval_values
from rl.observe.monitor_state import PANELS, MonitorState, ema

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 24) -> str:
    values = [v for v in values[-width:] if math.isfinite(v)]
    if not values:
        return ""
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(BARS[min(int((v - low) / span * len(BARS)), len(BARS) - 1)] for v in values)


def _fmt(value: object, spec: str = ".3g") -> str:
    if isinstance(value, int | float):
        return format(value, spec)
    return "-" if value is None else str(value)


def _curve(state: MonitorState, key: str, label: str, spec: str = ".2f") -> list[str]:
    raw = state.series(key)
    if not raw:
        return [label, "", "-", "-"]
    smooth = ema(raw)
    return [label, sparkline(smooth), format(raw[-1], spec), format(smooth[-1], spec)]


def _curves(state: MonitorState, rows: list[tuple[str, str, str]], title: str) -> Table:
    table = Table(title=title, expand=True)
    table.add_column("", no_wrap=True, min_width=14)
    table.add_column("curve (EMA 0.3, last 24 steps)", no_wrap=True, min_width=24)
    table.add_column("last", no_wrap=True, min_width=7, justify="right")
    table.add_column("smoothed", no_wrap=True, min_width=8, justify="right")
    for key, label, spec in rows:
        table.add_row(*_curve(state, key, label, spec))
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
    per_env = Table(title="per env", expand=True)
    for name in ("env", "success", "curve"):
        per_env.add_column(name)
    for key in sorted(k for k in last if k.startswith("env/") and k.endswith("/success_rate")):
        name = key.removeprefix("env/").removesuffix("/success_rate")
        per_env.add_row(name, _fmt(last[key], ".0%"), sparkline(ema(state.series(key))))
    tools = Table(title=f"per tool (step {last.get('step', '-')})", expand=True)
    for name in ("tool", "calls", "failure rate", "failure curve"):
        tools.add_column(name)
    for key in sorted(k for k in last if k.startswith("tools/") and k.endswith("/calls")):
        name = key.removeprefix("tools/").removesuffix("/calls")
        rate = f"tools/{name}/failure_rate"
        tools.add_row(
            name, _fmt(last[key], ".0f"), _fmt(last.get(rate), ".0%"), sparkline(state.series(rate))
        )
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
