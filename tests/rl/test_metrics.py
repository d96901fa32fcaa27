from __future__ import annotations

import json

from rl.observe.metrics import (
    CollapseDetector,
    MetricsLogger,
    eval_record,
    eval_values,
    redis_metrics,
    rollout_metrics,
)
from rollout.keys import RunKeys
from rollout.stream import RedisGroupReader


def test_collapse_is_reported_once():
    detector = CollapseDetector(window=3, drop=0.3)
    messages = [detector.update(v) for v in [0.9, 0.9, 0.9, 0.8, 0.5, 0.3, 0.2, 0.1]]
    alarms = [m for m in messages if m]
    assert len(alarms) == 1 and "REWARD COLLAPSE" in alarms[0]
    assert detector.collapsed


def test_no_collapse_on_noise():
    detector = CollapseDetector(window=5, drop=0.3)
    assert not any(detector.update(v) for v in [0.6, 0.7, 0.65, 0.8, 0.75, 0.7, 0.85, 0.8] * 3)


def test_rollout_metrics_add_up_workers():
    base = {
        "episodes": 4,
        "successes": 2,
        "reward_sum": 2.0,
        "reward_sq_sum": 2.0,
        "turns": 8,
        "tool_calls": 4,
        "tool_errors": 1,
        "parse_errors": 0,
        "episodes_with_tool_call": 4,
        "generated_tokens": 100,
        "truncated": 0,
        "errors": 0,
        "seconds": 2.0,
    }
    m = rollout_metrics(
        [base, dict(base, successes=4, reward_sum=4.0, reward_sq_sum=4.0, seconds=4.0)]
    )
    assert m["rollout/success_rate"] == 0.75 and m["reward/mean"] == 0.75
    assert m["rollout/tool_error_rate"] == 0.25 and m["rollout/tokens_per_s"] == 50.0


def test_logger_writes_jsonl_tensorboard_and_redis(tmp_path, redis_server):
    client = redis_server.client()
    log = MetricsLogger(tmp_path, client=client, stream="m", tensorboard=True)
    log.log(1, {"reward/mean": 0.5})
    log.log(2, {"reward/mean": 0.7})
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["reward/mean"] for x in lines] == [0.5, 0.7]
    assert client.xlen("m") == 2
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_each_evaluation_has_its_own_tensorboard_tag_and_jsonl_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, client=None, stream="", tensorboard=True)
    for label, step in (("sft", 0), ("grpo", 40)):
        for mode in ("sampled (T=1, 4/task)", "greedy"):
            log.log(step, eval_record(label, mode, 0.5, 0.4, 0.6), phase="eval")
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"eval/sft/sampled/success", "eval/sft/greedy/success"} <= tags
    assert {"eval/grpo/sampled/ci_low", "eval/grpo/greedy/ci_high"} <= tags
    assert not [t for t in tags if t.startswith("eval/eval/")]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [eval_values(r) for r in records] == [(0.5, 0.4, 0.6)] * 4
    old = {"eval/label": "sft", "eval/mode": "greedy", "eval/success": 1.0}
    assert eval_values({**old, "eval/ci_low": 0.9, "eval/ci_high": 1.0}) == (1.0, 0.9, 1.0)


def test_a_step_with_no_finished_episode_shows_what_it_trained():
    """The first async step after a resume trains on groups buffered before the crash: no
    episode finished during it, so the console shows the trained batch, not `reward nan`."""
    from rl.learner.stats import trained_outcomes
    from rl.observe.metrics import console_line
    from rollout.types import Trajectory, TrajectoryGroup

    def traj(reward: float, success: bool) -> Trajectory:
        return Trajectory(
            task_id="t#1",
            token_ids=[1, 2, 3],
            loss_mask=[0, 1, 1],
            reward=reward,
            outcome={"success": success},
        )

    trajs = [traj(1.0, True), traj(0.0, False), traj(1.0, True)]
    group = TrajectoryGroup(group_id="g", task_id="t#1", trajectories=trajs)
    trained = trained_outcomes([group])
    assert trained["learner/success_rate"] == 2 / 3
    line = console_line(1, 10, {"learner/grad_norm": 0.5, **trained})
    assert (
        "trained reward 0.67±0.47 | trained success 67%" in line and "nan" not in line.split("|")[1]
    )
    usual = console_line(
        2, 10, {"reward/mean": 0.5, "reward/std": 0.5, "rollout/success_rate": 0.5, **trained}
    )
    assert "| reward 0.50±0.50 | success 50%" in usual and "trained" not in usual


def test_redis_metrics_count_the_dead_letters_trimmed_ones_included(redis_server):
    client, keys = redis_server.client(), RunKeys("run")
    reader = RedisGroupReader(client, keys.trajectories, group="learner", consumer="c0")
    assert redis_metrics(client, keys.trajectories)["stream/dead_letters"] == 0
    for _ in range(3):
        client.xadd(keys.trajectories, {"group": b"\xff"})
    reader.read(10, block_ms=100)
    client.xtrim(keys.dead_letters, maxlen=0)  # the checkpoint trim (rollout/books.py)
    metrics = redis_metrics(client, keys.trajectories)
    assert metrics["stream/dead_letters"] == 3 and metrics["redis/stream_entries"] == 3
