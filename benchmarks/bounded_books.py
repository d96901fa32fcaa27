"""Bounded books: the exactly-once bookkeeping of an async run stays flat however long it runs.

    .venv/bin/python benchmarks/bounded_books.py [--groups 100000] [--batch 64]

A simulation through the real code paths, without a model: a private redis-server started by
the project's launcher (rl/run/launch.py start_redis: AOF, appendfsync always; its data dir on
/dev/shm where there is one), the driver's task queue (rollout/tasks.py TaskQueue, group ids
`t<i>` issued up to (version + 2) x batch like the Feeder at max_staleness 1), two workers that
claim tasks, save an unfinished episode for some, and complete them out of order (a quarter held
over to the next round; every 40 steps one worker stalls and the other takes its tasks over
with XAUTOCLAIM: the stalled one's completions are refused), the learner's reader
(rollout/stream.py RedisGroupReader: read, skip ids already in the trained set, ack; the trained
set is rl/learner/group_ids.py GroupIds), a corrupt group every 5,000 (dead-lettered, failed)
and, every 10 steps, a checkpoint: learner.json written with the trained set, the trajectory
stream trimmed to the last acked entry (as save_checkpoint does), then the async loop's
`trim_at_checkpoint` (rollout/books.py).

The same run is made twice: with the trim, and without it (the trajectory stream is still
trimmed, as before this change, and the trained ids are also measured as the plain sorted list
that checkpoints held before). Every 10,000 trained groups it prints Redis `used_memory`, the
books' sizes, and the checkpointed trained ids' size in bytes. Measured: docs/reliability.md,
"Bounded books".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import rollout.tasks
from rl.learner.group_ids import GroupIds
from rl.run.async_loop import TASK_FAMILY, trim_at_checkpoint
from rl.run.launch import start_redis
from rollout.keys import LEARNER_GROUP, RunKeys
from rollout.stream import RedisGroupReader, dead_letter_total
from rollout.tasks import TaskQueue
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

CHECKPOINT_EVERY = 10  # steps
STALL_EVERY = 40  # steps: a worker stalls and the other takes its tasks over
CORRUPT_EVERY = 5_000  # groups: one is written corrupt (dead-lettered)


def template() -> TrajectoryGroup:
    """A small group of 2 trajectories (a few tokens each): what matters here is the books."""
    trajs = []
    for i in range(2):
        t = Trajectory(task_id="bench#0", messages=[{"role": "user", "content": "1+1"}])
        t.append([1, 2, 3, 4], sampled=False)
        t.append([5 + i, 6], sampled=True, logprobs=[-0.5, -1.0], version=0)
        t.status, t.reward = RolloutStatus.COMPLETED, float(i)
        trajs.append(t)
    return TrajectoryGroup(group_id="", task_id="bench#0", trajectories=trajs)


class Worker:
    def __init__(self, queue: TaskQueue, name: str, rng: random.Random) -> None:
        self.queue, self.name, self.rng = queue, name, rng
        self.held: list = []
        self.refused = 0

    def round(self, room: int, group: TrajectoryGroup, corrupt: set[str], idle_ms=60_000):
        """Claim up to `room` tasks, complete three quarters of what it holds, in any order."""
        held = frozenset(t.entry_id for t in self.held)
        new = self.queue.claim(self.name, room - len(self.held), idle_ms=idle_ms, held=held)
        for task in new:
            if task.attempt == 1 and self.rng.random() < 0.25:  # an unfinished episode saved
                self.queue.save_episodes(task.group_id, {0: b"s" * 200})
        self.held += new
        self.rng.shuffle(self.held)
        cut = len(self.held) // 4
        done, self.held = self.held[cut:], self.held[:cut]
        for task in done:
            self.complete(task, dataclasses.replace(group, group_id=task.group_id), corrupt)

    def complete(self, task, group: TrajectoryGroup, corrupt: set[str]) -> None:
        encode = rollout.tasks.encode_group
        if task.group_id in corrupt:  # a payload damaged on its way: the learner can't decode it
            rollout.tasks.encode_group = lambda g: b"\xff" + encode(g)
        try:
            if self.queue.complete(task, group, consumer=self.name) is None:
                self.refused += 1
        finally:
            rollout.tasks.encode_group = encode


class Run:
    """One simulated async run against `client`; `step()` is one learner step."""

    def __init__(self, client, batch: int, groups: int, trim: bool, seed: int, ckpt: Path):
        self.client, self.keys, self.batch, self.trim, self.ckpt = (
            client, RunKeys("bounded-books"), batch, trim, ckpt,
        )  # fmt: skip
        self.queue = TaskQueue(client, self.keys)
        self.reader = RedisGroupReader(
            client, self.keys.trajectories, group=LEARNER_GROUP, consumer="l0"
        )
        self.group = template()
        self.workers = [Worker(self.queue, f"w{i}", random.Random(seed + i)) for i in range(2)]
        self.trained, self.plain = GroupIds(), set()
        self.issued = self.steps = self.done = self.duplicates = 0
        self.corrupt = {
            f"{TASK_FAMILY}{i}" for i in range(CORRUPT_EVERY // 2, groups, CORRUPT_EVERY)
        }

    def step(self) -> None:
        self.steps += 1
        allowed = (self.steps + 1) * self.batch  # the Feeder: (version + max_staleness + 1) x B
        self.queue.issue([(f"{TASK_FAMILY}{i}", i) for i in range(self.issued, allowed)])
        self.issued = max(self.issued, allowed)
        if self.steps % STALL_EVERY == 0:
            self.stall()
        ids = self.read_batch()
        self.settle([group_id for _, group_id in ids])
        self.reader.ack([e for e, _ in ids])
        self.done += len(ids)
        if self.steps % CHECKPOINT_EVERY == 0:
            self.checkpoint(max((e for e, _ in ids), key=_entry_key))

    def stall(self) -> None:
        """w1 stalls; w0 takes its tasks over once "idle"; w1 wakes up and finishes in vain."""
        self.workers[0].round(2 * self.batch, self.group, self.corrupt, idle_ms=0)
        stalled = self.workers[1]
        for task in stalled.held:
            self.queue.save_episodes(task.group_id, {1: b"late" * 50})  # a last turn saved
            group = dataclasses.replace(self.group, group_id=task.group_id)
            stalled.complete(task, group, self.corrupt)
        stalled.held = []

    def read_batch(self) -> list[tuple[str, str]]:
        """The learner's read: `batch` new groups (copies of trained ones acked and skipped)."""
        ids: list[tuple[str, str]] = []
        while len(ids) < self.batch:
            for w in self.workers:
                w.round(self.batch, self.group, self.corrupt)
            for entry_id, g in self.reader.read(self.batch - len(ids), block_ms=1):
                if g.group_id in self.trained:
                    self.duplicates += 1
                    self.reader.ack([entry_id])
                else:
                    ids.append((entry_id, g.group_id))
            self.settle(self.reader.take_dead_letters())  # failed: undecodable
        return ids

    def settle(self, group_ids: list[str]) -> None:
        self.trained.update(group_ids)
        self.plain.update(group_ids)

    def checkpoint(self, last_acked: str) -> None:
        """learner.json with the trained set; the learner's trim; the books' trim."""
        (self.ckpt / "learner.json").write_text(json.dumps({"trained": self.trained.to_json()}))
        self.reader.trim(last_acked)
        if self.trim:
            trim_at_checkpoint(self.client, self.keys, self.ckpt)

    def row(self, seconds: float) -> dict:
        c, keys = self.client, self.keys
        return {
            "groups": self.done,
            "seconds": seconds,
            "used_memory_mb": c.info("memory")["used_memory"] / 2**20,
            "tasks": c.xlen(keys.tasks),
            "attempts": c.hlen(keys.attempts),
            "produced": c.hlen(keys.produced),
            "trajectories": c.xlen(keys.trajectories),
            "episodes": sum(1 for _ in c.scan_iter(match=keys.episodes("*"), count=1000)),
            "dead_letters": c.xlen(keys.dead_letters),
            "dead_total": dead_letter_total(c, keys.trajectories),
            "trained_bytes": len(json.dumps(self.trained.to_json())),
            "plain_bytes": len(json.dumps(sorted(self.plain))),
            "refused": sum(w.refused for w in self.workers),
        }

    def summary(self) -> str:
        produced = sum(int(v) for v in self.client.hvals(self.keys.produced))
        produced += int(self.client.hget(self.keys.trimmed, "produced") or 0)
        return (
            f"  {'trim' if self.trim else 'no trim'}: {self.done} groups trained in {self.steps} "
            f"steps, {len(self.trained) - self.done} dead-lettered; produced {produced} "
            f"(refused completions {sum(w.refused for w in self.workers)}, copies skipped "
            f"{self.duplicates}); trained ids as many as the plain set: "
            f"{len(self.trained) == len(self.plain)}"
        )


def simulate(groups: int, batch: int, trim: bool, seed: int, out) -> list[dict]:
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="bounded-books-", dir=shm if shm.is_dir() else None))
    server = start_redis(root / "redis")
    rows: list[dict] = []
    try:
        (root / "checkpoint").mkdir()
        run = Run(server.client(), batch, groups, trim, seed, root / "checkpoint")
        start, next_row = time.perf_counter(), 10_000
        while run.done < groups:
            run.step()
            if run.done >= next_row:
                next_row += 10_000
                rows.append(run.row(time.perf_counter() - start))
                print(_line(rows[-1], trim), file=out, flush=True)
        print(run.summary(), file=out, flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _line(row: dict, trim: bool) -> str:
    return (
        f"  [{'trim' if trim else 'no trim'}] {row['groups']:>7} groups {row['seconds']:6.1f} s: "
        f"used_memory {row['used_memory_mb']:.2f} MB, tasks {row['tasks']}, attempts "
        f"{row['attempts']}, produced {row['produced']}, trajectories {row['trajectories']}, "
        f"saved episodes {row['episodes']}, "
        f"dead letters {row['dead_letters']} ({row['dead_total']} counted), trained ids "
        f"{row['trained_bytes']} B (plain list {row['plain_bytes']} B)"
    )


def table(with_trim: list[dict], without: list[dict]) -> str:
    lines = [
        "| groups | used_memory, trim (MB) | used_memory, no trim (MB) | task entries "
        "trim / no trim | attempts + produced fields trim / no trim | saved episodes trim / "
        "no trim | dead letters kept (counted) | trained ids, checkpointed (bytes) | as the old "
        "plain list (bytes) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(with_trim, without, strict=True):
        lines.append(
            f"| {a['groups']:,} | {a['used_memory_mb']:.2f} | {b['used_memory_mb']:.2f} | "
            f"{a['tasks']} / {b['tasks']} | {a['attempts'] + a['produced']} / "
            f"{b['attempts'] + b['produced']} | {a['episodes']} / {b['episodes']} | "
            f"{a['dead_letters']} ({a['dead_total']}) | "
            f"{a['trained_bytes']:,} | {b['plain_bytes']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    with_trim = simulate(args.groups, args.batch, True, args.seed, sys.stdout)
    without = simulate(args.groups, args.batch, False, args.seed, sys.stdout)
    print(table(with_trim, without))
    print(f"({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
