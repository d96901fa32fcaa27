"""The driver's side of async weight pushes (rl/run/async_loop.py): one push in flight at a time,
travelling while the learner's next step trains, settled once that step is done.

    step k trains ---------------> step k+1 trains --------------> ...
                  publish k (export: the learner's own time)
                  push k travels to the workers --> settled after step k+1

A worker that restarted meanwhile is forgiven a push it missed: it fetches the latest version
from the run's weight board itself (rl/run/board.py WeightBoard, rl/run/actors.py
`catch_up`). With the broadcast transport a restart also breaks the gloo group: a push that
was in flight then fails for every member, and the group is formed again before the next push.
"""

from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rl.observe.metrics import push_metrics
from rl.run.board import WeightBoard
from rl.run.weights import (
    Manifest,
    PushInFlight,
    begin_push,
    connect_broadcast,
    finish_push,
)
from rollout.keys import RunKeys

logger = logging.getLogger(__name__)


class Fleet:
    """Starts and settles the async pushes; `starts` reads each worker's incarnation count (the
    Redis counter every WorkerHost increments when it is built)."""

    def __init__(self, learner, workers, client, keys: RunKeys, weights_cfg) -> None:
        self.learner, self.workers, self.client, self.keys = learner, workers, client, keys
        self.timeout_s, self.transport = weights_cfg.push_timeout_s, weights_cfg.transport
        self.flight: PushInFlight | None = None
        self.flight_starts = self.group_starts = self.starts()

    def starts(self) -> list[int]:
        names = [self.keys.worker_starts(i) for i in range(len(self.workers))]
        return [int(v or 0) for v in self.client.mget(names)]

    def _restarted(self) -> set[int]:
        """Workers whose incarnation changed since the push in flight began."""
        pairs = enumerate(zip(self.flight_starts, self.starts(), strict=True))
        return {i for i, (a, b) in pairs if a != b}

    def settle(self) -> dict[str, float]:
        """Wait for the push in flight (if any): its metrics, tagged with its version."""
        if self.flight is None:
            return {}
        flight, self.flight = self.flight, None
        push = finish_push(flight, restarted=self._restarted)
        if push["missed"]:
            missed = push["missed"]
            logger.warning(f"push of version {push['version']} missed by {missed} worker(s)")
        return {
            **push_metrics(push),
            "weights/version": float(push["version"]),
            "weights/settle_wait_seconds": push["waited"],
        }

    def start(self) -> dict[str, float]:
        """Publish the learner's weights and send them (the previous push must be settled);
        re-forms the broadcast group first when a worker restarted since it was formed."""
        out = {}
        now = self.starts()
        if self.transport == "broadcast" and now != self.group_starts:
            connect_broadcast(self.learner, self.workers, timeout_s=self.timeout_s)
            self.group_starts, out["weights/regrouped"] = now, 1.0
            logger.info("broadcast group formed again after a worker restart")
        self.flight_starts = now
        self.flight = begin_push(
            self.learner, self.workers, timeout_s=self.timeout_s, transport=self.transport
        )
        return out


def board_name(run_id: str) -> str:
    return f"{run_id}-weights"


def start_board(run_id: str, node_id: str):
    """The run's WeightBoard, on the learner's node (`node_id`): losing a worker node must not
    take the board with it. Restarted (empty) if its process dies anyway; a post or a fetch that
    meets it down is only a warning (`post_to_board`, `fetch_from_board`)."""
    place = NodeAffinitySchedulingStrategy(node_id=node_id, soft=True)
    options = dict(name=board_name(run_id), scheduling_strategy=place, max_restarts=-1)
    return ray.remote(num_cpus=0)(WeightBoard).options(**options).remote()


def find_board(run_id: str):
    """The run's WeightBoard actor, or None (sync mode has none)."""
    try:
        return ray.get_actor(board_name(run_id))
    except ValueError:
        return None


def post_to_board(board, manifest: Manifest, refs: list) -> None:
    """The learner's post; a board that is down (restarting) misses this version only."""
    try:
        held = [ray.put(manifest), *refs]  # nested refs: the board never deserializes them
        ray.get(board.post.remote(manifest.version, held))
    except ray.exceptions.RayActorError as err:
        logger.warning(f"weight board unavailable; version {manifest.version} not posted: {err}")


def fetch_from_board(board) -> tuple[Manifest, list] | None:
    """The latest post, or None when the board is empty or down (the worker waits for a push)."""
    try:
        latest = ray.get(board.get.remote())
    except ray.exceptions.RayActorError as err:
        logger.warning(f"weight board unavailable; waiting for the next push: {err}")
        return None
    if latest is None:
        return None
    _, (manifest, *refs) = latest
    return ray.get(manifest), refs
