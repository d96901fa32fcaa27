"""Quantile Balancing (k3-architecture.md 7), the sign rule, and load metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from policy.k3.balance import (
    QuantileAccumulator,
    expert_load,
    load_metrics,
    quantile_balancing_candidate,
    quantile_balancing_update,
)


@torch.no_grad()
def sign_bias_update(load_N: torch.Tensor, bias_N: torch.Tensor, gamma: float) -> torch.Tensor:
    """The baseline QB is compared with: DeepSeek-V3's aux-loss-free rule (arXiv 2408.15664),
    b += gamma * sign(mean_load - load)."""
    load = load_N.to(bias_N.dtype)
    return bias_N + gamma * torch.sign(load.mean() - load)


def skewed_scores(gen, m=2048, n=16) -> torch.Tensor:
    """Sigmoid scores whose mean falls from expert 0 to expert n-1 (expert 0 is popular)."""
    skew = torch.linspace(2.0, -2.0, n, dtype=torch.float64)
    return torch.sigmoid(torch.randn(m, n, generator=gen, dtype=torch.float64) + skew)


def route(scores, bias, k) -> torch.Tensor:
    return (scores + bias).topk(k, dim=1).indices


def test_hand_built_example_k1_n4_m8():
    # scores in twentieths; every token prefers expert 0, so the load is [8, 0, 0, 0]
    s = torch.tensor(
        [[17, 11, 8, 8], [18, 2, 6, 4], [16, 2, 9, 10], [18, 7, 12, 5],
         [16, 2, 1, 11], [18, 1, 7, 4], [14, 5, 7, 1], [15, 8, 14, 2]],
        dtype=torch.float64,
    ) / 20  # fmt: skip
    b0 = torch.zeros(4, dtype=torch.float64)
    assert expert_load(route(s, b0, 1), 4).tolist() == [8, 0, 0, 0]
    # q = 8 * 1 / 4 = 2. Cutoffs (2nd largest, x20): 11 6 10 12 11 7 7 14.
    # Margins s - alpha per column (x20), 3rd largest: col0 {12,11,7,..} -> 7,
    # col1 {0,-2,-4,..} -> -4, col2 {0,0,0,..} -> 0, col3 {0,0,-2,..} -> -2.
    # bhat = (-7, 4, 0, 2) / 20, mean -0.25/20, so b = (-6.75, 4.25, 0.25, 2.25) / 20.
    b1 = quantile_balancing_update(s, b0, 1)
    want = torch.tensor([-6.75, 4.25, 0.25, 2.25], dtype=torch.float64) / 20
    assert (b1 - want).abs().max() < 1e-15
    # s + b1 (x20) picks experts 1 0 3 2 3 0 1 2 (margins >= 1/20): perfectly balanced
    assert route(s, b1, 1).flatten().tolist() == [1, 0, 3, 2, 3, 0, 1, 2]
    assert expert_load(route(s, b1, 1), 4).tolist() == [2, 2, 2, 2]


def test_new_bias_has_zero_mean_and_keeps_the_bias_dtype():
    gen = torch.Generator().manual_seed(0)
    s = skewed_scores(gen, m=256).float()
    b = quantile_balancing_update(s, torch.zeros(16), 2)
    assert b.dtype == torch.float32 and abs(b.mean().item()) < 1e-7


def test_invariant_to_a_constant_bias_shift():
    gen = torch.Generator().manual_seed(1)
    s, b = skewed_scores(gen, m=256), torch.randn(16, generator=gen, dtype=torch.float64) * 0.1
    assert torch.equal(route(s, b, 2), route(s, b + 0.3, 2))
    assert (
        quantile_balancing_update(s, b, 2) - quantile_balancing_update(s, b + 0.3, 2)
    ).abs().max() < 1e-12


def test_each_expert_admits_q_tokens_at_the_old_cutoffs():
    gen = torch.Generator().manual_seed(2)
    s, b, k = skewed_scores(gen, m=512), torch.zeros(16, dtype=torch.float64), 2
    bhat = quantile_balancing_candidate(s, b, k)
    margin = s - (s + b).topk(k + 1, dim=1).values[:, -1:]
    q = 512 * k // 16
    # ties are structural: every token whose cutoff expert is j has margin exactly -b_j, so an
    # under-loaded expert's threshold can sit on a tie (here expert 5: 51 strictly above)
    above, at_least = (margin > -bhat).sum(0), (margin >= -bhat).sum(0)
    assert (above <= q).all() and (at_least >= q + 1).all()
    assert (above == q).sum() >= 12


def test_update_uses_only_the_batch_it_was_routed_on():
    gen = torch.Generator().manual_seed(3)
    batches = [skewed_scores(gen, m=256) for _ in range(3)]
    b0 = torch.zeros(16, dtype=torch.float64)
    copy = batches[0].clone()
    b1 = quantile_balancing_update(batches[0], b0, 2)
    assert torch.equal(batches[0], copy) and torch.equal(b0, torch.zeros(16, dtype=torch.float64))
    # the routing of batch 1 uses b1, which no later batch can change
    b1_again = quantile_balancing_update(batches[0], b0, 2)
    _ = quantile_balancing_update(batches[1], b1, 2)
    assert torch.equal(b1, b1_again)
    assert torch.equal(route(batches[1], b1, 2), route(batches[1], b1_again, 2))


def steps_to_balance(rule, scores, k=2, threshold=1.2, max_steps=400) -> int | None:
    """Steps until the batch routed with the current bias has max/mean load <= threshold."""
    n = scores.shape[1]
    b = torch.zeros(n, dtype=torch.float64)
    for step in range(max_steps):
        idx = route(scores, b, k)
        if load_metrics(idx, n)["max_over_mean"] <= threshold:
            return step
        if rule == "qb":
            b = quantile_balancing_update(scores, b, k)
        else:
            b = sign_bias_update(expert_load(idx, n), b, gamma=1e-3)
    return None


def test_qb_balances_skewed_scores_in_a_few_steps_and_far_faster_than_the_sign_rule():
    scores = skewed_scores(torch.Generator().manual_seed(0))  # 2048 tokens, 16 experts, top-2
    start = load_metrics(route(scores, torch.zeros(16, dtype=torch.float64), 2), 16)
    assert start["max_over_mean"] > 4.5 and start["dead_experts"] == 1
    # measured to max/mean <= 1.2: QB 3 steps, sign rule (gamma 1e-3, DeepSeek-V3) 310 steps
    assert steps_to_balance("qb", scores) == 3
    assert steps_to_balance("sign", scores) == 310


def test_qb_keeps_fresh_batches_balanced():
    gen = torch.Generator().manual_seed(5)
    b, ratios = torch.zeros(16, dtype=torch.float64), []
    for _ in range(8):
        s = skewed_scores(gen)
        ratios.append(load_metrics(route(s, b, 2), 16)["max_over_mean"])
        b = quantile_balancing_update(s, b, 2)
    assert ratios[0] > 4 and max(ratios[4:]) < 1.25


def megatron_convention(scores: np.ndarray, k: int, qb_beta: np.ndarray):
    """Megatron-LM's stated QB semantics, transcribed with numpy sorts: select top-k of
    scores - qb_beta; cutoff = (k+1)-th of those; beta_local = (q+1)-th largest of
    scores - cutoff per expert; with ema 0 the new qb_beta is beta_local re-centred."""
    m, n = scores.shape
    adjusted = scores - qb_beta
    order = np.argsort(-adjusted, axis=1, kind="stable")
    cutoff = np.take_along_axis(adjusted, order[:, k : k + 1], axis=1)
    beta_local = -np.sort(-(scores - cutoff), axis=0)[m * k // n]
    return np.sort(order[:, :k], axis=1), beta_local - beta_local.mean()


def test_matches_megatron_with_b_equal_minus_qb_beta():
    gen = torch.Generator().manual_seed(6)
    s = skewed_scores(gen, m=96, n=12)
    b = torch.randn(12, generator=gen, dtype=torch.float64) * 0.05
    b -= b.mean()
    indices, qb_beta = megatron_convention(s.numpy(), 3, -b.numpy())
    assert np.array_equal(np.sort(route(s, b, 3).numpy(), axis=1), indices)
    assert np.abs(quantile_balancing_update(s, b, 3).numpy() - (-qb_beta)).max() < 1e-12


def test_sign_rule():
    load = torch.tensor([10, 2, 6, 6])
    b = sign_bias_update(load, torch.zeros(4), gamma=0.01)
    assert b.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_load_metrics():
    idx = torch.tensor([[0, 2], [0, 3], [0, 2], [0, 3]])  # loads 4 0 2 2, mean 2
    metrics = load_metrics(idx, 4)
    assert metrics["max_over_mean"] == 2.0 and metrics["min_over_mean"] == 0.0
    assert metrics["dead_experts"] == 1.0
    assert metrics["cv"] == pytest.approx(np.std([4, 0, 2, 2]) / 2)


def test_accumulator_matches_single_batch_and_averages_micro_batches():
    gen = torch.Generator().manual_seed(7)
    s1, s2 = skewed_scores(gen, m=128), skewed_scores(gen, m=128)
    b = torch.zeros(16, dtype=torch.float64)
    acc = QuantileAccumulator(16)
    acc.add(s1, b, 2)
    assert torch.equal(acc.update(b), quantile_balancing_update(s1, b, 2))
    acc.add(s1, b, 2)
    acc.add(s2, b, 2)
    mean = (quantile_balancing_candidate(s1, b, 2) + quantile_balancing_candidate(s2, b, 2)) / 2
    assert (acc.update(b) - (mean - mean.mean())).abs().max() < 1e-15
    with pytest.raises(ValueError):
        acc.update(b)  # reset after update
    ema = QuantileAccumulator(16, ema=0.5)
    old = torch.randn(16, generator=gen, dtype=torch.float64)
    old -= old.mean()
    ema.add(s1, old, 2)
    blended = 0.5 * old + 0.5 * quantile_balancing_candidate(s1, old, 2)
    assert (ema.update(old) - (blended - blended.mean())).abs().max() < 1e-15


def test_rejects_degenerate_sizes():
    with pytest.raises(ValueError):
        quantile_balancing_update(torch.rand(8, 4), torch.zeros(4), 4)  # k = n
    with pytest.raises(ValueError):
        quantile_balancing_update(torch.rand(3, 8), torch.zeros(8), 2)  # 6 assignments < 8
