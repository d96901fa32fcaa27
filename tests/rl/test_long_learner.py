"""The learner on long trajectories: `trainer.segment_tokens` gives the same update as one
forward, with and without routing replay; `trainer.autocast: bf16` keeps fp32 weights and
optimizer state and a loss close to fp32's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl.config.runfile import ConfigError, TrainerConfig
from rl.learner.learner import Learner
from tests.policy.k3.test_engine import make_model
from tests.rl.test_learner import ListSource
from tests.rl.test_routing_replay import rollouts


def run_step(model, group, **overrides):
    """One Learner.step on a copy of `model` -> (metrics, learner, parameters before)."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainerConfig(**{"group_size": 4, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-3,
                           **overrides})  # fmt: skip
    learner = Learner(cfg, model=model, source=ListSource([group]), pad_token_id=0, temperature=1.0)
    return learner.step(), learner, before


def updates(learner, before):
    return {n: p.detach() - before[n] for n, p in learner.model.named_parameters()}


@pytest.fixture(scope="module")
def model_and_group():
    model = make_model(torch.float32)
    return model, rollouts(model)  # 4 trajectories of different lengths: padding


@pytest.fixture(scope="module")
def model64_and_group():
    model = make_model(torch.float64)
    return model, rollouts(model)


@pytest.mark.parametrize("replay", [False, True])
def test_segmented_step_gives_the_unsegmented_update(model64_and_group, replay):
    """Segments of 5 tokens (trajectories of ~10-20: several segments, boundaries inside the
    padding) against segment_tokens 0, float64: the same parameter update and expert loads."""
    model, group = model64_and_group
    ref_metrics, ref, ref_before = run_step(model, group, routing_replay=replay)
    seg_metrics, seg, seg_before = run_step(model, group, routing_replay=replay, segment_tokens=5)
    ref_updates, seg_updates = updates(ref, ref_before), updates(seg, seg_before)
    moved = sum(float(u.abs().max() > 1e-5) for u in ref_updates.values())
    assert moved > 0.5 * len(ref_updates)
    for name, update in ref_updates.items():
        # Adam normalises each coordinate (update ~ lr g / (|g| + 1e-8)), which magnifies the
        # rounding of near-zero gradients: the bound is absolute, far below lr (1e-3)
        torch.testing.assert_close(seg_updates[name], update, rtol=0, atol=1e-9, msg=name)
    assert seg_metrics["learner/loss"] == pytest.approx(ref_metrics["learner/loss"], abs=1e-10)
    loads = [k for k in ref_metrics if k.startswith("moe/") and "max_over_mean" in k]
    assert loads and all(seg_metrics[k] == ref_metrics[k] for k in loads)


def test_bf16_autocast_step_keeps_fp32_state_and_a_close_loss(model_and_group):
    """bf16 (segmented too) against fp32: finite loss, logprobs within bf16 rounding of the
    rollout's fp32 ones (ratio ~ 1), an update in the same direction, fp32 weights and state."""
    model, group = model_and_group
    exact, ref, ref_before = run_step(model, group)
    mixed, learner, before = run_step(model, group, autocast="bf16", segment_tokens=6)
    assert math.isfinite(mixed["learner/loss"]) and math.isfinite(mixed["learner/grad_norm"])
    assert abs(mixed["learner/loss"] - exact["learner/loss"]) < 0.01
    assert abs(mixed["learner/ratio_mean"] - 1.0) < 0.02
    assert mixed["learner/entropy"] == pytest.approx(exact["learner/entropy"], rel=0.01)
    exact_update = torch.cat([u.flatten() for u in updates(ref, ref_before).values()])
    mixed_update = torch.cat([u.flatten() for u in updates(learner, before).values()])
    assert torch.cosine_similarity(exact_update, mixed_update, dim=0) > 0.8
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    state = [t for s in learner.optimizer.state.values() for t in s.values() if t.dim()]
    assert state and all(t.dtype == torch.float32 for t in state)


def test_config_validates_the_keys(tiny_model):
    with pytest.raises(ConfigError, match="segment_tokens"):
        TrainerConfig(group_size=4, batch_size=4, segment_tokens=-1)
    TrainerConfig(group_size=4, batch_size=4, segment_tokens=64, world_size=2)  # sharded: fine
    cfg = TrainerConfig(group_size=4, batch_size=4, segment_tokens=64)
    with pytest.raises(ConfigError, match=r"trainer\.segment_tokens.*K3 policy"):
        Learner(cfg, model=tiny_model, source=None, pad_token_id=0, temperature=1.0)


def test_loss_positions_only_gives_the_same_update_with_less_attention(
    model64_and_group, monkeypatch
):
    """One trajectory per micro-batch (no padding), segments of 5: the last layer at the loss
    positions only (the default) against every position, float64: the same loss and update,
    while the MLA layers attend from fewer queries. The last layer's router bias holds (its
    calls saw no sample of the sequence: left out of Quantile Balancing) where the other
    run's moved, and it reports no load figures."""
    from policy.k3.mla import GatedMLA

    model, group = model64_and_group
    attend, queries = GatedMLA.attend, []

    def counting(self, q_BTHQ, *args, **kwargs):
        queries[-1] += q_BTHQ.shape[1]
        return attend(self, q_BTHQ, *args, **kwargs)

    monkeypatch.setattr(GatedMLA, "attend", counting)
    runs = []
    for only in (False, True):
        queries.append(0)
        runs.append(run_step(model, group, segment_tokens=5, micro_batch_size=1,
                             routing_replay=True, loss_positions_only=only))  # fmt: skip
    (ref_metrics, ref, ref_before), (metrics, learner, before) = runs
    assert queries[1] < queries[0], queries
    assert metrics["learner/loss"] == pytest.approx(ref_metrics["learner/loss"], abs=1e-10)
    ref_updates, got = updates(ref, ref_before), updates(learner, before)
    last = f"layers.{len(model.model.layers) - 1}."
    name = f"model.{last}mlp.gate.e_score_correction_bias"
    start = model.get_buffer(name)
    assert not torch.equal(ref.model.get_buffer(name), start)  # QB moved it
    assert torch.equal(learner.model.get_buffer(name), start)  # held
    assert not [k for k in metrics if last in k and "max_over_mean" in k]
    assert [k for k in ref_metrics if last in k and "max_over_mean" in k]
    for name, update in ref_updates.items():
        torch.testing.assert_close(got[name], update, rtol=0, atol=1e-9, msg=name)
