"""The sharded K3 learner: 2 gloo ranks with FSDP2 + 2-way expert parallelism
(trainer.world_size=2, trainer.expert_parallel=2) against one rank, its exact resume, and no
FSDP2-wrapped module returning a view.

One spawned 2-rank run (K3 "k3-debug": KDA + MLA, AttnRes, 3 MoE layers of 8 experts; float64
weights and optimizer state) with FSDP2's "returned a view tensor" warning turned into an error:
- 3 learner steps (3 AdamW steps, 2 micro-batches per rank each, Quantile Balancing after each),
  checkpointing before the third; the weights and AdamW moments after them equal one process's
  3 steps to 1e-11 (absolute; float64, the two differ only by reduction order);
- a fresh 2-rank learner loads that checkpoint and takes the third step: weights, AdamW state,
  router biases and counters equal the uninterrupted run's bit for bit (EP 2 -> EP 2).
Plus an in-process one-rank FSDP2 forward/backward of the learner's module (fast, no spawn).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from policy.logprobs import TokenLogprobs
from policy.parallel import build_meshes, parallelize
from rl.learner import checkpoint as ckpt
from rl.learner.distributed import init_single
from tests.policy.k3.test_engine import make_model
from tests.policy.test_parallel import run_ranks
from tests.rl.test_reshard import assert_same_state, full_state, groups, learner

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3  # learner steps = optimizer steps (batch_size 8 = one mini-batch)
VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"
TOLERANCE = 1e-11  # float64 weights and AdamW moments, 2 ranks vs 1 (seen: 6e-14, 6e-16)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add scheduling latency on busy shared cores (the
    spawned ranks run on one thread each, tests/policy/test_parallel.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ranks(rank, world, tmp, staged) -> None:
    with warnings.catch_warnings():  # spawned: the parent's warning filters do not reach here
        warnings.filterwarnings("error", VIEW_WARNING, UserWarning)
        out = _train_and_resume(rank, world, Path(staged))
    if rank == 0:
        torch.save(out, Path(tmp) / "ranks.pt")


def _train_and_resume(rank, world, staged: Path) -> dict:
    """STEPS steps with a checkpoint (into `staged`) before the last; then a fresh learner
    resumes from it and takes the last step again."""
    model = make_model(torch.float64)
    batches = groups(model) if rank == 0 else []  # only rank 0 reads the stream
    trained = learner(model, batches, rank, world, ep=2)
    losses = []
    for step in range(STEPS):
        if step == STEPS - 1:
            trained.save(staged)
        losses.append(trained.step()["learner/loss"])
    out = dict(losses=losses, trained=full_state(trained))
    dist.barrier()
    resumed = learner(
        make_model(torch.float64, seed=1), batches, rank, world, ep=2, skip=2 * (STEPS - 1)
    )
    resumed.load(staged)
    resumed.step()
    out["resumed"] = full_state(resumed)
    return out


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_two_ranks_with_expert_parallel_train_like_one_and_resume_exactly(tmp_path):
    started = time.monotonic()
    staged = ckpt.staging_dir(tmp_path / "two", STEPS - 1)  # one directory for both ranks
    run_ranks(_ranks, str(tmp_path), str(staged), timeout=150)
    two = torch.load(tmp_path / "ranks.pt", weights_only=False)
    spawned = time.monotonic() - started

    model = make_model(torch.float64)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    one = learner(model, groups(model))
    losses = [one.step()["learner/loss"] for _ in range(STEPS)]
    want = full_state(one)

    got = two["trained"]
    assert list(got["model"]) == list(want["model"])
    weights = _max_diff(got["model"], want["model"])
    moved = max(float((want["model"][k] - initial[k.removeprefix("trunk.policy.")]).abs().max())
                for k in want["model"])  # fmt: skip
    assert weights < TOLERANCE < 1e-3 < moved, (weights, moved)
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
    moments = max(
        _max_diff(got["optim"]["state"][fqn], entry)
        for fqn, entry in want["optim"]["state"].items()
    )
    assert moments < TOLERANCE, moments
    assert two["losses"] == pytest.approx(losses, abs=1e-12)
    assert (got["version"], got["trained"]) == (want["version"], want["trained"])

    assert_same_state(two["resumed"], got)  # EP 2 -> EP 2 resume: bit for bit
    print(
        f"sharded K3 learner: {spawned:.1f} s for the ranks, {time.monotonic() - started:.1f} s "
        f"in all; weights {weights:.1e}, AdamW moments {moments:.1e} from one rank"
    )


SEGMENT = 4  # tokens: the groups' 9-13 token sequences run in 3-4 segments


def _segmented(rank, world, tmp) -> None:
    model = make_model(torch.float64)
    batches = groups(model) if rank == 0 else []
    trained = learner(model, batches, rank, world, ep=2, segment=SEGMENT)
    losses = [trained.step()["learner/loss"] for _ in range(2)]
    out = dict(losses=losses, trained=full_state(trained))
    if rank == 0:
        torch.save(out, Path(tmp) / "segmented.pt")


def test_segments_on_sharded_ranks_train_like_one_rank(tmp_path):
    """trainer.segment_tokens on 2 ranks with FSDP2 + 2-way EP: each rank's micro-batches are
    padded to the widest rank's, so both run the same segments (without it the ranks' FSDP and
    EP collectives fall out of step and hang), and a segment of padding only gives no Quantile
    Balancing candidate; 2 optimizer steps equal one rank's with the same segments."""
    run_ranks(_segmented, str(tmp_path), timeout=150)
    two = torch.load(tmp_path / "segmented.pt", weights_only=False)
    model = make_model(torch.float64)
    one = learner(model, groups(model), segment=SEGMENT, loss_positions_only=False)  # as 2 ranks
    losses = [one.step()["learner/loss"] for _ in range(2)]
    want, got = full_state(one), two["trained"]
    assert list(got["model"]) == list(want["model"])
    weights = _max_diff(got["model"], want["model"])
    assert weights < TOLERANCE, weights
    assert two["losses"] == pytest.approx(losses, abs=1e-12)


@pytest.mark.parametrize("block_size", [2, None], ids=["attn-res", "plain-residual"])
def test_no_fsdp_module_of_the_k3_learner_returns_a_view(block_size):
    """FSDP2 on a one-rank group runs the same hooks as on many: its pre-forward hook hands each
    wrapped module its inputs as views, so a decoder layer that returned part of its input (the
    AttnRes stored sources did) or a root that returned a slice (the hidden states did) warns."""
    init_single()
    model = make_model(torch.float64, attn_res_block_size=block_size)
    trunk = parallelize(TokenLogprobs(model), build_meshes(ep_size=1))
    ids_BT = torch.randint(1, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[1, 6:] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", VIEW_WARNING, UserWarning)
        logp_BT, entropy_BT, hidden_BTD, _ = trunk(ids_BT, mask_BT, 1.0, mask_BT[:, 1:] > 0)
        (logp_BT.sum() + entropy_BT.sum() + hidden_BTD[:, :-1].pow(2).mean()).backward()
    assert hidden_BTD.shape == (2, 9, model.config.hidden_size)
    grads = [p.grad for p in trunk.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.full_tensor()).all() for g in grads)
