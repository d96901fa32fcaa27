"""Weight push through a real local Ray, both transports: bucketed, verified on arrival,
installed whole, and a stuck worker is named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import ray

from policy.hf import HFPolicy, build_model, checksum, export_weights
from rl.weights import Publisher, Receiver, WeightPushTimeout, connect_broadcast, push_weights
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


class LearnerStub:
    """The weight-publishing half of LearnerHost, over a tiny model."""

    def __init__(self, corrupt: bool = False):
        self.model = build_model("qwen3", TINY_MODEL, vocab_size=300, seed=1)
        self.corrupt = corrupt
        self.publisher = Publisher(self.export, bucket_mb=0.02)  # several buckets

    def export(self):
        weights = export_weights(self.model)
        total = checksum(weights)
        if self.corrupt:  # damaged after the checksums were taken, as in transit
            weights["lm_head.weight"] = weights["lm_head.weight"] + 1
        return 7, weights, total

    def publish(self):
        return self.publisher.publish()

    def open_broadcast(self):
        return self.publisher.open_broadcast()

    def join_broadcast(self, address, port, world, timeout_s):
        self.publisher.join(address, port, world, timeout_s)

    def prepare_broadcast(self):
        return self.publisher.prepare_broadcast()

    def broadcast(self):
        self.publisher.broadcast()

    def expected(self):
        return checksum(export_weights(self.model))


class WorkerStub:
    """The weight-receiving half of WorkerHost, over an HFPolicy."""

    def __init__(self, delay: float = 0.0):
        self.policy = HFPolicy(
            build_model("qwen3", TINY_MODEL, vocab_size=300, seed=2), pad_token_id=0
        )
        self.receiver = Receiver(self.policy.load_weights)
        self.delay = delay

    def receive_object_store(self, manifest, refs):
        time.sleep(self.delay)
        return self.receiver.receive_object_store(manifest, refs)

    def join_broadcast(self, address, port, rank, world, timeout_s):
        self.receiver.join(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest):
        return self.receiver.receive_broadcast(manifest)

    def fingerprint(self):
        return self.policy.version, checksum(export_weights(self.policy.model))


def actors(n=2, corrupt=False, transport="object_store"):
    learner = ray.remote(LearnerStub).remote(corrupt=corrupt)
    workers = [ray.remote(WorkerStub).remote() for _ in range(n)]
    if transport == "broadcast":
        connect_broadcast(learner, workers, timeout_s=30)
    return learner, workers


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_push_installs_identical_weights_everywhere(local_ray, transport):
    learner, workers = actors(transport=transport)
    result = push_weights(learner, workers, timeout_s=60, transport=transport)
    assert result["version"] == 7 and result["seconds"] > 0 and result["gb_per_s"] > 0
    expected = ray.get(learner.expected.remote())
    assert ray.get([w.fingerprint.remote() for w in workers]) == [(7, expected)] * 2


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_corrupt_buckets_are_rejected_and_nothing_is_installed(local_ray, transport):
    learner, workers = actors(n=1, corrupt=True, transport=transport)
    before = ray.get(workers[0].fingerprint.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="corrupt"):
        push_weights(learner, workers, timeout_s=60, transport=transport)
    assert ray.get(workers[0].fingerprint.remote()) == before  # version 0, old weights: no mix


def test_a_stuck_worker_times_out_by_name(local_ray):
    learner = ray.remote(LearnerStub).remote()
    workers = [ray.remote(WorkerStub).remote(), ray.remote(WorkerStub).remote(delay=30)]
    ray.get([w.fingerprint.remote() for w in workers])  # both constructed
    start = time.monotonic()
    with pytest.raises(WeightPushTimeout, match=r"by: worker-1$"):
        push_weights(learner, workers, timeout_s=3)
    assert time.monotonic() - start < 15
