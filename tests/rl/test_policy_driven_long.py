"""A policy-driven episode past `max_seq_len` (issue 19 item 5): an untrained k3-tiny samples
every turn of multi-turn episodes through the real agent loop (K3Session, the env answering each
turn, routing recorded) until the context is full; the truncated trajectories carry int16
routes for every position and train: one segmented Learner.step with routing replay moves the
weights. (An untrained policy writes no tool call, which LongHorizon-v0 would grade as a final
answer after one turn; EchoEnv answers every turn.)"""

from __future__ import annotations

import copy

import numpy as np
import torch

from policy.engines import open_session
from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from rollout.agent import AgentLoop, run_all, start_episode
from rollout.episode import EpisodeLimits
from rollout.render import ChatRenderer
from rollout.types import RolloutStatus, TrajectoryGroup
from tests.rl.test_learner import ListSource
from tests.rollout.test_agent import EchoEnv

MAX_SEQ_LEN = 768


def long_episodes(tokenizer, model) -> list:
    renderer = ChatRenderer(tokenizer)
    policy = K3Policy(model, pad_token_id=0, seed=0, record_routing=True)
    limits = EpisodeLimits(max_turns=200, max_seq_len=MAX_SEQ_LEN)
    loop = AgentLoop(open_session(policy), renderer, limits)
    eps = [start_episode(EchoEnv(turns=200), s, f"g/{s}", f"t{s}", renderer) for s in range(4)]
    stops = tuple(range(0, len(tokenizer), 4))  # a quarter of the vocabulary ends a turn
    params = SamplingParams(max_new_tokens=48, stop_token_ids=stops)
    return run_all(loop, eps, params, max_live=4)


def test_a_policy_driven_episode_past_max_seq_len_ends_truncated_and_trains(tokenizer):
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny", vocab_size=len(tokenizer))).eval()
    trajs = long_episodes(tokenizer, model)
    moe_layers = model.config.mlp_types.count("sparse")
    for traj in trajs:
        assert traj.status is RolloutStatus.TRUNCATED and traj.finish_detail == "context full"
        assert MAX_SEQ_LEN - 96 < len(traj.token_ids) <= MAX_SEQ_LEN and traj.num_turns > 1
        routes = traj.routed_experts  # every forwarded position; not the final observation
        last_sampled = max(i for i, m in enumerate(traj.loss_mask) if m)
        assert routes.dtype == np.int16 and last_sampled <= len(routes) < len(traj.token_ids)
        assert routes.shape[1:] == (moe_layers, model.config.num_experts_per_token)
    for i, traj in enumerate(trajs):
        traj.reward = float(i % 2)  # a spread in the group, as graded episodes would give
    group = TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)
    cfg = TrainerConfig(group_size=4, batch_size=4, micro_batch_size=2, lr=1e-3,
                        segment_tokens=128, routing_replay=True)  # fmt: skip
    trained = copy.deepcopy(model).train()
    before = [p.detach().clone() for p in trained.parameters()]
    learner = Learner(cfg, model=trained, source=ListSource([group]), pad_token_id=0,
                      temperature=1.0)  # fmt: skip
    metrics = learner.step()
    assert all(np.isfinite(v) for v in metrics.values() if isinstance(v, float))
    assert metrics["moe/replayed_share"] == 1.0  # every sampled token replays its record
    moved = [
        not torch.equal(p.detach(), b) for p, b in zip(trained.parameters(), before, strict=True)
    ]
    assert sum(moved) > len(moved) // 2
