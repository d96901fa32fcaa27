"""Reward terms, their weights from a run file, grader errors, and the per-part, per-env and
per-tool metrics."""

from __future__ import annotations

import json
import math

import gymnasium
import pytest

from policy.sampling import SamplingParams
from reward import build_reward
from rl.config.runfile import ConfigError, load_config
from rl.observe.metrics import rollout_metrics
from rollout.episode import EpisodeLimits
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Trajectory
from rollout.worker import RolloutWorker, Task, summarize
from tests.fakes import ScriptedPolicy


def traj(**kwargs) -> Trajectory:
    t = Trajectory(task_id="agentrl/Calculator-v0#1", status=RolloutStatus.COMPLETED)
    for key, value in kwargs.items():
        setattr(t, key, value)
    return t


def test_terms_and_weights_with_a_breakdown():
    fn = build_reward({"task_completion": 1.0, "invalid_tool_call": -0.1, "length": -0.5})
    t = traj(outcome={"success": True}, num_tool_errors=2, num_parse_errors=1, loss_mask=[1] * 400)
    scored = fn(t)
    assert scored.parts == {"task_completion": 1.0, "invalid_tool_call": 3.0, "length": 0.4}
    assert math.isclose(scored.total, 1.0 - 0.3 - 0.2)


def test_unknown_terms_and_non_finite_values_are_errors():
    with pytest.raises(KeyError, match="known"):
        build_reward({"task_complete": 1.0})
    fn = build_reward({"length": -1.0})
    with pytest.raises(ValueError, match="returned nan"):
        fn.terms[0] = ("length", lambda t: type("R", (), {"total": float("nan")})(), -1.0)
        fn(traj())


def test_the_run_file_reward_section_is_validated(tmp_path):
    cfg = load_config(None, ["reward.invalid_tool_call=-0.1", "reward.length=-0.05"])
    assert cfg.reward.weights() == {
        "task_completion": 1.0,
        "invalid_tool_call": -0.1,
        "length": -0.05,
    }
    assert load_config(None, []).reward.weights() == {"task_completion": 1.0}
    for override, fragment in [
        ("reward.length=0.3", "penalty"),
        ("reward.task_completion=0", "nothing to learn"),
        ("reward.lenght=-1", "did you mean 'length'"),
        ("reward.invalid_tool_call=.nan", "finite"),
    ]:
        with pytest.raises(ConfigError, match=fragment) as info:
            load_config(None, [override])
        assert info.value.key.startswith("reward.")


def worker(tokenizer, scorer) -> RolloutWorker:
    def script(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]:
            return "42<|im_end|>"
        call = {"name": "calculate", "arguments": {"expression": "6 * 7"}}
        bad = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>{bad}<|im_end|>"

    return RolloutWorker(
        env_factory=lambda: gymnasium.make("agentrl/Calculator-v0"),
        env_id="agentrl/Calculator-v0",
        policy=ScriptedPolicy(tokenizer, script),
        renderer=ChatRenderer(tokenizer),
        scorer=scorer,
        sink=None,
        limits=EpisodeLimits(max_turns=3, max_seq_len=1024),
    )


def collect(w: RolloutWorker, tokenizer) -> dict:
    params = SamplingParams(max_new_tokens=96, stop_token_ids=(tokenizer.eos_token_id,))
    return w.collect([Task(seed=s, group_id=str(s)) for s in range(3)], 2, params)


def test_a_raising_or_nan_reward_is_a_counted_grader_error(tokenizer):
    calls = {"n": 0}

    def flaky(t):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("grader broke")
        total = float("nan") if calls["n"] % 3 == 1 else 1.0
        return type("R", (), {"total": total, "parts": {"task_completion": total}})()

    stats = collect(worker(tokenizer, flaky), tokenizer)
    assert stats["episodes"] == 6 and stats["grader_errors"] == 4 and stats["scored"] == 2
    metrics = rollout_metrics([stats])
    assert metrics["rollout/grader_errors"] == 4 and metrics["reward/mean"] == 1.0


def test_metrics_break_down_by_part_env_and_tool(tokenizer):
    scorer = build_reward({"task_completion": 1.0, "invalid_tool_call": -0.1})
    stats = collect(worker(tokenizer, scorer), tokenizer)
    other = summarize([traj(task_id="demo/Other-v0#3", outcome={"success": True})], seconds=1.0)
    m = rollout_metrics([stats, other])
    assert m["tools/calculate/calls"] == 6 and m["tools/calculate/failure_rate"] == 0.0
    assert m["tools/(invalid)/calls"] == 6 and m["tools/(invalid)/failure_rate"] == 1.0
    assert m["env/demo/Other-v0/success_rate"] == 1.0
    assert 0.0 <= m["env/agentrl/Calculator-v0/success_rate"] <= 1.0
    assert m["reward/invalid_tool_call"] == pytest.approx(6 / 7)
    assert m["rollout/grader_errors"] == 0 and m["rollout/env_errors"] == 0


def test_tool_messages_without_text_content_are_counted_not_fatal():
    """A plugin env's tool message may carry no text (content None, or a list of parts): the
    worker's counters (sync collect, async drain) count the call instead of raising, which in
    async mode would now stop the run (rl/run/async_loop.py _answer)."""
    messages = [
        {"role": "tool", "name": "look", "content": None},
        {"role": "tool", "name": "look", "content": [{"type": "text", "text": "Error: x"}]},
        {"role": "tool", "name": "look", "content": "Error: bad"},
    ]
    stats = summarize([traj(messages=messages, outcome={"success": False})], seconds=1.0)
    assert stats["tool/look/calls"] == 3 and stats["tool/look/failures"] == 1


class StepCost(gymnasium.Wrapper):
    """The calculator with a shaped native reward: -0.25 per step on top of its 1.0 on success."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward - 0.25, terminated, truncated, info


class ListSink:
    def __init__(self):
        self.groups = []

    def put(self, group):
        self.groups.append(group)


@pytest.mark.parametrize("weights", [{"env_reward": 1.0}, {"task_completion": 1.0}])
def test_the_env_reward_counts_only_through_the_env_reward_term(tokenizer, weights):
    """reward/ alone decides what is trained on; the env's own step rewards are summed into
    Trajectory.env_reward and matter only when the run file weights the env_reward term."""
    w = worker(tokenizer, build_reward(weights))
    w.env_factory, w.sink = (lambda: StepCost(gymnasium.make("agentrl/Calculator-v0"))), ListSink()
    collect(w, tokenizer)
    trajs = [t for group in w.sink.groups for t in group.trajectories]
    assert len(trajs) == 6
    for t in trajs:  # one tool turn, then the answer: two env steps
        assert t.env_reward == pytest.approx(float(t.success) - 0.5)
        expected = t.env_reward if "env_reward" in weights else float(t.success)
        assert t.reward == pytest.approx(expected)
    assert any(t.env_reward != float(t.success) for t in trajs)  # the two sources differ
