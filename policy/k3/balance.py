"""Expert load balancing without aux losses: Quantile Balancing (K3, k3-architecture.md 7), the
DeepSeek-V3 sign rule for comparison, and load metrics. Pure functions on tensors; the router's
`e_score_correction_bias` buffer is the state, written by the caller between steps.

Quantile Balancing, one step on a batch of M tokens, N experts, top-k, target load q = M k / N:

    alpha_i = (k+1)-th largest of (s_i + b)          cutoff of token i under the CURRENT bias
    M_ij    = s_ij - alpha_i                         margin of expert j for token i
    bhat_j  = -((q+1)-th largest of M_:j)            admit about q tokens per expert
    b_new   = bhat - mean(bhat)                      used for the NEXT batch only

Sign convention: Megatron-LM stores qb_beta = -b and selects on scores - qb_beta; the numbers are
the same. When M k is not a multiple of N, q = floor(M k / N) (Megatron requires divisibility).

Letters: M tokens in the statistics batch, N experts, T tokens, K experts per token.
"""

from __future__ import annotations

import torch

from policy.k3.routing import top_k_indices


def _target_load(num_tokens: int, num_experts: int, top_k: int) -> int:
    if not 0 < top_k < num_experts:
        raise ValueError(f"need 0 < top_k < num_experts, got {top_k} and {num_experts}")
    if num_tokens * top_k < num_experts:
        raise ValueError(f"{num_tokens} tokens x top-{top_k} < {num_experts} experts")
    return num_tokens * top_k // num_experts


@torch.no_grad()
def quantile_balancing_candidate(
    scores_MN: torch.Tensor, bias_N: torch.Tensor, top_k: int
) -> torch.Tensor:
    """bhat (before the mean is removed), in at least float32. Accumulate these over
    micro-batches (QuantileAccumulator) or call quantile_balancing_update for one batch."""
    num_tokens, num_experts = scores_MN.shape
    target = _target_load(num_tokens, num_experts, top_k)
    cd = torch.promote_types(scores_MN.dtype, torch.float32)
    s_MN, b_N = scores_MN.detach().to(cd), bias_N.detach().to(cd)
    biased_MN = s_MN + b_N
    alpha_M1 = biased_MN.gather(1, top_k_indices(biased_MN, top_k + 1)[:, -1:])
    margin_MN = s_MN - alpha_M1
    return -margin_MN.topk(target + 1, dim=0).values[-1]


@torch.no_grad()
def quantile_balancing_update(
    scores_MN: torch.Tensor, bias_N: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The next bias from this batch's unbiased scores and the bias it was routed with."""
    bhat_N = quantile_balancing_candidate(scores_MN, bias_N, top_k)
    return (bhat_N - bhat_N.mean()).to(bias_N.dtype)


def expert_load(indices_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert, int64 [N]."""
    return torch.bincount(indices_TK.reshape(-1), minlength=num_experts)


def load_metrics(indices_TK: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Balance of one layer's routing: max/mean and min/mean load, coefficient of variation
    (std/mean, population std) and the number of experts that received no token."""
    return load_summary(expert_load(indices_TK, num_experts))


def load_summary(load_N: torch.Tensor) -> dict[str, float]:
    """load_metrics' numbers from per-expert load counts [N] (e.g. summed over ranks)."""
    load_N = load_N.double()
    mean = load_N.mean().clamp_min(1e-12)
    return {
        "max_over_mean": float(load_N.max() / mean),
        "min_over_mean": float(load_N.min() / mean),
        "cv": float(load_N.std(unbiased=False) / mean),
        "dead_experts": float((load_N == 0).sum()),
    }


@torch.no_grad()
def next_bias(candidate_N: torch.Tensor, bias_N: torch.Tensor, ema: float = 0.0) -> torch.Tensor:
    """The new bias from an averaged candidate: blended with the old bias (ema, 0 = replace) and
    re-centred to mean zero, in the bias's dtype. The one place QB's average becomes a bias
    (QuantileAccumulator here, RouterStats in policy.parallel across ranks)."""
    mixed_N = ema * bias_N.to(candidate_N.dtype) + (1.0 - ema) * candidate_N.to(bias_N.device)
    return (mixed_N - mixed_N.mean()).to(bias_N.dtype)


class QuantileAccumulator:
    """QB over several micro-batches (Megatron's global-batch convention): average the
    per-micro-batch candidates, blend with the old bias (ema, default 0 = replace), re-center.

        acc = QuantileAccumulator(num_experts)
        for micro_batch in batch: acc.add(routing.scores_TE, router.e_score_correction_bias, k)
        router.e_score_correction_bias.copy_(acc.update(router.e_score_correction_bias))

    Across data-parallel ranks, all-reduce-average `mean_candidate()` before `update`. This is an
    average of per-micro-batch quantiles, not the quantile of the pooled tokens.
    """

    def __init__(self, num_experts: int, ema: float = 0.0) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.num_experts, self.ema = num_experts, ema
        self._total_N: torch.Tensor | None = None
        self._count = 0

    def add(self, scores_MN: torch.Tensor, bias_N: torch.Tensor, top_k: int) -> None:
        bhat_N = quantile_balancing_candidate(scores_MN, bias_N, top_k)
        self._total_N = bhat_N if self._total_N is None else self._total_N + bhat_N
        self._count += 1

    def mean_candidate(self) -> torch.Tensor:
        if self._total_N is None:
            raise ValueError("no micro-batch added since the last update")
        return self._total_N / self._count

    @torch.no_grad()
    def update(self, bias_N: torch.Tensor) -> torch.Tensor:
        """The next bias; resets the accumulator."""
        new_N = next_bias(self.mean_candidate(), bias_N, self.ema)
        self._total_N, self._count = None, 0
        return new_N
