"""Tool-using task environments: real `gymnasium.Env`s that speak chat messages.

Importing this package registers the built-in environments with gymnasium:

    import gymnasium, envs
    env = gymnasium.make("agentrl/Calculator-v0", difficulty=2)
"""

import gymnasium

from envs.base import ToolEnv
from envs.expert import Demonstration, Expert, demonstrate
from envs.tools import Tool, Toolbox, ToolError, tool
from envs.types import Message, Outcome

__all__ = [
    "Demonstration",
    "Expert",
    "Message",
    "Outcome",
    "Tool",
    "ToolEnv",
    "ToolError",
    "Toolbox",
    "demonstrate",
    "make_expert",
    "tool",
]

EXPERTS = {"agentrl/Calculator-v0": "envs.calculator:CalculatorExpert"}


def _register() -> None:
    if "agentrl/Calculator-v0" not in gymnasium.registry:
        gymnasium.register(
            id="agentrl/Calculator-v0",
            entry_point="envs.calculator:CalculatorEnv",
            kwargs={"difficulty": 1, "max_turns": 4},
        )


def make_expert(env_id: str, **kwargs):
    """The scripted expert of a registered env (raises KeyError naming the known ones)."""
    import importlib

    if env_id not in EXPERTS:
        raise KeyError(f"no scripted expert for {env_id!r}; known: {sorted(EXPERTS)}")
    module, name = EXPERTS[env_id].split(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


_register()
