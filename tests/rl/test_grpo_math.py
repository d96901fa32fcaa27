"""GRPO advantages and the PPO-clip loss against hand-computed values and loop references."""

from __future__ import annotations

import math

import torch

from rl.advantages import grpo_advantages, grpo_advantages_reference
from rl.losses import ppo_clip_loss, ppo_clip_loss_reference


def test_advantages_by_hand():
    rewards = torch.tensor(
        [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.5, 0.5]], dtype=torch.float64
    )
    valid = torch.ones_like(rewards, dtype=torch.bool)
    adv = grpo_advantages(rewards, valid, eps=0.0)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(
        adv[0], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], dtype=torch.float64)
    )
    assert torch.equal(adv[1], torch.zeros(4, dtype=torch.float64))  # no signal in a flat group
    s3 = math.sqrt(((0.5**2) * 2) / 3)
    assert torch.allclose(
        adv[2], torch.tensor([-0.5 / s3, 0.5 / s3, 0.0, 0.0], dtype=torch.float64)
    )


def test_invalid_samples_get_zero_and_do_not_move_the_group():
    rewards = torch.tensor([[1.0, 0.0, 123.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False]])
    adv = grpo_advantages(rewards, valid, eps=0.0)
    assert adv[0, 2] == 0 and torch.allclose(
        adv[0, :2], torch.tensor([1 / math.sqrt(2), -1 / math.sqrt(2)], dtype=torch.float64)
    )


def test_advantages_match_the_loop_reference():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(20, 6, generator=gen, dtype=torch.float64).round()
    valid = torch.rand(20, 6, generator=gen) > 0.2
    fast = grpo_advantages(rewards, valid)
    slow = grpo_advantages_reference(rewards.tolist(), valid.tolist())
    assert torch.allclose(fast, torch.tensor(slow, dtype=torch.float64))


def test_clip_loss_by_hand():
    # one sequence, three loss tokens and one masked token
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0, 5.0]])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # token 1: r=1.5, A=1 -> max(-1.5, -1.2) = -1.2 (clipped)
    # token 2: r=0.5, A=-1 -> max(0.5, 0.8) = 0.8 (clipped); token 3: r=1, A=2 -> -2
    assert torch.isclose(loss, torch.tensor((-1.2 + 0.8 - 2.0) / 3))
    assert stats.clipped_tokens == 2 and stats.tokens == 3


def test_clip_loss_and_gradients_match_the_reference_in_float64():
    gen = torch.Generator().manual_seed(1)
    logp = (torch.randn(4, 9, generator=gen, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = torch.randn(4, 9, generator=gen, dtype=torch.float64) * 0.3 - 1
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 9)
    mask = (torch.rand(4, 9, generator=gen) > 0.3).double()
    loss, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    ref = ppo_clip_loss_reference(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low=0.2, clip_high=0.28
    )
    assert abs(loss.item() - ref) < 1e-12
    loss.backward()
    # gradient by hand: -A r / n where unclipped term is the max, else 0
    ratio = (logp.detach() - old).exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(0.8, 1.28)
    active = (unclipped >= clipped).double() * mask
    expected = -adv * ratio * active / mask.sum()
    assert torch.allclose(logp.grad, expected)


def test_micro_batches_sum_to_the_full_batch_gradient():
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    old, adv = (
        torch.randn(6, 5, generator=gen, dtype=torch.float64),
        torch.randn(6, 5, generator=gen, dtype=torch.float64),
    )
    mask = (torch.rand(6, 5, generator=gen) > 0.4).double()
    full, _ = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    (grad_full,) = torch.autograd.grad(full, logp)
    n = float(mask.sum())
    parts = [
        ppo_clip_loss(
            logp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            clip_low=0.2,
            clip_high=0.2,
            normalizer=n,
        )[0]
        for i in range(0, 6, 2)
    ]
    (grad_parts,) = torch.autograd.grad(sum(parts), logp)
    assert torch.allclose(grad_full, grad_parts)
