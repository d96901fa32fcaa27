"""`agentrl/Mix-v0`: several tool envs in one, each task drawn from one of them by weight.

    env = gymnasium.make("agentrl/Mix-v0", envs=[
        {"id": "agentrl/Calculator-v0", "kwargs": {"difficulty": 1}, "weight": 2},
        {"id": "agentrl/Retrieval-v0", "weight": 1},
    ])

`reset(seed=s)` picks the sub-env from `s` and the weights alone (`pick`: its own random stream,
independent of the sub-env's draws), then resets that sub-env with the same `s`: the same seed
always gives the same sub-env and the same task, and held-out seeds (>= HELDOUT_SEEDS) follow the
weights like training seeds do. `env_id_for(s)` names the sub-env a seed draws (its id; `id[i]`
when the mix lists the same id more than once), so task ids and per-env metrics name the real
env. `step`, `render`, the tools and `max_turns` are the current sub-env's; `get_state()` wraps
the sub-env's state with its place in the mix, and `set_state` refuses a state of another mix.

`MixtureExpert` (the env's `expert`) delegates each episode to the expert of the sub-env its task
came from (`envs.make_expert`), so SFT demonstrations cover every env of the mix by weight.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import gymnasium
import numpy as np

from envs.registry import ensure_registered, make_expert
from envs.spaces import MessageSpace, MessagesSpace
from envs.types import HELDOUT_SEEDS, Message, check_state_owner, state_owner

MIX_ID = "agentrl/Mix-v0"
STATE_VERSION = 1
_SALT = 0x6D6978  # "mix": the pick's random stream is not the sub-env's (seeded by s alone)
_EXPERT_STRIDE = 1_000_003  # seeds of the sub-experts: seed + index * stride
_KEYS = ("id", "entry_point", "kwargs", "weight")


@dataclass(frozen=True, slots=True)
class MixEntry:
    """One env of a mix, as `envs=[...]` lists it."""

    id: str
    entry_point: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


def parse_envs(envs: Any) -> list[MixEntry]:
    """`envs=[{id, entry_point?, kwargs?, weight?}, ...]` checked; ValueError names the entry."""
    if not isinstance(envs, list | tuple) or not envs:
        raise ValueError(f"envs must be a non-empty list of {{id, kwargs, weight}}, got {envs!r}")
    out = []
    for i, entry in enumerate(envs):
        if not isinstance(entry, dict):
            raise ValueError(f"envs[{i}] must be a mapping with an id, got {entry!r}")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ValueError(f"envs[{i}] has unknown key {unknown[0]!r}; keys: {', '.join(_KEYS)}")
        if not isinstance(entry.get("id"), str):
            raise ValueError(f"envs[{i}].id must be a registered env id, got {entry.get('id')!r}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"envs[{i}].weight must be a number, got {weight!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"envs[{i}].weight must be > 0, got {weight}")
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValueError(f"envs[{i}].kwargs must be a mapping, got {kwargs!r}")
        out.append(MixEntry(entry["id"], entry.get("entry_point"), dict(kwargs), float(weight)))
    return out


def pick(seed: int, weights: Sequence[float]) -> int:
    """The index a seed draws: entry i with probability weights[i] / sum(weights), a stable
    function of (seed, weights) (NumPy's SeedSequence and PCG64 streams are stable)."""
    u = np.random.default_rng([_SALT, int(seed) % 2**64]).random()
    bounds = list(itertools.accumulate(weights))
    return min(bisect.bisect_right(bounds, u * bounds[-1]), len(bounds) - 1)


def labels(entries: Sequence[MixEntry]) -> list[str]:
    """The name of each entry in task ids and metrics: its id, or `id[i]` for an id listed twice."""
    ids = [e.id for e in entries]
    return [e.id if ids.count(e.id) == 1 else f"{e.id}[{i}]" for i, e in enumerate(entries)]


def env_of_seed(envs: Any) -> Callable[[int], str]:
    """seed -> the env (its label) that a mixture of these `envs` draws, without building any
    env: how the driver names the env of each held-out task (per-env evaluation results)."""
    entries = parse_envs(envs)
    names, weights = labels(entries), [e.weight for e in entries]
    return lambda seed: names[pick(seed, weights)]


class MixtureExpert:
    """Each episode, the scripted expert of the sub-env the task came from (made once per
    sub-env with `envs.make_expert`; a sub-env without one raises its KeyError)."""

    def __init__(self, *, error_rate: float = 0.0, seed: int = 0):
        self.error_rate, self.seed = error_rate, seed
        self._experts: dict[int, Any] = {}
        self._begun = False

    def begin(self) -> None:
        # demonstrate() calls this after reset, with no env: the sub-expert's own begin() runs
        # at the episode's first act, once the mixture says which sub-env it is.
        self._begun = False

    def act(self, env: Any, history: list[Message]) -> Message:
        mix = env.unwrapped
        index, sub = mix.current_index, mix.current
        expert = self._experts.get(index)
        if expert is None:
            seed = self.seed + index * _EXPERT_STRIDE
            expert = self._experts[index] = make_expert(sub, error_rate=self.error_rate, seed=seed)
        if not self._begun:
            expert.begin()
            self._begun = True
        return expert.act(sub, history)


class MixtureEnv(gymnasium.Env[list[Message], Message]):
    """Tool envs drawn by weight, one per task (see the module docstring).

    `envs`: the entries, each `{id, entry_point?, kwargs?, weight?}` (weight > 0, default 1);
    `max_turns`: if given, passed to every sub-env (each must take it)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    expert: ClassVar[Any] = MixtureExpert

    def __init__(
        self,
        *,
        envs: list[dict[str, Any]],
        max_turns: int | None = None,
        render_mode: str | None = None,
    ):
        self.entries = parse_envs(envs)
        self.labels = labels(self.entries)
        self.weights = [e.weight for e in self.entries]
        self.render_mode = render_mode
        self.observation_space = MessagesSpace(roles=("system", "user", "tool"))
        self.action_space = MessageSpace(roles=("assistant",))
        self.envs: list[gymnasium.Env] = []
        for i, entry in enumerate(self.entries):
            kwargs = dict(entry.kwargs)
            if max_turns is not None:
                kwargs["max_turns"] = max_turns
            try:
                ensure_registered(entry.id, entry.entry_point)
                self.envs.append(gymnasium.make(entry.id, render_mode=render_mode, **kwargs))
            except Exception as exc:
                exc.add_note(f"(building envs[{i}] = {entry.id} of {MIX_ID})")
                self.close()
                raise
        text = json.dumps([asdict(e) for e in self.entries], sort_keys=True, default=str)
        self.signature = hashlib.sha256(text.encode()).hexdigest()[:16]
        """Names this mix in saved states (its entries: ids, kwargs and weights)."""
        self._index: int | None = None
        self._ever_reset: set[int] = set()

    # --- which sub-env ----------------------------------------------------------------------
    def env_id_for(self, seed: int) -> str:
        """The sub-env (its label) that `reset(seed=seed)` draws."""
        return self.labels[pick(seed, self.weights)]

    @property
    def current_index(self) -> int:
        """The sub-env of the current episode (0 before the first reset)."""
        return 0 if self._index is None else self._index

    @property
    def current(self) -> gymnasium.Env:
        return self.envs[self.current_index]

    @property
    def max_turns(self) -> int:
        """The current sub-env's; before the first reset, the largest of them."""
        if self._index is None:
            return max(env.unwrapped.max_turns for env in self.envs)
        return self.current.unwrapped.max_turns

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The current sub-env's tool schemas; before the first reset, every sub-env's (the
        first schema of each name)."""
        if self._index is not None:
            return self.current.unwrapped.tools
        seen: dict[str, dict[str, Any]] = {}
        for env in self.envs:
            for schema in env.unwrapped.tools:
                seen.setdefault(schema.get("function", {}).get("name"), schema)
        return list(seen.values())

    @property
    def toolbox(self) -> Any:
        """The current sub-env's toolbox; before the first reset, the first sub-env's if every
        sub-env has the same tools (else there is no one toolbox to give)."""
        if self._index is None:
            names = {tuple(env.unwrapped.toolbox.names) for env in self.envs}
            if len(names) > 1:
                raise RuntimeError(
                    f"the envs of this mix have different tools ({sorted(names)}): reset it "
                    "first, then the current env's toolbox is the one"
                )
        return self.current.unwrapped.toolbox

    @property
    def done(self) -> bool:
        return self._index is None or self.current.unwrapped.done

    # --- gymnasium API ----------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if seed is None:  # after a seeded reset, unseeded ones are reproducible too
            seed = int(self.np_random.integers(HELDOUT_SEEDS))  # a training seed, never held out
        index = pick(seed, self.weights)
        observation, info = self.envs[index].reset(seed=seed, options=options)
        self._index = index
        self._ever_reset.add(index)
        return observation, {**info, "env_id": self.labels[index]}

    def step(self, action: Message):
        if self._index is None:
            raise RuntimeError("step() before reset(): there is no episode")
        return self.envs[self._index].step(action)

    def render(self) -> str | None:
        return None if self._index is None else self.current.render()

    def close(self) -> None:
        for env in self.envs:
            env.close()

    # --- save and continue ------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The current sub-env's state (`get_state()`), with its place in this mix."""
        if self._index is None:
            raise RuntimeError("get_state() before reset(): there is no episode to save")
        return {
            "version": STATE_VERSION,
            "env": state_owner(self),
            "mix": self.signature,
            "index": self._index,
            "id": self.labels[self._index],
            "state": copy.deepcopy(self.current.unwrapped.get_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue an episode saved by `get_state()` of a mix with the same entries."""
        check_state_owner(state, self, STATE_VERSION)
        index = state.get("index")
        if state.get("mix") != self.signature or index not in range(len(self.envs)):
            raise ValueError(
                f"state is of another mix (entry {state.get('id')!r}, mix {state.get('mix')}); "
                f"this mix is {self.signature}: {', '.join(self.labels)}"
            )
        sub = self.envs[index]
        if index not in self._ever_reset:  # wrappers (gymnasium's order enforcing) want a reset
            sub.reset(seed=0)
            self._ever_reset.add(index)
        sub.unwrapped.set_state(state["state"])
        self._index = index
