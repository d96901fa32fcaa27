"""Weight push throughput: learner -> N rollout workers through Ray, against a plain in-process
copy of the same bytes (the floor any transport is measured against).

    .venv/bin/python benchmarks/weight_push.py [--mb 256] [--workers 2] [--repeats 3]

Prints a markdown table: seconds per push, GB/s delivered (bytes x workers / seconds) and the
ratio to the in-process copy. Each push is verified (per-bucket and whole-push CRC32) and installed
whole, exactly as in training.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.hf import checksum
from rl.weights import Publisher, Receiver, connect_broadcast, push_weights


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


class Learner:
    def __init__(self, total_mb: int, bucket_mb: float):
        self.weights = fake_model(total_mb)
        self.total = checksum(self.weights)
        self.version = 0
        self.publisher = Publisher(self.export, bucket_mb=bucket_mb)

    def export(self):
        self.version += 1
        return self.version, self.weights, self.total

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


class Worker:
    def __init__(self):
        self.installed: dict[str, np.ndarray] = {}
        self.receiver = Receiver(self.install)

    def install(self, version, weights, expected):
        if checksum(weights) != expected:
            raise ValueError("corrupt push")
        for name, array in weights.items():  # what import_weights does: copy into the model
            target = self.installed.get(name)
            if target is None:
                self.installed[name] = np.array(array)
            else:
                np.copyto(target, array)

    def receive_object_store(self, manifest, refs):
        return self.receiver.receive_object_store(manifest, refs)

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    here = str(Path(__file__).resolve().parent)
    ray.init(
        address="local",
        num_cpus=args.workers + 1,
        include_dashboard=False,
        object_store_memory=max(4 * args.mb, 512) << 20,
        logging_level="error",
        runtime_env={"env_vars": {"PYTHONPATH": f"{here}:{Path(here).parent}"}},
    )
    try:
        copy_s = in_process_copy(fake_model(args.mb), args.repeats)
        nbytes = args.mb << 20
        rows = [("in-process copy (1x, the floor)", copy_s, nbytes / copy_s / 1e9)]
        for transport in ("object_store", "broadcast"):
            learner = ray.remote(Learner).remote(args.mb, args.bucket_mb)
            workers = [ray.remote(Worker).remote() for _ in range(args.workers)]
            if transport == "broadcast":
                connect_broadcast(learner, workers, timeout_s=120)
            push_weights(learner, workers, timeout_s=600, transport=transport)  # warm-up
            best = min(
                push_weights(learner, workers, timeout_s=600, transport=transport)["seconds"]
                for _ in range(args.repeats)
            )
            rows.append(
                (f"{transport} -> {args.workers} workers", best, nbytes * args.workers / best / 1e9)
            )
        print(
            f"\nweight push of {args.mb} MiB float32 ({args.bucket_mb:g} MiB buckets), "
            f"best of {args.repeats}\n"
        )
        print("| path | seconds | GB/s delivered | vs in-process copy |\n|---|---|---|---|")
        for name, seconds, rate in rows:
            print(f"| {name} | {seconds:.3f} | {rate:.2f} | {rate / rows[0][2]:.2f}x |")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
