from __future__ import annotations

import json

import gymnasium
import pytest

import envs  # noqa: F401
from envs.types import assistant, tool_call, tool_result, user
from policy.sampling import SamplingParams
from rollout.demos import render_demonstration
from rollout.episode import EpisodeLimits, run_episodes
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus
from tests.fakes import ScriptedPolicy

TOOLS = gymnasium.make("agentrl/Calculator-v0").unwrapped.tools


def conversation():
    return [
        user("Ana has 3 pens. Then they get 4 more. How many pens does Ana have now?"),
        assistant("", [tool_call("calculate", {"expression": "3 + 4"})]),
        tool_result("calculate", "7"),
        assistant("7"),
    ]


def test_incremental_rendering_equals_the_chat_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = conversation()
    ids, mask = render_demonstration(renderer, messages, TOOLS)
    full = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert renderer.decode(ids) == full.rstrip("\n")
    trained = renderer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == (
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 + 4"}}\n'
        "</tool_call><|im_end|>7<|im_end|>"
    )


def expert_script(tokenizer):
    def script(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]:
            return text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0] + "<|im_end|>"
        question = text.rsplit("<|im_start|>user\n", 1)[1]
        numbers = [w.strip(".") for w in question.split() if w.strip(".").isdigit()]
        op = "-" if any(w in question for w in ("away", "lose", "sell")) else "+"
        call = {"name": "calculate", "arguments": {"expression": f"{numbers[0]} {op} {numbers[1]}"}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"

    return script


def run(tokenizer, script, n=4, **limits):
    envs_ = [gymnasium.make("agentrl/Calculator-v0") for _ in range(n)]
    policy = ScriptedPolicy(tokenizer, script)
    renderer = ChatRenderer(tokenizer)
    params = SamplingParams(max_new_tokens=64, stop_token_ids=(renderer.eos_token_id,))
    trajs = run_episodes(
        envs_,
        list(range(n)),
        [f"t{i}" for i in range(n)],
        policy=policy,
        renderer=renderer,
        sampling=params,
        limits=EpisodeLimits(**limits),
    )
    return trajs, renderer, policy


def test_tool_results_are_never_trained(tokenizer):
    trajs, renderer, policy = run(tokenizer, expert_script(tokenizer))
    assert policy.calls == 2  # all episodes batched together, one generate call per turn
    for traj in trajs:
        assert traj.status is RolloutStatus.COMPLETED and traj.success
        assert traj.num_tool_calls == 1 and traj.num_turns == 2
        assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.sample_logprobs)
        untrained = renderer.decode(
            [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if not m]
        )
        trained = renderer.decode(
            [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        )
        answer = str(traj.outcome["details"]["expected"])
        assert "<tool_response>\n" + answer in untrained
        assert "<tool_response>" not in trained and "<|im_start|>" not in trained
        assert all(
            lp == 0.0 for lp, m in zip(traj.sample_logprobs, traj.loss_mask, strict=True) if not m
        )
        assert traj.prompt_length == traj.loss_mask.index(1)


def test_malformed_calls_become_observations_and_the_episode_continues(tokenizer):
    trajs, renderer, _ = run(
        tokenizer, lambda _: "<tool_call>{oops</tool_call><|im_end|>", n=2, max_turns=3
    )
    for traj in trajs:
        assert traj.status is RolloutStatus.TRUNCATED and traj.num_turns == 3
        assert traj.num_parse_errors == 3 and traj.num_tool_errors == 3
        assert "Error: malformed tool call" in renderer.decode(traj.token_ids)


@pytest.mark.parametrize(
    "near_miss",
    [
        '<TOOL_CALL>{"name": "calculate", "arguments": {}}</TOOL_CALL>',
        '{"name": "calculate", "arguments": {}}</tool_call>',
        '{"name": "calculate", "arguments": {"expression": "3 + 4"}}',
        "<tool_ca",
    ],
)
def test_near_miss_calls_are_parse_errors_and_the_episode_continues(tokenizer, near_miss):
    trajs, renderer, _ = run(tokenizer, lambda _: near_miss + "<|im_end|>", n=1, max_turns=3)
    (traj,) = trajs
    assert traj.status is RolloutStatus.TRUNCATED and traj.num_turns == 3  # never graded
    assert traj.num_parse_errors == 3 and traj.num_tool_errors == 3
    assert "Error: malformed tool call" in renderer.decode(traj.token_ids)


def test_prose_about_tool_calls_is_a_final_answer(tokenizer):
    trajs, _, _ = run(tokenizer, lambda _: "no tool call needed: 7<|im_end|>", n=1, max_turns=3)
    assert trajs[0].status is RolloutStatus.COMPLETED and trajs[0].num_turns == 1
    assert trajs[0].num_parse_errors == 0 and trajs[0].num_tool_calls == 0


def test_turn_without_stop_token_truncates(tokenizer):
    trajs, _, _ = run(tokenizer, lambda _: "1 2 3 4 5 6 7 8 " * 20, n=1)
    assert trajs[0].status is RolloutStatus.TRUNCATED
    assert trajs[0].finish_detail == "turn hit max_new_tokens"


def test_context_limit_truncates(tokenizer):
    trajs, _, _ = run(
        tokenizer,
        lambda _: "<tool_call>{}</tool_call><|im_end|>",
        n=1,
        max_turns=50,
        max_seq_len=300,
    )
    assert trajs[0].finish_detail == "context full"
    assert len(trajs[0].token_ids) <= 300


class _Unrenderable(ChatRenderer):
    """A template that cannot render what an env (or an agent harness) sent."""

    def prompt(self, messages, tools):
        raise ValueError("template cannot render this")

    def observation(self, history, new, tools):
        raise ValueError("template cannot render this")


def test_a_prompt_or_observation_that_does_not_render_ends_only_its_episode(tokenizer):
    from rollout.episode import _Episode, apply_env_step, open_episode

    env = gymnasium.make("agentrl/Calculator-v0")
    traj, tools = open_episode(env, 0, "t#0", _Unrenderable(tokenizer))
    assert traj.status is RolloutStatus.ENV_ERROR and "cannot render" in traj.finish_detail
    traj, tools = open_episode(env, 0, "t#0", ChatRenderer(tokenizer))
    episode = _Episode(env=env, traj=traj, tools=tools)
    call = assistant("", [tool_call("calculate", {"expression": "1 + 1"})])
    assert apply_env_step(episode, lambda: env.step(call), _Unrenderable(tokenizer)) is None
    assert episode.done and episode.traj.status is RolloutStatus.ENV_ERROR
