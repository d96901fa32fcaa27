"""Advantages. Each vectorised function has a plain loop reference beside it (tests compare).

Letters: G = groups, N = samples per group.
"""

from __future__ import annotations

import math

import torch


def grpo_advantages(
    rewards_GN: torch.Tensor, valid_GN: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """(r - group mean) / (group std + eps) over the valid samples of each group.

    The std is the unbiased one (as in TRL). A group whose valid rewards are all equal, or that
    has fewer than two valid samples, carries no signal: its advantages are 0. Invalid samples
    (env or grader errors) get 0 and do not move their group's statistics.
    """
    valid = valid_GN.to(rewards_GN.dtype)
    count_G = valid.sum(-1)
    mean_G = (rewards_GN * valid).sum(-1) / count_G.clamp(min=1)
    centred_GN = (rewards_GN - mean_G[:, None]) * valid
    var_G = (centred_GN**2).sum(-1) / (count_G - 1).clamp(min=1)
    std_G = var_G.sqrt()
    informative_G = (count_G >= 2) & (std_G > 0)
    keep_GN = informative_G[:, None] & valid_GN
    safe_std_G = torch.where(informative_G, std_G, torch.ones_like(std_G))
    return torch.where(
        keep_GN, centred_GN / (safe_std_G[:, None] + eps), torch.zeros_like(rewards_GN)
    )


def grpo_advantages_reference(
    rewards: list[list[float]], valid: list[list[bool]], eps: float = 1e-6
):
    out = []
    for group, ok in zip(rewards, valid, strict=True):
        values = [r for r, v in zip(group, ok, strict=True) if v]
        if len(values) < 2:
            out.append([0.0] * len(group))
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((r - mean) ** 2 for r in values) / (len(values) - 1))
        out.append(
            [
                (r - mean) / (std + eps) if v and std > 0 else 0.0
                for r, v in zip(group, ok, strict=True)
            ]
        )
    return out
