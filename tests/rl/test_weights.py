"""Weight push through a real local Ray: verified on arrival, and a stuck worker is named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from policy.hf import HFPolicy, build_model, checksum, export_weights
from rl.weights import WeightPushTimeout, push_weights
from tests.conftest import TINY_MODEL

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def local_ray():
    here = Path(__file__).resolve()
    path = f"{here.parent}:{here.parents[2]}"  # so Ray workers can import this module's classes
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 2**20,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


class Exporter:
    def __init__(self, corrupt: bool = False):
        self.model = build_model("qwen3", TINY_MODEL, vocab_size=300, seed=1)
        self.corrupt = corrupt

    def export(self):
        weights = export_weights(self.model)
        return 7, weights, checksum(weights) + (1 if self.corrupt else 0)


class PolicyHost:
    def __init__(self, delay: float = 0.0):
        self.policy = HFPolicy(
            build_model("qwen3", TINY_MODEL, vocab_size=300, seed=2), pad_token_id=0
        )
        self.delay = delay

    def load_weights(self, package):
        time.sleep(self.delay)
        version, weights, expected = package
        self.policy.load_weights(version, weights, expected)
        return version

    def fingerprint(self):
        return self.policy.version, checksum(export_weights(self.policy.model))


def test_push_installs_identical_weights_everywhere(local_ray):
    learner = ray.remote(Exporter).remote()
    workers = [ray.remote(PolicyHost).remote() for _ in range(2)]
    version, seconds = push_weights(learner, workers, timeout_s=60)
    assert version == 7 and seconds > 0
    expected = ray.get(learner.export.remote())[2]
    assert ray.get([w.fingerprint.remote() for w in workers]) == [(7, expected)] * 2


def test_corrupt_weights_are_rejected(local_ray):
    learner = ray.remote(Exporter).remote(corrupt=True)
    worker = ray.remote(PolicyHost).remote()
    with pytest.raises(ray.exceptions.RayTaskError, match="corrupt"):
        push_weights(learner, [worker], timeout_s=60)
    assert ray.get(worker.fingerprint.remote())[0] == 0


def test_a_stuck_worker_times_out_by_name(local_ray):
    learner = ray.remote(Exporter).remote()
    workers = [ray.remote(PolicyHost).remote(), ray.remote(PolicyHost).remote(delay=30)]
    ray.get([w.fingerprint.remote() for w in workers])  # both constructed
    start = time.monotonic()
    with pytest.raises(WeightPushTimeout, match=r"by: worker-1$"):
        push_weights(learner, workers, timeout_s=3)
    assert time.monotonic() - start < 15
