"""Learner ranks as Ray actors forming one torch.distributed group (FSDP2 over gloo)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from rl.config.runfile import load_config
from tests.rl.test_e2e import ROOT, run_cli, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def overrides(out: Path, world: int) -> list[str]:
    return [
        *tiny_overrides(out, steps=2),
        "sft.enabled=false",
        "eval.tasks=0",
        "trainer.entropy_coef=0.05",
        f"trainer.world_size={world}",
        "trainer.cpus=0.5",
        "trainer.micro_batch_size=4",
        "trainer.lr=1e-2",
        "trainer.shared_prefix=false",  # as on 2 ranks (tests/rl/test_reshard.py learner)
    ]


POLICIES = {
    "dense": [],  # the generic HF path: a tiny Qwen3 (tiny_overrides)
    "k3": [  # the Kimi-K3-style MoE (3 MoE layers of 8 experts)
        "policy.model_type=agentrl_k3",
        "policy.config={preset: k3-debug}",
    ],
}


@pytest.mark.parametrize("policy", POLICIES)
def test_two_learner_ranks_train_like_one(tmp_path, policy):
    """The whole run (Ray actors, weight pushes) on 1 and on 2 learner ranks (FSDP2; for K3
    also trainer.expert_parallel=2): float32, final weights within 1e-4 (seen: K3 2e-5)."""
    runs = {}
    for world in (1, 2):
        ep = world if policy == "k3" else 1  # K3: each MoE layer's experts split over the ranks
        args = [*overrides(tmp_path / str(world), world), *POLICIES[policy]]
        proc, _ = run_cli(
            [str(ROOT / "configs/quickstart.yaml"), *args, f"trainer.expert_parallel={ep}"]
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "returned a view tensor" not in proc.stderr  # FSDP2 (tests/rl/test_sharded_k3.py)
        (runs[world],) = (tmp_path / str(world)).glob("e2e-*")
    one, two = (load_file(str(runs[w] / "final-model" / "model.safetensors")) for w in (1, 2))
    assert one.keys() == two.keys()
    initial = load_file(str(runs[1] / "policy-init" / "model.safetensors"))
    assert any(not initial[k].equal(one[k]) for k in one)  # training really moved the weights
    diff = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert diff < 1e-4, f"2 ranks drifted from 1 rank by {diff}"
    losses = [
        [
            json.loads(x)["learner/loss"]
            for x in (runs[w] / "metrics.jsonl").read_text().splitlines()
        ]
        for w in (1, 2)
    ]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_unplaceable_learner_ranks_fail_fast_naming_resources(tmp_path):
    from rl.run.actors import start_learner

    cfg = load_config(
        ROOT / "configs/quickstart.yaml",
        ["trainer.world_size=2", "trainer.cpus=1", "trainer.placement_timeout_s=2"],
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=96 * 2**20)
    try:
        blocker = ray.remote(num_cpus=1.5)(type("Blocker", (), {"ping": lambda self: 1})).remote()
        ray.get(blocker.ping.remote())
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"could not place 2 learner ranks x \{CPU: 1\}.*0.5 free"
        ):
            start_learner(cfg, tmp_path, "redis://unused", "run")
        # nominal ~2 s (placement_timeout_s); without the timeout the placement waits forever
        assert time.monotonic() - start < 30
    finally:
        ray.shutdown()
