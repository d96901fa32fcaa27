"""Run model-written code away from the host: bubblewrap namespaces, rlimits, a wall timeout that
kills the whole process tree, a fresh size-capped workspace, capped output.

Model-written code never runs in our process: envs hand it to `Sandbox.run` / `run_python`.
See docs/reliability.md for each attack, its limit and the measured outcome.
"""

from envs.sandbox.limits import Limits
from envs.sandbox.runner import (
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxLaunchFailed,
    SandboxUnavailable,
)

__all__ = [
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxLaunchFailed",
    "SandboxUnavailable",
]
