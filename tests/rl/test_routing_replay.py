"""Routing replay (R3) and the routing-mismatch metric, with the real K3 policy and engine."""

from __future__ import annotations

import copy

import pytest
import torch

from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams
from rl.config.runfile import TrainerConfig
from rl.learner.batch import pack
from rl.learner.learner import Learner
from rollout.codec import decode_group, encode_group
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.policy.k3.test_engine import make_model
from tests.rl.test_learner import ListSource


def rollouts(model, n=4, seed=0):
    """Trajectories sampled by K3Policy with routing records, rewards alternating."""
    policy = K3Policy(model, pad_token_id=0, seed=seed, record_routing=True)
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(
            3, 400, (int(torch.randint(5, 12, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]
    outs = policy.generate(prompts, SamplingParams(max_new_tokens=8))
    trajs = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        t = Trajectory(task_id="t", status=RolloutStatus.COMPLETED, reward=float(i % 2))
        t.append(prompt, sampled=False)
        t.append(out.token_ids, sampled=True, logprobs=out.logprobs, version=0)
        t.routed_experts = out.routed_experts
        trajs.append(t)
    return TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)


def learner(model, group, replay: bool):
    cfg = TrainerConfig(
        group_size=4, batch_size=4, micro_batch_size=4, lr=1e-9, routing_replay=replay
    )
    return Learner(cfg, model=model, source=ListSource([group]), pad_token_id=0, temperature=1.0)


def test_records_survive_the_stream_codec():
    group = rollouts(make_model(torch.float32))
    back = decode_group(encode_group(group))
    assert back.trajectories[0].routed_experts == group.trajectories[0].routed_experts
    assert len(back.trajectories[0].routed_experts) == len(group.trajectories[0].token_ids) - 1


def test_mismatch_is_zero_on_the_same_weights_and_seen_when_routing_drifts():
    model = make_model(torch.float32)
    group = rollouts(model)
    same = learner(copy.deepcopy(model), group, replay=False).step()
    assert same["moe/routing_mismatch"] == 0.0
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for layer in drifted.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 1.0)
    assert learner(drifted, group, replay=False).step()["moe/routing_mismatch"] > 0.2


@pytest.mark.parametrize("replay", [True, False])
def test_replay_reproduces_the_rollout_logprobs_after_a_bias_change(replay):
    """The bias moves selection only (mixing weights come from unbiased scores): with replay
    the learner's ratio to the rollout stays exactly 1; without, it does not."""
    model = make_model(torch.float32)
    group = rollouts(model)
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for layer in drifted.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 1.0)
    run = learner(drifted, group, replay=replay)
    batch = pack([group], pad_token_id=0)
    logp, _, _, _ = run.trunk(
        batch.input_ids_NT, batch.attention_mask_NT, 1.0, replay_experts=run._replay(batch)
    )
    gap = ((logp - batch.old_logp_NT).abs() * batch.loss_mask_NT).max().item()
    assert (gap < 1e-4) if replay else (gap > 1e-3)


def test_replay_is_per_trajectory_when_some_lack_records():
    """Trajectories with records replay them, those without route live (-1 rows); the replayed
    share counts the sampled tokens of the former."""
    model = make_model(torch.float32)
    group = rollouts(model)
    for t in group.trajectories[::2]:
        t.routed_experts = None  # e.g. sampled by a worker that did not record
    batch = pack([group], pad_token_id=0)
    has = torch.tensor([bool(t.routed_experts) for t in group.trajectories])
    assert torch.equal(batch.routed_NT.any(-1), has)
    assert (batch.routes_NTMK[~has] == -1).all()
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for layer in drifted.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 1.0)
    run = learner(drifted, group, replay=True)
    logp, _, _, _ = run.trunk(
        batch.input_ids_NT, batch.attention_mask_NT, 1.0, replay_experts=run._replay(batch)
    )
    live, _, _, _ = run.trunk(batch.input_ids_NT, batch.attention_mask_NT, 1.0)
    gap_N = ((logp - batch.old_logp_NT).abs() * batch.loss_mask_NT).amax(-1)
    assert (gap_N[has] < 1e-4).all() and (gap_N[~has] > 1e-3).all()  # replayed / drifted
    assert torch.allclose(logp[~has], live[~has], atol=1e-5)  # -1 rows: the live forward
    mask = batch.loss_mask_NT
    want = float(mask[has].sum() / mask.sum())
    assert 0 < want < 1
    assert run.step()["moe/replayed_share"] == pytest.approx(want)
    assert learner(drifted, group, replay=False).step()["moe/replayed_share"] == 0.0
