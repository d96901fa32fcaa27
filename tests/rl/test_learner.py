"""The learner against a small in-memory source (a fake of our GroupSource seam)."""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import pytest
import torch

from policy.hf import checksum, export_weights
from policy.logprobs import token_logprobs
from rl.config.runfile import TrainerConfig
from rl.learner.batch import pack
from rl.learner.learner import Learner, StreamTimeout
from rl.observe.trajlog import records
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup


class ListSource:
    def __init__(self, groups):  # each entry its own group id, as a real stream has
        self.entries = [
            (f"{i}-0", dataclasses.replace(g, group_id=f"{g.group_id}#{i}"))
            for i, g in enumerate(groups)
        ]
        self.acked: list[str] = []

    def read(self, count, *, block_ms):
        taken, self.entries = self.entries[:count], self.entries[count:]
        return taken

    def ack(self, entry_ids):
        self.acked.extend(entry_ids)
        return len(entry_ids)

    def stopped(self):
        return False


class TrickleSource(ListSource):
    """A ListSource whose entries arrive one at a time, `gaps[i]` seconds after the previous one
    (the clock starts at the first read); `read` waits at most `block_ms` for the next, as the
    Redis stream does."""

    def __init__(self, groups, gaps):
        super().__init__(groups)
        self.gaps, self.next_at = list(gaps), None

    def read(self, count, *, block_ms):
        now = time.monotonic()
        if self.next_at is None and self.gaps:
            self.next_at = now + self.gaps[0]
        if not self.entries or self.next_at is None:  # nothing more will ever arrive
            time.sleep(block_ms / 1000)
            return []
        if self.next_at - now > block_ms / 1000:
            time.sleep(block_ms / 1000)
            return []
        time.sleep(max(0.0, self.next_at - now))
        self.gaps.pop(0)
        self.next_at = time.monotonic() + self.gaps[0] if self.gaps else None
        return super().read(1, block_ms=block_ms)


def make_group(model, rewards, *, seed, status=RolloutStatus.COMPLETED):
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for reward in rewards:
        prompt = torch.randint(5, 100, (6,), generator=gen).tolist()
        completion = torch.randint(
            5, 100, (int(torch.randint(3, 8, (1,), generator=gen)),), generator=gen
        ).tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        traj = Trajectory(task_id=f"t{seed}", status=status, reward=reward)
        traj.append(prompt, sampled=False)
        traj.append(
            completion, sampled=True, logprobs=logp[0, len(prompt) - 1 :].tolist(), version=0
        )
        trajs.append(traj)
    return TrajectoryGroup(group_id=str(seed), task_id=f"t{seed}", trajectories=trajs)


def learner_for(model, groups, batch_size=None):
    cfg = TrainerConfig(
        group_size=4,
        batch_size=batch_size or 4 * len(groups),
        micro_batch_size=3,
        lr=1e-2,
        read_timeout_s=0.5,
    )
    source = ListSource(groups)
    return Learner(cfg, model=model, source=source, pad_token_id=0, temperature=1.0), source


def test_step_updates_weights_then_acks(tiny_model):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    learner, source = learner_for(model, groups)
    before = checksum(export_weights(model))
    metrics = learner.step()
    assert checksum(export_weights(model)) != before
    assert source.acked == ["0-0", "1-0"] and learner.version == 1
    assert metrics["learner/policy_lag"] == 0.0
    assert abs(metrics["learner/ratio_mean"] - 1.0) < 1e-4  # on-policy: rollout == learner logprobs
    assert metrics["learner/clip_fraction"] == 0.0 and metrics["learner/loss_tokens"] > 0


def test_flat_groups_carry_no_gradient(tiny_model):
    model = copy.deepcopy(tiny_model)
    learner, _ = learner_for(model, [make_group(model, [1.0] * 4, seed=3)])
    before = checksum(export_weights(model))
    metrics = learner.step()
    assert metrics["learner/grad_norm"] == 0.0
    assert checksum(export_weights(model)) == before


def test_a_failed_step_acks_nothing(tiny_model, monkeypatch):
    model = copy.deepcopy(tiny_model)
    learner, source = learner_for(model, [make_group(model, [1.0, 0.0, 1.0, 0.0], seed=4)])

    def broken(batch):
        raise RuntimeError("the update failed")

    monkeypatch.setattr(learner, "_train", broken)
    with pytest.raises(RuntimeError, match="the update failed"):
        learner.step()
    assert source.acked == [] and learner.version == 0


class StoppingSource(ListSource):
    """A ListSource whose run stops (`stopped()` turns true) after `reads` reads."""

    def __init__(self, groups, reads):
        super().__init__(groups)
        self.reads_left = reads

    def read(self, count, *, block_ms):
        self.reads_left -= 1
        return super().read(1, block_ms=block_ms)

    def stopped(self):
        return self.reads_left <= 0


@pytest.mark.parametrize("reads", [1, 2], ids=["while-reading", "while-training"])
def test_a_step_the_run_stops_during_acks_nothing(tiny_model, reads):
    """The driver stops an async run while a learner step it started runs (rl/run/async_loop.py
    _stop_ahead): the learner reads no more and acks nothing, so the step's groups stay pending
    for a resume; the step says it stopped. With 2 groups a step, one read per group: after 1
    read the stop comes while reading (nothing trained), after 2 while training."""
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    learner, _ = learner_for(model, groups)
    learner.source = source = StoppingSource(groups, reads)
    before = checksum(export_weights(model))
    metrics = learner.step()
    assert metrics["learner/stopped"] == 1.0 and source.acked == []
    assert learner.ledger["trained"] == [] and not learner.trained  # pending, not settled
    assert ("learner/loss_tokens" in metrics) == (reads == 2)  # trained only with both groups
    assert (checksum(export_weights(model)) == before) == (reads == 1)


def test_an_all_errored_group_is_failed_in_the_ledger_and_acked(tiny_model):
    model = copy.deepcopy(tiny_model)
    group = make_group(model, [1.0, 0.0, 1.0, 0.0], seed=4, status=RolloutStatus.ENV_ERROR)
    learner, source = learner_for(model, [group])
    before = [p.detach().clone() for p in model.parameters()]
    learner.step()
    assert learner.ledger["failed"] == {"no trainable trajectory": ["4#0"]}
    assert learner.ledger["trained"] == [] and source.acked == ["0-0"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_second_copy_of_a_trained_group_is_filtered_not_trained(tiny_model):
    model = copy.deepcopy(tiny_model)
    group = make_group(model, [1.0, 0.0, 1.0, 0.0], seed=6)
    learner, source = learner_for(model, [group])
    source.entries.append(("1-0", group := source.entries[0][1]))  # a retried task's copy
    source.entries.append(("2-0", make_group(model, [0.0, 1.0, 0.0, 1.0], seed=7)))
    learner.step()
    learner.step()
    assert learner.ledger["filtered"] == {"duplicate": [group.group_id]}
    assert learner.ledger["trained"] == ["7"] and source.acked == ["0-0", "1-0", "2-0"]


def test_every_group_in_the_ledger_joins_the_trained_set(tiny_model):
    """Failed and filtered groups settle like trained ones (a copy is never trained later), so
    the set's watermarks advance past them; a dead-lettered entry's group is failed."""
    model = copy.deepcopy(tiny_model)
    errored = make_group(model, [1.0, 0.0, 1.0, 0.0], seed=4, status=RolloutStatus.ENV_ERROR)
    learner, source = learner_for(model, [errored, make_group(model, [1.0, 0.0] * 2, seed=5)])
    source.dead = ["t9"]
    source.take_dead_letters = lambda: [source.dead.pop()] if source.dead else []
    learner.step()
    assert learner.ledger["failed"] == {"undecodable": ["t9"], "no trainable trajectory": ["4#0"]}
    assert learner.ledger["trained"] == ["5#1"] and len(learner.trained) == 3
    assert all(g in learner.trained for g in ("t9", "4#0", "5#1"))


def test_a_silent_stream_times_out_with_a_clear_error(tiny_model):
    learner, _ = learner_for(copy.deepcopy(tiny_model), [], batch_size=8)
    with pytest.raises(StreamTimeout, match="0 of 2 groups"):
        learner.step()


def trickle_learner(model, groups, gaps, *, timeout_s, tasks):
    cfg = TrainerConfig(group_size=4, batch_size=4 * tasks, read_timeout_s=timeout_s)
    source = TrickleSource(groups, gaps)
    return Learner(cfg, model=copy.deepcopy(model), source=source, pad_token_id=0, temperature=1.0)


def test_read_timeout_is_a_silence_timer_not_a_batch_deadline(tiny_model):
    # Groups keep arriving, each well within the timeout, but the whole batch takes longer than
    # it: a healthy run with slow episodes must get its batch (the timer restarts per group).
    group = make_group(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=40)
    learner = trickle_learner(tiny_model, [group] * 6, [0.12] * 6, timeout_s=0.4, tasks=6)
    start = time.monotonic()
    ids, groups = learner.read_batch()
    assert time.monotonic() - start > 0.4  # longer in total than read_timeout_s
    assert ids == [f"{i}-0" for i in range(6)] and len(groups) == 6


def test_a_stream_that_falls_silent_times_out_naming_the_key(tiny_model):
    group = make_group(tiny_model, [1.0, 0.0, 0.0, 1.0], seed=41)
    learner = trickle_learner(tiny_model, [group] * 2, [0.05, 0.05], timeout_s=0.25, tasks=3)
    start = time.monotonic()
    with pytest.raises(StreamTimeout, match=r"2 of 3 groups .*trainer\.read_timeout_s"):
        learner.read_batch()
    # counted from the last group (at 0.1 s), not from the start (ms rounding aside)
    assert time.monotonic() - start > 0.1 + 0.25 - 0.02


def test_pack_masks_prompt_and_padding(tiny_model):
    group = make_group(tiny_model, [1.0, 0.0, 1.0, 0.0], seed=5)
    batch = pack([group], pad_token_id=0)
    for row, traj in enumerate(group.trajectories):
        n = len(traj.token_ids)
        assert batch.loss_mask_NT[row, : n - 1].tolist() == traj.loss_mask[1:]
        assert batch.loss_mask_NT[row, n - 1 :].sum() == 0
        assert batch.adv_NT[row, 0] == pytest.approx([0.866, -0.866, 0.866, -0.866][row], abs=1e-3)


def test_pack_keeps_routes_int16_from_arrays_or_lists():
    """Routing records (int16 arrays as rollouts make them, or nested lists) pack into an int16
    [N, T, M, K] batch, -1 past each record and on a trajectory without one; micro-batches
    padded past the batch's width stay int16 and -1."""
    trajs = []
    for reward, prompt in ((0.0, 3), (1.0, 5), (1.0, 4)):
        traj = Trajectory(task_id="t", status=RolloutStatus.COMPLETED, reward=reward)
        traj.append(list(range(5, 5 + prompt)), sampled=False)
        traj.append([8, 9], sampled=True, logprobs=[-0.5, -0.25], version=0)
        trajs.append(traj)
    record_TMK = torch.arange(6 * 2 * 3, dtype=torch.int16).view(6, 2, 3).numpy() + 32000
    trajs[1].routed_experts = record_TMK  # 7 tokens: a record for each of 6 positions
    trajs[0].routed_experts = (record_TMK[:3] - 32000).tolist()  # lists, 3 of 4 positions
    group = TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)
    batch = pack([group], pad_token_id=0)
    routes = batch.routes_NTMK
    assert routes.dtype == torch.int16 and routes.shape == (3, 7, 2, 3)
    assert routes[1, :6].tolist() == record_TMK.tolist() and (routes[1, 6] == -1).all()
    assert routes[0, :3].tolist() == (record_TMK[:3] - 32000).tolist()
    assert (routes[0, 3:] == -1).all() and (routes[2] == -1).all()
    assert batch.routed_NT.sum(-1).tolist() == [3, 6, 0]
    mb = batch.rows(torch.tensor([0, 2]), 9)
    assert mb.routes_NTMK.dtype == torch.int16 and mb.routes_NTMK.shape == (2, 9, 2, 3)
    assert (mb.routes_NTMK[:, 7:] == -1).all()


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "ppo"])
def test_every_algorithm_steps_and_changes_the_weights(tiny_model, algorithm):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(2)]
    cfg = TrainerConfig(
        algorithm=algorithm, group_size=4, batch_size=8, micro_batch_size=3, lr=1e-2
    )
    learner = Learner(cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0)
    before = checksum(export_weights(model))
    metrics = learner.step()
    assert checksum(export_weights(model)) != before, algorithm
    assert math.isfinite(metrics["learner/loss"]) and metrics["learner/grad_norm"] > 0
    if algorithm == "ppo":
        assert "learner/value_loss" in metrics


def test_dapo_drops_flat_groups_and_reports_them(tiny_model):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0] * 4, seed=8), make_group(model, [1.0, 0.0, 1.0, 0.0], seed=9)]
    cfg = TrainerConfig(algorithm="dapo", group_size=4, batch_size=8, micro_batch_size=4)
    source = ListSource(groups)
    learner = Learner(cfg, model=model, source=source, pad_token_id=0, temperature=1.0)
    metrics = learner.step()
    assert metrics["learner/dropped_groups"] == 1 and metrics["learner/trajectories"] == 4
    assert source.acked == ["0-0", "1-0"]  # the dropped group is consumed, not left pending
    recs = records(learner.last_groups, learner.ledger, limit=8, advantages="grpo")
    fate = {r["group"]: (r["fate"], r["advantage"]) for r in recs}
    assert fate["8#0"] == ("filtered: flat", 0.0)
    assert fate["9#1"][0] == "trained" and abs(fate["9#1"][1]) > 0.5
    assert [r["id"] for r in recs][:2] == ["8#0/0", "8#0/1"]


def test_ppo_value_head_learns_the_outcome(tiny_model):
    model = copy.deepcopy(tiny_model)
    cfg = TrainerConfig(
        algorithm="ppo", group_size=1, batch_size=4, micro_batch_size=4, lr=5e-2, vf_coef=1.0
    )
    groups = [make_group(model, [1.0], seed=20 + i) for i in range(4)] * 10
    learner = Learner(cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0)
    losses = [learner.step()["learner/value_loss"] for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0]


def test_kl_and_tis_report_their_terms(tiny_model):
    model = copy.deepcopy(tiny_model)
    groups = [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=30)] * 2
    cfg = TrainerConfig(
        group_size=4, batch_size=4, micro_batch_size=4, lr=1e-2, kl_coef=0.1, tis_cap=2.0
    )
    learner = Learner(cfg, model=model, source=ListSource(groups), pad_token_id=0, temperature=1.0)
    first, second = learner.step(), learner.step()
    assert first["learner/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # nothing moved yet
    assert second["learner/ref_kl"] > 0
    assert first["learner/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy


def shared_prompt_group(model, rewards, *, seed, prompt_len=12):
    """A GRPO group as rollouts make it: every sample starts with the same prompt."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 100, (prompt_len,), generator=gen).tolist()
    trajs = []
    for reward in rewards:
        completion = torch.randint(5, 100, (int(torch.randint(3, 8, (1,), generator=gen)),),
                                   generator=gen).tolist()  # fmt: skip
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
        traj = Trajectory(task_id=f"t{seed}", status=RolloutStatus.COMPLETED, reward=reward)
        traj.append(prompt, sampled=False)
        traj.append(completion, sampled=True, logprobs=logp[0, prompt_len - 1 :].tolist(),
                    version=0)  # fmt: skip
        trajs.append(traj)
    return TrajectoryGroup(group_id=str(seed), task_id=f"t{seed}", trajectories=trajs)


@pytest.mark.parametrize("policy", ["qwen3", "k3"])
def test_a_shared_prompt_runs_once_with_the_same_update(tiny_model, policy):
    """trainer.shared_prefix: the same loss and gradients as without it, the share of skipped
    tokens in the metrics, and (K3) the same Quantile Balancing update: the prompt's tokens
    count once per row, as in the whole forward."""
    if policy == "k3":
        from tests.policy.test_session import k3_model

        base = k3_model()
    else:
        base = copy.deepcopy(tiny_model)
    groups = [shared_prompt_group(base, [1.0, 0.0, 0.0, 1.0], seed=s) for s in range(3)]
    results = {}
    for shared in (True, False):
        model = copy.deepcopy(base)
        learner, _ = learner_for(model, groups)
        learner.share_prefix = shared
        learner.cfg.micro_batch_size = 12  # one micro-batch either way: QB's candidate is
        # taken per micro-batch, and grouping the rows changes which rows share one
        grads = {}
        params = dict(learner.trunk.named_parameters())
        learner.optimizer.step = lambda grads=grads, params=params: grads.update(
            {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        )  # the gradient the step would apply
        metrics = learner.step()
        biases = {n: b.clone() for n, b in model.state_dict().items() if "correction_bias" in n}
        results[shared] = metrics, grads, biases
    (on, g_on, b_on), (off, g_off, b_off) = results[True], results[False]
    assert b_on.keys() == b_off.keys() and (policy == "qwen3" or b_on)
    for name, bias in b_off.items():  # Quantile Balancing saw the same tokens either way
        torch.testing.assert_close(b_on[name], bias, rtol=1e-5, atol=1e-6, msg=name)
    assert on["learner/shared_prefix_share"] > 0.3 and "learner/shared_prefix_share" not in off
    assert on["learner/loss"] == pytest.approx(off["learner/loss"], rel=1e-4, abs=1e-6)
    assert g_on.keys() == g_off.keys() and g_on
    for name, grad in g_off.items():
        torch.testing.assert_close(g_on[name], grad, rtol=1e-3, atol=1e-6, msg=name)
