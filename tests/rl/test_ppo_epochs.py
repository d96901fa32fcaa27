"""Several optimizer steps per batch (ppo_epochs x mini-batches) and the per-token off-policy
corrections (tis, decoupled) against hand-written float64 references; staleness metrics."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from policy.hf import checksum, export_weights
from policy.logprobs import token_logprobs
from rl.config.runfile import ConfigError, TrainerConfig, load_config
from rl.learner.batch import pack
from rl.learner.learner import Learner
from rl.learner.losses import LossSpec, Normalizers, policy_loss
from rl.learner.stats import length_metrics, mini_batches, staleness_metrics
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.rl.test_learner import ListSource, make_group


def learner_for(model, groups, **trainer):
    cfg = TrainerConfig(
        **{"group_size": 4, "batch_size": 8, "micro_batch_size": 3, "lr": 1e-2, **trainer}
    )
    return Learner(cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0)


def count_optimizer_steps(learner) -> list[int]:
    calls, step = [], learner.optimizer.step
    learner.optimizer.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    return calls


# ---------------------------------------------------------------- (a) epochs and mini-batches


def test_epochs_and_mini_batches_make_the_clip_act(tiny_model):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    learner = learner_for(model, groups, ppo_epochs=4, mini_batch_size=4)
    calls = count_optimizer_steps(learner)
    metrics = learner.step()
    assert len(calls) == 4 * 2 and metrics["learner/optimizer_steps"] == 8
    assert learner.version == 1  # one policy version per batch, whatever the step count
    assert metrics["learner/clip_fraction"] > 0  # later steps see a policy that has moved
    assert metrics["learner/approx_kl"] > 0 and metrics["learner/loss_tokens"] > 0


def test_one_pass_over_fresh_data_never_clips(tiny_model):
    """The control: one optimizer step on the policy that sampled the batch."""
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    learner = learner_for(model, groups)
    calls = count_optimizer_steps(learner)
    metrics = learner.step()
    assert len(calls) == 1 and metrics["learner/optimizer_steps"] == 1
    assert metrics["learner/clip_fraction"] == 0.0
    assert abs(metrics["learner/ratio_mean"] - 1.0) < 1e-4


@pytest.mark.parametrize("algorithm", ["ppo", "gspo", "cispo"])
def test_other_algorithms_take_every_step(tiny_model, algorithm):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    learner = learner_for(model, groups, algorithm=algorithm, ppo_epochs=2, mini_batch_size=4)
    calls = count_optimizer_steps(learner)
    metrics = learner.step()
    assert len(calls) == 4 and math.isfinite(metrics["learner/loss"])
    if algorithm == "ppo":
        assert "learner/value_loss" in metrics


def test_epochs_are_deterministic_and_reshuffled_with_the_learner_seed(tiny_model):
    def weights(seed):
        model = copy.deepcopy(tiny_model)
        groups = [make_group(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
        cfg = TrainerConfig(
            group_size=4, batch_size=8, micro_batch_size=3, lr=1e-2, ppo_epochs=3, mini_batch_size=4
        )
        learner = Learner(
            cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0, seed=seed
        )
        learner.step()
        return checksum(export_weights(model))

    assert weights(0) == weights(0)
    assert weights(0) != weights(1)  # the mini-batches depend on the generator


def test_mini_batches_are_balanced_and_cover_every_row():
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    pieces = mini_batches(order, 4)
    assert [len(p) for p in pieces] == [4, 3, 3]
    assert torch.equal(torch.cat(pieces), order)
    assert mini_batches(order, None)[0] is order


# ---------------------------------------------------------------- (b) off-policy corrections


def per_token_reference(logp, behav, prox, adv, mask, mode, cap, clip=(0.2, 0.2)):
    """Loops in float64: (token-mean loss, d loss / d logp) of the corrected clip objective.
    tis: l = -min(min(r, C) A, clip(r) A), r = pi / mu, gradient -1[unclipped] min(r, C) A.
    decoupled: l = -w min(r A, clip(r) A), r = pi / pi_prox, w = min(pi_prox / mu, C)."""
    rows, cols = len(logp), len(logp[0])
    tokens = sum(mask[b][t] for b in range(rows) for t in range(cols))
    total, grad = 0.0, [[0.0] * cols for _ in range(rows)]
    for b in range(rows):
        for t in range(cols):
            if not mask[b][t]:
                continue
            a = adv[b][t]
            if mode == "tis":
                r, w = math.exp(logp[b][t] - behav[b][t]), 1.0
                weight = min(r, cap)
            else:
                r = math.exp(logp[b][t] - prox[b][t])
                w = min(math.exp(prox[b][t] - behav[b][t]), cap)
                weight = r
            bounded = min(max(r, 1 - clip[0]), 1 + clip[1]) * a
            unclipped = weight * a
            total += -w * min(unclipped, bounded)
            if unclipped <= bounded:  # the unclipped branch carries the gradient
                grad[b][t] = -w * weight * a / tokens
    return total / tokens, grad


def off_policy_inputs(seed=0, b=4, t=7):
    gen = torch.Generator().manual_seed(seed)
    logp = (torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    behav = logp.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.8
    prox = logp.detach() + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.15
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t)
    mask = (torch.rand(b, t, generator=gen) > 0.2).double()
    mask[:, 0] = 1
    return logp, behav, prox, adv, mask


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_corrections_equal_the_float64_reference(mode):
    cap = 1.5
    logp, behav, prox, adv, mask = off_policy_inputs(seed=3)
    spec, norm = LossSpec(aggregation="token-mean"), Normalizers.of(mask)
    if mode == "tis":
        loss, stats = policy_loss(logp, behav, adv, mask, spec, norm, ratio_cap=cap)
    else:
        weight = (prox - behav).exp().clamp(max=cap)
        loss, stats = policy_loss(logp, prox, adv, mask, spec, norm, is_weight_BT=weight)
    expected, expected_grad = per_token_reference(
        *(x.tolist() for x in (logp, behav, prox, adv, mask)), mode, cap
    )
    assert abs(loss.item() - expected) < 1e-12
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), atol=1e-12)
    if mode == "tis":  # the cap really acted, on the tokens PPO alone leaves unbounded
        ratio = (logp - behav).exp()
        acted = (ratio > cap) & (adv < 0) & (mask > 0)
        assert acted.any() and stats.truncated_tokens == float(((ratio > cap) & (mask > 0)).sum())
        plain, _ = policy_loss(logp, behav, adv, mask, spec, norm)
        (plain_grad,) = torch.autograd.grad(plain, logp)
        assert not torch.allclose(grad[acted], plain_grad[acted])
        assert torch.allclose(grad[~acted], plain_grad[~acted], atol=1e-15)


def test_decoupled_gradient_matches_finite_differences():
    logp, behav, prox, adv, mask = off_policy_inputs(seed=5)
    weight = (prox - behav).exp().clamp(max=2.0)
    spec = LossSpec(aggregation="token-mean")
    loss, _ = policy_loss(logp, prox, adv, mask, spec, Normalizers.of(mask), is_weight_BT=weight)
    (grad,) = torch.autograd.grad(loss, logp)
    eps, args = 1e-6, [x.tolist() for x in (behav, prox, adv, mask)]
    for b, t in [(0, 0), (1, 3), (3, 6)]:
        bumped = [logp.detach().clone() for _ in range(2)]
        bumped[0][b, t] += eps
        bumped[1][b, t] -= eps
        hi, lo = (per_token_reference(x.tolist(), *args, "decoupled", 2.0)[0] for x in bumped)
        assert abs(grad[b, t].item() - (hi - lo) / (2 * eps)) < 1e-7


def group_with_behaviour(model, rewards, *, seed, shift, versions=(0,)):
    """Trajectories whose recorded sampling logprobs are the model's + `shift` x noise (another,
    older policy sampled them); each token carries a version cycling through `versions`."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for reward in rewards:
        prompt = torch.randint(5, 100, (5,), generator=gen).tolist()
        completion = torch.randint(5, 100, (6,), generator=gen).tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        sampled = logp[0, len(prompt) - 1 :]
        behaviour = sampled + shift * torch.randn(sampled.shape, generator=gen)
        traj = Trajectory(task_id=f"t{seed}", status=RolloutStatus.COMPLETED, reward=reward)
        traj.append(prompt, sampled=False)
        for i, (token, lp) in enumerate(zip(completion, behaviour.tolist(), strict=True)):
            traj.append([token], sampled=True, logprobs=[lp], version=versions[i % len(versions)])
        trajs.append(traj)
    return TrajectoryGroup(group_id=str(seed), task_id=f"t{seed}", trajectories=trajs)


def learner_gradient(model, group, **trainer):
    """The learner's gradient of its one optimizer step (unclipped), by parameter name."""
    cfg = TrainerConfig(
        group_size=4,
        batch_size=4,
        micro_batch_size=3,
        lr=1e-3,
        max_grad_norm=1e9,
        loss_aggregation="token-mean",
        **trainer,
    )
    learner = Learner(cfg, model=model, source=ListSource([group]), pad_token_id=0, temperature=1.0)
    grads = {}

    def record(*args, **kwargs):
        for name, p in learner.trunk.named_parameters():
            if p.grad is not None:
                grads[name.removeprefix("policy.")] = p.grad.detach().clone()

    learner.optimizer.step = record
    return grads, learner.step()


def reference_gradient(model, group, mode, cap):
    """The same objective written out per token, on a copy of the model, in float64."""
    model = copy.deepcopy(model)
    batch = pack([group], pad_token_id=0)
    logp, _ = token_logprobs(model, batch.input_ids_NT, batch.attention_mask_NT)
    logp = logp.double()
    behav, mask, adv = (x.double() for x in (batch.old_logp_NT, batch.loss_mask_NT, batch.adv_NT))
    prox = logp.detach()
    if mode == "tis":
        r = (logp - behav).exp()
        truncated = r * (r.detach().clamp(max=cap) / r.detach())
        per_token = -torch.minimum(truncated * adv, r.clamp(0.8, 1.2) * adv)
        weights = r.detach().clamp(max=cap)
    else:
        r = (logp - prox).exp()
        weights = (prox - behav).exp().clamp(max=cap)
        per_token = -weights * torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    ((per_token * mask).sum() / mask.sum()).backward()
    mean_weight = float((weights * mask).sum() / mask.sum())
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, mean_weight


@pytest.mark.parametrize("mode", ["tis", "decoupled"])
def test_the_learner_applies_the_correction_it_is_configured_with(tiny_model, mode):
    cap = 1.3
    group = group_with_behaviour(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=40, shift=0.5)
    grads, metrics = learner_gradient(
        copy.deepcopy(tiny_model), group, off_policy=mode, tis_cap=cap
    )
    expected, mean_weight = reference_gradient(tiny_model, group, mode, cap)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad.double(), expected[name].double(), rtol=1e-3, atol=1e-6), name
    assert metrics["learner/tis_weight_mean"] == pytest.approx(mean_weight, rel=1e-4)
    assert 0 < metrics["learner/tis_truncated_fraction"] < 1
    assert metrics["learner/tis_weight_max"] > cap


def test_without_a_correction_the_ratio_is_against_the_behaviour(tiny_model):
    group = group_with_behaviour(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=41, shift=0.5)
    _, metrics = learner_gradient(copy.deepcopy(tiny_model), group)
    assert metrics["learner/clip_fraction"] > 0  # stale tokens are clipped from the start
    assert "learner/tis_weight_mean" not in metrics


# ---------------------------------------------------------------- (c) staleness and lengths


def test_staleness_metrics_from_known_token_versions(tiny_model):
    group = group_with_behaviour(
        tiny_model, [1.0, 0.0, 0.0, 1.0], seed=42, shift=0.0, versions=(7, 6, 5, 4, 3, 2)
    )
    batch = pack([group], pad_token_id=0)
    assert batch.versions_NT.shape == batch.loss_mask_NT.shape
    assert (batch.versions_NT[batch.loss_mask_NT == 0] == -1).all()
    metrics = staleness_metrics(batch.versions_NT, batch.loss_mask_NT, version=7)
    # per trajectory, 6 tokens with lags 0, 1, 2, 3, 4, 5
    assert [metrics[f"learner/staleness_lag{k}"] for k in range(4)] == [4.0] * 4
    assert metrics["learner/staleness_lag4plus"] == 8.0
    assert metrics["learner/staleness_max"] == 5.0
    assert metrics["learner/staleness_mean"] == pytest.approx(2.5)
    sliced = batch.rows(torch.tensor([2, 0]))
    assert torch.equal(sliced.versions_NT, batch.versions_NT[[2, 0], : sliced.lengths_N.max() - 1])


def test_the_learner_reports_staleness_and_generated_length(tiny_model):
    groups = [
        group_with_behaviour(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=s, shift=0.0, versions=(0,))
        for s in (43, 44)
    ]
    learner = learner_for(copy.deepcopy(tiny_model), groups)
    learner.version = 2  # the learner moved on twice since these were sampled
    metrics = learner.step()
    assert metrics["learner/staleness_lag2"] == metrics["learner/loss_tokens"] == 48
    assert metrics["learner/staleness_mean"] == 2.0 and metrics["learner/staleness_lag0"] == 0
    assert metrics["learner/gen_len_mean"] == metrics["learner/gen_len_max"] == 6.0


def test_length_percentiles():
    mask = torch.zeros(5, 12)
    for row, n in enumerate([1, 2, 3, 4, 10]):
        mask[row, :n] = 1
    metrics = length_metrics(mask)
    assert metrics["learner/gen_len_mean"] == 4.0 and metrics["learner/gen_len_p50"] == 3.0
    assert (
        metrics["learner/gen_len_p90"] == pytest.approx(7.6)
        and metrics["learner/gen_len_max"] == 10
    )


# ---------------------------------------------------------------- (d) config errors


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("trainer.ppo_epochs=0", "trainer.ppo_epochs", "must be >= 1"),
        ("trainer.mini_batch_size=0", "trainer.mini_batch_size", "must divide batch_size"),
        ("trainer.mini_batch_size=5", "trainer.mini_batch_size", "must divide batch_size"),
        ("trainer.mini_batch_size=1000", "trainer.mini_batch_size", "must divide batch_size"),
        ("trainer.off_policy=tis", "trainer.tis_cap", "set it"),
        ("trainer.off_policy=later", "trainer.off_policy", "must be one of"),
    ],
)
def test_bad_epoch_settings_name_the_key(override, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.batch_size=16", "trainer.group_size=8", override])
    assert info.value.key == key and fragment in info.value.message


def test_off_policy_defaults_keep_the_old_meaning_of_tis_cap():
    assert TrainerConfig().off_policy == "none"
    assert TrainerConfig(tis_cap=2.0).off_policy == "decoupled"
    assert TrainerConfig(off_policy="decoupled").tis_cap is None  # untruncated weights
    with pytest.raises(ConfigError, match="no effect"):
        TrainerConfig(off_policy="none", tis_cap=2.0)


# ---------------------------------------------------------------- sharded: 2 ranks == 1 rank


def _rank_run(rank, world, port, out):
    from policy.hf import build_model
    from rl.learner.distributed import Shard, init_group
    from tests.conftest import TINY_MODEL

    torch.set_num_threads(1)
    if world > 1:
        init_group("127.0.0.1", port, rank, world, 120)
    model = build_model("qwen3", TINY_MODEL, vocab_size=512, seed=0).eval()
    groups = [
        group_with_behaviour(model, [1.0, 0.0, 0.0, 1.0], seed=s, shift=0.4, versions=(0, 1))
        for s in (1, 2)
    ]
    cfg = TrainerConfig(
        algorithm="ppo",
        group_size=4,
        batch_size=8,
        micro_batch_size=2,
        lr=1e-2,
        kl_coef=0.05,
        world_size=world,
        ppo_epochs=2,
        mini_batch_size=4,
        off_policy="decoupled",
        tis_cap=1.5,
    )
    source = ListSource(groups) if rank == 0 else None
    learner = Learner(
        cfg, model=model, source=source, pad_token_id=0, temperature=1.0, shard=Shard(rank, world)
    )
    metrics = learner.step()
    weights = learner.export()[1]
    if rank == 0:
        out.put((metrics, weights))  # numpy: pickled by value, not shared with the child


def _ranks(world):
    import torch.multiprocessing as mp

    from rl.run.launch import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_run, args=(r, world, port, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        metrics, weights = out.get(timeout=300)
        return metrics, {k: torch.from_numpy(v) for k, v in weights.items()}
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_take_the_same_mini_batch_steps_as_one():
    """Mini-batches are cut from one global order; each rank trains its part of each one, with
    the proximal logprobs, values and reference logprobs shared between the ranks."""
    (one, w_one), (two, w_two) = _ranks(1), _ranks(2)
    assert one["learner/optimizer_steps"] == two["learner/optimizer_steps"] == 4
    assert max(float((w_one[k] - w_two[k]).abs().max()) for k in w_one) < 1e-4
    for key in ("loss", "clip_fraction", "value_loss", "ref_kl", "tis_weight_mean"):
        assert two[f"learner/{key}"] == pytest.approx(one[f"learner/{key}"], abs=1e-4), key
