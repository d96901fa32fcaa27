"""Context parallelism in the learner (trainer.context_parallel, policy/k3/context.py): each
trajectory split over context ranks, the KDA states, conv tails and MLA latents relayed rank to
rank, composed with FSDP2 and expert parallelism over the ranks of one context index.

Spawned gloo ranks, K3 "k3-debug" (KDA + MLA, AttnRes, 3 MoE layers of 8 experts) in float64,
the groups of tests/rl/test_reshard.py (9-13 token sequences) in segments of 4 tokens, against
one rank running the same segments (the context ranks together make exactly its router calls,
so Quantile Balancing sees the same candidates):
- context 2 on 2 ranks: 3 learner steps (3 AdamW steps, QB after each) equal one rank's to
  1e-11, weights, AdamW moments and losses; the checkpoint it wrote before the third step loads
  into one rank (context 1) with the same state, bit for bit, and that rank's third step
  matches the 2 ranks' third; one rank's checkpoint loads into context 2 bit for bit;
- context 2 x expert 2 on 4 ranks (2 data x 2 context; FSDP2 and 2-way EP over the 2 ranks of
  each context index): 3 steps equal one rank's;
- context 2 with decoupled PPO (proximal logprobs from a no-grad pass) and a KL reference, in
  segments of 16, longer than the sequences (so split by tokens): one step equals one rank's
  (Quantile Balancing's next bias then differs: 2 router calls per micro-batch against 1).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rl.learner import checkpoint as ckpt
from tests.policy.k3.test_engine import make_model
from tests.policy.test_parallel import run_ranks
from tests.rl.test_reshard import assert_same_state, full_state, groups, learner
from tests.rl.test_sharded_k3 import _one_thread  # noqa: F401 (autouse: one torch thread)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3
SEGMENT = 4
TOLERANCE = 1e-11  # float64, the ranks differ from one process only by reduction order


def _ranks(rank, world, tmp, staged, ep, load_from="") -> None:
    model = make_model(torch.float64)
    batches = groups(model) if rank == 0 else []
    trained = learner(model, batches, rank, world, ep=ep, segment=SEGMENT, context=2)
    losses = []
    for step in range(STEPS):
        if step == STEPS - 1 and staged:
            trained.save(Path(staged))
            saved = full_state(trained)
        losses.append(trained.step()["learner/loss"])
    out = dict(losses=losses, trained=full_state(trained))
    if staged:
        out["saved"] = saved
    if load_from:  # one rank's checkpoint into context 2
        fresh = learner(make_model(torch.float64, seed=1), [], rank, world, ep=ep, context=2)
        fresh.load(Path(load_from))
        out["loaded"] = full_state(fresh)
    if rank == 0:
        torch.save(out, Path(tmp) / f"world{world}.pt")


def _one_rank(save_to: Path | None = None):
    """One segmented rank's STEPS steps -> (losses, final state, state when saved or None);
    with `save_to`, a committed checkpoint there before the last step."""
    model = make_model(torch.float64)
    one = learner(model, groups(model), segment=SEGMENT, loss_positions_only=False)  # as 2 ranks
    losses, saved = [], None
    for step in range(STEPS):
        if step == STEPS - 1 and save_to is not None:
            staged = ckpt.staging_dir(save_to, step)
            one.save(staged)
            ckpt.commit(save_to, staged, step)
            saved = full_state(one)
        losses.append(one.step()["learner/loss"])
    return losses, full_state(one), saved


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _assert_like_one(got: dict, losses: list, want: dict) -> float:
    trained = got["trained"]
    assert list(trained["model"]) == list(want["model"])
    weights = _max_diff(trained["model"], want["model"])
    moments = max(
        _max_diff(trained["optim"]["state"][fqn], entry)
        for fqn, entry in want["optim"]["state"].items()
    )
    assert weights < TOLERANCE and moments < TOLERANCE, (weights, moments)
    assert got["losses"] == pytest.approx(losses, abs=1e-12)
    assert (trained["version"], trained["trained"]) == (want["version"], want["trained"])
    return weights


def test_two_context_ranks_train_like_one_and_reshard_to_one(tmp_path):
    started = time.monotonic()
    losses, want, one_saved = _one_rank(save_to=tmp_path / "one")
    staged = ckpt.staging_dir(tmp_path / "two", STEPS - 1)
    one_path = str(ckpt.latest(tmp_path / "one"))
    run_ranks(_ranks, str(tmp_path), str(staged), 1, one_path, world=2, timeout=240)
    two = torch.load(tmp_path / "world2.pt", weights_only=False)
    weights = _assert_like_one(two, losses, want)
    assert_same_state(two["loaded"], one_saved)  # context 1 -> context 2

    path = ckpt.commit(tmp_path / "two", staged, STEPS - 1)
    batches = groups(make_model(torch.float64))  # the run's data; weights from the checkpoint
    resumed = learner(
        make_model(torch.float64, seed=1), batches, skip=2 * (STEPS - 1), segment=SEGMENT,
        loss_positions_only=False,  # as the context ranks (one rank only: the default on)
    )  # fmt: skip
    resumed.load(path)  # context 2 -> context 1
    assert_same_state(full_state(resumed), two["saved"])
    resumed.step()
    after = _max_diff(full_state(resumed)["model"], two["trained"]["model"])
    assert after < TOLERANCE, after
    print(f"context 2: {time.monotonic() - started:.1f} s; weights {weights:.1e} from one rank")


def test_context_two_by_expert_two_on_four_ranks_train_like_one(tmp_path):
    started = time.monotonic()
    run_ranks(_ranks, str(tmp_path), "", 2, world=4, timeout=400)
    four = torch.load(tmp_path / "world4.pt", weights_only=False)
    losses, want, _ = _one_rank()
    weights = _assert_like_one(four, losses, want)
    print(f"context 2 x EP 2: {time.monotonic() - started:.1f} s; weights {weights:.1e}")


EXTRA = dict(kl_coef=0.01, off_policy="decoupled")


def _decoupled(rank, world, tmp) -> None:
    model = make_model(torch.float64)
    batches = groups(model) if rank == 0 else []
    trained = learner(model, batches, rank, world, segment=16, context=2, **EXTRA)
    out = dict(losses=[trained.step()["learner/loss"]], trained=full_state(trained))
    if rank == 0:
        torch.save(out, Path(tmp) / "decoupled.pt")


def test_context_ranks_with_decoupled_and_kl_on_sequences_shorter_than_a_segment(tmp_path):
    run_ranks(_decoupled, str(tmp_path), world=2, timeout=240)
    two = torch.load(tmp_path / "decoupled.pt", weights_only=False)
    model = make_model(torch.float64)
    one = learner(model, groups(model), segment=16, loss_positions_only=False, **EXTRA)
    losses = [one.step()["learner/loss"]]
    want = {k: v for k, v in full_state(one)["model"].items() if "e_score_correction" not in k}
    weights = _max_diff(two["trained"]["model"], want)  # QB's next bias aside (see above)
    assert weights < TOLERANCE, weights
    assert two["losses"] == pytest.approx(losses, abs=1e-12)
