"""Top-k router of K3's MoE with aux-loss-free bias and routing replay (k3-architecture.md 5.2,
5.3 and 8).

    scores_TE  = sigmoid(x_TD @ W_r^T)                   fp32 (at least), router reads the FULL x
    idx_TK     = topk_k(scores_TE + b)                   b = e_score_correction_bias (a buffer)
    weights_TK = scores[idx] / (sum_k scores[idx] + 1e-20) * routed_scaling_factor

The bias only chooses experts; the mixing weights come from the unbiased scores. The bias is a
buffer that no optimizer touches: Quantile Balancing (balance.py) writes it between steps and it
is frozen at inference.

Routing replay (R2/R3): every forward returns the selected indices, so a caller can record them
per layer. Passing `replay_indices_TK` to a later forward takes the selection from the replay
and gathers the weights from the live dense (pre-top-k) scores at the replayed indices, so the
router keeps receiving gradients even where the live top-k would have chosen differently. A row
of `replay_indices_TK` holding a negative index (the sentinel -1: no record for that token) is
routed live, exactly as without replay.

Letters: T tokens, D hidden size, E experts, K experts per token (top-k), G expert groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from policy.k3.precision import full_precision

SCORE_FUNCS = ("sigmoid", "softmax")
MAX_PASSES = 4
"""`top_k_indices` takes k passes of argmax up to this k, torch.topk above it."""


class Routing(NamedTuple):
    """What a router decided for T tokens."""

    weights_TK: torch.Tensor  # mixing weights (router compute dtype, differentiable)
    indices_TK: torch.Tensor  # int64 selected experts (live top-k, or the replayed ones)
    scores_TE: torch.Tensor  # dense pre-top-k scores (differentiable), for metrics and QB
    chosen_TK: torch.Tensor | None = None  # int64 the router's own top-k, replayed or not


@full_precision
def router_scores(x_TD: torch.Tensor, weight_ED: torch.Tensor, score_func: str) -> torch.Tensor:
    """Dense scores in at least float32 (float64 stays float64)."""
    cd = torch.promote_types(torch.promote_types(x_TD.dtype, weight_ED.dtype), torch.float32)
    logits_TE = x_TD.to(cd) @ weight_ED.to(cd).T
    if score_func == "sigmoid":
        return torch.sigmoid(logits_TE)
    return torch.softmax(logits_TE, dim=-1)


@torch.no_grad()
def select_experts(
    biased_TE: torch.Tensor, top_k: int, num_groups: int = 1, topk_group: int = 1
) -> torch.Tensor:
    """Indices of the top-k biased scores; with num_groups > 1, only inside the `topk_group`
    groups whose two best experts score highest (DeepSeek-V3 group-limited routing)."""
    if num_groups > 1:
        num_tokens, num_experts = biased_TE.shape
        grouped_TGe = biased_TE.view(num_tokens, num_groups, num_experts // num_groups)
        group_score_TG = grouped_TGe.topk(min(2, grouped_TGe.shape[-1]), dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_score_TG.topk(topk_group, dim=-1).indices, True)
        keep_TE = keep_TG.repeat_interleave(num_experts // num_groups, dim=1)
        return biased_TE.masked_fill(~keep_TE, float("-inf")).topk(top_k, dim=-1).indices
    return top_k_indices(biased_TE, top_k)


def top_k_indices(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest finite values of each row, largest first: torch.topk's answer,
    with ties going to the lower index. For k <= MAX_PASSES, k passes of argmax (which returns
    the first maximum), each masking its pick: ~3x faster than topk on the CPU at [6144, 48]
    (routing runs it in every MoE layer of every forward; the decode engine too, so the rollout
    and the learner choose alike). Rows must be finite (a -inf would be picked twice)."""
    if k > MAX_PASSES:
        return x_TE.topk(k, dim=-1).indices
    picked = [x_TE.argmax(-1, keepdim=True)]
    for step in range(1, k):
        if step == 1:
            x_TE = x_TE.scatter(-1, picked[-1], float("-inf"))  # a copy: the caller's stays
        else:
            x_TE.scatter_(-1, picked[-1], float("-inf"))
        picked.append(x_TE.argmax(-1, keepdim=True))
    return torch.cat(picked, -1)


def combine_weights(
    scores_TE: torch.Tensor, indices_TK: torch.Tensor, renormalize: bool, scale: float
) -> torch.Tensor:
    """Weights gathered from the dense scores at `indices_TK` (never from zeroed top-k probs)."""
    weights_TK = scores_TE.gather(1, indices_TK)
    if renormalize:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scale


class TopKRouter(nn.Module):
    """K3 / DeepSeek-V3 router: `weight` [E, D] (kept in fp32 by the caller), buffer
    `e_score_correction_bias` [E]. State-dict names match transformers' KimiLinearTopkRouter."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "sigmoid",
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        num_expert_group: int = 1,
        topk_group: int = 1,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"need 0 < top_k <= num_experts, got {top_k} and {num_experts}")
        if num_experts % num_expert_group or not 0 < topk_group <= num_expert_group:
            raise ValueError("num_experts must split into num_expert_group groups >= topk_group")
        self.num_experts, self.top_k, self.score_func = num_experts, top_k, score_func
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x_TD: torch.Tensor, replay_indices_TK: torch.Tensor | None = None) -> Routing:
        """Route T tokens; replay the given selection instead of choosing when provided (rows
        with a negative index, the sentinel -1, are chosen live)."""
        scores_TE = router_scores(x_TD, self.weight, self.score_func)
        biased_TE = scores_TE.detach() + self.e_score_correction_bias.to(scores_TE.dtype)
        indices_TK = select_experts(biased_TE, self.top_k, self.num_expert_group, self.topk_group)
        chosen_TK = indices_TK
        if replay_indices_TK is not None:
            expected = (x_TD.shape[0], self.top_k)
            if tuple(replay_indices_TK.shape) != expected or replay_indices_TK.is_floating_point():
                raise ValueError(f"replay indices must be integer {expected}")
            replay_TK = replay_indices_TK.to(device=scores_TE.device, dtype=torch.long)
            live_T1 = (replay_TK < 0).any(-1, keepdim=True)  # sentinel rows: no record
            indices_TK = torch.where(live_T1, indices_TK, replay_TK)  # no host sync
        weights_TK = combine_weights(
            scores_TE, indices_TK, self.renormalize, self.routed_scaling_factor
        )
        return Routing(weights_TK, indices_TK, scores_TE, chosen_TK)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, score={self.score_func}, "
            f"renormalize={self.renormalize}, scale={self.routed_scaling_factor}"
        )
