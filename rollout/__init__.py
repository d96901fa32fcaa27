"""Episodes and rollout workers: token-in/token-out agent loops over tool envs.

The names below load on first use (PEP 562), so that importing a light submodule such as
`rollout.stream` or `rollout.keys` (the monitor, `agentrl plot`) does not import torch through
`rollout.episode` and `rollout.worker`.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType

_EXPORTS = MappingProxyType(
    {
        "ChatRenderer": "rollout.render",
        "EpisodeLimits": "rollout.episode",
        "RolloutStatus": "rollout.types",
        "RolloutWorker": "rollout.worker",
        "Task": "rollout.worker",
        "Trajectory": "rollout.types",
        "TrajectoryGroup": "rollout.types",
        "run_episodes": "rollout.episode",
    }
)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
