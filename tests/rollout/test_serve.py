"""Asynchronous rollouts on a real redis-server: groups are produced atomically (XADD + XACK in one
transaction), a dead worker's tasks are taken over and its episodes continue from their saved
turns (env state included) under a new attempt, and a token budget pauses and saves."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import gymnasium

import envs  # noqa: F401
from envs.calculator import CalculatorEnv
from reward import build_reward
from rollout.agent import AgentLoop, start_episode
from rollout.codec import decode_episode, decode_group
from rollout.episode import EpisodeLimits
from rollout.keys import RunKeys
from rollout.render import ChatRenderer
from rollout.serve import AsyncRollouts, ServeOptions, _encode
from rollout.tasks import TaskQueue
from rollout.types import RolloutStatus
from rollout.worker import RolloutWorker
from tests.fakes import ScriptedSession
from tests.rollout.test_agent import fields, params_for
from tests.rollout.test_codec_stream import sample_group
from tests.rollout.test_render_and_episode import expert_script

KEYS = RunKeys("test")
STREAM = KEYS.trajectories


def make(
    tokenizer, client, consumer, env_factory=None, tool_timeout_s=60.0, session=None, **options
):
    """A worker's serve loop on the calculator env; its turns scripted by the expert (or
    `session`, any DecodeSession)."""
    renderer = ChatRenderer(tokenizer)
    session = session or ScriptedSession(tokenizer, expert_script(tokenizer))
    worker = RolloutWorker(
        env_factory=env_factory or (lambda: gymnasium.make("agentrl/Calculator-v0")),
        env_id="agentrl/Calculator-v0",
        policy=None,
        renderer=renderer,
        scorer=build_reward({"task_completion": 1.0}),
        sink=None,
        limits=EpisodeLimits(),
    )
    loop = AgentLoop(
        session, renderer, EpisodeLimits(), tool_timeout_s=tool_timeout_s, deterministic=False
    )
    queue = TaskQueue(client, KEYS)
    opts = ServeOptions(consumer=consumer, group_size=2, max_episodes=8, **options)
    return AsyncRollouts(worker, queue, loop, opts), queue, renderer


def run_for(serve, renderer, *, ticks=None, until=None):
    count = 0

    def stop():
        nonlocal count
        count += 1
        return (ticks is not None and count > ticks) or (until is not None and until())

    serve.run(
        params_for(renderer), should_stop=stop, install=lambda: None, may_generate=lambda: True
    )


def groups_in(client):
    return {
        g.group_id: g
        for g in (decode_group(f[b"group"]) for _, f in client.xrange(STREAM, "-", "+"))
    }


def test_groups_are_produced_and_their_tasks_acked_together(tokenizer, redis_server):
    client = redis_server.client()
    serve, queue, renderer = make(tokenizer, client, "w0")
    queue.issue([(f"g{i}", i) for i in range(4)])
    run_for(serve, renderer, until=lambda: client.xlen(STREAM) == 4)
    groups = groups_in(client)
    assert sorted(groups) == ["g0", "g1", "g2", "g3"]
    assert queue.backlog() == 0 and queue.produced() == {f"g{i}": 1 for i in range(4)}
    assert not client.keys(KEYS.episodes("*"))  # saved episodes go with the group
    for group in groups.values():
        assert [t.traj_id for t in group.trajectories] == [
            f"{group.group_id}/0",
            f"{group.group_id}/1",
        ]
        assert all(t.success and t.attempt == 1 and t.resumed == 0 for t in group.trajectories)
    finished, counters = serve.drain()  # every sampled token, finished episodes or not
    assert counters["sampled_tokens"] == sum(t.num_generated for t in finished) > 0
    assert serve.drain()[1]["sampled_tokens"] == 0  # since the last drain


def test_a_dead_workers_episodes_continue_from_their_saved_turns(tokenizer, redis_server):
    client = redis_server.client()
    reference, queue, renderer = make(tokenizer, client, "ref")
    queue.issue([("r0", 5), ("r1", 6)])
    run_for(reference, renderer, until=lambda: client.xlen(STREAM) == 2)
    expected = groups_in(client)

    dying, queue, renderer = make(tokenizer, client, "w0")
    queue.issue([("g0", 5), ("g1", 6)])
    saved = lambda: sum(len(queue.saved_episodes(g)) for g in ("g0", "g1"))  # noqa: E731
    run_for(dying, renderer, until=lambda: saved() > 0)  # w0 saved a turn boundary, then "died"
    unfinished = [
        data
        for g in ("g0", "g1")
        for data in queue.saved_episodes(g).values()
        if not decode_episode(data)[1].get("final")
    ]
    assert unfinished and client.xlen(STREAM) == 2

    taker, _, _ = make(tokenizer, client, "w1", claim_idle_ms=0)
    run_for(taker, renderer, until=lambda: client.xlen(STREAM) == 4)
    got = groups_in(client)
    assert taker.counters["restored_episodes"] == len(unfinished)
    for new, old in (("g0", "r0"), ("g1", "r1")):
        for a, b in zip(got[new].trajectories, expected[old].trajectories, strict=True):
            assert fields(a) == fields(b) and a.reward == b.reward
            assert a.attempt == 2 and a.resumed <= 1
    assert queue.backlog() == 0 and queue.produced()["g0"] == 1


def test_a_spent_token_budget_pauses_and_saves_mid_turn(tokenizer, redis_server):
    client = redis_server.client()
    serve, queue, renderer = make(tokenizer, client, "w0", token_budget=5)
    queue.issue([("g0", 1)])
    run_for(serve, renderer, ticks=40)
    # the budget is checked before each decode step (2 episodes: at most one token over)
    assert serve.paused and client.xlen(STREAM) == 0 and 5 <= serve.loop.generated <= 6
    saved = queue.saved_episodes("g0")
    assert len(saved) == 2  # both episodes saved mid-turn

    def install():  # a new policy version whenever the worker waits for one
        if serve.paused:
            serve.loop.session.version += 1

    serve.run(
        params_for(renderer),
        should_stop=lambda: client.xlen(STREAM) == 1,
        install=install,
        may_generate=lambda: True,
    )
    (group,) = groups_in(client).values()
    assert all(t.success for t in group.trajectories)
    versions = {v for t in group.trajectories for v in t.token_versions if v >= 0}
    assert {0, 1, 2} <= versions  # the episodes went on across versions, caches kept


def test_a_worker_takes_its_share_of_new_tasks_and_all_of_its_own(redis_server):
    """With room for every task, one of two workers takes ceil(unread / 2) new ones per claim
    (before: all of them, and the other worker idled); its own pending tasks (a restarted
    worker's) come back whole, whatever the share."""
    queue = TaskQueue(redis_server.client(), KEYS)
    queue.issue([(f"g{i}", i) for i in range(8)])
    first = queue.claim("w0", 16, idle_ms=60_000, workers=2)
    second = queue.claim("w1", 16, idle_ms=60_000, workers=2)
    assert (len(first), len(second)) == (4, 2)  # 8 unread -> 4, then 4 unread -> 2
    again = queue.claim("w0", 16, idle_ms=60_000, workers=2)  # its 4, and 1 of the 2 unread
    assert len(again) == 5 and {t.group_id for t in first} < {t.group_id for t in again}
    assert len(queue.claim("w1", 16, idle_ms=60_000)) == 2 + 1  # one worker: all unread
    assert queue.claim("w2", 16, idle_ms=60_000, workers=2) == []  # none left: none read


def test_a_task_taken_over_is_completed_once_by_its_new_owner(redis_server):
    """Worker A claims a task and goes quiet; B takes it over once idle (XAUTOCLAIM). A's
    complete is refused (it no longer owns the entry), B's goes through: one group."""
    client = redis_server.client()
    queue = TaskQueue(client, KEYS)
    queue.issue([("g0", 1)])
    (mine,) = queue.claim("A", 1, idle_ms=60_000)
    time.sleep(0.05)
    (taken,) = queue.claim("B", 1, idle_ms=20)
    assert taken.entry_id == mine.entry_id and taken.attempt == 2
    group = dataclasses.replace(sample_group(), group_id="g0")
    assert queue.complete(mine, group, consumer="A") is None
    assert queue.complete(taken, group, consumer="B") is not None
    assert queue.complete(taken, group, consumer="B") is None  # acked: a retry adds nothing
    assert client.xlen(STREAM) == 1 and queue.produced() == {"g0": 1} and queue.backlog() == 0


def test_a_worker_whose_tasks_were_taken_over_produces_nothing(tokenizer, redis_server):
    """The serve loop of a worker that stalled while another took its tasks over finishes its
    episodes in vain: its groups are refused and counted (workers/refused_groups)."""
    client = redis_server.client()
    slow, queue, renderer = make(tokenizer, client, "w0")
    queue.issue([("g0", 5), ("g1", 6)])
    saved = lambda: sum(len(queue.saved_episodes(g)) for g in ("g0", "g1"))  # noqa: E731
    run_for(slow, renderer, until=lambda: saved() > 0)  # w0 holds both, mid-episode
    taker, _, _ = make(tokenizer, client, "w1", claim_idle_ms=0)
    run_for(taker, renderer, until=lambda: client.xlen(STREAM) == 2)
    run_for(slow, renderer, ticks=2000, until=lambda: not slow.groups)  # w0 wakes up
    assert not slow.groups and slow.counters["refused_groups"] == 2
    assert slow.produced_groups == 0 and taker.produced_groups == 2
    assert client.xlen(STREAM) == 2 and queue.produced() == {"g0": 1, "g1": 1}


class ReplayMismatchEnv(CalculatorEnv):
    """A non-deterministic tool, as a restore sees it: replaying the saved actions fails."""

    def set_state(self, state):
        raise ValueError("replaying the saved actions gave a different transcript")


class HangingRestoreEnv(CalculatorEnv):
    """A replayed tool that hangs (until the test releases it, at most 60 s)."""

    release = threading.Event()

    def set_state(self, state):
        self.release.wait(60)
        super().set_state(state)


def saved_at_start(renderer, seed):
    """A saved unfinished episode as a worker writes it (at its first turn)."""
    env = gymnasium.make("agentrl/Calculator-v0")
    episode = start_episode(env, seed, "g0/0", f"agentrl/Calculator-v0#{seed}", renderer)
    return _encode(episode)


def produce_with_a_bad_restore(tokenizer, client, saved, **options):
    """Task g0 whose episode 0 was saved as `saved`: run a worker until the group is produced;
    returns it, the worker's drained counters and the seconds it took."""
    serve, queue, renderer = make(tokenizer, client, "w0", **options)
    queue.issue([("g0", 3)])
    queue.save_episodes("g0", {0: saved(renderer) if callable(saved) else saved})
    start = time.monotonic()
    run_for(serve, renderer, until=lambda: client.xlen(STREAM) == 1)  # never raises
    seconds = time.monotonic() - start
    (group,) = groups_in(client).values()
    finished, counters = serve.drain()
    assert queue.backlog() == 0 and queue.produced() == {"g0": 1}
    assert [t.traj_id for t in group.trajectories] == ["g0/0", "g0/1"]
    bad, good = group.trajectories
    assert bad.status is RolloutStatus.ENV_ERROR and "restore failed" in bad.finish_detail
    assert good.success and good.resumed == 0  # the group's other episode went on
    assert sum(t.status is RolloutStatus.ENV_ERROR for t in finished) == 1
    assert counters["restore_failures"] == 1 and counters["restored_episodes"] == 0
    return bad, seconds


def test_a_saved_episode_that_cannot_be_decoded_is_an_env_error(tokenizer, redis_server):
    bad, _ = produce_with_a_bad_restore(tokenizer, redis_server.client(), b"\x00garbage\xff")
    assert "CodecError" in bad.finish_detail


def test_a_restore_whose_replay_raises_is_an_env_error(tokenizer, redis_server):
    client = redis_server.client()
    bad, _ = produce_with_a_bad_restore(
        tokenizer,
        client,
        lambda renderer: saved_at_start(renderer, 3),
        env_factory=lambda: ReplayMismatchEnv(difficulty=1, max_turns=4),
    )
    assert "different transcript" in bad.finish_detail


def test_a_restore_that_hangs_times_out_as_an_env_error(tokenizer, redis_server):
    client = redis_server.client()
    HangingRestoreEnv.release.clear()
    try:
        bad, seconds = produce_with_a_bad_restore(
            tokenizer,
            client,
            lambda renderer: saved_at_start(renderer, 3),
            env_factory=lambda: HangingRestoreEnv(difficulty=1, max_turns=4),
            tool_timeout_s=0.3,
        )
    finally:
        HangingRestoreEnv.release.set()  # frees the pool thread
    assert "timed out after 0.3 s" in bad.finish_detail
    # the deadline cannot pass early (>= 0.3 s); nominal well under 1 s, and a loaded machine
    # gets plenty of slack while staying far under the 60 s the hung restore would take
    assert 0.3 <= seconds < 20, seconds


def test_counts_taken_by_drain_on_another_thread_are_never_lost(tokenizer, redis_server):
    """WorkerHost.drain runs on another actor thread than the serve loop, every step: every
    count the loop books while drains come and go is in exactly one drain (without the lock, a
    `+=` that straddled drain's copy and swap of the counters was lost)."""
    serve, _, _ = make(tokenizer, redis_server.client(), "w0")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    counts, rounds = 0.0, 60_000
    try:
        loop_thread = threading.Thread(
            target=lambda: [
                (serve._count("refused_groups", 1), serve._count("idle_seconds", 0.5))
                for _ in range(rounds)
            ]
        )
        loop_thread.start()
        while loop_thread.is_alive():
            _, counters = serve.drain()
            counts += counters["refused_groups"] + counters["idle_seconds"]
        _, counters = serve.drain()
        counts += counters["refused_groups"] + counters["idle_seconds"]
    finally:
        sys.setswitchinterval(switch)
    assert counts == 1.5 * rounds
