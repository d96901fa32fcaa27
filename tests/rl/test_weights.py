"""Weight push through a real local Ray, both transports: bucketed, verified on arrival (each
byte hashed once per side), installed whole, and a stuck or rejecting worker is named."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import ray

from policy.hf import (
    HFPolicy,
    VerifiedWeights,
    build_model,
    checksum,
    export_weights,
    import_verified,
    import_weights,
    verified,
)
from rl.run.board import WeightBoard
from rl.run.weights import (
    PIECE_BYTES,
    Publisher,
    Receiver,
    WeightPushRejected,
    WeightPushTimeout,
    begin_push,
    connect_broadcast,
    finish_push,
    join_bytes,
    make_manifest,
    pack_bucket,
    push_weights,
    split_bytes,
    unpack_bucket,
    unpack_pieces,
    verify_bucket,
)
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

    def __init__(self, corrupt: str = ""):
        self.model = build_model("qwen3", TINY_MODEL, vocab_size=300, seed=1)
        self.corrupt = corrupt
        self.publisher = Publisher(self.export, bucket_mb=0.02)  # several buckets

    def export(self):
        weights = export_weights(self.model)
        total = checksum(weights)
        if self.corrupt == "bucket":  # damaged after the checksums were taken, as in transit
            weights["lm_head.weight"] = weights["lm_head.weight"] + 1
        elif self.corrupt == "total":  # every bucket intact, the push's checksum wrong
            total = int(total) + 1
        return 7, weights, total

    def publish(self):
        return self.publisher.publish()

    def prepare_push(self):
        return self.publisher.prepare(), []

    def open_broadcast(self):
        return self.publisher.open_broadcast()

    def join_broadcast(self, address, port, world, timeout_s):
        self.publisher.join(address, port, world, timeout_s)

    def broadcast(self):
        self.publisher.broadcast()

    def sent(self):
        self.publisher.sent()

    def expected(self):
        return checksum(export_weights(self.model))

    def set_corrupt(self, corrupt: str):
        self.corrupt = corrupt


class WorkerStub:
    """The weight-receiving half of WorkerHost, over an HFPolicy. It takes a push only after
    `delay` seconds and, given a `gate` path, once that file exists (held at most 60 s)."""

    def __init__(self, delay: float = 0.0, gate: str | None = None):
        self.policy = HFPolicy(
            build_model("qwen3", TINY_MODEL, vocab_size=300, seed=2), pad_token_id=0
        )
        self.receiver = Receiver(self.policy.load_weights)
        self.delay, self.gate = delay, gate

    def hold(self):
        time.sleep(self.delay)
        deadline = time.monotonic() + 60
        while self.gate and not Path(self.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def receive_object_store(self, manifest, refs):
        self.hold()
        return self.receiver.receive_object_store(manifest, refs)

    def join_broadcast(self, address, port, rank, world, timeout_s):
        self.receiver.join(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest):
        self.hold()
        return self.receiver.receive_broadcast(manifest)

    def fingerprint(self):
        return self.policy.version, checksum(export_weights(self.policy.model))


def actors(n=2, corrupt="", transport="object_store"):
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


@pytest.mark.parametrize(
    ("transport", "corrupt", "cause"),
    [
        ("object_store", "bucket", r"weight bucket \d+ of version 7 is corrupt"),
        ("broadcast", "bucket", r"weight bucket \d+ of version 7 is corrupt"),
        ("object_store", "total", r"weights for version 7 are corrupt: checksum"),
        ("broadcast", "total", r"weights for version 7 are corrupt: checksum"),
    ],
)
def test_corrupt_pushes_are_rejected_by_name_and_nothing_is_installed(
    local_ray, transport, corrupt, cause
):
    learner, workers = actors(n=2, corrupt=corrupt, transport=transport)
    before = ray.get([w.fingerprint.remote() for w in workers])
    with pytest.raises(WeightPushRejected, match=rf"worker-0 .*{cause}.*; worker-1 .*{cause}"):
        push_weights(learner, workers, timeout_s=60, transport=transport)
    assert ray.get([w.fingerprint.remote() for w in workers]) == before  # old weights: no mix
    if transport == "broadcast":  # every bucket was drained: the group still works
        ray.get(learner.set_corrupt.remote(""))
        assert push_weights(learner, workers, timeout_s=60, transport=transport)["version"] == 7
        expected = ray.get(learner.expected.remote())
        assert ray.get([w.fingerprint.remote() for w in workers]) == [(7, expected)] * 2


def test_a_stuck_worker_times_out_by_name(local_ray):
    learner = ray.remote(LearnerStub).remote()
    workers = [ray.remote(WorkerStub).remote(), ray.remote(WorkerStub).remote(delay=120)]
    ray.get([w.fingerprint.remote() for w in workers])  # both constructed
    start = time.monotonic()
    with pytest.raises(WeightPushTimeout, match=r"by: worker-1$"):
        push_weights(learner, workers, timeout_s=3)
    # nominal ~3 s (timeout_s); far under the 120 s the stuck worker would make it wait
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_push_travels_while_the_driver_goes_on(local_ray, transport, tmp_path):
    """`begin_push` returns once the learner has exported (async mode starts the next step
    then), not when the workers have installed: it returns while a worker is held from taking
    the push (until the test opens its gate), and `finish_push` settles it with every worker at
    the version. The learner's broadcast is sent on a thread: its actor answers at once."""
    gate = tmp_path / "gate"
    learner = ray.remote(LearnerStub).remote()
    workers = [ray.remote(WorkerStub).remote(), ray.remote(WorkerStub).remote(gate=str(gate))]
    if transport == "broadcast":
        connect_broadcast(learner, workers, timeout_s=30)
    ray.get([w.fingerprint.remote() for w in workers])
    try:
        push = begin_push(learner, workers, timeout_s=60, transport=transport)
        held = [ref for ref, index in push.pending.items() if index == 1]
        assert ray.wait(held, timeout=0)[1] == held  # begun while worker-1 cannot have taken it
        # the learner is free while the push travels (answers in ms; were it busy with the push
        # it could not answer before the gate opens, below)
        ray.get(learner.expected.remote(), timeout=10)
    finally:
        gate.touch()
    result = finish_push(push)
    assert result["version"] == 7 and result["missed"] == 0
    assert ray.wait(held, timeout=0)[0] == held  # settled only once worker-1 took it
    expected = ray.get(learner.expected.remote())
    assert ray.get([w.fingerprint.remote() for w in workers]) == [(7, expected)] * 2


def test_a_push_missed_by_a_restarted_worker_is_forgiven_and_others_are_not(local_ray):
    """`restarted` names the workers that restarted meanwhile (they fetch the latest weights
    themselves): their failure is counted as missed; anyone else's is still an error, and with
    the broadcast transport a corrupt push is never forgiven to a member that did not restart."""
    learner, workers = actors(n=2, corrupt="bucket")
    push = begin_push(learner, workers, timeout_s=60, transport="object_store")
    assert finish_push(push, restarted=lambda: {0, 1})["missed"] == 2
    push = begin_push(learner, workers, timeout_s=60, transport="object_store")
    with pytest.raises(WeightPushRejected, match=r"failed on worker-1 "):
        finish_push(push, restarted=lambda: {0})
    learner, workers = actors(n=2, corrupt="bucket", transport="broadcast")
    push = begin_push(learner, workers, timeout_s=60, transport="broadcast")
    with pytest.raises(WeightPushRejected, match=r"failed on worker-1 .*corrupt"):
        finish_push(push, restarted=lambda: {0})


def test_the_weight_board_keeps_the_newest_post_only():
    board = WeightBoard()
    assert board.get() is None
    board.post(3, ["manifest-3", "refs-3"])
    board.post(2, ["manifest-2", "refs-2"])
    assert board.get() == (3, ["manifest-3", "refs-3"])  # a late, older post never wins


def test_checksums_are_per_tensor_digests_combined_and_taken_once(tiny_model, monkeypatch):
    """The push's checksum equals `checksum` of the weights whatever the buckets; bucket checksums
    come from the export's digests (no second pass on the learner); a worker's verified weights are
    not hashed again at install."""
    import policy.hf as hf

    weights = export_weights(tiny_model)
    total = checksum(weights)
    assert total == checksum(dict(reversed(weights.items())))  # order-independent
    calls = []
    real = hf.tensor_digest
    monkeypatch.setattr(hf, "tensor_digest", lambda n, a: calls.append(n) or real(n, a))
    import rl.run.weights

    monkeypatch.setattr(rl.run.weights, "tensor_digest", hf.tensor_digest)
    small = make_manifest(3, weights, 0.02, total)
    large = make_manifest(3, weights, 64, total)
    assert calls == []  # the export's digests made every bucket checksum
    assert len(small.buckets) > 3 and len(large.buckets) == 1
    assert small.checksum == large.checksum == total == make_manifest(3, weights, 0.02).checksum
    assert len(calls) == len(weights)  # without the export's digests: hashed here, once
    calls.clear()
    digests = {}
    for index, names in enumerate(small.buckets):
        bucket = {n: weights[n] for n in names}
        digests.update(zip(names, verify_bucket(small, index, bucket), strict=True))
    assert sorted(calls) == sorted(weights)  # each tensor hashed exactly once on arrival
    calls.clear()
    whole = verified(3, weights, digests, small.checksum)
    assert isinstance(whole, VerifiedWeights) and dict(whole) == weights
    import_verified(tiny_model, 3, whole, small.checksum)
    assert calls == []  # verified weights are installed without hashing them again
    import_verified(tiny_model, 3, weights, total)  # a plain dict is hashed
    assert len(calls) == len(weights)
    with pytest.raises(ValueError, match="corrupt"):
        verified(3, weights, digests, small.checksum + 1)
    bad = dict(weights, **{"lm_head.weight": weights["lm_head.weight"] + np.float32(1e-7)})
    with pytest.raises(ValueError, match="corrupt"):  # verified against another checksum: rehashed
        import_verified(tiny_model, 3, VerifiedWeights(bad, 5), small.checksum)
    index = next(i for i, names in enumerate(small.buckets) if "lm_head.weight" in names)
    with pytest.raises(ValueError, match=f"bucket {index} of version 3 is corrupt"):
        verify_bucket(small, index, {n: bad[n] for n in small.buckets[index]})


def test_broadcast_buckets_pack_to_aligned_bytes_and_back():
    weights = {
        "a.half": np.arange(7, dtype=np.float16),  # 14 bytes: the next tensor needs padding
        "b.long": np.arange(6, dtype=np.int64).reshape(2, 3),
        "c.scalar": np.array(2.5, dtype=np.float32),
        "d.empty": np.zeros((0, 4), dtype=np.float32),
        "e.strided": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # not contiguous
    }
    manifest = make_manifest(1, weights, bucket_mb=64)
    assert len(manifest.buckets) == 1
    flat = pack_bucket(manifest, 0, weights)
    received = flat.copy()
    bucket = unpack_bucket(manifest, 0, received)
    for array in bucket.values():  # views of the received bytes, each at a 64-byte offset
        assert array.base is not None and array.flags.aligned
        assert (array.ctypes.data - received.ctypes.data) % 64 == 0 or array.size == 0
    for name, array in weights.items():
        np.testing.assert_array_equal(bucket[name], array)
        assert bucket[name].dtype == array.dtype and bucket[name].shape == array.shape
    verify_bucket(manifest, 0, bucket)
    with pytest.raises(ValueError, match="corrupt"):
        unpack_bucket(manifest, 0, flat[:-1])


def test_object_store_pieces_rejoin_as_a_view_when_they_lie_end_to_end():
    weights = {"big": np.arange(300_000, dtype=np.float32), "small": np.arange(5, dtype=np.int64)}
    pieces = split_bytes(weights["big"])
    assert len(pieces) == 3 and all(p.size <= PIECE_BYTES for p in pieces)
    joined = join_bytes(pieces)  # as in one object-store object: end to end, no copy
    assert np.shares_memory(joined, weights["big"]) and not joined.flags.writeable
    scattered = [p.copy() for p in pieces]  # elsewhere: joined by a copy
    assert not any(np.shares_memory(join_bytes(scattered), p) for p in scattered)
    manifest = make_manifest(1, weights, bucket_mb=64)
    bucket = unpack_pieces(manifest, 0, {n: split_bytes(a) for n, a in weights.items()})
    for name, array in weights.items():
        np.testing.assert_array_equal(bucket[name], array)
    verify_bucket(manifest, 0, bucket)
    with pytest.raises(ValueError, match="bucket 0 of version 1 is corrupt"):
        unpack_pieces(manifest, 0, {"big": pieces[:2], "small": split_bytes(weights["small"])})


def test_verified_weights_are_adopted_without_a_copy_and_never_written_later(tiny_model, tokenizer):
    """A worker serves from the verified arrays themselves (no copy); a later install of plain
    arrays gives the model fresh memory instead of writing into the adopted, read-only arrays."""
    pushed = export_weights(build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=5))
    for array in pushed.values():
        array.flags.writeable = False  # as object-store arrays are
    total = checksum(pushed)
    import_verified(tiny_model, 1, verified(1, pushed, total.digests, total), int(total))
    addresses = {a.ctypes.data for a in pushed.values()}
    state = tiny_model.state_dict()
    assert all(t.data_ptr() in addresses for t in state.values())
    assert checksum(export_weights(tiny_model)) == total
    before = {n: a.copy() for n, a in pushed.items()}
    plain = export_weights(build_model("qwen3", TINY_MODEL, vocab_size=len(tokenizer), seed=6))
    import_weights(tiny_model, plain)
    assert checksum(export_weights(tiny_model)) == checksum(plain)
    for name, array in pushed.items():
        np.testing.assert_array_equal(array, before[name])
    assert not any(t.data_ptr() in addresses for t in tiny_model.state_dict().values())
