"""The only place that turns our plain classes into Ray actors.

Workers and the learner build their parts in their own process from the run config (so nothing
heavy is pickled), then expose a few methods. Weights travel through the object store as numpy
arrays: readers on the same node share one read-only copy.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import ray

from policy.sampling import SamplingParams
from rl.build import build_learner, build_worker
from rl.config import RunConfig
from rl.weights import Manifest, Publisher, Receiver, connect_broadcast
from rollout.worker import Task


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class WorkerHost:
    def __init__(self, cfg: RunConfig, model_dir: str, redis_url: str, run_id: str, index: int):
        _quiet()
        self.index = index
        self.worker = build_worker(cfg, Path(model_dir), redis_url, run_id, index)
        self.receiver = Receiver(self.worker.policy.load_weights)

    def collect(
        self, tasks: list[Task], group_size: int, sampling: SamplingParams, seed: int
    ) -> dict:
        self.worker.policy.reseed(seed)
        return self.worker.collect(tasks, group_size, sampling)

    def evaluate(
        self, seeds: list[int], samples: int, sampling: SamplingParams
    ) -> list[list[bool]]:
        self.worker.policy.reseed(seeds[0] if seeds else 0)
        return self.worker.evaluate(seeds, samples, sampling)

    def receive_object_store(self, manifest: Manifest, refs: list) -> int:
        return self.receiver.receive_object_store(manifest, refs)

    def join_broadcast(
        self, address: str, port: int, rank: int, world: int, timeout_s: float
    ) -> None:
        self.receiver.join(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest: Manifest) -> int:
        return self.receiver.receive_broadcast(manifest)

    def version(self) -> int:
        return self.worker.policy.version


class LearnerHost:
    def __init__(self, cfg: RunConfig, model_dir: str, redis_url: str, run_id: str):
        _quiet()
        self.learner = build_learner(cfg, Path(model_dir), redis_url, run_id)
        self.publisher = Publisher(self.learner.export, bucket_mb=cfg.weights.bucket_mb)

    def pid(self) -> int:
        return os.getpid()

    def step(self) -> dict[str, float]:
        # Fault injection for the resume tests: AGENTRL_FAULT_KILL_LEARNER_AT=<step> SIGKILLs this
        # process when that step begins (its rollouts are already in the stream).
        if os.environ.get("AGENTRL_FAULT_KILL_LEARNER_AT") == str(self.learner.version + 1):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.learner.step()

    def export(self) -> tuple:
        return self.learner.export()

    def publish(self) -> tuple:
        return self.publisher.publish()

    def open_broadcast(self) -> tuple[str, int]:
        return self.publisher.open_broadcast()

    def join_broadcast(self, address: str, port: int, world: int, timeout_s: float) -> None:
        self.publisher.join(address, port, world, timeout_s)

    def prepare_broadcast(self) -> Manifest:
        return self.publisher.prepare_broadcast()

    def broadcast(self) -> None:
        self.publisher.broadcast()

    def save_model(self, path: str) -> None:
        self.learner.model.save_pretrained(path)

    def save_checkpoint(self, path: str) -> str:
        self.learner.save(Path(path))
        return self.learner.last_acked

    def load_checkpoint(self, path: str, *, rng: bool = True, stream: bool = True) -> int:
        """Restore the learner; forget stream entries produced after the checkpoint."""
        self.learner.load(Path(path), rng=rng)
        return self.learner.source.skip_to_end(self.learner.last_acked) if stream else 0


def start_actors(cfg: RunConfig, model_dir: Path, redis_url: str, run_id: str):
    """One learner and `rollout.num_workers` workers, after checking the cluster can hold them."""
    need = cfg.trainer.cpus + cfg.rollout.num_workers * cfg.rollout.cpus_per_worker
    have = ray.cluster_resources().get("CPU", 0.0)
    if need > have:
        raise RuntimeError(
            f"the Ray cluster has {have:g} CPUs but the run needs {need:g} "
            f"(trainer.cpus={cfg.trainer.cpus:g} + rollout.num_workers={cfg.rollout.num_workers} x "
            f"rollout.cpus_per_worker={cfg.rollout.cpus_per_worker:g}); lower them or add nodes"
        )
    learner = ray.remote(num_cpus=cfg.trainer.cpus)(LearnerHost).options(name=f"{run_id}-learner")
    worker_cls = ray.remote(num_cpus=cfg.rollout.cpus_per_worker)(WorkerHost)
    workers = [
        worker_cls.options(name=f"{run_id}-worker-{i}").remote(
            cfg, str(model_dir), redis_url, run_id, i
        )
        for i in range(cfg.rollout.num_workers)
    ]
    learner = learner.remote(cfg, str(model_dir), redis_url, run_id)
    ray.get([w.version.remote() for w in workers])  # surface constructor errors now
    if cfg.weights.transport == "broadcast":
        connect_broadcast(learner, workers, timeout_s=cfg.weights.push_timeout_s)
    return learner, workers
