"""`check_tool_env(env_id)`: everything `agentrl envs check ID` verifies, with a pass/fail table.

Gymnasium's `check_env` covers one reset and a step or two. On top of it:
- tool schemas: named, described, typed, unique (what chat templates and TRL render);
- seeded resets: the same seed gives the same task, different seeds give different tasks;
- expert episodes: the scripted expert (the env class's `expert`) solves every seeded task, and
  the same seed gives the same transcript;
- random actions: random messages and random, malformed or mistyped tool calls never raise and
  always get answers that fit the observation space; every episode ends with an outcome;
- a long episode (`max_turns=long_steps` tool calls) truncates exactly at its limit;
- save and continue: `get_state()` mid-episode, `set_state()` on a fresh env, same next step.
"""

from __future__ import annotations

import json
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium.utils.env_checker import check_env

from envs.base import ToolEnv
from envs.expert import demonstrate
from envs.fuzz import random_action
from envs.mixture import MixtureEnv
from envs.registry import make_expert, register_entry_point, unknown_env


class CheckFailed(AssertionError):
    """A check found a problem (the message says which)."""


@dataclass(slots=True)
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass(slots=True)
class CheckReport:
    env_id: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    def format(self) -> str:
        lines = [f"agentrl envs check {self.env_id}"]
        for r in self.results:
            mark = "PASS" if r.passed else "FAIL"
            lines.append(f"  {mark}  {r.name:<26} {r.seconds:6.2f} s  {r.detail}")
        failed = sum(not r.passed for r in self.results)
        verdict = "PASSED" if not failed else f"FAILED ({failed} of {len(self.results)})"
        lines.append(f"{verdict}: {len(self.results) - failed}/{len(self.results)} checks passed")
        return "\n".join(lines)


def check_tool_env(
    env_id: str,
    *,
    kwargs: dict[str, Any] | None = None,
    episodes: int = 5,
    long_steps: int = 32,
    seed: int = 0,
) -> CheckReport:
    """Run every check on `env_id` (made with `kwargs`); never raises for a broken env.

    `env_id` may also be an entry point, "module:EnvClass", registered here as module/Class-v0.
    """
    kwargs = dict(kwargs or {})
    report = CheckReport(env_id)
    if ":" in env_id:
        try:
            env_id = register_entry_point(env_id)
        except Exception as exc:
            report.results.append(CheckResult("make", False, _explain(exc)))
            return report
    elif env_id not in gymnasium.registry:
        report.results.append(CheckResult("make", False, unknown_env(env_id)))
        return report
    make = lambda **extra: gymnasium.make(env_id, **{**kwargs, **extra})  # noqa: E731
    checks: list[tuple[str, Callable[[], str]]] = [
        ("make", lambda: _check_make(make)),
        ("gymnasium check_env", lambda: _check_gymnasium(make)),
        ("tool schemas", lambda: _check_schemas(make)),
        ("seeded reset", lambda: _check_reset(make, seed)),
        ("expert episodes", lambda: _check_expert(make, env_id, episodes, seed)),
        ("random actions", lambda: _check_random(make, episodes, seed)),
        ("long episode", lambda: _check_long(make, long_steps, seed)),
        ("save and continue", lambda: _check_state(make, seed)),
    ]
    for name, fn in checks:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                detail, passed = fn(), True
        except Exception as exc:
            detail, passed = _explain(exc), False
        report.results.append(CheckResult(name, passed, detail, time.perf_counter() - start))
        if name == "make" and not passed:
            break
    return report


def _explain(exc: Exception) -> str:
    if isinstance(exc, CheckFailed):
        return str(exc)
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def _check_make(make) -> str:
    env = make()
    inner = env.unwrapped
    _require(
        isinstance(inner, ToolEnv | MixtureEnv), f"{type(inner).__name__} is not an envs.ToolEnv"
    )
    env.close()
    names = [t["function"]["name"] for t in inner.tools]  # a mix's: every env's
    return f"{type(inner).__name__}, tools: {', '.join(names) or 'none'}"


def _check_gymnasium(make) -> str:
    env = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    problems = [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)]
    _require(not problems, "; ".join(problems)[:500])
    return "passed without warnings"


def _check_schemas(make) -> str:
    tools = make().unwrapped.tools
    names = [t.get("function", {}).get("name") for t in tools]
    _require(len(set(names)) == len(names), f"duplicate tool names: {names}")
    for schema in tools:
        json.dumps(schema)
        fn = schema.get("function", {})
        name = fn.get("name")
        _require(schema.get("type") == "function", f"{name}: type must be 'function'")
        _require(isinstance(name, str) and name.isidentifier(), f"bad tool name {name!r}")
        _require(bool(fn.get("description")), f"{name}: no description (docstring)")
        params = fn.get("parameters", {})
        _require(params.get("type") == "object", f"{name}: parameters must be an object")
        props = params.get("properties", {})
        for arg, prop in props.items():
            _require("type" in prop, f"{name}.{arg}: no type")
            _require(bool(prop.get("description")), f"{name}.{arg}: not documented (Args:)")
        missing = set(params.get("required", [])) - set(props)
        _require(not missing, f"{name}: required but undefined: {sorted(missing)}")
    return f"{len(tools)} tools, all typed and documented"


def _check_reset(make, seed: int) -> str:
    env = make()
    first, info = env.reset(seed=seed)
    again, info_again = env.reset(seed=seed)
    _require(first == again and info == info_again, "reset(seed=s) twice gave different results")
    openings = {json.dumps(env.reset(seed=seed + i)[0], sort_keys=True) for i in range(8)}
    _require(len(openings) > 1, "8 different seeds all gave the same task")
    _require(env.observation_space.contains(first), "the opening is not in observation_space")
    return f"deterministic; {len(openings)} distinct tasks from 8 seeds"


def _check_expert(make, env_id: str, episodes: int, seed: int) -> str:
    env = make()
    demos = []
    for i in range(episodes):
        expert = make_expert(env_id, error_rate=0.0, seed=seed + i)
        demos.append(demonstrate(env, expert, seed=seed + i))
    failed = [seed + i for i, d in enumerate(demos) if not d.outcome.get("success")]
    _require(not failed, f"the expert failed seeds {failed}: {demos[0].outcome}"[:500])
    again = demonstrate(env, make_expert(env_id, error_rate=0.0, seed=seed), seed=seed)
    _require(again.messages == demos[0].messages, "the same seed gave a different transcript")
    turns = sum(m["role"] == "assistant" for d in demos for m in d.messages) / len(demos)
    return f"{episodes}/{episodes} solved, {turns:.1f} turns each, deterministic"


def _run_episode(env, rng: np.random.Generator, seed: int, max_steps: int) -> tuple[int, dict]:
    obs, info = env.reset(seed=seed)
    tools = info.get("tools", [])
    for step in range(1, max_steps + 1):
        action = random_action(rng, tools)
        obs, reward, terminated, truncated, info = env.step(action)
        _require(env.observation_space.contains(obs), f"step {step}: observation out of space")
        _require(isinstance(reward, float) and np.isfinite(reward), f"step {step}: bad reward")
        _require(not (terminated and truncated), f"step {step}: terminated and truncated")
        _require(all(m["role"] == "tool" for m in obs) or not obs, "non-tool reply to a call")
        if terminated or truncated:
            _require(isinstance(info.get("outcome", {}).get("success"), bool), "no outcome")
            return step, info
    raise CheckFailed(f"the episode did not end within {max_steps} steps")


def _check_random(make, episodes: int, seed: int) -> str:
    env = make()
    rng = np.random.default_rng(seed)
    limit = env.unwrapped.max_turns
    lengths = [_run_episode(env, rng, seed + i, limit)[0] for i in range(episodes * 4)]
    return f"{len(lengths)} episodes, {sum(lengths)} random steps, no exception"


def _check_long(make, steps: int, seed: int) -> str:
    env = make(max_turns=steps)
    rng = np.random.default_rng(seed + 1)
    env.reset(seed=seed)
    tools = env.unwrapped.tools
    for step in range(1, steps + 1):
        action = random_action(rng, tools, final=False)
        _, _, terminated, truncated, info = env.step(action)
        if terminated:
            return f"ended by a tool after {step} steps (an answer tool)"
        if truncated:
            _require(step == steps, f"truncated after {step} steps, expected {steps}")
            _require(info["outcome"]["success"] is False, "truncation reported success")
            return f"{steps} tool-call steps, truncated exactly at max_turns"
    raise CheckFailed(f"not truncated after {steps} steps with max_turns={steps}")


def _check_state(make, seed: int) -> str:
    env, rng = make(), np.random.default_rng(seed + 2)
    env.reset(seed=seed)
    tools = env.unwrapped.tools
    steps = min(2, env.unwrapped.max_turns - 1)
    for _ in range(steps):
        if env.step(random_action(rng, tools, final=False))[2]:
            return "skipped: the random calls ended the episode"
    state = json.loads(json.dumps(env.unwrapped.get_state()))
    action = random_action(rng, tools)
    expected = env.step(action)
    other = make()
    other.reset(seed=seed + 12345)
    other.unwrapped.set_state(state)
    got = other.step(action)
    _require(got[:4] == expected[:4], "the continued episode answered differently")
    return f"saved after {steps} steps, continued in a fresh env: same next step"


def list_envs() -> str:
    """One line per tool environment: id, entry point, whether it has a scripted expert."""
    from envs.registry import env_class, env_ids, plugin_entry_points

    plugins = {ep.name: ep for ep in plugin_entry_points()}
    lines = []
    for env_id in env_ids():
        entry = gymnasium.registry[env_id].entry_point
        origin = (
            f"package {plugins[env_id].dist.name}"
            if env_id in plugins and plugins[env_id].dist
            else "built-in"
        )
        try:
            expert = "expert" if getattr(env_class(env_id), "expert", None) else "no expert"
        except Exception as exc:  # a broken plugin is listed with its error, not a crash
            expert = f"cannot import: {exc}"
        lines.append(f"{env_id:<28} {entry!s:<40} {expert:<10} {origin}")
    return "\n".join(lines)
