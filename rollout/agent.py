"""The agent loop with no barrier: live episodes on one decode session, each at its own turn.

Each live episode keeps its policy context (cache) in a `DecodeSession` (policy/session.py)
from its first token to its last. One `tick()`:

    1. tool calls that finished are turned into observations; an observation's tokens are
       appended to the episode's context by a chunked prefill of those tokens only
       (`session.add`), never by re-prefilling the history
    2. one decode step (`session.step`) for every episode that is generating, whatever its turn
       (continuous batching across episodes and turns)
    3. turns that ended (a stop token or max_new_tokens) are parsed and their env step (the
       tool calls) is submitted to a thread pool: a slow tool stalls only its own episode;
       one that runs past `tool_timeout_s` ends that episode as an env error

Every sampled token is recorded when it is sampled: its behaviour logprob, the policy version
whose logits produced it, and (MoE) the experts every position was routed to when it was
forwarded, each position exactly once: routing replay uses exactly those. The routes gather in
a `RouteBuffer` (int16 [n, M, Kx], amortised doubling) and become the trajectory's
`routed_experts` when the episode ends.

`deterministic=True` (sync mode, evaluation) applies the tool results of a tick before the
next decode step, in episode order, so a run is reproducible bit for bit; async workers use
`deterministic=False`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from policy.sampling import SamplingParams
from rollout.episode import EpisodeLimits, apply_env_step, open_episode, tools_running_late
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Trajectory

TOOL_THREADS = 16
"""Env steps (tool calls) running at once in one loop, unless its maker says (run files:
rollout.tool_threads, one per live episode)."""


class Sampled(Protocol):
    token: int
    logprob: float
    routes: np.ndarray | None
    """int16 [n, M, Kx] (policy.session.Sampled)."""


class Session(Protocol):
    """What the loop needs of policy.session.DecodeSession."""

    version: int

    def add(self, keys: list[Hashable], token_ids: list[list[int]]) -> list[np.ndarray | None]: ...
    def step(self, keys: list[Hashable], params: SamplingParams) -> list[Sampled]: ...
    def drop(self, keys: list[Hashable]) -> None: ...
    def reserve_for(self, tokens: int) -> int: ...


@dataclass(slots=True, kw_only=True)
class Episode:
    """One live episode: its env, its trajectory so far, and where its current turn stands."""

    key: str
    """Unique while live: `<group_id>/<index>`; the session's key for its context."""
    env: Any
    traj: Trajectory
    tools: list[dict] = field(default_factory=list)
    routes: RouteBuffer | None = None
    """Experts per forwarded position (MoE policies), in order: int16 [P, M, Kx]."""
    skip_routes: int = 0
    """Positions whose routes are already in `routes` (a restored episode: its history is
    forwarded again to rebuild the cache, but the routes recorded at sampling time stay)."""
    feed: list[int] = field(default_factory=list)
    """Tokens to append to the context before decoding (prompt, observation, restored history)."""
    turn_ids: list[int] = field(default_factory=list)
    turn_logps: list[float] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    logits_version: int = -1
    """Policy version that computed the logits the next token is sampled from."""
    pending: bool = False
    """The session holds a sampled token not yet fed (its logits are not computed yet)."""
    tool: Future | None = None
    tool_deadline: float = 0.0
    done: bool = False
    env_broken: bool = False
    """The env may be in a bad state (a tool that timed out): do not reuse it."""

    def finish(self, status: RolloutStatus, detail: str, outcome=None) -> None:
        self.traj.status, self.traj.finish_detail, self.done = status, detail, True
        self.traj.outcome = outcome

    @property
    def generating(self) -> bool:
        return not self.done and self.tool is None and not self.feed


def start_episode(env, seed: int, key: str, task_id: str, renderer: ChatRenderer) -> Episode:
    """Reset `env` and render the opening prompt (fed to the session on the next tick). A reset
    that raises gives an episode already finished as an env error, whose env is not reused."""
    traj, tools = open_episode(env, seed, task_id, renderer)
    if traj.status is RolloutStatus.ENV_ERROR:
        return Episode(key=key, env=env, traj=traj, done=True, env_broken=True)
    return Episode(key=key, env=env, traj=traj, tools=tools, feed=traj.token_ids[:])


class AgentLoop:
    """Live episodes advanced together on one session; see the module docstring."""

    def __init__(
        self,
        session: Session,
        renderer: ChatRenderer,
        limits: EpisodeLimits,
        *,
        tool_timeout_s: float = 60.0,
        deterministic: bool = True,
        pool: ThreadPoolExecutor | None = None,
        cache_budget: int | None = None,
        tool_threads: int = TOOL_THREADS,
    ) -> None:
        self.session, self.renderer, self.limits = session, renderer, limits
        self.cache_budget = cache_budget
        """Bytes of cache this loop may hold (None: no limit); see `room`."""
        self.tool_timeout_s, self.deterministic = tool_timeout_s, deterministic
        self.own_pool, self.tool_threads = pool is None, tool_threads
        self.pool = pool or _tool_pool(tool_threads)
        self.stuck: list[Future] = []
        """Env steps that timed out and still hold a pool thread (Python cannot stop one)."""
        self.live: dict[str, Episode] = {}
        self.on_boundary: Callable[[Episode], None] | None = None
        """Called when an episode is between two turns (its observation appended, env idle)."""
        self.generated = 0
        """Tokens sampled by this loop (partial rollouts count them against a budget)."""

    def episode_reserve(self) -> int:
        """Cache bytes reserved per live episode: what the session sets aside for one that may
        reach `limits.max_seq_len` tokens (twice what it then holds for caches that grow by
        doubling; its pages for the paged K3 cache, policy/k3/paged.py)."""
        return self.session.reserve_for(self.limits.max_seq_len)

    def room(self, max_live: int) -> int:
        """How many more episodes may start: at most `max_live` live, and every live one's
        reserve within `cache_budget`, so a started episode can always reach max_seq_len (where
        it ends as truncated) without running the worker out of memory."""
        free = max_live - len(self.live)
        if self.cache_budget is not None:
            reserve = self.episode_reserve()
            if reserve > self.cache_budget:
                raise ValueError(
                    f"rollout.cache_budget_mb: an episode of rollout.max_seq_len="
                    f"{self.limits.max_seq_len} tokens reserves {reserve / 2**20:.1f} MiB of "
                    f"cache, over the worker's budget of "
                    f"{self.cache_budget / 2**20:.1f} MiB; raise the budget or lower max_seq_len"
                )
            free = min(free, self.cache_budget // reserve - len(self.live))
        return max(free, 0)

    def add(self, episode: Episode) -> None:
        if episode.key in self.live:
            raise ValueError(f"episode {episode.key!r} is already live")
        self.live[episode.key] = episode

    def tick(self, params: SamplingParams, *, decode: bool = True) -> list[Episode]:
        """Advance every live episode one step; returns (and forgets) the finished ones."""
        self._collect_tools(block=False)
        self._feed(params)
        if decode:
            self._decode(params)
        if self.deterministic:
            self._collect_tools(block=True)
            self._feed(params)
        return self._reap()

    def idle(self) -> bool:
        """True when no episode can decode: all wait on tools (or none is live)."""
        return not any(e.generating or e.feed for e in self.live.values())

    def wait_tools(self, timeout_s: float) -> None:
        futures = [e.tool for e in self.live.values() if e.tool is not None]
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def detach(self, key: str) -> Episode:
        """Take a live episode out (e.g. to save it); its context stays in the session."""
        return self.live.pop(key)

    # -- the three phases ---------------------------------------------------------------------
    def _collect_tools(self, *, block: bool) -> None:
        now = time.monotonic()
        for episode in self.live.values():
            if episode.tool is None:
                continue
            left = episode.tool_deadline - time.monotonic()
            if block and left > 0:
                wait_futures([episode.tool], timeout=left)
            if episode.tool.done():
                future, episode.tool = episode.tool, None
                self._after_env_step(episode, future)
            elif now >= episode.tool_deadline or (block and not episode.tool.done()):
                self.abandon(episode.tool)
                episode.tool, episode.env_broken = None, True
                episode.finish(
                    RolloutStatus.ENV_ERROR, f"env step timed out after {self.tool_timeout_s:g} s"
                )

    def abandon(self, future: Future) -> None:
        """A timed-out env step keeps its thread for as long as it hangs (forever, maybe): once
        half the pool's threads are held so, later steps go to a fresh pool (the old one keeps
        running what it has), so hung tools never starve the other episodes' env steps."""
        self.stuck = [f for f in self.stuck if not f.done()] + [future]
        if self.own_pool and len(self.stuck) >= max(1, self.tool_threads // 2):
            self.pool.shutdown(wait=False)
            self.pool, self.stuck = _tool_pool(self.tool_threads), []

    def _feed(self, params: SamplingParams) -> None:
        ready = [e for e in self.live.values() if e.feed and not e.done]
        for e in ready:  # a turn needs room for max_new_tokens more
            if len(e.traj.token_ids) + params.max_new_tokens > self.limits.max_seq_len:
                e.finish(RolloutStatus.TRUNCATED, "context full")
        ready = [e for e in ready if not e.done]
        if not ready:
            return
        routes = self.session.add([e.key for e in ready], [e.feed for e in ready])
        for episode, new in zip(ready, routes, strict=True):
            episode.feed, episode.pending = [], False
            episode.logits_version = self.session.version
            _extend_routes(episode, new)

    def _decode(self, params: SamplingParams) -> None:
        active = [e for e in self.live.values() if e.generating]
        if not active:
            return
        version = self.session.version
        for episode, s in zip(
            active, self.session.step([e.key for e in active], params), strict=True
        ):
            _extend_routes(episode, s.routes)
            episode.turn_versions.append(version if episode.pending else episode.logits_version)
            episode.logits_version, episode.pending = version, True
            episode.turn_ids.append(int(s.token))
            episode.turn_logps.append(float(s.logprob))
            self.generated += 1
            stopped = int(s.token) in params.stop_token_ids
            if stopped or len(episode.turn_ids) >= params.max_new_tokens:
                self._end_turn(episode, stopped)

    def _end_turn(self, episode: Episode, stopped: bool) -> None:
        traj, ids = episode.traj, episode.turn_ids
        traj.append(ids, sampled=True, logprobs=episode.turn_logps, version=episode.turn_versions)
        episode.turn_ids, episode.turn_logps, episode.turn_versions = [], [], []
        traj.num_turns += 1
        if not stopped:
            episode.finish(RolloutStatus.TRUNCATED, "turn hit max_new_tokens")
            return
        parsed = self.renderer.parse(ids)
        traj.num_parse_errors += len(parsed.errors)
        traj.messages.append(parsed.message)
        episode.tool = self.pool.submit(_env_step, episode.env, parsed.message)
        episode.tool_deadline = time.monotonic() + self.tool_timeout_s

    def _after_env_step(self, episode: Episode, future: Future) -> None:
        ids = apply_env_step(episode, future.result, self.renderer)
        if tools_running_late(episode.env):  # a timed-out tool call may still change the env
            episode.env_broken = True
        if ids is None:  # finished; an env whose step raised is not trusted with another
            episode.env_broken |= episode.traj.status is RolloutStatus.ENV_ERROR
            return
        if episode.traj.num_turns >= self.limits.max_turns:
            episode.finish(RolloutStatus.TRUNCATED, "out of turns")
            return
        episode.feed = ids
        if self.on_boundary is not None:
            self.on_boundary(episode)

    def _reap(self) -> list[Episode]:
        done = [e for e in self.live.values() if e.done]
        if done:
            self.session.drop([e.key for e in done])
        for episode in done:
            del self.live[episode.key]
            if episode.routes is not None:
                episode.traj.routed_experts = episode.routes.array()
        return done


def run_all(
    loop: AgentLoop,
    episodes: list[Episode],
    params: SamplingParams,
    *,
    max_live: int,
    before_step: Callable[[], None] | None = None,
) -> list[Trajectory]:
    """Run `episodes` to the end, at most `max_live` at once; trajectories in input order."""
    waiting = list(reversed(episodes))
    while waiting or loop.live:
        for _ in range(min(loop.room(max_live), len(waiting))):
            loop.add(waiting.pop())
        if before_step is not None:
            before_step()
        loop.tick(params)
        if loop.idle() and loop.live:
            loop.wait_tools(0.05)
    return [e.traj for e in episodes]


def _tool_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="agentrl-tool")


def _env_step(env, message):
    return env.step(message)


def _extend_routes(episode: Episode, new_nMK: np.ndarray | None) -> None:
    if new_nMK is None:
        return
    if episode.skip_routes:
        skip = min(episode.skip_routes, len(new_nMK))
        episode.skip_routes -= skip
        new_nMK = new_nMK[skip:]
    if episode.routes is None:
        episode.routes = RouteBuffer(new_nMK)
    else:
        episode.routes.extend(new_nMK)


class RouteBuffer:
    """An episode's routes, appended turn by turn: int16 [n, M, Kx] rows in one array whose
    capacity at least doubles when it fills, so appending costs O(new rows) amortised, never a
    copy of the whole history per turn. Rows once written never change (a growth copies them
    to a new array), so `view()` stays valid while the buffer grows."""

    __slots__ = ("_data_CMK", "_size")

    def __init__(self, routes_nMK: np.ndarray) -> None:
        """Start from `routes_nMK` (int16 [n, M, Kx]; nested lists are converted), held as is
        until the first growth: it is never written to."""
        self._data_CMK = np.asarray(routes_nMK, dtype=np.int16)  # C >= n rows of capacity
        if self._data_CMK.ndim != 3:
            raise ValueError(f"routes must be [n, M, Kx], got shape {self._data_CMK.shape}")
        self._size = len(self._data_CMK)

    def __len__(self) -> int:
        return self._size

    def extend(self, new_nMK: np.ndarray) -> None:
        """Append rows (int16 [n, M, Kx], or nested lists)."""
        new_nMK = np.asarray(new_nMK, dtype=np.int16)
        if not len(new_nMK):
            return
        if new_nMK.shape[1:] != self._data_CMK.shape[1:]:
            raise ValueError(f"routes {new_nMK.shape} after {self._data_CMK.shape[1:]} rows")
        end = self._size + len(new_nMK)
        if end > len(self._data_CMK):
            grown_CMK = np.empty((max(end, 2 * self._size), *new_nMK.shape[1:]), np.int16)
            grown_CMK[: self._size] = self._data_CMK[: self._size]
            self._data_CMK = grown_CMK
        self._data_CMK[self._size : end] = new_nMK
        self._size = end

    def view(self) -> np.ndarray:
        """The routes so far, int16 [n, M, Kx], without a copy."""
        return self._data_CMK[: self._size]

    def array(self) -> np.ndarray:
        """The routes so far in an array of their own (no spare capacity kept alive)."""
        view = self.view()
        return view if len(self._data_CMK) == self._size else view.copy()
