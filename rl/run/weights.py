"""Weight push: learner -> every rollout worker, bucketed, versioned, verified, with a deadline.

The learner exports full tensors once per push and splits them into buckets of about
`bucket_mb`. Two transports carry the buckets:

- `object_store`: each bucket is one Ray object of byte pieces (`split_bytes`), stored while the
  learner hashes the tensors on a thread; workers on a node map the same read-only memory,
  fetch bucket i+1 (a thread) while they hash bucket i, and install by adopting those verified
  arrays as their CPU tensors (no copy: `policy.hf.import_weights`).
- `broadcast`: a gloo process group (learner = rank 0, workers = 1..N; formed again after a
  worker restarts, rl/run/fleet.py) broadcasts each bucket as one flat byte tensor from a
  learner thread; the next bucket is on the wire while one is hashed.

Checksums are xxh3-64 (`policy.hf.checksum`): one digest per tensor, a bucket's checksum combines
its tensors' digests, the push's checksum combines all of them. Every byte is hashed once on each
side: the learner while it stores the buckets (or at export, when the export's checksum keeps its
digests), a worker as each bucket arrives. A worker verifies every bucket and the whole push
before it installs anything, then installs all buckets at once: it serves version N or N-1, never
a mix. A push not acknowledged by every worker within the timeout, or rejected by one, raises an
error naming the workers, unless the worker restarted meanwhile (it then fetches the newest
version from the run's WeightBoard itself, rl/run/board.py; async mode, `finish_push`).
"""

from __future__ import annotations

import datetime
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import ray
import torch

from policy.hf import as_bytes, bucketize, checksum, combine, tensor_digest, verified
from rl.run.launch import rendezvous

logger = logging.getLogger(__name__)


class WeightPushTimeout(TimeoutError):
    """Some workers did not install the new weights in time (their names are in the message)."""


class WeightPushRejected(RuntimeError):
    """Some workers refused the push (a corrupt bucket, a checksum mismatch) or died; their names
    and the causes are in the message. Nothing corrupt was installed anywhere."""


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
    """`total` is the checksum the learner took at export: with `policy.hf.checksum`'s digests
    the buckets' checksums come from them (no second pass over the bytes); otherwise, or when
    not given, the tensors are hashed here once."""
    digests = getattr(total, "digests", None)
    if not digests or digests.keys() != weights.keys():
        digests = checksum(weights).digests
    buckets = bucketize(weights, int(bucket_mb * 2**20))
    whole = combine(digests[n] for names in buckets for n in names)  # from the same digests
    return Manifest(
        version=version,
        buckets=buckets,
        bucket_checksums=[combine(digests[n] for n in names) for names in buckets],
        checksum=whole if total is None else int(total),
        specs={n: (tuple(a.shape), a.dtype.str) for n, a in weights.items()},
    )


def verify_bucket(manifest: Manifest, index: int, bucket: dict[str, np.ndarray]) -> list[int]:
    """Hash bucket `index` (each byte once) against the manifest; its tensors' digests."""
    names = manifest.buckets[index]
    if len(bucket) != len(names) or any(n not in bucket for n in names):
        raise ValueError(f"weight bucket {index} of version {manifest.version} is corrupt")
    digests = [tensor_digest(n, bucket[n]) for n in names]
    if combine(digests) != manifest.bucket_checksums[index]:
        raise ValueError(f"weight bucket {index} of version {manifest.version} is corrupt")
    return digests


# --- object-store transport -----------------------------------------------------------------
PIECE_BYTES = 512 << 10
"""Tensors travel through the object store in pieces of at most this many bytes. Ray copies
each buffer over 1 MiB with a pool of threads, which on a few cores is far slower than plain
memcpy of smaller buffers (a 64 MiB bucket: 23 ms as one array, 6.5 ms as 4 MiB arrays, 4.3 ms
in 512 KiB pieces, 2 cores; `benchmarks/weight_push.py`)."""


def split_bytes(array: np.ndarray) -> list[np.ndarray]:
    """An array's bytes as consecutive pieces of at most PIECE_BYTES (views, no copy)."""
    flat = as_bytes(array)
    return [flat[i : i + PIECE_BYTES] for i in range(0, flat.size, PIECE_BYTES)] or [flat]


def join_bytes(pieces: list[np.ndarray]) -> np.ndarray:
    """The pieces as one flat byte array: a read-only view when they lie end to end in memory
    (one object-store object lays its buffers out so), a copy otherwise. The view's base is the
    first piece, whose object-store buffer pins the whole object. Callers hash the result, so a
    wrong join could only fail verification, never install wrong bytes."""
    if len(pieces) == 1:
        return pieces[0]
    start = pieces[0].__array_interface__["data"][0]
    offset = 0
    for piece in pieces:
        if piece.dtype != np.uint8 or piece.ndim != 1:
            raise ValueError("weight pieces must be flat uint8 arrays")
        if piece.__array_interface__["data"][0] != start + offset:
            return np.concatenate(pieces)
        offset += piece.size
    return np.lib.stride_tricks.as_strided(
        pieces[0], shape=(offset,), strides=(1,), writeable=False
    )


def unpack_pieces(manifest: Manifest, index: int, bucket: dict) -> dict[str, np.ndarray]:
    """Bucket `index` as it came out of the object store (name -> byte pieces) as arrays."""
    arrays = {}
    for name, pieces in bucket.items():
        shape, dtype = manifest.specs.get(name, ((), "|u1"))
        flat = join_bytes(list(pieces))
        if flat.size != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ValueError(f"weight bucket {index} of version {manifest.version} is corrupt")
        arrays[name] = flat.view(np.dtype(dtype)).reshape(shape)
    return arrays


# --- broadcast transport --------------------------------------------------------------------
def open_group(address: str, port: int, rank: int, world: int, timeout_s: float):
    """A private gloo group (not the default one, which sharded training may own)."""
    store = torch.distributed.TCPStore(
        address, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout_s)
    )
    return torch.distributed.ProcessGroupGloo(
        store, rank, world, datetime.timedelta(seconds=timeout_s)
    )


ALIGN = 64
"""Byte alignment of every tensor inside a bucket's flat form."""


def bucket_layout(manifest: Manifest, index: int) -> tuple[list[tuple[str, int, int]], int]:
    """Where each tensor of bucket `index` lies in the bucket's flat bytes, as
    (name, offset, nbytes), and the flat size; offsets are `ALIGN`-aligned."""
    layout, offset = [], 0
    for name in manifest.buckets[index]:
        shape, dtype = manifest.specs[name]
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        layout.append((name, offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return layout, offset


def pack_bucket(manifest: Manifest, index: int, weights: dict[str, np.ndarray]) -> np.ndarray:
    """A bucket as one flat byte array (one copy; a view when it is one contiguous tensor)."""
    layout, size = bucket_layout(manifest, index)
    if len(layout) == 1:
        return as_bytes(weights[layout[0][0]])
    flat = np.empty(size, dtype=np.uint8)
    end = 0
    for name, offset, nbytes in layout:
        flat[end:offset] = 0  # alignment padding
        flat[offset : offset + nbytes] = as_bytes(weights[name])
        end = offset + nbytes
    flat[end:] = 0
    return flat


def unpack_bucket(manifest: Manifest, index: int, flat: np.ndarray) -> dict[str, np.ndarray]:
    """Views of a bucket's tensors in its flat bytes (no copy)."""
    layout, size = bucket_layout(manifest, index)
    if flat.dtype != np.uint8 or flat.ndim != 1 or flat.size != size:
        raise ValueError(f"weight bucket {index} of version {manifest.version} is corrupt")
    bucket = {}
    for name, offset, nbytes in layout:
        shape, dtype = manifest.specs[name]
        bucket[name] = flat[offset : offset + nbytes].view(np.dtype(dtype)).reshape(shape)
    return bucket


def send_buckets(group, manifest: Manifest, weights: dict[str, np.ndarray]) -> None:
    """Broadcast every bucket; the next one is packed while the previous is on the wire."""
    previous = None
    for index in range(len(manifest.buckets)):
        flat = torch.from_numpy(pack_bucket(manifest, index, weights))
        if previous is not None:
            previous[1].wait()
        previous = (flat, group.broadcast(flat, 0))
    if previous is not None:
        previous[1].wait()


def receive_buckets(group, manifest: Manifest) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Receive every bucket (bucket i+1 arrives while bucket i is hashed); all of them even after
    a corrupt one, so the sender and the group stay in step, then raise."""

    def start(index: int):
        buffer = torch.empty(bucket_layout(manifest, index)[1], dtype=torch.uint8)
        return buffer, group.broadcast(buffer, 0)

    weights: dict[str, np.ndarray] = {}
    digests: dict[str, int] = {}
    error: ValueError | None = None
    pending = start(0) if manifest.buckets else None
    for index, names in enumerate(manifest.buckets):
        buffer, work = pending
        work.wait()
        if index + 1 < len(manifest.buckets):
            pending = start(index + 1)
        if error is not None:
            continue
        bucket = unpack_bucket(manifest, index, buffer.numpy())
        try:
            digests.update(zip(names, verify_bucket(manifest, index, bucket), strict=True))
        except ValueError as err:
            error = err
        weights.update(bucket)
    if error is not None:
        raise error
    return weights, digests


# --- the two ends, as plain classes the actors delegate to ----------------------------------
class Publisher:
    """Learner side. `export()` returns (version, {name: array}, checksum). A broadcast is sent
    on a thread (`broadcast` returns at once, `sent` waits for it), so the learner's next step
    trains while its last weights travel: the exported arrays are copies, the second buffer."""

    def __init__(self, export, *, bucket_mb: float):
        self.export, self.bucket_mb = export, bucket_mb
        self.group = None
        self.pending: tuple[Manifest, dict] | None = None
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="weight-hash")
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="weight-send")
        self.sending = None

    def publish(self, *, keep: bool = False) -> tuple[Manifest, list]:
        """Object-store transport: one object per bucket (the returned refs keep them alive).
        Storing the buckets and hashing the tensors overlap (both release the GIL): each byte
        is read once for the checksum and once into the object store. `keep`: also hold the
        arrays for the next `broadcast`."""
        version, weights, total = self.export()
        hashing = None
        if getattr(total, "digests", None) is None:
            hashing = self.hasher.submit(checksum, weights)
        buckets = bucketize(weights, int(self.bucket_mb * 2**20))
        refs = [ray.put({n: split_bytes(weights[n]) for n in names}) for names in buckets]
        digests = total if hashing is None else hashing.result()
        manifest = make_manifest(version, weights, self.bucket_mb, digests)
        if total is not None and int(total) != int(digests):
            manifest = replace(manifest, checksum=int(total))  # the export's word is final
        if keep:
            self.pending = (manifest, weights)
        return manifest, refs

    def prepare(self) -> Manifest:
        """Broadcast transport: export and checksum now, send with `broadcast`."""
        version, weights, total = self.export()
        self.pending = (make_manifest(version, weights, self.bucket_mb, total), weights)
        return self.pending[0]

    def open_broadcast(self) -> tuple[str, int]:
        return rendezvous()

    def join(self, address: str, port: int, world: int, timeout_s: float) -> None:
        """A new group (the first, or after a worker restarted); a send still stuck on the old
        group is left to end there."""
        if self.sending is not None and not self.sending.done():  # stuck on the old group:
            self.sender.shutdown(wait=False)  # it ends at that group's timeout, on its own
            self.sender = ThreadPoolExecutor(1, thread_name_prefix="weight-send")
        elif self.sending is not None and self.sending.exception() is not None:
            error = self.sending.exception()
            logger.warning(f"the last broadcast before a new group failed: {error!r}")
        self.sending = None
        self.group = open_group(address, port, 0, world, timeout_s)

    def broadcast(self) -> None:
        """Start sending the prepared push on the sender thread and return."""
        self.sent()
        manifest, weights = self.pending
        self.pending = None
        self.sending = self.sender.submit(send_buckets, self.group, manifest, weights)

    def sent(self) -> None:
        """Wait for the last broadcast to leave; raise its error, if any."""
        sending, self.sending = self.sending, None
        if sending is not None:
            sending.result()


class Receiver:
    """Worker side. `install(version, weights, checksum)` gets `policy.hf.VerifiedWeights` (every
    bucket and the whole push already verified, each byte hashed once) and copies them in."""

    def __init__(self, install):
        self.install = install
        self.group = None

    def receive_object_store(self, manifest: Manifest, refs: list) -> int:
        if len(refs) != len(manifest.buckets):
            raise ValueError(f"{len(refs)} buckets for a manifest of {len(manifest.buckets)}")
        weights: dict[str, np.ndarray] = {}
        digests: dict[str, int] = {}
        fetcher = ThreadPoolExecutor(1, thread_name_prefix="weight-fetch")
        try:
            fetch = fetcher.submit(ray.get, refs[0]) if refs else None
            for index, names in enumerate(manifest.buckets):
                bucket = unpack_pieces(manifest, index, fetch.result())
                if index + 1 < len(refs):  # bucket i+1 is fetched while bucket i is hashed
                    fetch = fetcher.submit(ray.get, refs[index + 1])
                digests.update(zip(names, verify_bucket(manifest, index, bucket), strict=True))
                weights.update(bucket)  # read-only views of the object store: no copy
        finally:  # a corrupt bucket or a cancelled push does not wait for the next fetch
            fetcher.shutdown(wait=False, cancel_futures=True)
        self._install(manifest, weights, digests)
        return manifest.version

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        self.group = open_group(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest: Manifest) -> int:
        self._install(manifest, *receive_buckets(self.group, manifest))
        return manifest.version

    def _install(self, manifest: Manifest, weights: dict, digests: dict[str, int]) -> None:
        whole = verified(manifest.version, weights, digests, manifest.checksum)
        self.install(manifest.version, whole, manifest.checksum)


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
@dataclass
class PushInFlight:
    """A push the driver started and has not settled: the workers' acknowledgements to come."""

    manifest: Manifest
    transport: str
    learner: object
    pending: dict
    """worker call ref -> worker index"""
    workers: int
    started: float
    timeout_s: float
    refs: list = field(default_factory=list)
    """The object-store buckets (kept alive until the push is settled)."""


def begin_push(learner, workers, *, timeout_s: float, transport: str) -> PushInFlight:
    """Export the learner's weights now (the learner does it before any later call, so its next
    step may start at once) and send them to every worker; `finish_push` waits for them."""
    start = time.perf_counter()
    if transport == "broadcast":
        manifest, refs = ray.get(learner.prepare_push.remote(), timeout=timeout_s)
        learner.broadcast.remote()  # the learner sends on a thread; `sent` reports its end
        pending = {w.receive_broadcast.remote(manifest): i for i, w in enumerate(workers)}
    else:
        manifest, refs = ray.get(learner.publish.remote(), timeout=timeout_s)
        pending = {w.receive_object_store.remote(manifest, refs): i for i, w in enumerate(workers)}
    return PushInFlight(manifest, transport, learner, pending, len(workers), start, timeout_s, refs)


def finish_push(push: PushInFlight, *, restarted=lambda: set()) -> dict:
    """Wait for every worker to install the push (the deadline counts from its start); returns
    version, seconds (start to settled), waited (this call), bytes, GB/s, missed.
    `restarted()`: workers that restarted meanwhile: their failure is not an error (a restarted
    worker fetches the latest weights itself). With the broadcast transport a restart breaks
    the group's collective, so the other members' timeouts and transport errors are forgiven
    too (they get the next push, after the group is formed again); a corrupt push never is."""
    called = time.perf_counter()
    pending, version = push.pending, push.manifest.version
    ready, not_ready = _wait(push, restarted)
    versions, failed, corrupt = [], {}, set()
    for ref in sorted(ready, key=pending.get):  # in worker order
        try:
            versions.append(ray.get(ref))
        except ray.exceptions.RayError as err:  # a rejected push, or a dead worker
            cause = err.cause if isinstance(err, ray.exceptions.RayTaskError) else err
            failed[pending[ref]] = f"worker-{pending[ref]} ({cause!r})"
            if isinstance(cause, ValueError):  # a corrupt bucket or checksum
                corrupt.add(pending[ref])
    late = {pending[ref] for ref in not_ready}
    gone = restarted() if failed or late or push.transport == "broadcast" else set()
    missed = _missed(push, set(failed) | late, corrupt, gone)
    for ref in not_ready:
        ray.cancel(ref, force=False)
    _raise_failures(
        version,
        push.timeout_s,
        late - missed,
        [failed[i] for i in sorted(failed) if i not in missed],
    )
    if push.transport == "broadcast" and not gone:  # else the group is formed again
        _sent(push)
    if any(v < version for v in versions):  # a newer version (fetched by itself) is fine
        raise RuntimeError(f"workers report versions {versions} after pushing {version}")
    seconds = time.perf_counter() - push.started
    delivered = push.manifest.nbytes * (push.workers - len(missed))
    logger.debug(
        f"pushed version {version} ({push.manifest.nbytes / 2**20:.1f} MiB, "
        f"{len(push.manifest.buckets)} buckets, {push.transport}) to {push.workers} workers "
        f"in {seconds:.3f} s" + (f"; missed by {sorted(missed)}" if missed else "")
    )
    return {
        "version": version,
        "seconds": seconds,
        "waited": time.perf_counter() - called,
        "bytes": push.manifest.nbytes,
        "gb_per_s": delivered / seconds / 1e9,
        "missed": len(missed),
    }


def _missed(push: PushInFlight, failing: set[int], corrupt: set[int], gone: set[int]) -> set[int]:
    """The failing workers that are forgiven (see finish_push)."""
    if push.transport == "broadcast" and gone:
        return (failing - corrupt) | (failing & gone)
    return failing & gone


def _raise_failures(version: int, timeout_s: float, late: set[int], rejected: list[str]) -> None:
    if late:
        names = ", ".join(f"worker-{i}" for i in sorted(late))
        also = f"failed on {'; '.join(rejected)}; " if rejected else ""
        raise WeightPushTimeout(
            f"weight push of version {version} {also}not acknowledged within "
            f"{timeout_s:.0f} s by: {names}"
        )
    if rejected:
        why = "; ".join(rejected)
        raise WeightPushRejected(f"weight push of version {version} failed on {why}")


def _sent(push: PushInFlight) -> None:
    """The learner's send thread ended well (within what is left of the push's deadline)."""
    left = max(1.0, push.started + push.timeout_s - time.perf_counter())
    try:
        ray.get(push.learner.sent.remote(), timeout=left)
    except ray.exceptions.GetTimeoutError:
        raise WeightPushTimeout(
            f"weight push of version {push.manifest.version}: the learner's broadcast did not "
            f"end within {push.timeout_s:.0f} s"
        ) from None


def _wait(push: PushInFlight, restarted) -> tuple[list, list]:
    """The workers' answers until all came or the deadline passed; with the broadcast
    transport also until a worker restarted (its group's collective cannot end well, and the
    members still in it would only time out)."""
    refs, deadline = list(push.pending), push.started + push.timeout_s
    while True:
        left = max(0.0, deadline - time.perf_counter())
        slice_s = left if push.transport != "broadcast" else min(left, 1.0)
        ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=slice_s)
        if not not_ready or left <= slice_s or restarted():
            return ready, not_ready


def push_weights(learner, workers, *, timeout_s: float, transport: str = "object_store") -> dict:
    """Publish the learner's weights to every worker and wait for them all (sync mode, resume);
    returns version, seconds, bytes, GB/s."""
    push = begin_push(learner, workers, timeout_s=timeout_s, transport=transport)
    return finish_push(push)
