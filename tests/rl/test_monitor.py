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
from rl.observe.monitor_state import PANELS, MonitorState
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
    assert "no alarms" in out


def test_a_restarted_worker_raises_one_alarm():
    state = recorded_state(RESTARTED, total_steps=8)
    state.finished = True
    out = text(render_all(state, now=1e6))  # finished: never stalled
    assert "step 8/8  (finished, 1 alarms)" in out
    assert "a rollout worker restarted (1 so far)" in out  # the SIGKILLed worker
    assert "episodes restored" in out and "workers answering" in out


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
