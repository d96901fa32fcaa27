"""Policy losses: hand-computed values, loop references, micro-batch exactness, and TRL 1.16's
GRPO-family losses on identical inputs (TRL is the outside reference)."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rl.learner.losses import (
    LossSpec,
    LossStats,
    Normalizers,
    policy_loss,
    policy_loss_reference,
    value_loss,
)


def inputs(seed=0, b=5, t=9):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=gen) > 0.3).double()
    mask[:, 0] = 1
    return logp, old, adv, mask


def test_clip_loss_by_hand():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), 0.0, 5.0]])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = policy_loss(logp, old, adv, mask, LossSpec(), Normalizers.of(mask))
    # token 1: r=1.5, A=1 -> -min(1.5, 1.2) = -1.2 (clipped)
    # token 2: r=0.5, A=-1 -> -min(-0.5, -0.8) = 0.8 (clipped); token 3: r=1, A=2 -> -2
    assert torch.isclose(loss, torch.tensor((-1.2 + 0.8 - 2.0) / 3))
    assert stats.clipped_tokens == 2 and stats.tokens == 3


SPECS = {
    "grpo": LossSpec(aggregation="seq-mean-token-mean"),
    "dapo": LossSpec(clip_high=0.28, aggregation="token-mean"),
    "dr_grpo": LossSpec(aggregation="seq-mean-token-sum-norm"),
    "gspo": LossSpec(
        level="sequence", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean"
    ),
    "cispo": LossSpec(objective="cispo", clip_high=1.2, aggregation="token-mean"),
    "token-sum": LossSpec(aggregation="seq-mean-token-sum"),
    "kl-k1": LossSpec(kl_coef=0.1, kl_estimator="k1"),
    "kl-k3": LossSpec(kl_coef=0.1, kl_estimator="k3", aggregation="seq-mean-token-mean"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_losses_match_the_loop_reference_with_gradients(name):
    spec = SPECS[name]
    logp, old, adv, mask = inputs(seed=len(name))
    ref_logp = old - 0.1
    adv_bt = adv.expand_as(logp)
    loss, _ = policy_loss(
        logp, old, adv_bt, mask, spec, Normalizers.of(mask, 12), ref_logp_BT=ref_logp
    )
    expected = policy_loss_reference(
        logp.tolist(),
        old.tolist(),
        adv_bt.tolist(),
        mask.tolist(),
        spec,
        max_tokens=12,
        ref_logp=ref_logp.tolist(),
    )
    assert abs(loss.item() - expected) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    eps = 1e-6
    for b, t in [(0, 0), (1, 3), (4, 8)]:  # central differences on the loop reference
        bumped = [logp.detach().clone() for _ in range(2)]
        bumped[0][b, t] += eps
        bumped[1][b, t] -= eps
        hi, lo = (
            policy_loss_reference(
                x.tolist(),
                old.tolist(),
                adv_bt.tolist(),
                mask.tolist(),
                spec,
                max_tokens=12,
                ref_logp=ref_logp.tolist(),
            )
            for x in bumped
        )
        if spec.objective == "cispo":
            continue  # cispo's ratio is a stop-gradient weight; finite differences would include it
        assert abs(grad[b, t].item() - (hi - lo) / (2 * eps)) < 1e-6


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "token-sum", "kl-k3"])
def test_micro_batches_sum_to_the_full_batch(name):
    spec = SPECS[name]
    logp, old, adv, mask = inputs(seed=3, b=6)
    ref = old - 0.2
    norm = Normalizers.of(mask)
    full, _ = policy_loss(logp, old, adv.expand_as(logp), mask, spec, norm, ref_logp_BT=ref)
    parts = sum(
        policy_loss(
            logp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2].expand(2, 9),
            mask[i : i + 2],
            spec,
            norm,
            ref_logp_BT=ref[i : i + 2],
        )[0]
        for i in range(0, 6, 2)
    )
    assert torch.allclose(torch.autograd.grad(full, logp)[0], torch.autograd.grad(parts, logp)[0])


def test_truncated_importance_weight_scales_the_token_gradient():
    logp, old, adv, mask = inputs(seed=4)
    weight = torch.full_like(logp, 0.5)
    a, _ = policy_loss(logp, old, adv.expand_as(logp), mask, LossSpec(), Normalizers.of(mask))
    b, _ = policy_loss(
        logp, old, adv.expand_as(logp), mask, LossSpec(), Normalizers.of(mask), is_weight_BT=weight
    )
    assert torch.allclose(torch.autograd.grad(b, logp)[0], 0.5 * torch.autograd.grad(a, logp)[0])


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
    logp, old, adv, mask = inputs(seed=5)
    entropy = torch.rand_like(logp)
    base, _ = policy_loss(logp, old, adv.expand_as(logp), mask, LossSpec(), Normalizers.of(mask))
    bonus, _ = policy_loss(
        logp,
        old,
        adv.expand_as(logp),
        mask,
        LossSpec(entropy_coef=0.01),
        Normalizers.of(mask),
        entropy_BT=entropy,
    )
    assert torch.isclose(base - bonus, 0.01 * (entropy * mask).sum() / mask.sum())


def test_value_loss_clipping():
    values, old, returns = (
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([[0.0, 0.0]]),
        torch.tensor([[2.0, 1.0]]),
    )
    mask = torch.tensor([[1.0, 0.0]])
    assert value_loss(values, returns, old, mask, clip=None) == 0.5
    assert value_loss(values, returns, old, mask, clip=0.2).item() == pytest.approx(0.5 * 1.8**2)


class _Accelerator:
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(
    loss_type,
    logp,
    old,
    adv,
    mask,
    *,
    eps_low,
    eps_high,
    level="token",
    beta=0.0,
    ref=None,
    max_len=None,
    is_ratio=None,
):
    from trl import GRPOTrainer

    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=is_ratio is not None,  # TRL applies its IS correction to vLLM samples only
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len or logp.shape[1],
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    b, t = logp.shape
    batch = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv[:, 0],
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": is_ratio,
    }
    return GRPOTrainer._compute_loss(fake, None, batch)


TRL_CASES = {
    "grpo": ("grpo", {}),
    "dapo": ("dapo", {}),
    "dr_grpo": ("dr_grpo", {"max_len": 12}),
    "gspo": ("grpo", {"level": "sequence"}),
    "cispo": ("cispo", {}),
    "kl-k3": ("grpo", {"beta": 0.1}),
}


@pytest.mark.parametrize("name", sorted(TRL_CASES))
def test_losses_and_gradients_equal_trl(name):
    loss_type, extra = TRL_CASES[name]
    spec = SPECS[name]
    logp, old, adv, mask = inputs(seed=7 + len(name))
    ref = old - 0.15 if "beta" in extra else None
    ours, _ = policy_loss(
        logp,
        old,
        adv.expand_as(logp),
        mask,
        spec,
        Normalizers.of(mask, extra.get("max_len")),
        ref_logp_BT=ref,
    )
    theirs = trl_loss(
        loss_type,
        logp,
        old,
        adv,
        mask,
        eps_low=spec.clip_low,
        eps_high=spec.clip_high,
        ref=ref,
        **extra,
    )
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    g_ours = torch.autograd.grad(ours, logp)[0]
    g_theirs = torch.autograd.grad(theirs, logp)[0]
    assert torch.allclose(g_ours, g_theirs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_decoupled_weights_equal_trl_token_truncate(name):
    """off_policy decoupled = TRL's vllm_importance_sampling_correction, token_truncate: the
    clip on pi / pi_old (the learner's own logprobs), each token x min(pi_old / mu, cap)."""
    spec = SPECS[name]
    logp, old, adv, mask = inputs(seed=11)
    behaviour = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    weight = (old - behaviour).exp().clamp(max=2.0)
    ours, _ = policy_loss(
        logp, old, adv.expand_as(logp), mask, spec, Normalizers.of(mask), is_weight_BT=weight
    )
    theirs = trl_loss(
        name, logp, old, adv, mask, eps_low=spec.clip_low, eps_high=spec.clip_high, is_ratio=weight
    )
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    g_ours, g_theirs = (torch.autograd.grad(x, logp)[0] for x in (ours, theirs))
    assert torch.allclose(g_ours, g_theirs, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo"])
def test_tis_cap_micro_batches_sum_to_the_full_batch(name):
    spec = SPECS[name]
    logp, old, adv, mask = inputs(seed=12, b=6)
    old = old - 0.3  # ratios above the cap for some tokens
    norm = Normalizers.of(mask)
    full, stats = policy_loss(logp, old, adv.expand_as(logp), mask, spec, norm, ratio_cap=1.1)
    parts = [
        policy_loss(
            logp[i : i + 2], old[i : i + 2], adv[i : i + 2].expand(2, 9), mask[i : i + 2], spec,
            norm, ratio_cap=1.1,
        )
        for i in range(0, 6, 2)
    ]  # fmt: skip
    total = LossStats()
    for _, part in parts:
        total.add(part)
    grads = [torch.autograd.grad(x, logp)[0] for x in (full, sum(p[0] for p in parts))]
    assert torch.allclose(grads[0], grads[1], atol=1e-14)
    assert 0 < total.truncated_tokens == stats.truncated_tokens <= stats.tokens
    assert total.is_weight_max == stats.is_weight_max
