"""Policy-gradient losses. Letters: B = sequences, T = token positions.

`ppo_clip_loss` is the PPO clipped surrogate per token,
    l_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = exp(logp_t - old_logp_t),
aggregated as a token mean: sum over every loss token of the batch / number of loss tokens.
Pass `normalizer` (the loss-token count of the whole batch) when accumulating micro-batches, so
the summed gradients equal the full batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LossStats:
    clipped_tokens: float
    approx_kl_sum: float
    ratio_sum: float
    tokens: float


def ppo_clip_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    mask = mask_BT.to(logp_BT.dtype)
    log_ratio_BT = (logp_BT - old_logp_BT) * mask
    ratio_BT = log_ratio_BT.exp()
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    denom = normalizer if normalizer is not None else mask.sum().clamp(min=1)
    loss = (loss_BT * mask).sum() / denom
    with torch.no_grad():
        stats = LossStats(
            clipped_tokens=float(((clipped_BT > unclipped_BT) * mask).sum()),
            approx_kl_sum=float((((ratio_BT - 1) - log_ratio_BT) * mask).sum()),  # k3 estimator
            ratio_sum=float((ratio_BT * mask).sum()),
            tokens=float(mask.sum()),
        )
    return loss, stats


def ppo_clip_loss_reference(
    logp, old_logp, adv, mask, *, clip_low: float, clip_high: float
) -> float:
    """Loop version over plain lists of lists (tests compare it with the vectorised one)."""
    import math

    total, count = 0.0, 0
    for seq_logp, seq_old, seq_adv, seq_mask in zip(logp, old_logp, adv, mask, strict=True):
        for lp, olp, a, m in zip(seq_logp, seq_old, seq_adv, seq_mask, strict=True):
            if not m:
                continue
            ratio = math.exp(lp - olp)
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            total += max(-a * ratio, -a * clipped)
            count += 1
    return total / max(count, 1)
