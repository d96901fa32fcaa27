"""rl/learner/reference.py's one-screen `grpo_step` takes the same optimizer step as the sharded
`Learner` (world size 1, the default grpo config) on the same batch, and the test can tell when
either drifts (negative controls).

The model is float64; the learner computes logprobs and the loss in float32 whatever the model's
dtype (policy/logprobs.py casts the logits), and so does the reference, so the two differ only by
the order of sums (a micro-batch's rows are shuffled, the LM head runs on the sampled positions
only): ~4e-7 (relative) in the float32 loss, ~1e-11 in the weight changes (TOLERANCE).
"""

from __future__ import annotations

import copy

import pytest
import torch

from policy.logprobs import token_logprobs
from rl.config.runfile import TrainerConfig
from rl.learner import reference
from rl.learner.learner import Learner
from rl.learner.reference import grpo_step
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.rl.test_learner import ListSource

TEMPERATURE = 0.8
SGD_LR = 1e-2


def trajectory(model, gen, reward, *, turns=1, status=RolloutStatus.COMPLETED):
    """prompt, then `turns` sampled completions with tool output between them; the recorded
    sampling logprobs are the model's plus noise (a slightly different policy sampled them), so
    the ratio is not 1 and the clip acts on the first step."""
    ids, mask = torch.randint(5, 100, (6,), generator=gen).tolist(), [0] * 6
    for turn in range(turns):
        if turn:
            ids += torch.randint(5, 100, (3,), generator=gen).tolist()
            mask += [0] * 3
        length = int(torch.randint(3, 9, (1,), generator=gen))
        ids += torch.randint(5, 100, (length,), generator=gen).tolist()
        mask += [1] * length
    with torch.no_grad():
        ids_BT = torch.tensor([ids])
        logp = token_logprobs(model, ids_BT, torch.ones_like(ids_BT), temperature=TEMPERATURE)[0]
    noise = 0.4 * torch.randn(len(ids) - 1, generator=gen)
    noisy = [0.0, *(logp[0] + noise).tolist()]
    return Trajectory(
        task_id="t",
        token_ids=ids,
        loss_mask=mask,
        sample_logprobs=[lp if m else 0.0 for lp, m in zip(noisy, mask, strict=True)],
        token_versions=[0 if m else -1 for m in mask],
        status=status,
        reward=reward,
    )


def batch(model) -> list[TrajectoryGroup]:
    """Single- and multi-turn groups, one with an env error (left out of its group's statistics)
    and one flat group (advantage 0, still counted in the mean over sequences)."""
    gen = torch.Generator().manual_seed(0)
    error = RolloutStatus.ENV_ERROR
    groups = [
        [trajectory(model, gen, r) for r in (1.0, 0.0, 0.0, 1.0)],
        [trajectory(model, gen, r, turns=2) for r in (1.0, 0.0, 0.25)]
        + [trajectory(model, gen, 1.0, turns=2, status=error)],
        [trajectory(model, gen, 1.0) for _ in range(4)],
    ]
    return [
        TrajectoryGroup(group_id=str(i), task_id=f"t{i}", trajectories=trajs)
        for i, trajs in enumerate(groups)
    ]


def run_both(tiny_model, optimizer: str, *, trainer=None, ref=None):
    """One `Learner.step()` and one `grpo_step` from the same float64 weights on the same groups:
    (learner metrics, reference metrics, learner's weight change, reference's weight change)."""
    start = copy.deepcopy(tiny_model).double().eval()
    groups = batch(start)
    cfg = TrainerConfig(group_size=4, batch_size=12, read_timeout_s=5.0, **(trainer or {}))
    assert cfg.algorithm == "grpo" and cfg.ppo_epochs == 1 and cfg.mini_batch_size is None
    learned, referenced = copy.deepcopy(start), copy.deepcopy(start)
    learner = Learner(
        cfg,
        model=learned,
        source=ListSource(groups),
        pad_token_id=0,
        temperature=TEMPERATURE,
    )
    if optimizer == "sgd":  # the weight change is -lr x the clipped gradient itself
        learner.optimizer = torch.optim.SGD(learner.trunk.parameters(), lr=SGD_LR)
        ref_opt = torch.optim.SGD(referenced.parameters(), lr=SGD_LR)
    else:  # the learner's own: AdamW(lr, weight_decay) from the run file
        assert isinstance(learner.optimizer, torch.optim.AdamW)
        ref_opt = torch.optim.AdamW(
            referenced.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
    metrics = learner.step()
    assert metrics["learner/optimizer_steps"] == 1 and metrics["learner/trajectories"] == 11
    settings = {"clip_low": 0.2, "clip_high": 0.2}  # grpo's defaults (rl/learner/algorithms.py)
    settings |= {"max_grad_norm": cfg.max_grad_norm, **(ref or {})}
    out = grpo_step(referenced, ref_opt, groups, temperature=TEMPERATURE, **settings)
    before = dict(start.named_parameters())
    delta_l = {k: (p - before[k]).detach() for k, p in learned.named_parameters()}
    delta_r = {k: (p - before[k]).detach() for k, p in referenced.named_parameters()}
    return metrics, out, delta_l, delta_r


# The weight changes agree to ~1e-11 (relative): per token the gradient reaching the logits is
# the same float32 number on both sides, only float64 sums differ. rtol 1e-6 allows one float32
# rounding (6e-8) to go the other way at the logits; atol for changes that are ~0.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-12}
LOSS_RTOL = 1e-5
"""The float32 loss is summed in another order (~4e-7 here: its terms have both signs)."""


@pytest.mark.parametrize(
    ("optimizer", "micro_batch_size"), [("adamw", 32), ("sgd", 32), ("sgd", 5)]
)
def test_reference_takes_the_learners_step(tiny_model, optimizer, micro_batch_size):
    """adamw: the run file's optimizer, as is. sgd (swapped into both): the weight change is
    the clipped gradient itself, so its size is checked too, not only its sign (AdamW's first
    step is ~ lr x sign(g)). micro_batch_size 5: the learner accumulates 3 micro-batches."""
    metrics, out, delta_l, delta_r = run_both(
        tiny_model, optimizer, trainer={"micro_batch_size": micro_batch_size}
    )
    assert out["clip_fraction"] > 0.1  # the clip acts
    assert out["grad_norm"] > 1.0  # and so does the gradient clipping (max_grad_norm 1.0)
    assert out["loss"] == pytest.approx(metrics["learner/loss"], rel=LOSS_RTOL)
    assert out["grad_norm"] == pytest.approx(metrics["learner/grad_norm"], rel=1e-6)
    assert out["clip_fraction"] == pytest.approx(metrics["learner/clip_fraction"], rel=1e-6)
    assert any(d.abs().max() > 0 for d in delta_r.values())
    for name, change in delta_l.items():
        torch.testing.assert_close(delta_r[name], change, **TOLERANCE, msg=name)


def centred_only(rewards_S):  # Dr. GRPO's: no division by the std
    return rewards_S - rewards_S.mean() if len(rewards_S) > 1 else torch.zeros_like(rewards_S)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize(
    "drift", ["reference clip 0.1", "reference without std", "learner token-mean"]
)
def test_a_drift_on_either_side_changes_the_step(tiny_model, monkeypatch, optimizer, drift):
    """Negative controls: the comparison above fails when one side changes the clip, the
    advantage normalisation or the loss aggregation."""
    trainer, ref = {}, {}
    if drift == "reference clip 0.1":
        ref = {"clip_low": 0.1, "clip_high": 0.1}
    elif drift == "reference without std":
        monkeypatch.setattr(reference, "group_advantages", centred_only)
    else:
        trainer = {"loss_aggregation": "token-mean"}
    metrics, out, delta_l, delta_r = run_both(tiny_model, optimizer, trainer=trainer, ref=ref)
    assert out["loss"] != pytest.approx(metrics["learner/loss"], rel=1e-3)
    with pytest.raises(AssertionError):
        for name, change in delta_l.items():
            torch.testing.assert_close(delta_r[name], change, **TOLERANCE, msg=name)
