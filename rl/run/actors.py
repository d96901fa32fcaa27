"""The only place that turns our plain classes into Ray actors.

Workers and the learner build their parts in their own process from the run config (so nothing
heavy is pickled), then expose a few methods. Weights travel through the object store as numpy
arrays: readers on the same node share one read-only copy.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from transformers import AutoModelForCausalLM

from policy.hf import import_weights
from policy.sampling import SamplingParams
from rl import faults
from rl.config.resources import ray_options
from rl.config.runfile import RunConfig
from rl.learner.distributed import Shard, init_group
from rl.observe.console import configure_from_env
from rl.run.build import build_learner, build_worker
from rl.run.cpu_priority import idle_supported, idle_thread, wants_idle
from rl.run.devices import torch_device, with_devices
from rl.run.fleet import fetch_from_board, find_board, post_to_board, start_board
from rl.run.launch import connect, rendezvous
from rl.run.placement import PlacementError, check_cluster, demands, unplaced
from rl.run.weights import Manifest, Publisher, Receiver, connect_broadcast
from rollout.keys import RunKeys
from rollout.worker import Task

logger = logging.getLogger(__name__)


def _quiet() -> None:
    """An actor's logging: transformers quiet, ours at the level the CLI chose
    (rl/observe/console.py)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    configure_from_env()


class WorkerHost:
    """A rollout worker. In async mode `serve` runs for the whole run in one of the actor's
    threads while pushes arrive on another: a push is then staged and installed by the serve
    loop between two decode steps (never under a running forward)."""

    def __init__(self, cfg: RunConfig, model_dir: str, redis_url: str, run_id: str, index: int):
        _quiet()
        self.index, self.cfg, self.redis_url, self.run_id = index, cfg, redis_url, run_id
        self.worker = build_worker(cfg, Path(model_dir), redis_url, run_id, index)
        self.receiver = Receiver(self._install)
        self.lock = threading.Lock()
        self.staged: tuple | None = None
        self.serving = False
        self.serve_ended = threading.Event()  # set while no serve loop runs (or is winding down)
        self.serve_ended.set()
        self.stop_event = threading.Event()
        self.rollouts = None
        self.starts = 1  # incarnations of this worker (Ray restarts it after a crash)
        self.caught_up = 0  # versions fetched from the weight board by this incarnation
        if redis_url is not None:
            self.starts = int(connect(redis_url).incr(RunKeys(run_id).worker_starts(index)))

    def _install(self, version: int, weights, expected) -> None:
        with self.lock:  # a push and a fetch from the board may race: the newer one stays
            staged = self.staged[0] if self.staged is not None else -1
            if version <= max(staged, self.worker.policy.version):
                return
            if self.serving:  # the serve loop installs it between two decode steps
                self.staged = (version, weights, expected)
                return
            self.worker.policy.load_weights(version, weights, expected)

    def _install_staged(self) -> None:
        with self.lock:  # held while loading: a push meanwhile compares with the new version
            staged, self.staged = self.staged, None
            if staged is not None:
                self.worker.session().load_weights(*staged)

    def serve(self, params: SamplingParams) -> None:
        """Async mode: generate until `stop_serving` (rl/run/serving.py builds the loop), at
        idle CPU priority where `rollout.cpu_priority` says so (rl/run/cpu_priority.py)."""
        from rl.run.serving import serve_worker

        self.catch_up()
        with self.lock:
            self.serving = True
        self.serve_ended.clear()
        self.stop_event.clear()
        r = self.cfg.rollout
        idle = wants_idle(r.cpu_priority, self.cfg.trainer.mode, r.device)
        try:
            with idle_thread(idle):
                serve_worker(self, params)
        finally:
            with self.lock:
                self.serving = False
            try:
                self._install_staged()
            finally:  # an install that raises must not leave an evaluation waiting
                self.serve_ended.set()

    def _after_serving(self, limit_s: float = 600.0) -> None:
        """Evaluations and sync collections use the serve loop's decode session: wait until an
        async serve loop has ended (the driver waits 60 s for it after the last step, then goes
        on: a decode step at long context can take longer). Raises after `limit_s`."""
        if self.serve_ended.wait(timeout=min(5.0, limit_s)):
            return
        logger.info(f"worker-{self.index}: waiting for its serve loop to stop")
        if not self.serve_ended.wait(timeout=max(0.0, limit_s - 5.0)):
            raise RuntimeError(
                f"worker-{self.index}: its serve loop did not stop within {limit_s:g} s"
            )

    def stop_serving(self) -> None:
        self.stop_event.set()

    def drain(self) -> dict:
        """Counters of the trajectories finished since the last call (async mode). A restarted
        worker reports its restart even before its serve loop is rebuilt."""
        from rollout.worker import summarize

        with self.lock:
            caught_up, self.caught_up = self.caught_up, 0
        restarts = {"restarts": float(self.starts - 1), "caught_up": float(caught_up)}
        if self.rollouts is None:
            return restarts
        trajs, counters = self.rollouts.drain()
        stats = summarize(trajs, seconds=0.0) if trajs else {}
        return {**stats, **counters, **restarts}

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address) of the node this worker runs on."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def set_stage(self, cfg: RunConfig) -> None:
        """A curriculum stage begins: its limits and env settings (rl/run/curriculum.py)."""
        from rl.run.build import make_env
        from rollout.episode import EpisodeLimits

        self.cfg = cfg
        limits = EpisodeLimits(max_turns=cfg.rollout.max_turns, max_seq_len=cfg.rollout.max_seq_len)
        self.worker.reconfigure(limits, lambda: make_env(cfg))

    def collect(
        self, tasks: list[Task], group_size: int, sampling: SamplingParams, seed: int
    ) -> dict:
        self._after_serving()
        self.worker.policy.reseed(seed)
        return self.worker.collect(tasks, group_size, sampling)

    def evaluate(
        self, seeds: list[int], samples: int, sampling: SamplingParams
    ) -> tuple[list[list[bool]], dict[str, int]]:
        self._after_serving()
        self.worker.policy.reseed(seeds[0] if seeds else 0)
        return self.worker.evaluate(seeds, samples, sampling)

    def receive_object_store(self, manifest: Manifest, refs: list) -> int:
        faults.kill_on_push(self.cfg.testing.faults, self.index, self.starts, manifest.version)
        if manifest.version <= self.newest():  # it fetched as new a version by itself
            return self.newest()
        return self.receiver.receive_object_store(manifest, refs)

    def join_broadcast(
        self, address: str, port: int, rank: int, world: int, timeout_s: float
    ) -> None:
        self.receiver.join(address, port, rank, world, timeout_s)

    def receive_broadcast(self, manifest: Manifest) -> int:
        faults.kill_on_push(self.cfg.testing.faults, self.index, self.starts, manifest.version)
        if self.receiver.group is None:  # a restart, not in the group yet: the board has it
            self.catch_up()
            return self.newest()
        return self.receiver.receive_broadcast(manifest)

    def catch_up(self) -> int:
        """Fetch the latest published weights from the run's board (rl/run/board.py
        WeightBoard) when they are newer than ours: a started or restarted worker does not wait
        for the next push. Returns the version now held."""
        board = find_board(self.run_id)
        if board is None:
            if self.cfg.trainer.mode == "async":
                logger.warning(f"worker-{self.index}: no weight board; waiting for a push")
            return self.newest()
        latest = fetch_from_board(board)
        if latest is not None and latest[0].version > self.newest():
            self.receiver.receive_object_store(*latest)
            with self.lock:
                self.caught_up += 1
            logger.warning(f"worker-{self.index} fetched version {latest[0].version} by itself")
        return self.newest()

    def newest(self) -> int:
        """The newest version installed or staged."""
        with self.lock:
            staged = self.staged[0] if self.staged is not None else -1
        return max(staged, self.worker.policy.version)

    def version(self) -> int:
        return self.worker.policy.version


class LearnerHost:
    """One learner rank. Rank 0 is the handle the driver uses: for every collective call it
    first starts the same call on its followers (ranks 1..W-1), then does its own part."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str,
        redis_url: str,
        run_id: str,
        rank: int = 0,
        world: int = 1,
    ):
        _quiet()
        self.args = (cfg, Path(model_dir), redis_url, run_id)
        device = torch_device(cfg.trainer.device).type  # resolved on the driver (rl/run/devices.py)
        trainer = cfg.trainer
        self.shard = Shard(rank, world, trainer.expert_parallel, device, trainer.context_parallel)
        self.followers: list = []
        self.learner = None
        self.publisher = Publisher(self._export_all, bucket_mb=cfg.weights.bucket_mb)
        self._board = None  # async mode: rl/run/board.py WeightBoard (attach_board)
        if world == 1:
            self.setup()

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous()

    def setup(self, address: str | None = None, port: int | None = None) -> None:
        cfg = self.args[0]
        if self.shard.world > 1:
            init_group(
                address, port, self.shard.rank, self.shard.world, cfg.weights.push_timeout_s,
                self.shard.device,
            )  # fmt: skip
        self.learner = build_learner(*self.args, shard=self.shard)

    def attach(self, followers: list) -> None:
        self.followers = followers

    def _fan_out(self, name: str, *args, **kwargs) -> list:
        return [getattr(f, name).remote(*args, **kwargs) for f in self.followers]

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> tuple[str, str]:
        """(Ray node id, node address) of the learner's node (rank 0)."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def step(self) -> dict[str, float]:
        # Fault injection for the resume tests: testing.faults.kill_learner_at SIGKILLs this
        # process when that step begins (its rollouts are already in the stream).
        faults.kill_learner(self.args[0].testing.faults, self.learner.version + 1)
        pending = self._fan_out("step")
        metrics = self.learner.step()
        ray.get(pending)
        return metrics

    def step_with_records(self, limit: int) -> tuple[dict[str, float], dict, list[dict]]:
        """Async mode: the step's metrics, ledger entry and up to `limit` trajectory records in
        one answer (no second round trip before the next step)."""
        metrics = self.step()
        return metrics, self.ledger(), self.trajectories(limit) if limit else []

    def export(self) -> tuple:
        return self.learner.export()

    def _export_all(self) -> tuple:
        pending = self._fan_out("export")
        result = self.learner.export()
        ray.get(pending)
        return result

    def publish(self) -> tuple:
        manifest, refs = self.publisher.publish()
        self._post(manifest, refs)
        return manifest, refs

    def prepare_push(self) -> tuple[Manifest, list]:
        """Broadcast transport. With a weight board (async mode) the push is also stored in the
        object store, so that a restarted worker can fetch it before it rejoins the group."""
        if self.board() is None:
            return self.publisher.prepare(), []
        manifest, refs = self.publisher.publish(keep=True)
        self._post(manifest, refs)
        return manifest, refs

    def attach_board(self, board) -> None:
        """The run's weight board (async mode); this handle keeps the actor alive."""
        self._board = board

    def board(self):
        return self._board

    def _post(self, manifest: Manifest, refs: list) -> None:
        board = self.board()
        if board is not None:
            post_to_board(board, manifest, refs)

    def open_broadcast(self) -> tuple[str, int]:
        return self.publisher.open_broadcast()

    def join_broadcast(self, address: str, port: int, world: int, timeout_s: float) -> None:
        self.publisher.join(address, port, world, timeout_s)

    def broadcast(self) -> None:
        self.publisher.broadcast()

    def sent(self) -> None:
        self.publisher.sent()

    def save_model(self, path: str) -> None:
        """The full (unsharded) policy as a transformers directory."""
        if self.shard.world == 1:
            self.learner.model.save_pretrained(path)
            return
        _, weights, _ = self._export_all()
        model = AutoModelForCausalLM.from_config(self.learner.model.config)
        import_weights(model, weights)
        model.save_pretrained(path)

    def save_checkpoint(self, path: str) -> str:
        pending = self._fan_out("save_checkpoint", path)
        self.learner.save(Path(path))
        faults.disk_full(
            self.args[0].testing.faults, Path(path), self.learner.version, self.shard.rank
        )
        ray.get(pending)
        return self.learner.last_acked

    def load_checkpoint(
        self, path: str, *, rng: bool = True, stream: bool = True, rewind: bool = False
    ) -> int:
        """Restore every rank. Sync mode forgets stream entries produced after the checkpoint
        (the same steps regenerate them); async mode (`rewind`) delivers them all again."""
        pending = self._fan_out("load_checkpoint", path, rng=rng, stream=False)
        self.learner.load(Path(path), rng=rng)
        ray.get(pending)
        if stream and self.shard.leader:
            source = self.learner.source
            if rewind:
                return source.rewind(self.learner.last_acked)
            return source.skip_to_end(self.learner.last_acked)
        return 0

    def trim(self, upto: str) -> int:
        """After a checkpoint is committed: delete the stream entries it has consumed."""
        return self.learner.source.trim(upto) if self.shard.leader else 0

    def ledger(self) -> dict:
        return self.learner.ledger

    def trajectories(self, limit: int) -> list[dict]:
        """Up to `limit` of the last step's trajectories as rl/observe/trajlog.py records."""
        from rl.observe.trajlog import records

        learner = self.learner
        return records(
            learner.last_groups, learner.ledger, limit=limit, advantages=learner.algo.advantages
        )

    def last_acked(self) -> str:
        return self.learner.last_acked


def resolved(cfg: RunConfig) -> RunConfig:
    """`cfg` with its devices resolved (and an explicit cuda checked) against the GPUs of the
    Ray cluster (rl/run/devices.py)."""
    return with_devices(cfg, int(ray.cluster_resources().get("GPU", 0)), "the Ray cluster")


def start_learner(cfg: RunConfig, model_dir: Path, redis_url: str, run_id: str):
    """Rank 0's handle; with world_size > 1 the ranks share one placement group and form one
    torch.distributed group before any model is built."""
    cfg = resolved(cfg)
    t = cfg.trainer
    request = t.ray_resources
    remote = ray.remote(**ray_options(request))(LearnerHost)
    args = (cfg, str(model_dir), redis_url, run_id)
    if t.world_size == 1:
        return remote.options(name=f"{run_id}-learner").remote(*args)
    pg = placement_group([request] * t.world_size, strategy="PACK")
    if not pg.wait(timeout_seconds=t.placement_timeout_s):
        remove_placement_group(pg)
        total, free = ray.cluster_resources(), ray.available_resources()
        learner = demands(cfg)[0]
        raise PlacementError(unplaced(learner, t.placement_timeout_s, total, free))
    ranks = [
        remote.options(
            name=f"{run_id}-learner-{r}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=r
            ),
        ).remote(*args, rank=r, world=t.world_size)
        for r in range(t.world_size)
    ]
    address, port = ray.get(ranks[0].rendezvous.remote())
    ray.get([r.setup.remote(address, port) for r in ranks])
    ray.get(ranks[0].attach.remote(ranks[1:]))
    return ranks[0]


def start_actors(cfg: RunConfig, model_dir: Path, redis_url: str, run_id: str):
    """One learner and `rollout.num_workers` workers, after checking the cluster can hold them
    (rl/run/placement.py; rl/run/train.py checks once before any work already), with its devices
    resolved against the cluster's GPUs if the caller has not (rl/run/devices.py)."""
    cfg = resolved(cfg)
    check_cluster(cfg)
    r = cfg.rollout
    # the learner first: workers sharing GPUs, spread over nodes, could otherwise take a slice
    # of every GPU and leave none whole for it
    learner = start_learner(cfg, model_dir, redis_url, run_id)
    retries = -1 if cfg.trainer.mode == "async" else 0  # `serve` resumes after a restart
    worker_cls = ray.remote(
        **ray_options(r.ray_resources),
        max_concurrency=4,  # pushes and counters arrive while `serve` runs
        max_restarts=r.max_restarts,
        max_task_retries=retries,
        scheduling_strategy="SPREAD" if r.spread else "DEFAULT",
    )(WorkerHost)
    workers = [
        worker_cls.options(name=f"{run_id}-worker-{i}").remote(
            cfg, str(model_dir), redis_url, run_id, i
        )
        for i in range(r.num_workers)
    ]
    ready = []
    if cfg.trainer.mode == "async":  # restarted workers fetch the latest weights from it
        board = start_board(run_id, ray.get(learner.node.remote())[0])
        ray.get(learner.attach_board.remote(board))  # its handle keeps the board alive
        ready.append(board.get.remote())  # its process starts now, not in the first step
    places = ray.get([w.node.remote() for w in workers])  # surfaces constructor errors now
    ray.get(ready)
    logger.info(f"rollout workers on {where(places)}")
    if wants_idle(r.cpu_priority, cfg.trainer.mode, r.device) and idle_supported():
        logger.info(f"rollout workers decode at idle CPU priority (rollout.cpu_priority: "
                    f"{r.cpu_priority}): the learner never waits for a core")  # fmt: skip
    if cfg.weights.transport == "broadcast":
        connect_broadcast(learner, workers, timeout_s=cfg.weights.push_timeout_s)
    return learner, workers


def where(places: list[tuple[str, str]]) -> str:
    """'2 nodes: 10.0.0.2 (node 3f2a9c1e) worker-0; 10.0.0.3 (node 77b0d2aa) worker-1'"""
    on: dict[tuple[str, str], list[str]] = {}
    for i, place in enumerate(places):
        on.setdefault(place, []).append(f"worker-{i}")
    nodes = [f"{ip} (node {node[:8]}) {', '.join(names)}" for (node, ip), names in on.items()]
    return f"{len(on)} node{'s' if len(on) > 1 else ''}: " + "; ".join(nodes)
