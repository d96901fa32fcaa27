"""Tool-using task environments: real `gymnasium.Env`s that speak chat messages.

Importing this package registers the built-in environments with gymnasium, and every installed
package's `agentrl.envs` entry points (see `envs.registry`):

    import gymnasium, envs
    env = gymnasium.make("agentrl/Calculator-v0", difficulty=2)
"""

import gymnasium

from envs.base import ToolEnv
from envs.expert import Demonstration, Expert, demonstrate
from envs.registry import (
    RegistrationError,
    check_kwargs,
    ensure_registered,
    env_class,
    env_ids,
    make_expert,
    register_plugins,
)
from envs.tools import Tool, Toolbox, ToolError, tool
from envs.types import Message, Outcome

__all__ = [
    "BUILTIN",
    "Demonstration",
    "Expert",
    "Message",
    "Outcome",
    "RegistrationError",
    "Tool",
    "ToolEnv",
    "ToolError",
    "Toolbox",
    "check_kwargs",
    "demonstrate",
    "ensure_registered",
    "env_class",
    "env_ids",
    "make_expert",
    "tool",
]

BUILTIN = (
    ("agentrl/Calculator-v0", "envs.calculator:CalculatorEnv", {"difficulty": 1, "max_turns": 4}),
    ("agentrl/PythonCode-v0", "envs.python_code:PythonCodeEnv", {"difficulty": 1}),
    ("agentrl/Retrieval-v0", "envs.retrieval:RetrievalEnv", {"difficulty": 1}),
    ("agentrl/FileEdit-v0", "envs.file_edit:FileEditEnv", {"difficulty": 1}),
    ("agentrl/LongHorizon-v0", "envs.long_horizon:LongHorizonEnv", {}),
    ("agentrl/Mix-v0", "envs.mixture:MixtureEnv", {"envs": [{"id": "agentrl/Calculator-v0"}]}),
    ("agentrl/Dataset-v0", "envs.dataset:DatasetEnv", {}),
    ("agentrl/Harness-v0", "envs.harness:HarnessEnv", {}),
)
"""(id, entry point, default kwargs) of the built-in environments."""


def _register() -> None:
    for env_id, entry_point, kwargs in BUILTIN:
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point, kwargs=kwargs)
    register_plugins()


_register()
