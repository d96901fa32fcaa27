"""The check-time checks of `env.mix` (rl/config/sections.py) that need the env classes: every
env of a mix has a scripted expert when SFT or a fresh policy's tokenizer needs demonstrations
(`agentrl check` runs it from rl/cli.py, after each entry's id, kwargs and build)."""

from __future__ import annotations

from typing import Any

from rl.config.errors import ConfigError


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
            "from the expert demonstrations of every env of the mix; give its env class an "
            "`expert` (docs/environments.md), or set sft.enabled: false and policy.path",
        )
