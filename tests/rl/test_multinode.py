"""A multi-node run on one machine: a Ray cluster of a head and two worker nodes
(`ray.cluster_utils.Cluster`), each with its own resources, and `agentrl train` joining it
through `ray.address`.

Custom resources place the actors: the head offers `learner: 1` (the learner asks for it), each
worker node `rollout: 2` (the workers ask for `rollout: 1`, spread over the nodes). Once step 2
is in metrics.jsonl and the worker on the second node holds a task with an unfinished episode
saved in Redis, that node is removed (its raylet killed, the worker process SIGKILLed: a lost
machine). The run must go on: the worker restarted on the remaining worker node, its tasks
retried from the saved episodes, every acknowledged group accounted for, none trained twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from rollout.codec import decode_episode
from rollout.keys import WORKER_GROUP, RunKeys
from tests.rl.test_async import account, check_books, live_client, metrics, overrides
from tests.rl.test_e2e import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 6
MB = 2**20


@pytest.fixture()
def cluster():
    from ray._private.utils import get_ray_address_file, read_ray_address
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"learner": 1},
            "object_store_memory": 100 * MB,
            "include_dashboard": False,
            # a node whose raylet is gone is declared dead within about 2 s (default 15 s)
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"rollout": 2}, object_store_memory=100 * MB)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        address = cluster.address
        cluster.shutdown()
        with contextlib.suppress(OSError):  # Cluster made it what a bare ray.init() joins
            if read_ray_address() == address:
                os.remove(get_ray_address_file(None))


def actors(cluster, cls: str) -> dict[str, dict]:
    """The live actors of class `cls`, by name, as the cluster's GCS reports them."""
    table = cluster.global_state.actor_table(None).values()
    return {a["Name"]: a for a in table if a["ActorClassName"] == cls and a["State"] == "ALIVE"}


def up(cluster) -> tuple[dict, dict] | None:
    """(workers, learners) once the run's two workers and its learner are alive."""
    workers, learners = actors(cluster, "WorkerHost"), actors(cluster, "LearnerHost")
    return (workers, learners) if len(workers) == 2 and len(learners) == 1 else None


def wait_for(what: str, probe, proc: subprocess.Popen, log: Path, timeout: float = 300):
    """probe()'s first true answer; the run's output tail if it ends or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text()[-3000:]
    raise AssertionError(f"no {what} (exit {proc.poll()}):\n{tail}")


def holds_a_saved_episode(client: redis.Redis, keys: RunKeys, consumer: str) -> bool:
    """`consumer` holds a task of which an unfinished episode is saved in Redis."""
    tasks = keys.tasks
    for entry in client.xpending_range(tasks, WORKER_GROUP, "-", "+", 1000, consumername=consumer):
        ((_, fields),) = client.xrange(tasks, min=entry["message_id"], max=entry["message_id"])
        saved = client.hgetall(keys.episodes(fields[b"group_id"].decode())).values()
        if any(not decode_episode(data)[1].get("final") for data in saved):
            return True
    return False


def freeze_holding_a_saved_episode(run_dir: Path, pid: int, consumer: str, proc, log) -> None:
    """SIGSTOP the worker process at a moment it holds a task with a saved unfinished episode
    (frozen, it cannot finish that task before its node goes)."""
    client, keys = live_client(run_dir), RunKeys(run_dir.name)

    def frozen_holding() -> bool:
        os.kill(pid, signal.SIGSTOP)
        with contextlib.suppress(redis.RedisError):
            if holds_a_saved_episode(client, keys, consumer):
                return True
        os.kill(pid, signal.SIGCONT)
        return False

    wait_for(f"saved unfinished episode held by {consumer}", frozen_holding, proc, log)


def train_steps(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in metrics(run_dir)), default=0)


def test_a_run_across_nodes_survives_losing_a_worker_node(cluster, tmp_path):
    started, log = time.monotonic(), tmp_path / "train.log"
    sink = log.open("w")
    head = cluster.head_node.node_id
    nodes = {node.node_id: node for node in cluster.worker_nodes}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rl.cli",
            "train",
            str(ROOT / "configs/quickstart.yaml"),
            *overrides(tmp_path, STEPS),
            f"ray.address={cluster.address}",
            "trainer.resources={CPU: 1, learner: 1}",
            "rollout.resources={CPU: 0.5, rollout: 1}",
            "rollout.tool_timeout_s=30",
            "weights.push_timeout_s=300",
        ],
        cwd=ROOT,
        stdout=sink,  # a file, not a pipe nobody reads while the run goes on
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        workers, learners = wait_for("learner and two workers", lambda: up(cluster), proc, log)
        (learner,) = learners.values()
        placed = {name: a["Address"]["NodeID"] for name, a in workers.items()}
        assert learner["Address"]["NodeID"] == head
        boards = wait_for("weight board", lambda: actors(cluster, "WeightBoard"), proc, log)
        (board,) = boards.values()  # asked for the learner's node (soft: Ray may put it
        # elsewhere, as it did once on CI); on the lost node it is restarted, and the run goes on
        on = "head" if board["Address"]["NodeID"] == head else "a worker node"
        print(f"weight board on {on}")
        assert set(placed.values()) == set(nodes), f"not one worker per worker node: {placed}"
        (run_dir,) = tmp_path.glob("e2e-*")
        wait_for("step 2", lambda: train_steps(run_dir) >= 2, proc, log)
        victim = workers[next(n for n in workers if n.endswith("worker-1"))]
        freeze_holding_a_saved_episode(run_dir, victim["Pid"], "worker-1", proc, log)
        lost = victim["Address"]["NodeID"]
        removed_at = train_steps(run_dir)
        removed = time.monotonic()
        cluster.remove_node(nodes[lost], allow_graceful=False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["Pid"], signal.SIGKILL)  # its raylet is gone: the machine is lost

        def restarted() -> dict | None:
            now = actors(cluster, "WorkerHost").get(victim["Name"])
            return now if now and now["NumRestarts"] >= 1 else None

        again = wait_for("restart of worker-1", restarted, proc, log)
        back = time.monotonic() - removed
        survivor = next(n for n in nodes if n != lost)
        assert again["Address"]["NodeID"] == survivor
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        sink.close()
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "rollout workers on 2 nodes" in out
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert max(r.get("workers/restarted", 0) for r in records) >= 1
    assert sum(r.get("workers/restored_episodes", 0) for r in records) > 0
    print(
        f"node removed after step {removed_at}; worker-1 back on the other worker node "
        f"{back:.0f} s later; the run took {time.monotonic() - started:.0f} s"
    )
    check_books(account(run_dir), STEPS)
