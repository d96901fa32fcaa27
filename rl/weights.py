"""Weight push: learner -> every rollout worker, bucketed, versioned, verified, with a deadline.

The learner exports full tensors once per push and splits them into buckets of about
`bucket_mb`. Two transports carry the buckets:

- `object_store`: each bucket is one Ray object of numpy arrays; workers on a node map the same
  read-only memory, fetching one bucket at a time.
- `broadcast`: a gloo process group (learner = rank 0, workers = 1..N, set up once) broadcasts
  each bucket as one flat byte tensor.

Either way a worker verifies every bucket's CRC32 and the whole push's checksum before it
installs anything, and installs all buckets at once: it serves version N or N-1, never a mix.
A push not acknowledged by every worker within the timeout raises an error naming the workers.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from policy.hf import bucketize, checksum


class WeightPushTimeout(TimeoutError):
    """Some workers did not install the new weights in time (their names are in the message)."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a worker needs to receive and verify one push."""

    version: int
    buckets: list[list[str]]
    bucket_checksums: list[int]
    checksum: int
    specs: dict[str, tuple[tuple[int, ...], str]]
    """name -> (shape, numpy dtype string), for rebuilding arrays from broadcast bytes."""

    @property
    def nbytes(self) -> int:
        return sum(
            int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.specs.values()
        )


def make_manifest(
    version: int, weights: dict[str, np.ndarray], bucket_mb: float, total: int | None = None
) -> Manifest:
    """`total` is the checksum the learner took at export (recomputed when not given)."""
    buckets = bucketize(weights, int(bucket_mb * 2**20))
    return Manifest(
        version=version,
        buckets=buckets,
        bucket_checksums=[checksum({n: weights[n] for n in names}) for names in buckets],
        checksum=checksum(weights) if total is None else total,
        specs={n: (tuple(a.shape), a.dtype.str) for n, a in weights.items()},
    )


def verify_bucket(manifest: Manifest, index: int, bucket: dict[str, np.ndarray]) -> None:
    if (
        sorted(bucket) != sorted(manifest.buckets[index])
        or checksum(bucket) != manifest.bucket_checksums[index]
    ):
        raise ValueError(f"weight bucket {index} of version {manifest.version} is corrupt")


# --- broadcast transport --------------------------------------------------------------------
def open_group(address: str, port: int, rank: int, world: int, timeout_s: float):
    """A private gloo group (not the default one, which sharded training may own)."""
    store = torch.distributed.TCPStore(
        address, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return torch.distributed.ProcessGroupGloo(
        store, rank, world, datetime.timedelta(seconds=timeout_s)
    )


def send_buckets(group, manifest: Manifest, weights: dict[str, np.ndarray]) -> None:
    for names in manifest.buckets:
        flat = np.concatenate([weights[n].reshape(-1).view(np.uint8) for n in names])
        group.broadcast(torch.from_numpy(flat), 0).wait()


def receive_buckets(group, manifest: Manifest) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for index, names in enumerate(manifest.buckets):
        sizes = [
            int(np.prod(manifest.specs[n][0])) * np.dtype(manifest.specs[n][1]).itemsize
            for n in names
        ]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast(buffer, 0).wait()
        raw, offset, bucket = buffer.numpy(), 0, {}
        for name, size in zip(names, sizes, strict=True):
            shape, dtype = manifest.specs[name]
            bucket[name] = raw[offset : offset + size].view(np.dtype(dtype)).reshape(shape)
            offset += size
        verify_bucket(manifest, index, bucket)
        weights.update(bucket)
    return weights


# --- the two ends, as plain classes the actors delegate to ----------------------------------
class Publisher:
    """Learner side. `export()` returns (version, {name: array}, checksum)."""

    def __init__(self, export, *, bucket_mb: float):
        self.export, self.bucket_mb = export, bucket_mb
        self.group = None
        self.pending: tuple[Manifest, dict] | None = None

    def publish(self) -> tuple[Manifest, list]:
        """Object-store transport: one object per bucket (the returned refs keep them alive)."""
        version, weights, total = self.export()
        manifest = make_manifest(version, weights, self.bucket_mb, total)
        return manifest, [ray.put({n: weights[n] for n in names}) for names in manifest.buckets]

    def open_broadcast(self) -> tuple[str, int]:
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, address: str, port: int, world: int, timeout_s: float) -> None:
        self.group = open_group(address, port, 0, world, timeout_s)

    def prepare_broadcast(self) -> Manifest:
        version, weights, total = self.export()
        self.pending = (make_manifest(version, weights, self.bucket_mb, total), weights)
        return self.pending[0]

    def broadcast(self) -> None:
        manifest, weights = self.pending
        self.pending = None
        send_buckets(self.group, manifest, weights)


class Receiver:
    """Worker side. `install(version, weights, checksum)` verifies the push, then swaps it in."""

    def __init__(self, install):
        self.install = install
        self.group = None

    def receive_object_store(self, manifest: Manifest, refs: list) -> int:
        weights = {}
        for index, ref in enumerate(refs):  # one bucket in memory at a time while fetching
            bucket = ray.get(ref)
            verify_bucket(manifest, index, bucket)
            weights.update(bucket)
        self.install(manifest.version, weights, manifest.checksum)
        return manifest.version

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        self.group = open_group(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest: Manifest) -> int:
        self.install(manifest.version, receive_buckets(self.group, manifest), manifest.checksum)
        return manifest.version


def connect_broadcast(learner, workers, *, timeout_s: float) -> None:
    """Form the gloo group of the broadcast transport: learner rank 0, workers 1..N."""
    world = len(workers) + 1
    address, port = ray.get(learner.open_broadcast.remote())
    joins = [learner.join_broadcast.remote(address, port, world, timeout_s)]
    joins += [
        w.join_broadcast.remote(address, port, i + 1, world, timeout_s)
        for i, w in enumerate(workers)
    ]
    ray.get(joins, timeout=timeout_s + 10)


# --- driver side ----------------------------------------------------------------------------
def push_weights(learner, workers, *, timeout_s: float, transport: str = "object_store") -> dict:
    """Publish the learner's weights to every worker; returns version, seconds, bytes, GB/s."""
    start = time.perf_counter()
    if transport == "broadcast":
        manifest = ray.get(learner.prepare_broadcast.remote())
        sender = learner.broadcast.remote()
        pending = {w.receive_broadcast.remote(manifest): i for i, w in enumerate(workers)}
    else:
        manifest, refs = ray.get(learner.publish.remote())
        sender = None
        pending = {w.receive_object_store.remote(manifest, refs): i for i, w in enumerate(workers)}
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if not_ready:
        names = ", ".join(f"worker-{pending[ref]}" for ref in not_ready)
        for ref in not_ready:
            ray.cancel(ref, force=False)
        raise WeightPushTimeout(
            f"weight push not acknowledged within {timeout_s:.0f} s by: {names}"
        )
    versions = ray.get(ready)  # raises here if a worker rejected the weights
    if sender is not None:
        ray.get(sender)
    if set(versions) != {manifest.version}:
        raise RuntimeError(f"workers report versions {versions} after pushing {manifest.version}")
    seconds = time.perf_counter() - start
    delivered = manifest.nbytes * len(workers)
    return {
        "version": manifest.version,
        "seconds": seconds,
        "bytes": manifest.nbytes,
        "gb_per_s": delivered / seconds / 1e9,
    }
