"""Policy-gradient losses for the GRPO family and PPO. Letters: B = sequences, T = token positions.

Per token, with log importance weight w (token level: logp - old_logp; sequence level (GSPO): the
masked mean of that over the sequence, shared by its tokens) and r = exp(w):

    clip   (grpo, dr_grpo, dapo, gspo, ppo): l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo:                                   l = -sg(min(r, eps_high)) A logp

plus kl_coef * KL(pi || ref) per token (k1 or k3 estimator). The per-token losses are aggregated by
`aggregation` over the *whole* batch: pass `Normalizers` computed on the full batch when
accumulating micro-batches so the summed gradients equal the full batch's. An entropy bonus
subtracts entropy_coef x the token-mean entropy.

Off-policy correction (`trainer.off_policy`; mu = the behaviour policy that sampled the token,
its logprob recorded by the rollout; C = `tis_cap`):

    none       old = mu. PPO with the sampling policy as the old policy (verl's "bypass mode").
    tis        old = mu, and the importance weight r = pi / mu (gspo: the sequence's) is
               truncated at C where the objective uses it: the unclipped branch becomes
               min(r, C) A with gradient min(r, C) A grad(log pi), so every token's gradient is
               -1[not clipped] min(r, C) A grad(log pi) (cispo: the weight is
               sg(min(r, clip_high, C))). Truncated IS (Yao et al. 2025,
               "Your efficient RL framework secretly brings you off-policy RL training";
               verl's token-level TIS) inside PPO's pessimistic min: the clip bounds r for A > 0,
               the cap bounds it for A < 0, where PPO alone leaves it unbounded (dual-clip PPO,
               Ye et al. 2020, zeroes that gradient instead). No extra forward.
    decoupled  old = pi_prox, the learner's own logprobs from a no-grad forward before the
               batch's first update (fixed during the epochs), and every token is weighted by
               sg(rho), rho = min(pi_prox / mu, C) (C null: untruncated): decoupled PPO (Hilton et
               al. 2021, "Batch size-invariance for policy optimization"; AReaL, Fu et al. 2025,
               whose behav_imp_weight_cap drops tokens with rho > C where we truncate; verl's
               decoupled mode; TRL's vllm_importance_sampling_correction, token_truncate).

`policy_loss_reference` is the same thing as plain Python loops (tests compare them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from rl.config.runfile import Aggregation


@dataclass(frozen=True, slots=True, kw_only=True)
class LossSpec:
    objective: Literal["clip", "cispo"] = "clip"
    level: Literal["token", "sequence"] = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    """Upper clip (clip objective: 1 + clip_high) or the ratio cap (cispo: clip_high itself)."""
    aggregation: Aggregation = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0


@dataclass(frozen=True, slots=True)
class Normalizers:
    """Whole-batch counts: loss tokens, sequences, and the length seq-mean-token-sum-norm uses."""

    tokens: float
    sequences: float
    max_tokens: float

    @staticmethod
    def of(mask_BT: torch.Tensor, max_tokens: int | None = None) -> Normalizers:
        return Normalizers(
            float(mask_BT.sum().clamp(min=1)),
            float(mask_BT.shape[0]),
            float(max_tokens or mask_BT.shape[1]),
        )


@dataclass(slots=True)
class LossStats:
    clipped_tokens: float = 0.0
    approx_kl_sum: float = 0.0
    ratio_sum: float = 0.0
    ref_kl_sum: float = 0.0
    tokens: float = 0.0
    is_weight_sum: float = 0.0
    """tis: the truncated weights min(r, C) summed over tokens."""
    truncated_tokens: float = 0.0
    """tis: tokens whose r exceeded C."""
    is_weight_max: float = 0.0
    """tis: the largest untruncated r (combined with max, never summed)."""

    SUMMED = (
        "clipped_tokens",
        "approx_kl_sum",
        "ratio_sum",
        "ref_kl_sum",
        "tokens",
        "is_weight_sum",
        "truncated_tokens",
    )

    def add(self, other: LossStats) -> None:
        for name in LossStats.SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.is_weight_max = max(self.is_weight_max, other.is_weight_max)


def log_importance_weights(logp_BT, old_logp_BT, mask_BT, level: str) -> torch.Tensor:
    """[B, T] (token level) or [B, 1] (sequence level: masked mean over the sequence)."""
    log_ratio_BT = (logp_BT - old_logp_BT) * mask_BT
    if level == "token":
        return log_ratio_BT
    return (log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).unsqueeze(-1)


def kl_per_token(logp_BT, ref_logp_BT, estimator: str) -> torch.Tensor:
    """KL(pi || ref) estimators on tokens sampled from pi: k1 = log(pi/ref), k3 = r - 1 - log r
    with r = ref/pi (non-negative, unbiased)."""
    delta_BT = ref_logp_BT - logp_BT
    if estimator == "k1":
        return -delta_BT
    return delta_BT.exp() - delta_BT - 1


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm: Normalizers
) -> torch.Tensor:
    masked_BT = loss_BT * mask_BT
    if mode == "token-mean":
        return masked_BT.sum() / norm.tokens
    if mode == "seq-mean-token-mean":
        return (masked_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)).sum() / norm.sequences
    if mode == "seq-mean-token-sum":
        return masked_BT.sum() / norm.sequences
    if mode == "seq-mean-token-sum-norm":
        return masked_BT.sum() / (norm.sequences * norm.max_tokens)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    spec: LossSpec,
    norm: Normalizers,
    *,
    is_weight_BT: torch.Tensor | None = None,
    ratio_cap: float | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """`is_weight_BT`: decoupled's fixed per-token weight; `ratio_cap`: tis's C (module doc)."""
    mask_BT = mask_BT.to(logp_BT.dtype)
    log_w = log_importance_weights(logp_BT, old_logp_BT, mask_BT, spec.level)
    ratio = log_w.exp()
    if spec.objective == "cispo":
        cap = spec.clip_high if ratio_cap is None else min(spec.clip_high, ratio_cap)
        capped = ratio.clamp(max=cap).detach()
        loss_BT = -capped * adv_BT * logp_BT
        clipped = (ratio > cap) & (adv_BT > 0)
    else:
        unclipped, bounded = (
            (ratio if ratio_cap is None else _truncated(log_w, ratio_cap)) * adv_BT,
            ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high) * adv_BT,
        )
        loss_BT = -torch.minimum(unclipped, bounded)
        clipped = bounded < unclipped
    loss_BT = loss_BT.expand_as(logp_BT)
    if is_weight_BT is not None:
        loss_BT = loss_BT * is_weight_BT.detach()
    ref_kl_BT = None
    if spec.kl_coef and ref_logp_BT is not None:
        ref_kl_BT = kl_per_token(logp_BT, ref_logp_BT, spec.kl_estimator)
        loss_BT = loss_BT + spec.kl_coef * ref_kl_BT
    loss = aggregate(loss_BT, mask_BT, spec.aggregation, norm)
    if spec.entropy_coef and entropy_BT is not None:
        loss = loss - spec.entropy_coef * (entropy_BT * mask_BT).sum() / norm.tokens
    stats = _stats(logp_BT, old_logp_BT, mask_BT, clipped, ref_kl_BT)
    if ratio_cap is not None:
        _truncation_stats(stats, ratio.detach().expand_as(mask_BT), mask_BT, ratio_cap)
    return loss, stats


def _truncated(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """exp(log_w) with its value truncated at `cap` and gradient min(r, cap) grad(log_w)."""
    excess = (log_w - math.log(cap)).clamp(min=0).detach()
    return (log_w - excess).exp()


def _stats(logp_BT, old_logp_BT, mask_BT, clipped, ref_kl_BT) -> LossStats:
    with torch.no_grad():
        log_ratio_BT = (logp_BT - old_logp_BT) * mask_BT
        ratio_BT = log_ratio_BT.exp()
        return LossStats(
            clipped_tokens=float((clipped.expand_as(mask_BT) * mask_BT).sum()),
            approx_kl_sum=float((((ratio_BT - 1) - log_ratio_BT) * mask_BT).sum()),  # k3 vs old
            ratio_sum=float((ratio_BT * mask_BT).sum()),
            ref_kl_sum=float((ref_kl_BT * mask_BT).sum()) if ref_kl_BT is not None else 0.0,
            tokens=float(mask_BT.sum()),
        )


def _truncation_stats(stats: LossStats, ratio_BT, mask_BT, cap: float) -> None:
    sampled = mask_BT > 0
    stats.is_weight_sum = float((ratio_BT.clamp(max=cap) * mask_BT).sum())
    stats.truncated_tokens = float(((ratio_BT > cap) & sampled).sum())
    stats.is_weight_max = float(ratio_BT[sampled].max()) if sampled.any() else 0.0


def value_loss(
    values_BK, returns_BK, old_values_BK, mask_BK, *, clip: float | None
) -> torch.Tensor:
    """PPO value loss (optionally clipped around the old values), mean over valid turns."""
    error = (values_BK - returns_BK) ** 2
    if clip is not None:
        clipped = old_values_BK + (values_BK - old_values_BK).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - returns_BK) ** 2)
    return 0.5 * (error * mask_BK).sum() / mask_BK.sum().clamp(min=1)


def policy_loss_reference(
    logp, old_logp, adv, mask, spec: LossSpec, *, max_tokens: int | None = None, ref_logp=None
) -> float:
    """Loop version over plain lists of lists (no entropy, no IS weight)."""
    per_seq, total_tokens, total_sum = [], 0, 0.0
    for b, (lp, olp, a, m) in enumerate(zip(logp, old_logp, adv, mask, strict=True)):
        tokens = [t for t in range(len(lp)) if m[t]]
        seq_w = sum(lp[t] - olp[t] for t in tokens) / max(len(tokens), 1)
        seq_sum = 0.0
        for t in tokens:
            w = seq_w if spec.level == "sequence" else lp[t] - olp[t]
            r = math.exp(w)
            if spec.objective == "cispo":
                loss = -min(r, spec.clip_high) * a[t] * lp[t]
            else:
                loss = -min(r * a[t], min(max(r, 1 - spec.clip_low), 1 + spec.clip_high) * a[t])
            if spec.kl_coef and ref_logp is not None:
                d = ref_logp[b][t] - lp[t]
                loss += spec.kl_coef * (-d if spec.kl_estimator == "k1" else math.exp(d) - d - 1)
            seq_sum += loss
        per_seq.append((seq_sum, len(tokens)))
        total_tokens += len(tokens)
        total_sum += seq_sum
    n = len(per_seq)
    if spec.aggregation == "token-mean":
        return total_sum / max(total_tokens, 1)
    if spec.aggregation == "seq-mean-token-mean":
        return sum(s / max(k, 1) for s, k in per_seq) / n
    if spec.aggregation == "seq-mean-token-sum":
        return total_sum / n
    return total_sum / (n * (max_tokens or len(logp[0])))
