"""The barrier-free agent loop (rollout/agent.py) on a scripted session: the same trajectories as
the per-turn loop, episodes at different turns in one decode step, a slow tool that stalls only
its own episode, tool timeouts, and per-token policy versions across a weight update."""

from __future__ import annotations

import threading
import time

import gymnasium
import numpy as np
import pytest

import envs  # noqa: F401
from envs.calculator import CalculatorEnv
from envs.tools import tool
from policy.sampling import SamplingParams
from rollout.agent import AgentLoop, Episode, RouteBuffer, _extend_routes, run_all, start_episode
from rollout.episode import EpisodeLimits, run_episodes
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Trajectory
from tests.fakes import ScriptedPolicy, ScriptedSession
from tests.rollout.test_render_and_episode import expert_script


def params_for(renderer, max_new_tokens=64):
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(renderer.eos_token_id,))


def episodes(renderer, n, make_env=None):
    make_env = make_env or (lambda: gymnasium.make("agentrl/Calculator-v0"))
    return [start_episode(make_env(), seed, f"g/{seed}", f"t{seed}", renderer) for seed in range(n)]


def fields(traj):
    return (
        traj.token_ids,
        traj.loss_mask,
        traj.sample_logprobs,
        traj.messages,
        traj.status,
        traj.finish_detail,
        traj.num_turns,
        traj.num_tool_calls,
        traj.outcome,
    )


def test_same_trajectories_as_the_per_turn_loop(tokenizer):
    renderer = ChatRenderer(tokenizer)
    for script, limits in (
        (expert_script(tokenizer), EpisodeLimits()),
        (lambda _: "<tool_call>{oops</tool_call><|im_end|>", EpisodeLimits(max_turns=3)),
        (lambda _: "1 2 3 4 5 6 7 8 " * 20, EpisodeLimits()),
        (
            lambda _: "<tool_call>{}</tool_call><|im_end|>",
            EpisodeLimits(max_turns=50, max_seq_len=300),
        ),
    ):
        old = run_episodes(
            [gymnasium.make("agentrl/Calculator-v0") for _ in range(4)],
            list(range(4)),
            [f"t{i}" for i in range(4)],
            policy=ScriptedPolicy(tokenizer, script),
            renderer=renderer,
            sampling=params_for(renderer),
            limits=limits,
        )
        loop = AgentLoop(ScriptedSession(tokenizer, script), renderer, limits)
        new = run_all(loop, episodes(renderer, 4), params_for(renderer), max_live=2)
        assert [fields(t) for t in new] == [fields(t) for t in old]


class SlowEnv(gymnasium.Wrapper):
    def __init__(self, env, delay):
        super().__init__(env)
        self.delay = delay

    def step(self, action):
        time.sleep(self.delay)
        return self.env.step(action)


class HeldEnv(gymnasium.Wrapper):
    """An env whose steps wait until `release` is set (at most 30 s: under the loop's 60 s tool
    timeout); `waits` records, per step, whether it was released (not left to time out)."""

    def __init__(self, env):
        super().__init__(env)
        self.release, self.waits = threading.Event(), []

    def step(self, action):
        self.waits.append(self.release.wait(30))
        return self.env.step(action)


def test_a_slow_tool_stalls_only_its_own_episode(tokenizer):
    renderer = ChatRenderer(tokenizer)
    session = ScriptedSession(tokenizer, expert_script(tokenizer))
    loop = AgentLoop(session, renderer, EpisodeLimits(), deterministic=False)
    eps = episodes(renderer, 3)
    eps[0].env = held = HeldEnv(eps[0].env)
    for e in eps:
        loop.add(e)
    finished = []
    while loop.live:
        finished += [e.key for e in loop.tick(params_for(renderer))]
        if {"g/1", "g/2"} <= set(finished):
            held.release.set()  # episode 0's tool answers only once the others have finished
        if loop.idle():
            loop.wait_tools(0.02)
    # the others finished while episode 0 was held in its tool (had the loop waited on that
    # tool, nothing would have released it: its wait would have run out instead)
    assert sorted(finished[:2]) == ["g/1", "g/2"] and finished[2:] == ["g/0"]
    assert held.waits and all(held.waits), held.waits
    assert all(e.traj.status is RolloutStatus.COMPLETED for e in eps)
    # while episode 0 waited on its tool, the others decoded their second turn without it
    assert any("g/0" not in keys and "g/1" in keys for keys in session.steps)


def test_a_tool_past_its_timeout_ends_only_that_episode(tokenizer):
    renderer = ChatRenderer(tokenizer)
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)),
        renderer,
        EpisodeLimits(),
        tool_timeout_s=0.3,
        deterministic=False,
    )
    eps = episodes(renderer, 2)
    eps[1].env = SlowEnv(eps[1].env, 2.0)
    trajs = run_all(loop, eps, params_for(renderer), max_live=2)
    assert trajs[0].status is RolloutStatus.COMPLETED
    assert trajs[1].status is RolloutStatus.ENV_ERROR and "timed out" in trajs[1].finish_detail
    assert eps[1].env_broken


class RaisingEnv(gymnasium.Wrapper):
    """An env whose step raises (a harness that failed, an MCP server that died)."""

    def step(self, action):
        raise RuntimeError("the env broke")


def test_an_env_whose_step_raised_is_not_reused(tokenizer):
    renderer = ChatRenderer(tokenizer)
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)), renderer, EpisodeLimits()
    )
    eps = episodes(renderer, 2)
    eps[1].env = RaisingEnv(eps[1].env)
    trajs = run_all(loop, eps, params_for(renderer), max_live=2)
    assert trajs[1].status is RolloutStatus.ENV_ERROR and "the env broke" in trajs[1].finish_detail
    assert eps[1].env_broken and not eps[0].env_broken  # the worker replaces (and closes) it


class HungEnv(gymnasium.Wrapper):
    """An env whose step never returns until `release` is set (a tool that hangs forever)."""

    def __init__(self, env, release):
        super().__init__(env)
        self.release = release

    def step(self, action):
        self.release.wait()
        return self.env.step(action)


def test_env_steps_that_hang_forever_never_starve_the_others(tokenizer):
    """Each timed-out step keeps its pool thread; 20 of them (more than the pool's 16 threads)
    must not leave the next episode's env step queued behind them."""
    renderer = ChatRenderer(tokenizer)
    release = threading.Event()
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)),
        renderer,
        EpisodeLimits(),
        tool_timeout_s=0.2,
        deterministic=False,
    )
    try:
        hung = episodes(
            renderer, 20, lambda: HungEnv(gymnasium.make("agentrl/Calculator-v0"), release)
        )
        trajs = run_all(loop, hung, params_for(renderer), max_live=20)
        assert all(t.status is RolloutStatus.ENV_ERROR for t in trajs)
        (after,) = run_all(loop, episodes(renderer, 1), params_for(renderer), max_live=1)
        assert after.status is RolloutStatus.COMPLETED, after.finish_detail
    finally:
        release.set()


class MeetingEnv(gymnasium.Wrapper):
    """An env whose first step waits until every episode's first step has started (a barrier
    that breaks after `timeout` s): it completes only when all of them run at once."""

    def __init__(self, env, barrier):
        super().__init__(env)
        self.barrier, self.met = barrier, False

    def step(self, action):
        if not self.met:
            self.barrier.wait()
            self.met = True
        return self.env.step(action)


@pytest.mark.parametrize("threads", [24, 16])
def test_a_thread_per_live_episode_runs_every_tool_call_at_once(tokenizer, threads):
    """rollout.tool_threads null gives a thread per live episode: 24 episodes whose first tool
    calls wait for each other all complete; with 16 threads (the old fixed pool), 8 of them
    queue behind the 16 that wait, the barrier breaks and their episodes end as env errors."""
    renderer = ChatRenderer(tokenizer)
    barrier = threading.Barrier(24, timeout=2.0)
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)),
        renderer,
        EpisodeLimits(),
        deterministic=False,
        tool_threads=threads,
    )
    make = lambda: MeetingEnv(gymnasium.make("agentrl/Calculator-v0"), barrier)  # noqa: E731
    trajs = run_all(loop, episodes(renderer, 24, make), params_for(renderer), max_live=24)
    completed = [t.status is RolloutStatus.COMPLETED for t in trajs]
    assert all(completed) if threads == 24 else not any(completed), [t.status for t in trajs]


def test_tokens_carry_the_version_that_sampled_them(tokenizer):
    renderer = ChatRenderer(tokenizer)
    session = ScriptedSession(tokenizer, expert_script(tokenizer))
    loop = AgentLoop(session, renderer, EpisodeLimits())
    (episode,) = episodes(renderer, 1)
    ticks = 0

    def bump():  # a new policy version is installed between two decode steps
        nonlocal ticks
        ticks += 1
        if ticks == 6:
            session.version = 7

    run_all(loop, [episode], params_for(renderer), max_live=1, before_step=bump)
    versions = [
        v for v, m in zip(episode.traj.token_versions, episode.traj.loss_mask, strict=True) if m
    ]
    assert versions[:4] == [0] * 4 and versions[-1] == 7 and set(versions) == {0, 7}
    unsampled = {
        v for v, m in zip(episode.traj.token_versions, episode.traj.loss_mask, strict=True) if not m
    }
    assert unsampled == {-1}


class EchoEnv(gymnasium.Env):
    """Every assistant turn gets a user reply; the episode ends after `turns` turns."""

    def __init__(self, turns=4):
        self.turns, self.count = turns, 0

    def reset(self, *, seed=None, options=None):
        self.count, self.seed_ = 0, seed
        return [{"role": "user", "content": f"Task {seed}: say something."}], {"tools": []}

    def step(self, action):
        self.count += 1
        done = self.count >= self.turns
        reply = [{"role": "user", "content": f"Go on ({self.count}, {self.seed_ * 7})."}]
        return reply, 0.0, done, False, {"outcome": {"success": False}} if done else {}


def test_k3_greedy_episodes_equal_the_re_prefill_path(tokenizer):
    import torch

    from policy.engines import open_session
    from policy.k3 import K3ForCausalLM, k3_preset
    from policy.k3.engine import K3Policy

    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny", vocab_size=len(tokenizer))).eval()
    renderer = ChatRenderer(tokenizer)
    stops = tuple(range(0, len(tokenizer), 4))  # a quarter of the vocabulary ends a turn
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=stops)
    limits = EpisodeLimits(max_turns=4, max_seq_len=1024)
    old = run_episodes(
        [EchoEnv() for _ in range(5)],
        list(range(5)),
        [f"t{i}" for i in range(5)],
        policy=K3Policy(model),
        renderer=renderer,
        sampling=params,
        limits=limits,
    )
    loop = AgentLoop(open_session(K3Policy(model)), renderer, limits)
    eps = [start_episode(EchoEnv(), s, f"g/{s}", f"t{s}", renderer) for s in range(5)]
    new = run_all(loop, eps, params, max_live=3)
    assert sum(t.num_turns for t in old) > 5  # multi-turn episodes, not one turn each
    for a, b in zip(new, old, strict=True):
        assert a.token_ids == b.token_ids and a.num_turns == b.num_turns
        assert a.sample_logprobs == pytest.approx(b.sample_logprobs, abs=1e-4)


def test_memory_aware_admission_never_starts_what_the_budget_cannot_hold(tokenizer):
    """Every live episode reserves twice the cache of a max_seq_len episode; the loop starts no
    more than the budget holds, runs the rest as room frees up, and refuses a budget smaller
    than one episode's reserve, naming the key."""
    renderer = ChatRenderer(tokenizer)
    limits = EpisodeLimits(max_seq_len=1024)
    session = ScriptedSession(tokenizer, expert_script(tokenizer))
    loop = AgentLoop(session, renderer, limits, cache_budget=3 * 2 * 100 * 1024 + 99)
    assert loop.episode_reserve() == 2 * 100 * 1024 and loop.room(max_live=10) == 3
    most = []
    trajs = run_all(
        loop, episodes(renderer, 8), params_for(renderer), max_live=10,
        before_step=lambda: most.append(len(loop.live)),
    )  # fmt: skip
    assert max(most) == 3 and all(t.status is RolloutStatus.COMPLETED for t in trajs)
    small = AgentLoop(session, renderer, limits, cache_budget=2 * 100 * 1024 - 1)
    with pytest.raises(ValueError, match=r"rollout.cache_budget_mb: .*max_seq_len=1024"):
        run_all(small, episodes(renderer, 1), params_for(renderer), max_live=4)


class ResetRaises(gymnasium.Wrapper):
    def reset(self, **kwargs):
        raise RuntimeError("task database unreachable")


def test_a_raising_reset_is_an_env_error_of_its_episode_only(tokenizer):
    """Both loops: the episode is finished as an env error (never trained on), its env is not
    reused, and the other episodes run on."""
    renderer = ChatRenderer(tokenizer)
    make = lambda: gymnasium.make("agentrl/Calculator-v0")  # noqa: E731
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)), renderer, EpisodeLimits()
    )
    eps = [start_episode(ResetRaises(make()), 0, "g/0", "t0", renderer), *episodes(renderer, 3)[1:]]
    assert eps[0].done and eps[0].env_broken
    new = run_all(loop, eps, params_for(renderer), max_live=3)
    old = run_episodes(
        [ResetRaises(make()), make(), make()],
        [0, 1, 2],
        ["t0", "t1", "t2"],
        policy=ScriptedPolicy(tokenizer, expert_script(tokenizer)),
        renderer=renderer,
        sampling=params_for(renderer),
        limits=EpisodeLimits(),
    )
    for trajs in (new, old):
        assert trajs[0].status is RolloutStatus.ENV_ERROR
        assert trajs[0].finish_detail == "reset raised RuntimeError: task database unreachable"
        assert trajs[0].token_ids == [] and not trajs[0].trainable
        assert [t.status for t in trajs[1:]] == [RolloutStatus.COMPLETED] * 2


def test_route_buffer_grows_by_doubling_and_never_rewrites_its_rows():
    """Routes appended a row at a time cost a logarithmic number of growths; views taken earlier
    stay right; lists are accepted, wrong shapes refused; `array` is int16 [n, M, Kx]."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 32767, (1000, 3, 2)).astype(np.int16)  # [n, M, Kx]
    buffer, capacities = RouteBuffer(rows[:5].tolist()), set()
    early = buffer.view()
    for i in range(5, 1000):
        buffer.extend(rows[i : i + 1])
        capacities.add(len(buffer._data_CMK))
    buffer.extend(np.zeros((0, 3, 2), np.int16))
    assert len(buffer) == 1000 and len(capacities) <= 9  # 10, 20, ... 1280
    np.testing.assert_array_equal(early, rows[:5])
    out = buffer.array()
    assert out.dtype == np.int16 and out.flags.c_contiguous and out.base is None
    np.testing.assert_array_equal(out, rows)
    with pytest.raises(ValueError, match="routes"):
        buffer.extend(np.zeros((1, 2, 2), np.int16))
    with pytest.raises(ValueError, match="routes"):
        RouteBuffer([1, 2])


def test_a_restored_episode_skips_the_routes_of_its_history_forwarded_again():
    kept, forwarded = np.full((4, 2, 2), 7, np.int16), np.full((6, 2, 2), 9, np.int16)
    episode = Episode(key="g/0", env=None, traj=Trajectory(task_id="t"),
                      routes=RouteBuffer(kept), skip_routes=4)  # fmt: skip
    _extend_routes(episode, forwarded)  # the history (4 rows) forwarded again, then 2 new
    _extend_routes(episode, None)  # a session that records nothing
    np.testing.assert_array_equal(episode.routes.view(), np.concatenate([kept, forwarded[4:]]))
    assert episode.skip_routes == 0


class SlowToolCalculator(CalculatorEnv):
    """The calculator whose tool answers after its own (tool-level) timeout: the call ends as
    a "timed out" observation and the episode goes on, while the call's thread still runs."""

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression, slowly.

        Args:
            expression: Numbers with + - * / and parentheses.
        """
        time.sleep(1.5)
        return "0"


def test_an_env_whose_timed_out_tool_still_runs_is_not_reused(tokenizer):
    """The episode continues past the tool's timeout (an error observation), but the env is
    marked broken, so the worker closes it instead of giving it to the next episode, whose
    reset the late call could still change."""
    renderer = ChatRenderer(tokenizer)
    loop = AgentLoop(
        ScriptedSession(tokenizer, expert_script(tokenizer)), renderer, EpisodeLimits()
    )
    eps = episodes(renderer, 2)
    eps[1] = start_episode(SlowToolCalculator(tool_timeout_s=0.2), 1, "g/1", "t1", renderer)
    trajs = run_all(loop, eps, params_for(renderer), max_live=2)
    assert trajs[1].status is not RolloutStatus.ENV_ERROR  # not an env error: the episode went on
    assert any("timed out after 0.2 s" in str(m.get("content")) for m in trajs[1].messages)
    assert eps[1].env_broken and not eps[0].env_broken
