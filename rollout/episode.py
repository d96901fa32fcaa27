"""The agent loop: many episodes advanced together, one batched generation per turn.

Each turn, every unfinished episode contributes its token history to one `policy.generate` call;
then each completion is parsed, stepped through its env, and the env's reply is appended as
tokens with loss mask 0. Finished episodes drop out; the rest go round again.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from policy.sampling import Completion, SamplingParams
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, Trajectory


class Policy(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class EpisodeLimits:
    max_turns: int = 4
    """Assistant turns per episode (the env may end it sooner)."""
    max_seq_len: int = 2048
    """Total tokens per trajectory; an episode that would exceed it is truncated."""


@dataclass(slots=True)
class _Episode:
    env: Any
    traj: Trajectory
    tools: list[dict] = field(default_factory=list)
    done: bool = False

    def finish(self, status: RolloutStatus, detail: str, outcome=None) -> None:
        self.traj.status, self.traj.finish_detail, self.done = status, detail, True
        self.traj.outcome = outcome


def run_episodes(
    envs: list[Any],
    seeds: list[int],
    task_ids: list[str],
    *,
    policy: Policy,
    renderer: ChatRenderer,
    sampling: SamplingParams,
    limits: EpisodeLimits,
) -> list[Trajectory]:
    """Run one episode per (env, seed); returns trajectories in the same order."""
    episodes = [
        _start(env, seed, tid, renderer)
        for env, seed, tid in zip(envs, seeds, task_ids, strict=True)
    ]
    for _ in range(limits.max_turns):
        active = [e for e in episodes if not e.done]
        for e in active:
            if len(e.traj.token_ids) + sampling.max_new_tokens > limits.max_seq_len:
                e.finish(RolloutStatus.TRUNCATED, "context full")
        active = [e for e in active if not e.done]
        if not active:
            break
        completions = policy.generate([e.traj.token_ids for e in active], sampling)
        for episode, completion in zip(active, completions, strict=True):
            _advance(episode, completion, policy.version, renderer)
    for e in episodes:
        if not e.done:
            e.finish(RolloutStatus.TRUNCATED, "out of turns")
    return [e.traj for e in episodes]


def restorable(env) -> bool:
    """Whether an unfinished episode of `env` can be saved and continued (`get_state` /
    `set_state`); an env says no with `restorable = False` (envs/harness.py)."""
    return bool(getattr(getattr(env, "unwrapped", env), "restorable", True))


def tools_running_late(env) -> bool:
    """Whether a tool call of `env` that timed out still runs on the env's state (a ToolEnv's
    `toolbox.running_late()`): the episode goes on, but the env is not reused after it."""
    toolbox = getattr(getattr(env, "unwrapped", env), "toolbox", None)
    running_late = getattr(toolbox, "running_late", None)
    return bool(running_late is not None and running_late())


def discard(env) -> None:
    """Close an env that will not be used again, on a daemon thread: a timed-out tool may
    still hold it, and its close (an agent's endpoint, MCP servers) must not stall the loop."""

    def close() -> None:
        with contextlib.suppress(Exception):
            env.close()

    threading.Thread(target=close, name="agentrl-env-close", daemon=True).start()


def task_id(env, env_id: str, seed: int) -> str:
    """`<env>#<seed>`, the id of the task `env.reset(seed=seed)` draws: a mixture of envs
    (envs/mixture.py) names the env the seed draws from (`env_id_for`), any other env `env_id`.
    Per-env metrics (rollout/worker.py `summarize`) read the env back from it."""
    which = getattr(getattr(env, "unwrapped", env), "env_id_for", None)
    return f"{env_id if which is None else which(seed)}#{seed}"


def open_episode(
    env, seed: int, task_id: str, renderer: ChatRenderer
) -> tuple[Trajectory, list[dict]]:
    """Reset `env` and render the opening prompt: the trajectory so far and the tools. A reset
    that raises is an env error of this episode (finished, never trained on), not of the worker."""
    try:
        observation, info = env.reset(seed=seed)
        tools = info.get("tools", [])
        prompt = renderer.prompt(observation, tools)  # (messages from outside may not render)
    except Exception as exc:
        traj = Trajectory(task_id=task_id, messages=[])
        traj.status, traj.finish_detail = (
            RolloutStatus.ENV_ERROR,
            f"reset raised {type(exc).__name__}: {exc}",
        )
        return traj, []
    traj = Trajectory(task_id=task_id, messages=copy.deepcopy(observation))
    traj.append(prompt, sampled=False)
    traj.prompt_length = len(traj.token_ids)
    return traj, tools


def _start(env, seed: int, task_id: str, renderer: ChatRenderer) -> _Episode:
    traj, tools = open_episode(env, seed, task_id, renderer)
    return _Episode(env=env, traj=traj, tools=tools, done=traj.status is RolloutStatus.ENV_ERROR)


def _advance(episode: _Episode, completion: Completion, version: int, renderer) -> None:
    traj = episode.traj
    traj.append(completion.token_ids, sampled=True, logprobs=completion.logprobs, version=version)
    traj.num_turns += 1
    if completion.routed_experts is not None:  # each turn's forward covers the whole history
        traj.routed_experts = completion.routed_experts
    if completion.finish_reason != "stop":
        episode.finish(RolloutStatus.TRUNCATED, "turn hit max_new_tokens")
        return
    parsed = renderer.parse(completion.token_ids)
    traj.num_parse_errors += len(parsed.errors)
    traj.messages.append(parsed.message)
    apply_env_step(episode, lambda: episode.env.step(parsed.message), renderer)


def apply_env_step(episode, step: Callable[[], tuple], renderer: ChatRenderer) -> list[int] | None:
    """Apply one env step to `episode` (anything with `traj`, `tools` and `finish`: `_Episode`
    here, `Episode` in rollout/agent.py). `step()` gives the step's (observation, reward,
    terminated, truncated, info): it runs `env.step`, or returns the result of one run
    elsewhere (a finished future's `result`). If it raises, the episode ends as an env error (an
    env bug ends this episode, not the worker). Otherwise the reward and the tool-call and
    tool-error counts are added; a terminated or truncated step finishes the episode (its last
    observation kept as messages only, its `outcome` recorded); any other step's observation is
    rendered and appended as tokens with loss mask 0. Returns those tokens, or None when the
    episode finished."""
    traj = episode.traj
    try:
        observation, step_reward, terminated, truncated, info = step()
    except Exception as exc:  # an env bug ends this episode, not the worker
        episode.finish(RolloutStatus.ENV_ERROR, f"{type(exc).__name__}: {exc}")
        return None
    traj.env_reward += float(step_reward)
    traj.num_tool_calls += int(info.get("tool_calls", 0))
    traj.num_tool_errors += int(info.get("tool_errors", 0))
    if terminated or truncated:
        traj.messages.extend(observation)
        status = RolloutStatus.COMPLETED if terminated else RolloutStatus.TRUNCATED
        detail = "env terminated" if terminated else "env truncated"
        episode.finish(status, detail, info.get("outcome"))
        return None
    try:  # an observation the template cannot render ends this episode, not the worker
        ids = renderer.observation(traj.messages, observation, episode.tools)
    except Exception as exc:
        episode.finish(RolloutStatus.ENV_ERROR, f"{type(exc).__name__}: {exc}")
        return None
    traj.messages.extend(copy.deepcopy(observation))
    traj.append(ids, sampled=False)
    return ids
