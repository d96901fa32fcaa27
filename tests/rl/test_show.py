"""`agentrl show` on a run directory written by the trajectory writer (rl/observe/trajlog.py) from
real episodes: the Calculator env, the rollout renderer and parser, the reward package."""

from __future__ import annotations

import io
import json

import gymnasium
import pytest
from rich.console import Console

import envs  # noqa: F401  (registers the built-in envs)
from policy.sampling import SamplingParams
from reward import build_reward
from rl.cli import main
from rl.observe import show as rl_show
from rl.observe import trajlog
from rollout.episode import EpisodeLimits, run_episodes
from rollout.render import ChatRenderer
from rollout.types import TrajectoryGroup
from tests.fakes import ScriptedPolicy


def script(tokenizer, *, right: bool):
    """Call the calculator, then answer with its result (or a wrong number)."""

    def answer(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]:
            result = text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
            return (result if right else "999") + "<|im_end|>"
        question = text.rsplit("<|im_start|>user\n", 1)[1]
        a, b = [w.strip(".") for w in question.split() if w.strip(".").isdigit()][:2]
        call = {"name": "calculate", "arguments": {"expression": f"{a} + {b}"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"

    return answer


def episodes(tokenizer, *, right: bool, seeds: list[int], version: int):
    policy = ScriptedPolicy(tokenizer, script(tokenizer, right=right))
    policy.version = version
    renderer = ChatRenderer(tokenizer)
    trajs = run_episodes(
        [gymnasium.make("agentrl/Calculator-v0") for _ in seeds],
        seeds,
        [f"agentrl/Calculator-v0#{s}" for s in seeds],
        policy=policy,
        renderer=renderer,
        sampling=SamplingParams(max_new_tokens=64, stop_token_ids=(renderer.eos_token_id,)),
        limits=EpisodeLimits(max_turns=3),
    )
    scorer = build_reward({"task_completion": 1.0, "invalid_tool_call": 0.1})
    for t in trajs:
        scored = scorer(t)
        t.reward, t.reward_parts = scored.total, scored.parts
    return trajs


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer):
    """Two steps of records: step 1 a group of two right and two wrong answers, step 2 one
    all-right group that DAPO would filter as flat."""
    run = tmp_path_factory.mktemp("run")
    tokenizer.save_pretrained(run / "policy-init")
    mixed = episodes(tokenizer, right=True, seeds=[3, 3], version=0)
    mixed += episodes(tokenizer, right=False, seeds=[3, 3], version=0)
    group = TrajectoryGroup(group_id="1-0", task_id=mixed[0].task_id, trajectories=mixed)
    entry = {"trained": ["1-0"], "filtered": {}, "failed": {}}
    trajlog.append(run, 1, trajlog.records([group], entry, limit=32, advantages="grpo"))
    flat = episodes(tokenizer, right=True, seeds=[5, 5, 5, 5], version=1)
    group = TrajectoryGroup(group_id="2-0", task_id=flat[0].task_id, trajectories=flat)
    entry = {"trained": [], "filtered": {"flat": ["2-0"]}, "failed": {}}
    trajlog.append(run, 2, trajlog.records([group], entry, limit=32, advantages="grpo"))
    return run


def show(capsys, *args):
    code = main(["show", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_worst_trajectory_reads_as_a_transcript(run_dir, capsys):
    code, out, _ = show(capsys, run_dir, "--worst")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("trajectory 1-0/2 · step 1 · task agentrl/Calculator-v0#3")
    assert "trained (advantage -0.866)" in lines[0]
    assert "reward 0.000 (terms: task_completion +0.000, invalid_tool_call +0.000)" in lines[1]
    assert "success no · completed (env terminated)" in lines[1]
    assert lines[2].startswith("2 turns · 1 tool call (0 failed, 0 unparsable) · 152 tokens")
    assert "policy v0" in lines[2]
    assert any("prompt · masked" in x for x in lines)
    assert any("turn 1 · sampled" in x and "policy v0" in x for x in lines)
    assert any("tool output / template · masked" in x for x in lines)
    assert any("turn 2 · sampled" in x for x in lines)
    assert '{"name": "calculate", "arguments": {"expression":' in out  # the sampled tool call
    assert "<tool_response>" in out and "999<|im_end|>" in out  # tool output, wrong answer
    assert "\x1b[" not in out  # plain text when not a terminal
    # segments in order: prompt, turn 1, tool output, turn 2
    order = [x.split(" · ")[0].strip("─ ") for x in lines if " · " in x and "─" in x]
    assert order == ["prompt", "turn 1", "tool output / template", "turn 2"]


def test_best_id_step_and_list(run_dir, capsys):
    code, out, _ = show(capsys, run_dir, "--best", "--step", "1")
    assert code == 0 and out.startswith("trajectory 1-0/0 · step 1")
    assert "reward 1.000" in out and "success yes" in out and "(advantage +0.866)" in out
    code, out, _ = show(capsys, run_dir, "--id", "2-0/3")
    assert code == 0 and out.startswith("trajectory 2-0/3 · step 2")
    assert "filtered: flat (advantage +0.000)" in out and "policy v1" in out
    code, out, _ = show(capsys, run_dir)  # no flag: the last one recorded
    assert out.startswith("trajectory 2-0/3")
    code, out, _ = show(capsys, run_dir, "--step", "1", "--list")
    ids = [line.split()[1] for line in out.splitlines()[1:]]
    assert code == 0 and ids == ["1-0/0", "1-0/1", "1-0/2", "1-0/3"]


def test_clear_errors(run_dir, tmp_path, capsys):
    code, _, err = show(capsys, run_dir, "--id", "nope")
    assert code == 2 and "no trajectory 'nope' (ids look like 1-0/0" in err
    code, _, err = show(capsys, run_dir, "--step", "9")
    assert code == 2 and "no trajectory recorded for step 9; recorded steps: 1..2" in err
    code, _, err = show(capsys, tmp_path)
    assert code == 2 and "is not a run directory (no config.yaml, no trajectories.jsonl)" in err
    (tmp_path / "config.yaml").write_text("name: fresh\n")  # a run that recorded nothing yet
    code, _, err = show(capsys, tmp_path)
    assert code == 2 and "trajectories.jsonl is missing or empty" in err
    with pytest.raises(SystemExit):
        main(["show", str(run_dir), "--worst", "--best"])


def test_colour_on_a_terminal(run_dir, tokenizer):
    out = io.StringIO()
    record = trajlog.read(run_dir)[0]
    rl_show.show(record, tokenizer.decode, Console(file=out, force_terminal=True, width=100))
    assert "\x1b[" in out.getvalue() and "sampled: green (trained on)" in out.getvalue()


def test_records_are_compact_and_exact(tokenizer):
    trajs = episodes(tokenizer, right=True, seeds=[1, 2], version=4)
    groups = [
        TrajectoryGroup(group_id=f"7-{i}", task_id=t.task_id, trajectories=[t])
        for i, t in enumerate(trajs * 4)
    ]
    entry = {"trained": [g.group_id for g in groups]}
    recs = trajlog.records(groups, entry, limit=3, advantages="none")
    assert [r["group"] for r in recs] == ["7-0", "7-2", "7-5"]  # spread over the batch
    assert all(r["advantage"] is None for r in recs)  # PPO: no group advantage
    rec, traj = recs[0], trajs[0]
    assert rec["tokens"] == traj.token_ids and trajlog.expand(rec["mask"]) == traj.loss_mask
    assert trajlog.expand(rec["versions"]) == traj.token_versions
    assert len(rec["mask"]) == 4 and {v for v, _ in rec["versions"]} == {-1, 4}
    assert trajlog.records(groups, entry, limit=0, advantages="grpo") == []
