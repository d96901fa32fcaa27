"""The reward side of the scoring seam: `rollout.types.Scorer` is the one protocol (what the
worker calls on a finished episode); every term here returns a `Reward`, which is a
`rollout.types.Scored`: a number with a breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Reward:
    total: float
    parts: dict[str, float] = field(default_factory=dict)
