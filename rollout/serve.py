"""Asynchronous rollouts: a worker that never waits for the learner.

`AsyncRollouts.run()` loops until told to stop:

    install a newer weight version if one was staged (between two decode steps; live episodes
      keep their caches and go on under the new version)
    admit: claim tasks from the durable queue (rollout/tasks.py) while there is room for a whole
      group and generation is allowed (the staleness gate); each episode starts fresh or
      continues from its saved state (env state included; cache rebuilt by prefill). A restore
      (decode, env reset, replay of the saved tool calls) runs on the loop's tool pool under
      `tool_timeout_s`; one that raises or times out ends that episode as an env error (its
      group goes on), never the worker
    one AgentLoop tick (decode step for every generating episode, tools concurrently)
    save episodes that reached a turn boundary; keep finished ones (saved as final)
    a group whose last episode finished: score it, then XADD + XACK in one transaction

Partial rollouts: with `token_budget`, a worker samples at most that many tokens per policy
version; when it is spent it saves every live episode (mid-turn included) and pauses decoding
until a newer version arrives, keeping the caches (the same worker continues them). If it dies
instead, the saved states let any worker continue them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from policy.sampling import SamplingParams
from rollout.agent import AgentLoop, Episode, RouteBuffer, start_episode
from rollout.codec import decode_episode, encode_episode
from rollout.episode import discard, restorable, task_id
from rollout.tasks import Task, TaskQueue
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup


@dataclass(slots=True)
class _Group:
    task: Task
    done: dict[int, Trajectory] = field(default_factory=dict)
    saved_turns: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Restore:
    """A saved episode being restored on the tool pool."""

    group: _Group
    index: int
    env: Any
    future: Future | None
    deadline: float
    timeout_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeOptions:
    consumer: str
    group_size: int
    max_episodes: int = 64
    token_budget: int | None = None
    workers: int = 1  # rollout workers reading the task queue (each takes its share of new tasks)
    claim_idle_ms: int = 20_000
    heartbeat_s: float = 2.0


class AsyncRollouts:
    def __init__(self, worker, queue: TaskQueue, loop: AgentLoop, options: ServeOptions):
        self.worker, self.queue, self.loop, self.opt = worker, queue, loop, options
        self.groups: dict[str, _Group] = {}
        self.free_envs: list[Any] = []
        # the serve loop writes finished trajectories and counters; drain() (another actor
        # thread, each step) takes them: both under this lock, or updates get lost
        self.books = threading.Lock()
        self.finished: list[Trajectory] = []
        self.counters = {
            "restored_episodes": 0,
            "restore_failures": 0,
            "refused_groups": 0,
            "paused_seconds": 0.0,
            "idle_seconds": 0.0,
        }
        self.restoring: dict[str, _Restore] = {}
        self.produced_groups = 0
        self.drained_tokens = 0  # loop.generated at the last drain
        self.budget_start = 0
        self.version = loop.session.version
        self.paused = False
        self.snapshots: dict[str, tuple[int, bytes]] = {}
        loop.on_boundary = self._snapshot

    def run(
        self,
        params: SamplingParams,
        *,
        should_stop: Callable[[], bool],
        install: Callable[[], None],
        may_generate: Callable[[], bool],
        starving: Callable[[], bool] = lambda: False,
    ) -> None:
        """`starving()`: the learner waits for groups; the token budget then does not pause
        (a budget must never stall the run)."""
        last_beat = 0.0
        while not should_stop():
            install()
            self._on_version()
            if time.monotonic() - last_beat > self.opt.heartbeat_s:
                self.queue.heartbeat(self.opt.consumer, [g.task for g in self.groups.values()])
                last_beat = time.monotonic()
            allowed = may_generate() and (not self._over_budget() or starving())
            if allowed:
                self._admit()
            self._collect_restores()
            start = time.monotonic()
            for episode in self.loop.tick(params, decode=allowed):
                self._finished(episode)
            self._save_turn_boundaries()
            self._complete_groups()
            if not allowed or self.loop.idle():
                self._wait(allowed, start)

    # -- admission and budget ----------------------------------------------------------------
    def _on_version(self) -> None:
        if self.loop.session.version != self.version:
            self.version, self.paused = self.loop.session.version, False
            self.budget_start = self.loop.generated

    def _over_budget(self) -> bool:
        budget = self.opt.token_budget
        if budget is None or self.loop.generated - self.budget_start < budget:
            return False
        if not self.paused:  # spent: save every live episode, then wait for a newer version
            self.save_live()
            self.paused = True
        return True

    def _admit(self) -> None:
        room = self.loop.room(self.opt.max_episodes) - len(self.restoring)
        count = room // self.opt.group_size
        if count <= 0:
            return
        held = frozenset(g.task.entry_id for g in self.groups.values())
        claimed = self.queue.claim(
            self.opt.consumer,
            count,
            idle_ms=self.opt.claim_idle_ms,
            held=held,
            workers=self.opt.workers,
        )
        for task in claimed:
            if task.group_id in self.groups:  # the same group under a second entry: keep ours
                continue
            group = self.groups[task.group_id] = _Group(task)
            saved = self.queue.saved_episodes(task.group_id)
            for index in range(self.opt.group_size):
                self._start(group, index, saved.get(index))

    def _start(self, group: _Group, index: int, saved: bytes | None) -> None:
        task, key = group.task, f"{group.task.group_id}/{index}"
        env = self.free_envs.pop() if self.free_envs else self.worker.env_factory()
        if saved is not None:  # restored on the tool pool: see _collect_restores
            timeout = self.loop.tool_timeout_s
            r = _Restore(group, index, env, None, time.monotonic() + timeout, timeout)
            r.future = self.loop.pool.submit(_restore_saved, env, task.seed, key, saved, r)
            self.restoring[key] = r
            return
        episode = start_episode(
            env, task.seed, key, task_id(env, self.worker.env_id, task.seed), self.worker.renderer
        )
        episode.traj.traj_id, episode.traj.attempt = key, task.attempt
        self.loop.add(episode)

    def _collect_restores(self) -> None:
        """Restores that finished join the loop (or their group, when saved as finished); one
        that raised or ran past `tool_timeout_s` ends its episode as an env error."""
        now = time.monotonic()
        for key, r in list(self.restoring.items()):
            done = r.future.done()
            if not done and now < r.deadline:
                continue
            del self.restoring[key]
            if not done:
                self.loop.abandon(r.future)  # a hung restore keeps its thread, not the pool
                self._restore_failed(key, r, f"timed out after {self.loop.tool_timeout_s:g} s")
                continue
            try:
                restored = r.future.result()
            except Exception as exc:  # a bad saved episode ends that episode, not the worker
                self._restore_failed(key, r, f"{type(exc).__name__}: {exc}")
                continue
            attempt = r.group.task.attempt
            if isinstance(restored, Trajectory):  # saved as finished
                restored.attempt = attempt
                r.group.done[r.index] = restored
                self.free_envs.append(r.env)
                continue
            r.group.saved_turns[r.index] = restored.traj.num_turns
            self._count("restored_episodes", 1)
            restored.traj.traj_id, restored.traj.attempt = key, attempt
            self.loop.add(restored)

    def _restore_failed(self, key: str, r: _Restore, detail: str) -> None:
        """Finish the episode as an env error (counted, never trained on; its env is not
        reused) and save it as final, so a later claim of the task does not try again."""
        task = r.group.task
        traj = Trajectory(
            task_id=task_id(r.env, self.worker.env_id, task.seed),
            traj_id=key,
            attempt=task.attempt,
            status=RolloutStatus.ENV_ERROR,
            finish_detail=f"restore failed: {detail}",
        )
        r.group.done[r.index] = traj
        self.queue.save_episodes(task.group_id, {r.index: encode_episode(traj, {"final": 1})})
        self._count("restore_failures", 1)
        discard(r.env)

    # -- progress ------------------------------------------------------------------------------
    def _finished(self, episode: Episode) -> None:
        group_id, _, index = episode.key.rpartition("/")
        group = self.groups[group_id]
        group.done[int(index)] = episode.traj
        self.queue.save_episodes(group_id, {int(index): encode_episode(episode.traj, {"final": 1})})
        if episode.env_broken:
            discard(episode.env)
        else:
            self.free_envs.append(episode.env)

    def _snapshot(self, episode: Episode) -> None:
        """Between two turns (observation appended, env idle): encode it as it is now."""
        if restorable(episode.env):
            self.snapshots[episode.key] = (episode.traj.num_turns, _encode(episode))

    def _save_turn_boundaries(self) -> None:
        """Write the snapshots of the last tick (one HSET per group)."""
        by_group: dict[str, dict[int, bytes]] = {}
        for key, (turns, data) in self.snapshots.items():
            group_id, _, index = key.rpartition("/")
            if group_id in self.groups and int(index) not in self.groups[group_id].done:
                by_group.setdefault(group_id, {})[int(index)] = data
                self.groups[group_id].saved_turns[int(index)] = turns
        self.snapshots = {}
        for group_id, saved in by_group.items():
            self.queue.save_episodes(group_id, saved)

    def save_live(self) -> int:
        """Save every live episode whose env is idle to Redis, as it is now (its tokens, versions,
        logprobs, routes and env state); one waiting on a tool keeps its last saved turn. Returns
        how many were saved."""
        by_group: dict[str, dict[int, bytes]] = {}
        for episode in list(self.loop.live.values()):
            if episode.tool is not None or episode.done or not restorable(episode.env):
                continue  # its env is busy (the last saved turn stands), or cannot be saved
            group_id, _, index = episode.key.rpartition("/")
            by_group.setdefault(group_id, {})[int(index)] = _encode(episode)
            self.groups[group_id].saved_turns[int(index)] = episode.traj.num_turns
        for group_id, saved in by_group.items():
            self.queue.save_episodes(group_id, saved)
        return sum(len(saved) for saved in by_group.values())

    def _complete_groups(self) -> None:
        for group_id in [g for g, v in self.groups.items() if len(v.done) == self.opt.group_size]:
            group = self.groups.pop(group_id)
            trajs = [group.done[i] for i in range(self.opt.group_size)]
            for traj in trajs:
                self.worker._score(traj)
            produced = self.queue.complete(
                group.task,
                TrajectoryGroup(group_id=group_id, task_id=trajs[0].task_id, trajectories=trajs),
                consumer=self.opt.consumer,
            )
            if produced is None:  # another worker took the task over: it produces the group
                self._count("refused_groups", 1)
                continue
            with self.books:
                self.finished.extend(trajs)
            self.produced_groups += 1

    def _wait(self, allowed: bool, start: float) -> None:
        if self.loop.live and self.loop.idle():
            self.loop.wait_tools(0.02)
        elif not self.loop.live or not allowed:
            time.sleep(0.02)
        key = "idle_seconds" if allowed else "paused_seconds"
        self._count(key, time.monotonic() - start)

    def _count(self, key: str, amount: float) -> None:
        with self.books:
            self.counters[key] += amount

    def drain(self) -> tuple[list[Trajectory], dict[str, float]]:
        """Trajectories finished since the last call, and the counters (then reset), with the
        tokens sampled since the last call (finished episodes or not). Called from another
        thread than the serve loop's (rl/run/actors.py WorkerHost.drain)."""
        with self.books:
            out, self.finished = self.finished, []
            counters = dict(self.counters)
            self.counters = {k: 0 * v for k, v in self.counters.items()}
        generated = self.loop.generated  # read once: the serve loop keeps adding to it
        counters["sampled_tokens"] = float(generated - self.drained_tokens)
        self.drained_tokens = generated
        return out, counters


def _encode(episode: Episode) -> bytes:
    traj = episode.traj
    # a view, not a copy: the buffer never rewrites the rows it holds (RouteBuffer)
    traj.routed_experts = None if episode.routes is None else episode.routes.view()
    extra = {
        "env_state": json.dumps(episode.env.unwrapped.get_state()),  # RNG states exceed 64 bits
        "tools": episode.tools,
        "turn_ids": list(episode.turn_ids),
        "turn_logps": list(episode.turn_logps),
        "turn_versions": list(episode.turn_versions),
    }
    return encode_episode(traj, extra)


def _restore_saved(env, seed: int, key: str, saved: bytes, r: _Restore) -> Episode | Trajectory:
    """Runs on the tool pool: a saved episode, continued (`_restore`), or its trajectory when it
    was saved as finished. Raises what decoding or the env's replay raises. Once decoded, the
    replay gets `tool_timeout_s` for each saved turn (each replays at most one turn's calls)."""
    traj, extra = decode_episode(saved)
    if extra.get("final"):
        return traj
    r.deadline += r.timeout_s * max(traj.num_turns - 1, 0)
    return _restore(env, seed, key, traj, extra)


def _restore(env, seed: int, key: str, traj: Trajectory, extra: dict) -> Episode:
    """A saved episode, continued: the env replays its state, the whole context is prefilled
    again, and the routes recorded when its tokens were sampled are kept."""
    env.reset(seed=seed)  # wrappers (gymnasium's order enforcing) want a reset first
    env.unwrapped.set_state(json.loads(extra["env_state"]))
    traj.resumed += 1
    routes_nMK = traj.routed_experts
    return Episode(
        key=key,
        env=env,
        traj=traj,
        tools=extra["tools"],
        routes=None if routes_nMK is None else RouteBuffer(routes_nMK),
        skip_routes=0 if routes_nMK is None else len(routes_nMK),
        feed=traj.token_ids + extra["turn_ids"],
        turn_ids=extra["turn_ids"],
        turn_logps=extra["turn_logps"],
        turn_versions=extra["turn_versions"],
    )
