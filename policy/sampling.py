"""Sampling parameters, completions, and next-token sampling shared by every engine.

Letters: B = batch (sequences), V = vocabulary.

The logprob recorded for a sampled token is log softmax(logits / temperature) at that token,
over the *full* vocabulary (top-k / top-p only restrict which tokens can be drawn). That is the
quantity the learner recomputes, so rollout and learner logprobs agree for the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_new_tokens: int = 64
    """Generation stops after this many tokens (finish_reason "length")."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after emitting one of these (finish_reason "stop")."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("top_k must be >= 0 and max_new_tokens >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True, kw_only=True)
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    """"stop" (a stop token was emitted, and is included) or "length"."""
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    """MoE routing for replay (left out of `==`: compare with np.array_equal), recorded only
    by engines asked to (policy.k3.engine.K3Policy):
    int16 [len(prompt) + len(token_ids) - 1, M, Kx] (M MoE layers, Kx experts per token),
    routed_experts[j, m, r] = expert picked in rank r by the m-th MoE layer at input position j
    of prompt + token_ids; row len(prompt) - 1 + i is the routing that produced token_ids[i].
    None when not recorded."""


def sample_next(
    logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens [B], logprobs [B]) under softmax(logits / T)."""
    logits_BV = logits_BV.float()
    if params.greedy:
        tokens_B = logits_BV.argmax(-1)
        logp_BV = torch.log_softmax(logits_BV, -1)
        return tokens_B, logp_BV.gather(-1, tokens_B[:, None])[:, 0]
    scaled_BV = logits_BV / params.temperature
    logp_BV = torch.log_softmax(scaled_BV, -1)
    filtered_BV = _filter(scaled_BV, params)
    probs_BV = torch.softmax(filtered_BV, -1)
    tokens_B = torch.multinomial(probs_BV, 1, generator=generator)[:, 0]
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None])[:, 0]


def _filter(scaled_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if params.top_k and params.top_k < scaled_BV.shape[-1]:
        kth_B1 = scaled_BV.topk(params.top_k, -1).values[:, -1:]
        scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, float("-inf"))
    if params.top_p < 1.0:
        sorted_BV, order_BV = scaled_BV.sort(-1, descending=True)
        cum_BV = torch.softmax(sorted_BV, -1).cumsum(-1)
        drop_BV = cum_BV - torch.softmax(sorted_BV, -1) > params.top_p  # keep the first over p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        scaled_BV = torch.full_like(scaled_BV, float("-inf")).scatter(-1, order_BV, sorted_BV)
    return scaled_BV


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as a left-padded batch: ids [B, P] (long, `pad_token_id` in the padding) and
    mask [B, P] (bool, True = real token), P the longest prompt."""
    width = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask_BP = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids_BP[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask_BP[row, width - len(prompt) :] = True
    return ids_BP, mask_BP
