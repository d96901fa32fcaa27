"""Weight push throughput: learner -> N rollout workers through a real local Ray, against a plain
in-process copy of the same bytes (the floor any transport is measured against), in one run.

    .venv/bin/python benchmarks/weight_push.py [--models quickstart 128 256] [--workers 2]

`quickstart` is the quickstart's policy (k3-tiny, its real tensors); a number is that many MiB of
float32 tensors of a few sizes, like a model's layers. Prints a markdown table per model: seconds
per push, GB/s delivered (bytes x workers / seconds) and the ratio to the in-process copy. Each
push is exactly what training does: the learner's export takes the checksum (xxh3 per tensor,
`policy.hf.checksum`), the buckets' checksums come from it, every worker hashes each bucket once
as it arrives, verifies the whole push and installs it whole through `import_verified` (torch
`copy_` into preallocated tensors, as into a model's parameters); afterwards every worker's
tensors are checked to hash to the learner's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.hf import checksum, import_verified
from rl.run.weights import Publisher, Receiver, connect_broadcast, push_weights


def fake_model(total_mb: int) -> dict[str, np.ndarray]:
    """float32 tensors of a few sizes, like a model's layers."""
    rng = np.random.default_rng(0)
    sizes = [4 << 20, 1 << 20, 256 << 10, 64 << 10]  # bytes
    weights, left, i = {}, total_mb << 20, 0
    while left > 0:
        nbytes = min(sizes[i % len(sizes)], left)
        weights[f"layer{i}.weight"] = rng.standard_normal(nbytes // 4, dtype=np.float32)
        left -= nbytes
        i += 1
    return weights


def model_weights(model: str) -> dict[str, np.ndarray]:
    if model != "quickstart":
        return fake_model(int(model))
    from policy.hf import build_model, export_weights

    return export_weights(build_model("agentrl_k3", {"preset": "k3-tiny"}, vocab_size=768))


class Learner:
    def __init__(self, model: str, bucket_mb: float):
        self.weights = model_weights(model)
        self.version = 0
        self.publisher = Publisher(self.export, bucket_mb=bucket_mb)

    def export(self):  # what rl/learner/learner.py's export does, less gathering the tensors
        self.version += 1
        return self.version, self.weights, None  # the publisher hashes while it stores

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


class StateDict:
    """What import_weights needs of a model: its tensors by name."""

    def __init__(self, weights: dict[str, np.ndarray]):
        self.tensors = {name: torch.from_numpy(np.zeros_like(a)) for name, a in weights.items()}

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return self.tensors


class Worker:
    def __init__(self, model: str):
        torch.set_num_threads(1)  # rollout.threads_per_worker
        self.model = StateDict(model_weights(model))
        self.receiver = Receiver(self.install)

    def install(self, version, weights, expected):  # = K3Policy/HFPolicy.load_weights
        import_verified(self.model, version, weights, expected)

    def receive_object_store(self, manifest, refs):
        return self.receiver.receive_object_store(manifest, refs)

    def fingerprint(self) -> int:
        return int(checksum({n: t.numpy() for n, t in self.model.state_dict().items()}))

    def join_broadcast(self, address, port, rank, world, timeout_s):
        self.receiver.join(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest):
        return self.receiver.receive_broadcast(manifest)


def in_process_copy(weights: dict[str, np.ndarray], repeats: int) -> float:
    targets = {n: np.empty_like(a) for n, a in weights.items()}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for name, array in weights.items():
            np.copyto(targets[name], array)
        best = min(best, time.perf_counter() - start)
    return best


def bench(model: str, args) -> list[tuple[str, float, float]]:
    weights = model_weights(model)
    nbytes = sum(a.nbytes for a in weights.values())
    copy_s = in_process_copy(weights, max(args.repeats, 5))
    rows = []
    for transport in ("object_store", "broadcast"):
        learner = ray.remote(Learner).remote(model, args.bucket_mb)
        workers = [ray.remote(Worker).remote(model) for _ in range(args.workers)]
        if transport == "broadcast":
            connect_broadcast(learner, workers, timeout_s=120)
        push_weights(learner, workers, timeout_s=600, transport=transport)  # warm-up
        seconds = []
        for _ in range(args.repeats):
            time.sleep(args.gap)  # training rolls out between pushes; the last push's objects go
            seconds.append(
                push_weights(learner, workers, timeout_s=600, transport=transport)["seconds"]
            )
        installed = ray.get([w.fingerprint.remote() for w in workers])
        assert installed == [checksum(weights)] * args.workers, "a worker installed other bytes"
        rows.append((f"{transport} -> {args.workers} workers", min(seconds), np.median(seconds)))
        for actor in [learner, *workers]:
            ray.kill(actor)
    copy_s = min(copy_s, in_process_copy(weights, max(args.repeats, 5)))  # again, after the pushes
    copy_rate = nbytes / copy_s / 1e9
    label = model if model == "quickstart" else f"{model} MiB"
    print(
        f"\n{label}: {nbytes / 2**20:.1f} MiB in {len(weights)} tensors, {args.bucket_mb:g} MiB "
        f"buckets, {args.workers} workers, {args.repeats} pushes {args.gap:g} s apart\n"
    )
    print(
        "| path | seconds (best / median) | GB/s delivered (best / median) "
        "| vs in-process copy (best / median) |\n|---|---|---|---|"
    )
    print(f"| in-process copy (the floor) | {copy_s:.4f} | {copy_rate:.2f} | 1.00x |")
    for name, best, median in rows:
        rates = [nbytes * args.workers / s / 1e9 for s in (best, median)]
        print(
            f"| {name} | {best:.4f} / {median:.4f} | {rates[0]:.2f} / {rates[1]:.2f} "
            f"| {rates[0] / copy_rate:.2f}x / {rates[1] / copy_rate:.2f}x |"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=["quickstart", "128", "256"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gap", type=float, default=0.5, help="seconds between pushes")
    args = p.parse_args()
    largest = max((int(m) for m in args.models if m != "quickstart"), default=16)
    here = str(Path(__file__).resolve().parent)
    ray.init(
        address="local",
        num_cpus=args.workers + 1,
        include_dashboard=False,
        object_store_memory=max(4 * largest, 512) << 20,
        logging_level="error",
        runtime_env={"env_vars": {"PYTHONPATH": f"{here}:{Path(here).parent}"}},
    )
    try:
        for model in args.models:
            bench(model, args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
