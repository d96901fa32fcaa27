"""Learner checkpoints load at another world size and expert-parallel size (rl/learner/state.py).

One spawned 2-rank run (K3 "k3-debug", 8 experts, float64) and the test process (1 rank):
- 2 -> 1: 2 ranks with 2-way expert parallelism train 2 steps and checkpoint; one process loads
  it and holds exactly the weights and AdamW state the 2 ranks gather; its next step matches the
  2 ranks' next step (float64: the two differ only by reduction order);
- 1 -> 2: one process trains 2 steps and checkpoints; 2 ranks (EP 2) load it, gather exactly
  the state the process had;
- EP 2 -> 1: 2 ranks without expert parallelism load the EP-2 checkpoint, gather it exactly.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from rl.config.runfile import TrainerConfig
from rl.learner import checkpoint as ckpt
from rl.learner.distributed import Shard
from rl.learner.learner import Learner
from rl.learner.state import IMPLEMENTATION_KEYS, _modules
from tests.policy.k3.test_engine import make_model
from tests.policy.test_parallel import run_ranks
from tests.rl.test_learner import ListSource, make_group

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 2  # trained before the checkpoint; one more after it


def groups(model) -> list:
    return [make_group(model, [1.0, 0.0, 0.0, 1.0], seed=100 + i) for i in range(2 * STEPS + 2)]


def learner(
    model, batches, rank=0, world=1, ep=1, skip=0, segment=0, context=1, **extra
) -> Learner:
    # several ranks never share a prompt (trainer.shared_prefix), so neither does the one-rank
    # reference: a shared prompt chunks K3's KDA elsewhere (the same math, other float32
    # rounding: tests/policy/test_shared_prefix.py checks it in float64)
    extra.setdefault("shared_prefix", False)
    cfg = TrainerConfig(
        group_size=4, batch_size=8, micro_batch_size=2, lr=1e-3, world_size=world,
        expert_parallel=ep, segment_tokens=segment, context_parallel=context, **extra,
    )  # fmt: skip
    source = None
    if rank == 0:
        source = ListSource(batches)
        source.entries = source.entries[skip:]  # the groups a resumed run reads next
    return Learner(
        cfg, model=model, source=source, pad_token_id=0, temperature=1.0, seed=5,
        shard=Shard(rank, world, ep, context=context),
    )  # fmt: skip


def full_state(one: Learner) -> dict:
    """Weights and AdamW state, unsharded (collective), plus the counters."""
    options = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(_modules(one), one.optimizer, options=options)
    state = dict(model=model_sd, optim=optim_sd, version=one.version, trained=one.trained)
    return copy.deepcopy(state)  # unsharded tensors (buffers) are the learner's own: copy


def assert_same_state(got: dict, want: dict) -> None:
    assert list(got["model"]) == list(want["model"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["optim"]["state"].keys() == want["optim"]["state"].keys()
    for fqn, entry in want["optim"]["state"].items():
        for key, tensor in entry.items():
            assert torch.equal(got["optim"]["state"][fqn][key], tensor), (fqn, key)
    assert _hyper(got["optim"]["param_groups"]) == _hyper(want["optim"]["param_groups"])
    assert (got["version"], got["trained"]) == (want["version"], want["trained"])


def _hyper(groups: list[dict]) -> list[dict]:
    """Param groups without how the optimizer runs: one rank's AdamW is fused, sharded ranks'
    are not (rl/learner/optim.py), and a resume keeps the loading learner's (state.py)."""
    return [{k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS} for g in groups]


def _ranks(rank, world, tmp, staged) -> None:
    tmp, staged = Path(tmp), Path(staged)
    model = make_model(torch.float64)
    batches = groups(model)
    trained = learner(model, batches, rank, world, ep=2)
    for _ in range(STEPS):
        trained.step()
    trained.save(staged)  # the parent commits it
    saved = full_state(trained)
    trained.step()
    out = dict(saved=saved, continued=full_state(trained)["model"])
    dist.barrier()
    for ep, path in ((2, ckpt.latest(tmp / "one")), (1, staged)):
        fresh = learner(make_model(torch.float64, seed=1), batches, rank, world, ep=ep)
        fresh.load(path)
        out[f"loaded_ep{ep}"] = full_state(fresh)
    if rank == 0:
        torch.save(out, tmp / "ranks.pt")


def test_checkpoints_reshard_between_world_and_expert_parallel_sizes(tmp_path):
    started = time.monotonic()
    model = make_model(torch.float64)
    batches = groups(model)
    one = learner(model, batches)
    for _ in range(STEPS):
        one.step()
    staged = ckpt.staging_dir(tmp_path / "one", STEPS)
    one.save(staged)
    ckpt.commit(tmp_path / "one", staged, STEPS)
    staged = ckpt.staging_dir(tmp_path / "two", STEPS)
    run_ranks(_ranks, str(tmp_path), str(staged), timeout=120)
    two = torch.load(tmp_path / "ranks.pt", weights_only=False)
    assert_same_state(two["loaded_ep2"], full_state(one))  # 1 -> 2 ranks, EP 2
    assert_same_state(two["loaded_ep1"], two["saved"])  # EP 2 -> EP 1

    path = ckpt.commit(tmp_path / "two", staged, STEPS)
    resumed = learner(make_model(torch.float64, seed=1), batches, skip=2 * STEPS)
    resumed.load(path)
    assert_same_state(full_state(resumed), two["saved"])  # 2 ranks, EP 2 -> 1 rank
    resumed.step()
    after = full_state(resumed)["model"]
    diff = max(float((after[k] - two["continued"][k]).abs().max()) for k in after)
    moved = max(float((after[k] - two["saved"]["model"][k]).abs().max()) for k in after)
    assert diff < 1e-9 < moved, (diff, moved)
    print(f"resharding test: {time.monotonic() - started:.1f} s, step difference {diff:.1e}")
