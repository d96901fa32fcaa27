"""Routing replay (R3) and the routing-mismatch metric, with the real K3 policy and engine, and
routes that cross a worker crash (a saved episode restored by another worker's engine)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import envs  # noqa: F401
from policy.engines import open_session
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams
from policy.session import Sampled
from rl.config.runfile import TrainerConfig
from rl.learner.batch import pack
from rl.learner.learner import Learner
from rollout.codec import decode_episode, decode_group, encode_group
from rollout.serve import AsyncRollouts
from rollout.tasks import TaskQueue
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.policy.k3.test_engine import make_model
from tests.rl.test_learner import ListSource
from tests.rollout.test_render_and_episode import expert_script
from tests.rollout.test_serve import KEYS, make, run_for


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
    for got, sent in zip(back.trajectories, group.trajectories, strict=True):
        assert sent.routed_experts.dtype == got.routed_experts.dtype == np.int16
        np.testing.assert_array_equal(got.routed_experts, sent.routed_experts)
        assert len(got.routed_experts) == len(sent.token_ids) - 1


@pytest.mark.parametrize("replay", [False, True])
def test_mismatch_is_zero_on_the_same_weights_and_seen_when_routing_drifts(replay):
    """In every mode: with replay the learner trains on the recorded experts and still reports
    where its router would have chosen others."""
    model = make_model(torch.float32)
    group = rollouts(model)
    same = learner(copy.deepcopy(model), group, replay=replay).step()
    assert same["moe/routing_mismatch"] == 0.0
    drifted = drift(model)
    assert learner(drifted, group, replay=replay).step()["moe/routing_mismatch"] > 0.2


@pytest.mark.parametrize("replay", [True, False])
def test_replay_reproduces_the_rollout_logprobs_after_a_bias_change(replay):
    """The bias moves selection only (mixing weights come from unbiased scores): with replay
    the learner's ratio to the rollout stays exactly 1; without, it does not."""
    model = make_model(torch.float32)
    group = rollouts(model)
    drifted = drift(model)
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
    has = torch.tensor([t.routed_experts is not None for t in group.trajectories])
    assert torch.equal(batch.routed_NT.any(-1), has)
    assert batch.routes_NTMK.dtype == torch.int16 and (batch.routes_NTMK[~has] == -1).all()
    drifted = drift(model)
    run = learner(drifted, group, replay=True)
    assert all(r.dtype == torch.long for r in run._replay(batch))  # int64 where they index
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


class ForcedK3Session:
    """The real K3 session (its forwards record the routes), with each sampled token replaced
    by a script's, so that an untrained model makes tool calls and episodes have several turns.
    The logprobs stay those of the tokens the model sampled: only the routes are under test."""

    def __init__(self, inner, tokenizer, script):
        self.inner, self.tokenizer, self.script = inner, tokenizer, script
        self.history: dict = {}  # key -> every token fed or forced so far
        self.queued: dict = {}  # key -> the rest of the scripted turn

    def add(self, keys, token_ids):
        for key, ids in zip(keys, token_ids, strict=True):
            self.history.setdefault(key, []).extend(ids)
            self.queued.pop(key, None)
        return self.inner.add(keys, token_ids)

    def step(self, keys, params):
        out = []
        for key, sampled in zip(keys, self.inner.step(keys, params), strict=True):
            if key not in self.queued:
                text = self.script(self.history[key])
                self.queued[key] = self.tokenizer.encode(text, add_special_tokens=False)
            token = self.queued[key].pop(0)
            if not self.queued[key]:
                del self.queued[key]
            self.inner.contexts[key].pending = token  # fed by the next forward, as sampled
            self.history[key].append(token)
            out.append(Sampled(token=token, logprob=sampled.logprob, routes=sampled.routes))
        return out

    def drop(self, keys):
        self.inner.drop(keys)
        for key in keys:
            self.history.pop(key, None)
            self.queued.pop(key, None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def serving(model, tokenizer, client, consumer: str, **options) -> AsyncRollouts:
    """A rollout worker's serve loop on a K3 session that records routes (a fresh K3Policy over
    `model`: a new process's engine), its turns scripted by the calculator expert."""
    policy = K3Policy(model, pad_token_id=0, record_routing=True)
    session = ForcedK3Session(open_session(policy), tokenizer, expert_script(tokenizer))
    return make(tokenizer, client, consumer, session=session, **options)[0]


def drift(model):
    """A copy whose expert selection differs (the bias moves selection only)."""
    drifted = copy.deepcopy(model)
    with torch.no_grad():
        for layer in drifted.model.layers:
            if layer.is_sparse:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 1.0)
    return drifted


def routing(model, token_ids: list[int]) -> torch.Tensor:
    """[T - 1, M, Kx] the model's own expert choices (sorted) at every predicting position."""
    with torch.no_grad():
        live = model(torch.tensor([token_ids]), return_routing=True).routed_experts
    return live[:, :-1].transpose(0, 1).sort(-1).values  # [M, T, Kx] -> [T - 1, M, Kx]


def test_a_trajectory_continued_across_a_worker_crash_replays_every_turns_routes(
    tokenizer, redis_server
):
    """Worker w0 records routes, saves its episodes at a turn boundary and dies; w1, a new
    engine that holds newer weights (routing moved), claims them, restores them (the whole
    context prefilled again) and finishes them. Each continued trajectory keeps the routes
    recorded before the crash (not w1's re-prefill), gains w1's for the later turns, covers
    every position once (float64, against each model's own routing of the final sequence),
    and the learner replays all of its sampled tokens."""
    client, model = redis_server.client(), make_model(torch.float64)
    newer = drift(model)
    queue = TaskQueue(client, KEYS)
    queue.issue([("g0", 5)])
    dying = serving(model, tokenizer, client, "w0")
    saved = lambda: [  # noqa: E731
        decode_episode(data) for data in queue.saved_episodes("g0").values()
    ]
    run_for(dying, dying.loop.renderer, until=lambda: any(not x.get("final") for _, x in saved()))
    before = {t.traj_id: t.routed_experts for t, x in saved() if not x.get("final")}
    assert before and all(r is not None and len(r) for r in before.values())

    taker = serving(newer, tokenizer, client, "w1", claim_idle_ms=0)
    run_for(taker, taker.loop.renderer, until=lambda: client.xlen(KEYS.trajectories) == 1)
    assert taker.counters["restored_episodes"] == len(before)
    (_, fields_), *_ = client.xrange(KEYS.trajectories, "-", "+")
    group = decode_group(fields_[b"group"])
    continued = [t for t in group.trajectories if t.traj_id in before]
    assert continued and all(t.resumed == 1 and t.num_turns >= 2 for t in continued)
    for traj in continued:
        routes = torch.from_numpy(traj.routed_experts).long().sort(-1).values  # [T - 1, M, Kx]
        assert routes.shape[0] == len(traj.token_ids) - 1, traj.traj_id
        kept = torch.from_numpy(before[traj.traj_id]).long().sort(-1).values
        assert 0 < len(kept) < len(routes)  # turns before the crash and after it
        old, new = routing(model, traj.token_ids), routing(newer, traj.token_ids)
        assert torch.equal(routes[: len(kept)], kept)  # recorded before the crash, kept
        assert torch.equal(kept, old[: len(kept)]) and not torch.equal(kept, new[: len(kept)])
        assert torch.equal(routes[len(kept) :], new[len(kept) :]), traj.traj_id
    cfg = TrainerConfig(group_size=2, batch_size=2, micro_batch_size=2, lr=1e-9,
                        routing_replay=True)  # fmt: skip
    run = Learner(cfg, model=copy.deepcopy(newer).float(), source=ListSource([group]),
                  pad_token_id=0, temperature=1.0)  # fmt: skip
    assert run.step()["moe/replayed_share"] == 1.0


@pytest.mark.parametrize("off_policy", ["none", "decoupled"])
def test_the_logprob_gap_is_measured_on_the_current_weights_tokens(off_policy):
    """learner/logprob_delta_max: max |learner - rollout| logprob over the sampled tokens of
    the learner's own version. Same weights and replayed routes: float32 noise only; routing
    drifted and not replayed: large; tokens of another version only: not reported."""
    model = make_model(torch.float32)
    group = rollouts(model)

    def step(policy, data, replay):
        run = learner(policy, data, replay=replay)
        run.cfg.off_policy = off_policy
        return run.step()

    assert step(copy.deepcopy(model), group, True)["learner/logprob_delta_max"] < 1e-4
    assert step(drift(model), group, False)["learner/logprob_delta_max"] > 1e-3
    for t in group.trajectories:
        t.token_versions = [7 if v >= 0 else v for v in t.token_versions]
    assert "learner/logprob_delta_max" not in step(copy.deepcopy(model), group, True)
