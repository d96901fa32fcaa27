"""GRPO advantages and the PPO-clip loss against hand-computed values and loop references."""

from __future__ import annotations

import math

import torch

from rl.learner.advantages import (
    centred_advantages,
    gae,
    gae_reference,
    grpo_advantages,
    grpo_advantages_reference,
)


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


def test_dr_grpo_advantages_are_only_centred():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 5.0, 5.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, True], [True, True, False, True]])
    adv = centred_advantages(rewards, valid)
    assert torch.allclose(adv[0], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))
    assert torch.allclose(adv[1], torch.tensor([-1.0, -1.0, 0.0, 2.0], dtype=torch.float64))


def test_gae_by_hand_and_against_the_loop():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.4, 0.6], [0.3, 0.9, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # trajectory 2 has one turn: delta = 0.5 + 0 - 0.3
    assert (
        torch.isclose(adv[1, 0], torch.tensor(0.2, dtype=torch.float64)) and adv[1, 1:].eq(0).all()
    )
    d2 = 1.0 - 0.6
    d1 = 0.0 + 0.9 * 0.6 - 0.4
    d0 = 0.0 + 0.9 * 0.4 - 0.2
    expected = [d0 + 0.72 * d1 + 0.72**2 * d2, d1 + 0.72 * d2, d2]
    assert torch.allclose(adv[0], torch.tensor(expected, dtype=torch.float64))
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), [3, 1], gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor(ref_adv, dtype=torch.float64))
    assert torch.allclose(ret, torch.tensor(ref_ret, dtype=torch.float64))
