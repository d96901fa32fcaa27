"""`agentrl monitor`, headless: two recorded metrics streams drawn through rich's recording
console (the first 10 steps of a `make run` quickstart: K3, tools, MoE, evaluations; an 8-step
tiny async run in which a rollout worker was SIGKILLed and restarted); the Redis source against
a real redis-server; alarms; keys; the CLI."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from rl.cli import main
from rl.observe.metrics import MetricsLogger, eval_record
from rl.observe.monitor import JsonlSource, RedisSource
from rl.observe.monitor_state import MAX_POINTS, PANELS, Curve, MonitorState, ema
from rl.observe.monitor_view import render, render_all
from rl.run.launch import start_redis
from rollout.keys import RunKeys

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "monitor_quickstart.jsonl"
RESTARTED = DATA / "monitor_async_restart.jsonl"


def text(renderable) -> str:
    console = Console(file=io.StringIO(), width=140, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def recorded_state(path: Path = RECORDED, **kwargs) -> MonitorState:
    state = MonitorState(**kwargs)
    state.add(JsonlSource(path).poll(), now=0.0)
    return state


def test_every_panel_of_a_recorded_quickstart():
    state = recorded_state(total_steps=40)
    out = text(render_all(state, now=1.0))
    assert "step 10/40  (live, 0 alarms)" in out
    for panel in PANELS:
        assert panel in out
    assert "agentrl/Calculator-v0" in out  # per env
    assert "calculate" in out  # per tool
    assert "layers.1.mlp" in out  # MoE load per layer
    assert "weight push (s)" in out and "staleness mean" in out
    assert "[62.0%, 68.3%]" in out  # the SFT evaluation's interval
    assert "min 1 ───── 10 max" in out  # 10 steps: one bar a step, and the scale around them
    assert "no alarms" in out


def test_a_restarted_worker_raises_one_alarm():
    state = recorded_state(RESTARTED, total_steps=8)
    state.finished = True
    out = text(render_all(state, now=1e6))  # finished: never stalled
    assert "step 8/8  (finished, 1 alarms)" in out
    assert "a rollout worker restarted (1 so far)" in out  # the SIGKILLed worker
    assert "episodes restored" in out and "workers answering" in out
    assert "dead letters (undecodable groups, run total)" in out


def test_one_panel_at_a_time_and_keys_switch_it():
    state = recorded_state()
    assert "per tool" not in text(render(state, now=1.0))
    assert state.key("3") and "per tool" in text(render(state, now=1.0))
    assert state.key("\t") and state.panel == 3
    assert state.key("p") and state.panel == 2
    assert state.key("9") and state.panel == 2  # no such panel: nothing happens
    assert not state.key("q")


def test_alarms_nan_collapse_silent_worker_and_stall():
    state = MonitorState(collapse_window=2, collapse_drop=0.3, stall_after_s=60)
    good = {"phase": "train", "rollout/success_rate": 0.9, "workers/answering": 2.0}
    state.add([{**good, "step": 1}, {**good, "step": 2}], now=0.0)
    assert state.alarms == [] and state.stalled(now=59.0) is None
    bad = {"phase": "train", "rollout/success_rate": 0.1, "workers/answering": 1.0}
    state.add([{**bad, "step": 3, "learner/loss": float("nan")}, {**bad, "step": 4}], now=1.0)
    joined = "\n".join(state.alarms)
    assert "NaN/inf at step 3: learner/loss" in joined
    assert "REWARD COLLAPSE" in joined
    assert "1 rollout worker(s) silent" in joined
    assert "no metrics for 61 s" in state.stalled(now=62.0)
    state.finished = True
    assert state.stalled(now=1000.0) is None


def test_a_worker_that_samples_nothing_for_three_steps_raises_one_alarm():
    state = MonitorState()
    shares = [0.0, 0.4, 0.0, 0.0, None, 0.0, 0.0, 0.0]  # None: a step without the figure
    records = [{"phase": "train", "step": i + 1} for i in range(len(shares))]
    for record, share in zip(records, shares, strict=True):
        if share is not None:
            record["workers/token_share_min"] = share
    state.add(records, now=0.0)
    assert state.alarms == [
        "step 6: a rollout worker sampled nothing for 3 steps in a row (waiting on tools, held "
        "back by trainer.max_staleness, or given no tasks)"
    ]


def test_the_file_source_returns_complete_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    source = JsonlSource(path)
    assert source.poll() == []  # not written yet
    line = json.dumps({"step": 1, "phase": "train", "reward/mean": 0.5})
    path.write_text(line[:10])
    assert source.poll() == []
    with path.open("a") as fh:
        fh.write(line[10:] + "\n")
    assert source.poll() == [json.loads(line)]
    assert source.poll() == []


def test_the_redis_source_follows_the_runs_stream(tmp_path):
    server = start_redis(tmp_path / "redis")
    try:
        client = server.client()
        stream = RunKeys("r1").metrics  # what the run writes to (rl/run/train.py)
        log = MetricsLogger(tmp_path, client=client, stream=stream, tensorboard=False)
        source = RedisSource(client, "r1")
        log.log(1, {"reward/mean": 0.25})
        log.log(2, {"reward/mean": 0.5})
        assert [r["step"] for r in source.poll(timeout=1.0)] == [1, 2]
        assert source.poll() == []
        log.log(0, eval_record("sft", "greedy", 0.5, 0.4, 0.6), phase="eval")
        state = MonitorState()
        state.add(source.poll(timeout=1.0), now=0.0)
        assert state.evals[0]["eval/sft/greedy/success"] == 0.5
    finally:
        server.stop()


def test_the_cli_prints_a_finished_run_once(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RESTARTED, run / "metrics.jsonl")
    (run / "config.yaml").write_text("trainer:\n  steps: 8\n")
    (run / "summary.json").write_text("{}")
    assert main(["monitor", str(run), "--once"]) == 0
    out = capsys.readouterr().out
    assert "step 8/8" in out and "finished" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["monitor"], "name a run directory"), (["monitor", "--redis", "redis://x"], "--run")],
)
def test_the_cli_says_what_is_missing(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_cli_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["monitor", str(tmp_path), "--once"]) == 2
    assert "not a run directory" in capsys.readouterr().err


def rising(step: int) -> float:
    """0.2 for steps 1..500, then rising by 0.001 a step to 0.7 at step 1000."""
    return 0.2 + max(0, step - 500) / 1000


def test_a_thousand_steps_are_drawn_whole_with_their_scale():
    state = MonitorState()
    state.add(
        [{"phase": "train", "step": s, "reward/mean": rising(s)} for s in range(1, 1001)], 0.0
    )
    lines = text(render(state, now=1.0)).splitlines()
    axis = next(line for line in lines if "min 1 ─" in line)
    row = next(line for line in lines if "│ reward " in line)
    assert "─ 1000 max" in axis and "steps, " in axis and " a column " in axis
    low, bars, high = row.split("│")[2].split()
    assert low == "0.20" and bars[0] == "▁" and bars[-1] == "█"
    assert 0.68 <= float(high) <= 0.70  # the last column's mean EMA: just under the last value
    assert axis.index("min 1 ─") + 4 == row.index(bars)  # step 1 is over the first bar
    assert axis.index("1000 max") + 3 == row.index(bars) + len(bars) - 1  # and 1000 the last
    assert row.split("│")[3].strip() == "0.70" and row.split("│")[4].strip() == "0.70"


def test_downsampling_keeps_the_means_of_a_constant_then_rising_series():
    def fed(cap: int, steps: int) -> Curve:
        curve = Curve(cap=cap)
        for s in range(1, steps + 1):
            curve.add(s, rising(s))
        return curve

    whole = fed(cap=2048, steps=1000)  # one bucket a step; 50 columns of 20 steps
    first, *_, last = whole.columns(50)
    assert (first["mean"], first["smooth"]) == pytest.approx((0.2, 0.2))
    assert (first["min"], first["max"], first["count"]) == (0.2, 0.2, 20)
    assert last["mean"] == pytest.approx(sum(rising(s) for s in range(981, 1001)) / 20)
    assert (last["min"], last["max"], last["count"]) == (rising(981), 0.7, 20)
    merged = fed(cap=64, steps=1024)  # merged four times: 64 buckets of 16 steps, 2 a column
    assert len(merged) == 64 and merged.per == 16 and merged.first[0] == 1
    first, *_, last = merged.columns(32)
    assert first["mean"] == pytest.approx(0.2) and first["count"] == 32
    assert last["mean"] == pytest.approx(sum(rising(s) for s in range(993, 1025)) / 32)
    assert sum(c["count"] for c in merged.columns(32)) == 1024
    assert len(merged.columns(2000)) == 1024  # never wider than the steps: one column a step


def test_the_smoothing_is_per_step_however_far_a_curve_is_downsampled():
    values = [0.5, 0.9, 0.1, 0.7, 0.3, 0.8, 0.6, float("nan")]
    short, coarse = Curve(), Curve(cap=2)
    for step, value in enumerate(values, start=1):
        short.add(step, value)
        coarse.add(step, value)
    finite = [v for v in values if v == v]
    assert [c["smooth"] for c in short.columns(24) if c] == pytest.approx(ema(finite))
    assert short.smoothed == coarse.smoothed == pytest.approx(ema(finite)[-1])  # NaN skipped
    assert short.last != short.last and short.points == 7  # but shown as the last value
    assert len(coarse) == 2 and sum(c["count"] for c in coarse.columns(24) if c) == 7


def test_a_hundred_thousand_records_stay_under_the_cap():
    state = MonitorState()
    for start in range(0, 100_000, 10_000):
        state.add(
            [
                {"phase": "train", "step": s, "reward/mean": s % 7 / 7, "step/seconds": 3.0}
                for s in range(start + 1, start + 10_001)
            ],
            now=0.0,
        )
    assert set(state.curves) == {"reward/mean", "step/seconds"}
    for curve in state.curves.values():
        assert len(curve) <= MAX_POINTS and curve.points == 100_000
        assert (curve.first[0], curve.final[-1], sum(curve.count)) == (1, 100_000, 100_000)
    reward = state.curves["reward/mean"]
    assert sum(reward.total) / 100_000 == pytest.approx(
        sum(s % 7 / 7 for s in range(1, 100_001)) / 1e5
    )
    assert (min(reward.low), max(reward.high)) == (0.0, 6 / 7)
    assert state.latest()["step"] == 100_000
    out = text(render(state, now=1.0))
    assert "min 1 ─" in out and "─ 100000 max" in out
