"""agentrl/Mix-v0 (envs/mixture.py): tasks drawn from several envs by weight, the same seed the
same env and task, gymnasium's checker and ours, save and continue across sub-envs, and the
mixture's expert delegating to each env's own."""

from __future__ import annotations

import json

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.check import check_tool_env
from envs.mixture import MIX_ID, MixtureEnv, parse_envs, pick
from envs.types import HELDOUT_SEEDS, assistant, tool_call

CALC, RETR = "agentrl/Calculator-v0", "agentrl/Retrieval-v0"
TWO = [{"id": CALC, "kwargs": {"difficulty": 1}, "weight": 3}, {"id": RETR, "weight": 1}]


def mix(entries=TWO, **kwargs):
    return gymnasium.make(MIX_ID, envs=entries, **kwargs)


def test_weights_are_respected_for_training_and_held_out_seeds():
    env = mix().unwrapped
    for start in (0, HELDOUT_SEEDS):
        drawn = [env.env_id_for(start + s) for s in range(4000)]
        assert drawn.count(CALC) / len(drawn) == pytest.approx(0.75, abs=0.03)
        assert set(drawn) == {CALC, RETR}
    assert [pick(s, [1.0, 1e-9]) for s in range(200)] == [0] * 200  # a tiny weight: ~never


def test_the_pick_does_not_bias_the_sub_env_tasks():
    # the sub-env is reset with the same seed: were the pick drawn from that seed's own stream,
    # an env with weight w would only see seeds whose first draw is below w (a quarter of them)
    first = np.array([np.random.default_rng(s).random() for s in range(4000)])
    calc = np.array([pick(s, [3, 1]) == 0 for s in range(4000)])
    assert first[~calc].mean() == pytest.approx(0.5, abs=0.04)
    assert first[calc].mean() == pytest.approx(0.5, abs=0.04)


def test_the_same_seed_gives_the_same_env_and_the_same_task():
    env, alone = mix(), {CALC: gymnasium.make(CALC, difficulty=1), RETR: gymnasium.make(RETR)}
    for seed in range(12):
        opening, info = env.reset(seed=seed)
        assert info["env_id"] == env.unwrapped.env_id_for(seed)
        assert env.reset(seed=seed) == (opening, info)
        own, own_info = alone[info["env_id"]].reset(seed=seed)
        assert opening == own and info["tools"] == own_info["tools"]  # the env's own task
        assert env.unwrapped.tools == own_info["tools"]
        assert env.unwrapped.max_turns == alone[info["env_id"]].unwrapped.max_turns


def test_unseeded_resets_draw_training_seeds_only():
    # seeds >= HELDOUT_SEEDS are held-out (and >= DEMO_SEEDS demonstration) tasks: an unseeded
    # reset must never train on them
    env = mix()
    used: list[int] = []

    def recording(reset):
        def wrapped(*, seed=None, options=None):
            used.append(seed)
            return reset(seed=seed, options=options)

        return wrapped

    for sub in env.unwrapped.envs:
        sub.reset = recording(sub.reset)
    env.reset(seed=0)
    for _ in range(200):
        env.reset()
    assert len(used) == 201 and max(used) < HELDOUT_SEEDS
    assert len(set(used[1:])) > 190  # still spread over the training seeds


def test_gymnasium_check_env_and_agentrl_envs_check_pass():
    check_env(mix().unwrapped)
    report = check_tool_env(MIX_ID, kwargs={"envs": TWO}, episodes=3, long_steps=12)
    assert report.passed, report.format()
    assert "tools: calculate, search, open, answer" in report.format()


def test_save_and_continue_across_sub_envs():
    env = mix().unwrapped
    seed = next(s for s in range(100) if env.env_id_for(s) == RETR)
    other = next(s for s in range(100) if env.env_id_for(s) == CALC)
    opening, _ = env.reset(seed=seed)
    env.step(assistant("", [tool_call("search", {"query": opening[0]["content"][12:30]})]))
    state = json.loads(json.dumps(env.get_state()))  # JSON-able, as Redis stores it
    assert state["id"] == RETR and state["index"] == 1
    action = assistant("", [tool_call("open", {"doc_id": 3})])
    expected = env.step(action)
    fresh = mix()
    fresh.reset(seed=other)  # on another sub-env: set_state switches
    fresh.unwrapped.set_state(state)
    assert fresh.step(action)[:4] == expected[:4]
    never_reset = mix().unwrapped  # the sub-env was never reset in this instance
    never_reset.set_state(state)
    assert never_reset.step(action)[:4] == expected[:4]


def test_a_state_of_another_mix_or_env_is_refused():
    env = mix().unwrapped
    env.reset(seed=0)
    state = env.get_state()
    reweighted = mix([{**TWO[0], "weight": 1}, TWO[1]]).unwrapped
    with pytest.raises(ValueError, match="another mix"):
        reweighted.set_state(state)
    with pytest.raises(ValueError, match=r"this env is 'envs\.mixture:MixtureEnv'"):
        env.set_state(env.current.unwrapped.get_state())  # a plain ToolEnv's
    with pytest.raises(RuntimeError, match="before reset"):
        mix().unwrapped.get_state()


def test_expert_demonstrations_cover_every_env_and_succeed():
    env = mix()
    expert = envs.make_expert(MIX_ID, error_rate=0.0, seed=0)
    demos = [envs.demonstrate(env, expert, seed=s) for s in range(24)]
    assert all(d.outcome["success"] for d in demos)
    tools = {d.tools[0]["function"]["name"] for d in demos}
    assert tools == {"calculate", "search"}  # both envs, each solved by its own expert
    again = envs.make_expert(MIX_ID, error_rate=0.0, seed=0)
    assert [envs.demonstrate(env, again, seed=s).messages for s in range(24)] == [
        d.messages for d in demos
    ]


def test_the_same_id_twice_is_told_apart():
    env = mix(
        [{"id": CALC, "kwargs": {"difficulty": 1}}, {"id": CALC, "kwargs": {"difficulty": 4}}]
    )
    assert env.unwrapped.labels == [f"{CALC}[0]", f"{CALC}[1]"]
    assert {env.unwrapped.env_id_for(s) for s in range(20)} == set(env.unwrapped.labels)


def test_max_turns_is_passed_to_every_env():
    env = mix(max_turns=7).unwrapped
    assert [e.unwrapped.max_turns for e in env.envs] == [7, 7]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "non-empty list"),
        ([{"id": CALC, "weight": 0}], r"envs\[0\].weight must be > 0"),
        ([{"id": CALC, "weight": float("inf")}], r"envs\[0\].weight must be > 0"),
        ([{"id": CALC}, {"id": CALC, "wieght": 2}], r"envs\[1\] has unknown key 'wieght'"),
        ([{"kwargs": {}}], r"envs\[0\].id must be a registered env id"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(entries, message):
    with pytest.raises(ValueError, match=message):
        parse_envs(entries)


def test_an_unknown_id_names_the_entry_and_the_closest_id():
    with pytest.raises(envs.RegistrationError, match="did you mean 'agentrl/Retrieval-v0'") as info:
        MixtureEnv(envs=[{"id": CALC}, {"id": "agentrl/Retreival-v0"}])
    assert any("envs[1]" in note for note in info.value.__notes__)
