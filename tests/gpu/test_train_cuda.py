"""Training on CUDA: a learner step on the GPU equals the CPU's (dense and MoE policies; the MoE
one also runs Quantile Balancing's collectives on the one-rank cpu:gloo,cuda:nccl group), and a
2-step tiny run through the CLI with the learner, then the rollout workers, on the GPU."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from policy.hf import build_model
from policy.logprobs import token_logprobs
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup
from tests.conftest import TINY_MODEL
from tests.policy.k3.test_engine import make_model
from tests.rl.test_e2e import ROOT, run_cli, tiny_overrides

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
LR = 1e-5


class Source:
    """The same groups on every read (a stand-in for the Redis stream)."""

    def __init__(self, groups):
        self.groups = groups

    def read(self, count, *, block_ms):
        return [(f"{i}-0", g) for i, g in enumerate(self.groups[:count])]

    def ack(self, ids):
        return len(ids)

    def stopped(self):
        return False


def groups_for(model, vocab: int, count: int = 2, size: int = 4) -> list[TrajectoryGroup]:
    """`count` groups of `size` trajectories with on-policy logprobs (ratio 1)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(count):
        trajs = []
        for i in range(size):
            prompt = torch.randint(3, vocab, (10,), generator=gen).tolist()
            completion = torch.randint(3, vocab, (5 + i,), generator=gen).tolist()
            ids = torch.tensor([prompt + completion])
            with torch.no_grad():
                logp, _ = token_logprobs(model, ids, torch.ones_like(ids))
            traj = Trajectory(task_id=str(g), status=RolloutStatus.COMPLETED, reward=(g + i) % 2)
            traj.append(prompt, sampled=False)
            traj.append(completion, sampled=True, logprobs=logp[0, 9:].tolist(), version=0)
            trajs.append(traj)
        out.append(TrajectoryGroup(group_id=f"1-{g}", task_id=str(g), trajectories=trajs))
    return out


def step_once(model, groups) -> tuple[dict, dict]:
    cfg = TrainerConfig(algorithm="grpo", group_size=4, batch_size=8, micro_batch_size=4, lr=LR)
    learner = Learner(cfg, model=model, source=Source(groups), pad_token_id=0, temperature=1.0)
    metrics = learner.step()
    return metrics, {k: v.detach().cpu() for k, v in learner.model.state_dict().items()}


@pytest.mark.parametrize("policy", ["qwen3", "k3-debug"])
def test_learner_step_on_cuda_equals_the_cpu(policy):
    if policy == "qwen3":
        cpu = build_model("qwen3", TINY_MODEL, vocab_size=512, seed=0).eval()
    else:
        cpu = make_model(dtype=torch.float32, preset=policy)
    groups = groups_for(cpu, cpu.config.vocab_size)
    gpu = copy.deepcopy(cpu).to(CUDA)
    got, got_weights = step_once(gpu, groups)  # first: the MoE run creates the cuda group
    assert next(gpu.parameters()).device.type == CUDA.type
    want, want_weights = step_once(cpu, groups)
    assert math.isfinite(got["learner/loss"]) and got["learner/optimizer_steps"] == 1
    assert abs(got["learner/loss"] - want["learner/loss"]) < 1e-5
    assert (
        abs(got["learner/grad_norm"] - want["learner/grad_norm"]) < 1e-3 * want["learner/grad_norm"]
    )
    assert {k for k in got if k.startswith("moe/")} == {k for k in want if k.startswith("moe/")}
    for name, tensor in got_weights.items():  # AdamW's first step moves a weight by <= ~lr
        torch.testing.assert_close(tensor, want_weights[name], atol=2.5 * LR, rtol=0)


def device_pairs():
    pairs = [("cuda", "cpu"), ("cpu", "cuda")]
    two = pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs (one for the learner, one worker)"
    )
    return [*pairs, pytest.param("cuda", "cuda", marks=two)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("learner", "rollout"), device_pairs())
def test_two_step_run_on_cuda(tmp_path, learner, rollout):
    overrides = [
        *tiny_overrides(tmp_path),
        "rollout.num_workers=1",
        "eval.tasks=4",
        f"trainer.device={learner}",
        f"rollout.device={rollout}",
    ]
    proc, _ = run_cli([str(ROOT / "configs/quickstart.yaml"), *overrides], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"devices: learner {learner} (trainer.device: {learner})" in proc.stdout
    assert f"rollout workers {rollout} (rollout.device: {rollout})" in proc.stdout
    (run_dir,) = list(tmp_path.glob("e2e-*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["phase"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["learner/grad_norm"]) for r in train)
    assert train[-1]["learner/version"] == 2
    assert (run_dir / "final-model" / "model.safetensors").exists()
