"""The run-file `env.mix`: several envs in one run, as agentrl/Mix-v0 (envs/mixture.py).

`EnvKeys` are the keys of `env:` that each entry of a mix takes too (rl/config/sections.py
`EnvConfig` adds `mix`), `MixEntry` one entry (those keys and a `weight`), `expand_mix` turns
`env.mix` into agentrl/Mix-v0 with the entries as its kwargs.envs (EnvConfig's validator calls
it). `check_mix_expert` is the check-time check that needs the env classes: every env of a mix
has a scripted expert when SFT or a fresh policy's tokenizer needs demonstrations (`agentrl
check` runs it from rl/cli.py, after each entry's id, kwargs and build).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Protocol, TypeVar

from pydantic import AfterValidator, Field, model_validator

from rl.config.base import Section
from rl.config.dataset import check_grader, expand_shorthand
from rl.config.errors import ConfigError

MIX_ID = "agentrl/Mix-v0"
"""The env `env.mix` maps to (envs/mixture.py)."""


def _entry_point(value: str | None) -> str | None:
    if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
        raise ValueError(f"must look like 'package.module:EnvClass'; got {value!r}")
    return value


class EnvKeys(Section):
    """The keys of `env:` (rl/config/sections.py `EnvConfig`), which each entry of a mix takes
    too."""

    id: str | None = None
    """A gymnasium id of a tool environment (default agentrl/Calculator-v0); with `entry_point`,
    the id to register it under (default <module>/<Class>-v0)."""
    entry_point: Annotated[str | None, AfterValidator(_entry_point)] = None
    """"package.module:EnvClass" of an env that is not registered yet (a module in the current
    directory works); registered under `id` before the run starts."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to gymnasium.make (they override the registered defaults)."""
    dataset: str | None = None
    """A .jsonl or .parquet file of tasks (a prompt and an answer per row) to train on, with no
    env class to write: it selects agentrl/Dataset-v0 (so no `id` or `entry_point`) and becomes
    its kwargs.path, resolved against the current directory. Its other options go in kwargs:
    prompt_key, answer_key, heldout_fraction, split_seed, system, judge, mcp
    (docs/environments.md, "Tasks from a data file")."""
    grader: Annotated[str | None, AfterValidator(check_grader)] = None
    """How a `dataset` answer is graded: exact, numeric, judge (an LLM at kwargs.judge.url) or
    "package.module:function" (null: exact); becomes kwargs.grader."""
    harness: str | None = None
    """"package.module:function" of your own agent (sync or async, `run(base_url, task)`),
    trained through agentrl's OpenAI-compatible endpoint on the tasks of `dataset`: it selects
    agentrl/Harness-v0 (envs/harness.py; docs/environments.md, "Bring your own agent")."""

    @model_validator(mode="before")
    @classmethod
    def _dataset(cls, data: Any) -> Any:
        """`dataset` / `grader` -> agentrl/Dataset-v0 and its kwargs (rl/config/dataset.py)."""
        return expand_shorthand(data)


Keys = TypeVar("Keys", bound=EnvKeys)


def default_id(env: Keys) -> Keys:
    """No `id`: <module>/<Class>-v0 of the `entry_point`, else agentrl/Calculator-v0."""
    if env.id is None and env.entry_point is not None:
        module, _, cls = env.entry_point.partition(":")
        env.id = f"{module.split('.')[0]}/{cls}-v0"
    if env.id is None:
        env.id = "agentrl/Calculator-v0"
    return env


class MixEntry(EnvKeys):
    """One env of `env.mix`: the keys of `env:` and its weight."""

    weight: float = Field(1.0, gt=0)
    """Share of the tasks drawn from this env: weight / the sum of the mix's weights."""

    @model_validator(mode="before")
    @classmethod
    def _not_nested(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mix" in data:
            raise ConfigError("mix", "an entry of a mix cannot be a mix; list its envs in env.mix")
        return data

    @model_validator(mode="after")
    def _default_id(self) -> MixEntry:
        return default_id(self)

    def mix_entry(self) -> dict[str, Any]:
        """This entry as agentrl/Mix-v0's `envs` lists it."""
        entry = {"id": self.id, "kwargs": dict(self.kwargs), "weight": self.weight}
        return entry if self.entry_point is None else {**entry, "entry_point": self.entry_point}


class Mixed(Protocol):
    """What `expand_mix` sees of rl/config/sections.py `EnvConfig`: its keys and `mix`."""

    id: str | None
    kwargs: dict[str, Any]
    mix: list[MixEntry] | None
    model_fields_set: set[str]


Env = TypeVar("Env", bound=Mixed)


def expand_mix(env: Env) -> Env:
    """`env.mix` -> agentrl/Mix-v0 with the entries as kwargs.envs (a saved config.yaml, which
    has both, loads again); any other key of `env:` set beside `mix` is a ConfigError naming
    it. EnvConfig's after-validator, before its default id."""
    if env.mix is None:
        return env
    if not env.mix:
        raise ConfigError("mix", "is empty; list the envs to mix (a mix of one works)")
    made = {"id": MIX_ID, "kwargs": {"envs": [entry.mix_entry() for entry in env.mix]}}
    fields = type(env).model_fields  # type: ignore[attr-defined]
    for key in sorted(env.model_fields_set - {"mix"}):
        default = fields[key].get_default(call_default_factory=True)
        if getattr(env, key) not in (default, made.get(key)):
            raise ConfigError(
                key,
                f"cannot be set beside mix: the mix is {MIX_ID}, and each of its envs takes "
                f"its own {key} (env.mix[i].{key}); move it into the entries, or drop mix",
            )
    env.id, env.kwargs = made["id"], made["kwargs"]
    return env


def check_mix_expert(cfg: Any, entry: Any, key: str) -> None:
    """SFT, and a fresh policy's tokenizer, learn from the expert demonstrations of every env of
    the mix (envs/mixture.py `MixtureExpert`): `entry` without a scripted expert is a
    ConfigError naming `key`, unless neither is needed (sft off and a saved policy)."""
    if not cfg.sft.enabled and cfg.policy.path is not None:
        return
    import gymnasium

    import envs

    try:
        expert = getattr(envs.env_class(entry.id), "expert", None)
    except envs.RegistrationError:  # made by a function, not a class: ask an instance
        expert = None
    if expert is None:  # an env may take its expert as a kwarg (envs/harness.py): ask it
        made = gymnasium.make(entry.id, **entry.kwargs)
        expert = getattr(made.unwrapped, "expert", None)
        made.close()
    if expert is None:
        raise ConfigError(
            key,
            f"{entry.id} has no scripted expert, and SFT (and a fresh policy's tokenizer) learns "
            "from the expert demonstrations of every env of the run; give its env class an "
            "`expert` (docs/environments.md; a harness env takes env.kwargs.expert), or set "
            "sft.enabled: false and policy.path",
        )
