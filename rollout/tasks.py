"""Durable task queue and saved episodes for asynchronous rollouts (Redis, AOF).

The driver XADDs tasks (a group id and an env seed) to a task stream; rollout workers read them
through the consumer group "workers". A task stays pending in that group until the worker that
holds it finishes its whole group, and then one Lua script does everything at once, only while
that worker still owns the pending entry: XADD the trajectory group, XACK the task, count the
group as produced, delete its saved episodes. A worker that dies leaves its tasks pending: it
reclaims them when Ray restarts it, and any other worker takes them over (XAUTOCLAIM) once they
have been idle `claim_idle_ms`; live workers keep their own tasks fresh (XCLAIM JUSTID, a
heartbeat). A slow worker whose task was taken over finishes in vain: its `complete` is refused,
so a group is never produced twice. Every claim counts an attempt. At each async checkpoint the
finished part of these books is trimmed (rollout/books.py).

Unfinished episodes are saved at turn boundaries (and when a worker pauses for its token
budget) in a hash per group (`rollout/codec.py encode_episode`: tokens, per-token versions,
logprobs and routes, the env's `get_state()`), so a retried task continues each episode from
where it was saved instead of from its first token.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rollout.codec import encode_group
from rollout.keys import WORKER_GROUP as GROUP
from rollout.keys import RunKeys
from rollout.stream import FIELD, GROUP_ID
from rollout.types import TrajectoryGroup

COMPLETE = """
local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #held == 0 or held[1][2] ~= ARGV[3] then return false end
local entry = redis.call('XADD', KEYS[2], '*', ARGV[6], ARGV[4], ARGV[7], ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[3], ARGV[5], 1)
redis.call('DEL', KEYS[4])
return entry
"""
"""KEYS: tasks, trajectories, produced, the group's saved episodes; ARGV: worker group, task
entry id, consumer, encoded group, group id, the two field names. Nil when `consumer` does not
own the pending task (another worker took it over, or it was acked)."""
_FIELDS = (FIELD, GROUP_ID)


@dataclass(frozen=True, slots=True)
class Task:
    entry_id: str
    group_id: str
    seed: int
    attempt: int


class TaskQueue:
    """Both sides of the task stream of the run whose keys are `keys` (rollout/keys.py)."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client, self.keys = client, keys
        try:
            self.client.xgroup_create(self.keys.tasks, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- driver --------------------------------------------------------------------------------
    def issue(self, tasks: list[tuple[str, int]]) -> None:
        """Publish (group id, seed) tasks."""
        pipe = self.client.pipeline(transaction=True)
        for group_id, seed in tasks:
            pipe.xadd(self.keys.tasks, {"group_id": group_id, "seed": seed})
        pipe.execute()

    def requeue_all_pending(self) -> int:
        """After a whole-job restart every pending task belongs to a dead worker: publish each
        again (same group id; its saved episodes are kept) and ack the old entry, atomically."""
        moved = 0
        for p in self.client.xpending_range(
            self.keys.tasks, GROUP, min="-", max="+", count=1 << 30
        ):
            entry = self.client.xrange(self.keys.tasks, min=p["message_id"], max=p["message_id"])
            if not entry:
                continue
            fields = entry[0][1]
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(self.keys.tasks, fields)
            pipe.xack(self.keys.tasks, GROUP, p["message_id"])
            pipe.execute()
            moved += 1
        return moved

    def backlog(self) -> int:
        """Tasks issued but not finished (pending or not yet read)."""
        pending = int(self.client.xpending(self.keys.tasks, GROUP)["pending"])
        return pending + (self.unread() or 0)

    def unread(self) -> int | None:
        """Tasks issued but not yet read by any worker (the group's lag); None when Redis cannot
        say (after deletions past the group's last delivered entry)."""
        info = self.client.xinfo_groups(self.keys.tasks)
        lag = next((g.get("lag") for g in info if _text(g["name"]) == GROUP), None)
        return None if lag is None else int(lag)

    # -- workers -------------------------------------------------------------------------------
    def claim(
        self,
        consumer: str,
        count: int,
        *,
        idle_ms: int,
        held: frozenset[str] = frozenset(),
        workers: int = 1,
    ) -> list[Task]:
        """Up to `count` tasks: first this consumer's own pending ones (a restarted worker),
        then ones idle past `idle_ms` (a dead worker's), then new ones. `held`: entry ids the
        caller is working on (never returned, never counted as a new attempt). `workers`: how
        many read this queue; new tasks are taken at most ceil(unread / workers) at a time, so
        one worker with room for all does not leave the others idle (a faster worker, asking
        more often, still takes more)."""
        entries = [
            e for e in self._own_pending(consumer, count + len(held)) if _text(e[0]) not in held
        ]
        if len(entries) < count:
            _, stolen, *_ = self.client.xautoclaim(
                self.keys.tasks, GROUP, consumer, idle_ms, count=count - len(entries)
            )
            entries += [e for e in stolen if e[1] and _text(e[0]) not in held]
        want = count - len(entries)
        if want > 0:
            want = min(want, self._share(workers, want))
        if want > 0:
            reply = self.client.xreadgroup(GROUP, consumer, {self.keys.tasks: ">"}, count=want)
            for _, new in reply or []:
                entries += new
        return [self._task(entry_id, fields) for entry_id, fields in entries[:count]]

    def _share(self, workers: int, count: int) -> int:
        """ceil(unread tasks / workers); `count` when one worker reads or Redis cannot say."""
        unread = self.unread() if workers > 1 else None
        return count if unread is None else -(-unread // workers)

    def _own_pending(self, consumer: str, count: int) -> list:
        mine = self.client.xpending_range(
            self.keys.tasks, GROUP, min="-", max="+", count=count, consumername=consumer
        )
        if not mine:
            return []
        ids = [p["message_id"] for p in mine]
        return [e for e in self.client.xclaim(self.keys.tasks, GROUP, consumer, 0, ids) if e[1]]

    def _task(self, entry_id, fields) -> Task:
        fields = {_text(k): _text(v) for k, v in fields.items()}
        attempt = int(self.client.hincrby(self.keys.attempts, fields["group_id"], 1))
        return Task(_text(entry_id), fields["group_id"], int(fields["seed"]), attempt)

    def heartbeat(self, consumer: str, tasks: list[Task]) -> None:
        """Keep our tasks from looking idle (so no other worker takes them over)."""
        if tasks:
            self.client.xclaim(
                self.keys.tasks, GROUP, consumer, 0, [t.entry_id for t in tasks], justid=True
            )

    def complete(self, task: Task, group: TrajectoryGroup, *, consumer: str) -> str | None:
        """Atomically, if `consumer` still owns the pending task: the group into the trajectory
        stream, the task acked, counted, its saved episodes deleted. Returns the trajectory
        stream entry id, or None when refused (another worker took the task over after
        `claim_idle_ms`, or it was issued again: that one produces the group)."""
        keys = [self.keys.tasks, self.keys.trajectories, self.keys.produced,
                self.keys.episodes(group.group_id)]  # fmt: skip
        args = [GROUP, task.entry_id, consumer, encode_group(group), group.group_id, *_FIELDS]
        # EVAL, not EVALSHA: a redis-server restarted from its AOF has no script cache, and a
        # restart between SCRIPT LOAD and EVALSHA failed a run (the chaos suite)
        entry = self.client.eval(COMPLETE, len(keys), *keys, *args)
        return None if entry is None else _text(entry)

    # -- saved episodes ------------------------------------------------------------------------
    def save_episodes(self, group_id: str, episodes: dict[int, bytes]) -> None:
        if episodes:
            self.client.hset(self.keys.episodes(group_id), mapping=episodes)

    def saved_episodes(self, group_id: str) -> dict[int, bytes]:
        raw = self.client.hgetall(self.keys.episodes(group_id))
        return {int(k): v for k, v in raw.items()}

    def produced(self) -> dict[str, int]:
        raw = self.client.hgetall(self.keys.produced)
        return {_text(k): int(v) for k, v in raw.items()}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
