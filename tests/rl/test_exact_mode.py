"""trainer.exact_logprobs: the learner's logprobs equal those the rollout engine recorded, bit
for bit (K3, CPU, float32), with and without routing replay; learner/logprob_delta_max is 0 then
and not otherwise. Bad settings are refused before anything starts."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy.engines import open_session
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.policy.k3.test_engine import make_model
from tests.rl.test_config import error_for
from tests.rl.test_learner import ListSource

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16)


def exact_rollouts(model, n=4, seed=0) -> TrajectoryGroup:
    """Two-turn trajectories sampled by an exact session (routes recorded), rewards alternating."""
    session = open_session(K3Policy(model, seed=seed, record_routing=True, exact=True))
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        key, traj = f"k{i}", Trajectory(task_id="t", status=RolloutStatus.COMPLETED)
        traj.reward, routes = float(i % 2), []  # int16 [n, M, Kx] chunks
        for turn in range(2):
            feed = torch.randint(3, 400, (int(torch.randint(4, 12, (1,), generator=gen)),),
                                 generator=gen).tolist()  # fmt: skip
            routes.append(session.add([key], [feed])[0])
            traj.append(feed, sampled=False)
            tokens, logps = [], []
            for _ in range(5 + 3 * turn):
                out = session.step([key], PARAMS)[0]
                routes.append(out.routes)
                tokens.append(out.token)
                logps.append(out.logprob)
            traj.append(tokens, sampled=True, logprobs=logps, version=0)
        traj.routed_experts = np.concatenate(routes)[: len(traj.token_ids) - 1]  # last not fed
        trajs.append(traj)
    return TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)


def learner(model, group, *, exact: bool, replay: bool, off_policy: str = "none") -> Learner:
    cfg = TrainerConfig(group_size=4, batch_size=4, micro_batch_size=2, lr=1e-3,
                        routing_replay=replay, exact_logprobs=exact,
                        off_policy=off_policy)  # fmt: skip
    return Learner(cfg, model=model, source=ListSource([group]), pad_token_id=0, temperature=1.0)


@pytest.mark.parametrize("off_policy", ["none", "decoupled"])
@pytest.mark.parametrize("replay", [False, True])
def test_exact_mode_gives_the_recorded_logprobs_bit_for_bit(replay, off_policy):
    """decoupled: the proximal pass is exact too (its importance weights exactly 1)."""
    model = make_model(torch.float32)
    group = exact_rollouts(model)
    kw = dict(replay=replay, off_policy=off_policy)
    exact = learner(copy.deepcopy(model), group, exact=True, **kw).step()
    usual = learner(copy.deepcopy(model), group, exact=False, **kw).step()
    assert exact["learner/logprob_delta_max"] == 0.0  # any mismatched bit fails
    assert 0.0 < usual["learner/logprob_delta_max"] < 1e-4  # the usual forward: close only
    assert exact["learner/clip_fraction"] == 0.0


def test_exact_mode_trains_with_the_usual_gradient():
    """The values come from the exact pass, the gradient from the learner's forward: one step
    moves the weights as the usual mode does (to float32 noise)."""
    model = make_model(torch.float32)
    group = exact_rollouts(model)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    learner(a, group, exact=True, replay=True).step()
    learner(b, group, exact=False, replay=True).step()
    moved = [(pa - p0).abs().max().item() for pa, p0 in zip(a.parameters(), model.parameters(),
                                                             strict=True)]  # fmt: skip
    assert max(moved) > 1e-4
    # AdamW's first step moves each weight by lr * g / (|g| + eps): a weight whose gradient is
    # within a few eps of 0 moves by a fraction of lr that float32 noise in g shifts (one of
    # 2,048 moved 1.1e-5 = 1.1% of lr apart on one CPU, under 1e-5 on another); a gradient
    # that differed would move many weights up to 2 lr apart.
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0.05 * 1e-3, rtol=0)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["policy.model_type=qwen3"], "needs the K3 policy"),
        (["trainer.world_size=2"], "one learner rank"),
        (["trainer.autocast=bf16"], "trainer.autocast: none"),
        (["rollout.device=cuda"], "CPU mode"),
    ],
)
def test_exact_mode_refuses_what_it_cannot_make_exact(overrides, says):
    err = error_for("trainer.exact_logprobs=true", "policy.model_type=agentrl_k3",
                    "policy.config={preset: k3-debug}", *overrides)  # fmt: skip
    assert err.key == "trainer.exact_logprobs" and says in err.message, err
    assert "set it to false" in err.message
