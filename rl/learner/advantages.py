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


def centred_advantages(rewards_GN: torch.Tensor, valid_GN: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean, no division by the std (no length or difficulty bias)."""
    valid = valid_GN.to(rewards_GN.dtype)
    count_G = valid.sum(-1)
    mean_G = (rewards_GN * valid).sum(-1) / count_G.clamp(min=1)
    keep_GN = valid_GN & (count_G >= 2)[:, None]
    return torch.where(keep_GN, rewards_GN - mean_G[:, None], torch.zeros_like(rewards_GN))


def gae(
    rewards_BK: torch.Tensor,
    values_BK: torch.Tensor,
    mask_BK: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over turns. Letters: B = trajectories, K = turns (right-padded, `mask_BK` marks real
    ones). The state after the last real turn is terminal (value 0).
    Returns (advantages, returns)."""
    mask = mask_BK.to(values_BK.dtype)
    adv_BK = torch.zeros_like(values_BK)
    next_value_B = torch.zeros_like(values_BK[:, 0])
    running_B = torch.zeros_like(values_BK[:, 0])
    for k in reversed(range(values_BK.shape[1])):
        delta_B = rewards_BK[:, k] + gamma * next_value_B - values_BK[:, k]
        running_B = (delta_B + gamma * lam * running_B) * mask[:, k]
        adv_BK[:, k] = running_B
        next_value_B = values_BK[:, k] * mask[:, k]
    return adv_BK, (adv_BK + values_BK) * mask


def gae_reference(rewards, values, lengths, *, gamma: float, lam: float):
    advs, rets = [], []
    for r, v, n in zip(rewards, values, lengths, strict=True):
        a = [0.0] * len(v)
        for k in range(n):
            total = 0.0
            for j in range(k, n):
                next_v = v[j + 1] if j + 1 < n else 0.0
                total += (gamma * lam) ** (j - k) * (r[j] + gamma * next_v - v[j])
            a[k] = total
        advs.append(a)
        rets.append([a[k] + v[k] if k < n else 0.0 for k in range(len(v))])
    return advs, rets
