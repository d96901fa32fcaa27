"""A long-tail tool-latency workload for `benchmarks/async_vs_sync.py`.

`LongTailCalculatorEnv` is `agentrl/Calculator-v0` (same problems, same `calculate` tool and
schema, same grading, same scripted expert) whose env steps that carry tool calls sleep
`latency_s` first, and `slow_factor` times as long on a `slow_share` of episodes. Which episodes
are slow is decided by the episode's seed alone (a hash of it), so the same task is slow in every
run, in both modes, and on a replay after a restore; all samples of a group share the seed, so a
slow task makes its whole group slow. Register it from a run file:

    env:
      id: benchmarks/LongTailCalculator-v0
      entry_point: "benchmarks.longtail_env:LongTailCalculatorEnv"
      kwargs: {difficulty: 1, max_turns: 4, latency_s: 0.05, slow_factor: 10, slow_share: 0.1}
"""

from __future__ import annotations

import time
import zlib
from typing import Any

from envs.calculator import CalculatorEnv


def is_slow(seed: int | None, share: float) -> bool:
    """Deterministic in the seed; about `share` of seeds are slow."""
    if seed is None or share <= 0:
        return False
    return zlib.crc32(f"longtail:{int(seed)}".encode()) % 10_000 < share * 10_000


class LongTailCalculatorEnv(CalculatorEnv):
    """Calculator whose tool calls take `latency_s` (x `slow_factor` on slow episodes)."""

    def __init__(
        self,
        *,
        latency_s: float = 0.05,
        slow_factor: float = 10.0,
        slow_share: float = 0.1,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if latency_s < 0 or slow_factor < 1 or not 0 <= slow_share <= 1:
            raise ValueError("need latency_s >= 0, slow_factor >= 1 and 0 <= slow_share <= 1")
        self.latency_s, self.slow_factor, self.slow_share = latency_s, slow_factor, slow_share
        self.slow = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.slow = is_slow(seed, self.slow_share)
        return super().reset(seed=seed, options=options)

    def step(self, action):
        calls = action.get("tool_calls") if isinstance(action, dict) else None
        if calls and not self.done:
            time.sleep(self.latency_s * (self.slow_factor if self.slow else 1.0))
        return super().step(action)
