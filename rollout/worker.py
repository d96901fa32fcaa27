"""`RolloutWorker`: runs groups of episodes, scores them and ships them to the stream.

A plain class (no Ray here): `rl/run/actors.py` wraps it into a Ray actor. Its parts come in as
objects: an env factory, the policy, the renderer, the reward function, and a sink.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from policy.engines import open_session
from policy.sampling import SamplingParams
from rollout.agent import TOOL_THREADS, AgentLoop, run_all, start_episode
from rollout.episode import EpisodeLimits, Policy, discard, run_episodes, task_id
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Scorer, Trajectory, TrajectoryGroup

logger = logging.getLogger(__name__)


class TrajectorySink(Protocol):
    def put(self, group: TrajectoryGroup) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    seed: int
    """The env's `reset(seed=...)` draws the task."""
    group_id: str


class RolloutWorker:
    def __init__(
        self,
        *,
        env_factory: Callable[[], Any],
        env_id: str,
        policy: Policy,
        renderer: ChatRenderer,
        scorer: Scorer,
        sink: TrajectorySink | None,
        limits: EpisodeLimits,
        max_episodes: int = 64,
        tool_timeout_s: float = 60.0,
        cache_budget: int | None = None,
        tool_threads: int = TOOL_THREADS,
    ):
        self.env_factory, self.env_id = env_factory, env_id
        self.policy, self.renderer, self.scorer, self.sink = policy, renderer, scorer, sink
        self.limits, self.max_episodes, self.tool_timeout_s = limits, max_episodes, tool_timeout_s
        self.cache_budget = cache_budget
        """Bytes of decode cache this worker may hold (None: no limit; AgentLoop.room)."""
        self.tool_threads = tool_threads
        """Env steps run at once (each AgentLoop's tool pool)."""
        self._envs: list[Any] = []
        self._session = None
        self._env_errors_seen: set[str] = set()  # env and grader errors: each logged once

    def reconfigure(self, limits: EpisodeLimits, env_factory: Callable[[], Any]) -> None:
        """New episode limits and envs from the next episode on (a curriculum stage begins)."""
        for env in self._envs:
            env.close()
        self.limits, self.env_factory, self._envs = limits, env_factory, []

    def session(self):
        """The policy's decode session (persistent per-episode caches), or None for a policy
        that has none (then episodes advance turn by turn through `policy.generate`)."""
        if self._session is None:
            try:
                self._session = open_session(self.policy)
            except TypeError:
                return None
        return self._session

    def _env_pool(self, n: int) -> list[Any]:
        while len(self._envs) < n:
            self._envs.append(self.env_factory())
        return self._envs[:n]

    def run(self, seeds: list[int], sampling: SamplingParams) -> list[Trajectory]:
        """One episode per seed, reproducibly (tool results are applied in a fixed order)."""
        session = self.session()
        if session is not None:
            loop = AgentLoop(
                session,
                self.renderer,
                self.limits,
                tool_timeout_s=self.tool_timeout_s,
                cache_budget=self.cache_budget,
                tool_threads=self.tool_threads,
            )
            envs = self._env_pool(len(seeds))

            def start(i: int) -> Any:  # resets run on the tool pool, side by side: an env
                env, seed = envs[i], seeds[i]  # whose reset waits (an agent harness) stalls
                key, tid = f"run/{i}", task_id(env, self.env_id, seed)  # only its own episode
                return start_episode(env, seed, key, tid, self.renderer)

            episodes = list(loop.pool.map(start, range(len(seeds))))
            trajs = run_all(loop, episodes, sampling, max_live=self.max_episodes)
            for i, episode in enumerate(episodes):
                if episode.env_broken:  # a timed-out tool may still hold it
                    discard(self._envs[i])
                    self._envs[i] = self.env_factory()
            return trajs
        envs = self._env_pool(len(seeds))
        return run_episodes(
            envs,
            seeds,
            [task_id(env, self.env_id, seed) for env, seed in zip(envs, seeds, strict=True)],
            policy=self.policy,
            renderer=self.renderer,
            sampling=sampling,
            limits=self.limits,
        )

    def collect(self, tasks: list[Task], group_size: int, sampling: SamplingParams) -> dict:
        """Run `group_size` episodes per task, score them, XADD one entry per group."""
        start = time.perf_counter()
        seeds = [t.seed for t in tasks for _ in range(group_size)]
        trajs = self.run(seeds, sampling)
        for traj in trajs:
            self._score(traj)
        groups = [
            TrajectoryGroup(
                group_id=task.group_id,
                task_id=trajs[i * group_size].task_id,
                trajectories=trajs[i * group_size : (i + 1) * group_size],
            )
            for i, task in enumerate(tasks)
        ]
        if self.sink is not None:
            for group in groups:
                self.sink.put(group)
        return summarize(trajs, seconds=time.perf_counter() - start)

    def _score(self, traj: Trajectory) -> None:
        if traj.status is RolloutStatus.ENV_ERROR:
            if traj.finish_detail not in self._env_errors_seen:  # each distinct error once
                self._env_errors_seen.add(traj.finish_detail)
                logger.warning("env error in %s: %s", traj.task_id, traj.finish_detail)
            return
        try:
            scored = self.scorer(traj)
            total = float(scored.total)
            if not math.isfinite(total):
                raise ValueError(f"reward is {total}")
            traj.reward, traj.reward_parts = total, dict(scored.parts)
        except Exception as exc:  # recorded and excluded, never silently scored
            traj.status = RolloutStatus.GRADER_ERROR
            traj.finish_detail = f"reward raised {type(exc).__name__}: {exc}"
            if traj.finish_detail not in self._env_errors_seen:
                self._env_errors_seen.add(traj.finish_detail)
                logger.warning("grader error in %s: %s", traj.task_id, traj.finish_detail)

    def evaluate(
        self, seeds: list[int], samples: int, sampling: SamplingParams
    ) -> tuple[list[list[bool]], dict[str, int]]:
        """Success of `samples` episodes per seed, and counts over all of them: episodes,
        tool_calls, tool_errors, parse_errors, truncated (nothing is written to the stream)."""
        trajs = self.run([s for s in seeds for _ in range(samples)], sampling)
        per_seed = [
            [t.success for t in trajs[i * samples : (i + 1) * samples]] for i in range(len(seeds))
        ]
        counts = {
            "episodes": len(trajs),
            "tool_calls": sum(t.num_tool_calls for t in trajs),
            "tool_errors": sum(t.num_tool_errors for t in trajs),
            "parse_errors": sum(t.num_parse_errors for t in trajs),
            "truncated": sum(t.status is RolloutStatus.TRUNCATED for t in trajs),
        }
        return per_seed, counts


def summarize(trajs: list[Trajectory], *, seconds: float) -> dict[str, float]:
    """Counters a driver can add up across workers (flat keys; see `rl.observe.metrics`).

    Besides the totals: `reward_part/<term>` sums over scored trajectories, `env/<id>/episodes`,
    `env/<id>/successes`, `env/<id>/scored` and `env/<id>/reward_sum` per env (from the task id:
    a mixture's names the env of the task), and `tool/<name>/calls` and
    `tool/<name>/failures` per tool (from the tool messages; calls that named no valid tool
    count under `tool/(invalid)/...`).
    """
    n = len(trajs)
    errors = (RolloutStatus.ENV_ERROR, RolloutStatus.GRADER_ERROR)
    scored = [t for t in trajs if t.status not in errors]
    stats: dict[str, float] = {
        "episodes": n,
        "scored": len(scored),
        "successes": sum(t.success for t in trajs),
        "reward_sum": sum(t.reward for t in scored),
        "reward_sq_sum": sum(t.reward**2 for t in scored),
        "turns": sum(t.num_turns for t in trajs),
        "tool_calls": sum(t.num_tool_calls for t in trajs),
        "tool_errors": sum(t.num_tool_errors for t in trajs),
        "parse_errors": sum(t.num_parse_errors for t in trajs),
        "episodes_with_tool_call": sum(t.num_tool_calls > 0 for t in trajs),
        "generated_tokens": sum(t.num_generated for t in trajs),
        "truncated": sum(t.status is RolloutStatus.TRUNCATED for t in trajs),
        "errors": sum(t.status in errors for t in trajs),
        "env_errors": sum(t.status is RolloutStatus.ENV_ERROR for t in trajs),
        "grader_errors": sum(t.status is RolloutStatus.GRADER_ERROR for t in trajs),
        "seconds": seconds,
    }
    for t in trajs:
        env_id = t.task_id.rsplit("#", 1)[0]
        _add(stats, f"env/{env_id}/episodes", 1)
        _add(stats, f"env/{env_id}/successes", int(t.success))
        if t.status not in errors:
            _add(stats, f"env/{env_id}/scored", 1)
            _add(stats, f"env/{env_id}/reward_sum", t.reward)
            for name, value in t.reward_parts.items():
                _add(stats, f"reward_part/{name}", value)
        for m in t.messages:
            if m.get("role") == "tool":
                name = m.get("name") or "error"
                name = "(invalid)" if name == "error" else name
                _add(stats, f"tool/{name}/calls", 1)
                content = m.get("content")  # a plugin env's may be None or a list of parts
                failed = isinstance(content, str) and content.startswith("Error:")
                _add(stats, f"tool/{name}/failures", int(failed))
    return stats


def _add(stats: dict[str, float], key: str, value: float) -> None:
    stats[key] = stats.get(key, 0) + value
