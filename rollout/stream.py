"""The Redis stream that carries trajectory groups from rollout workers to the learner.

Writers XADD one entry per group. The learner reads through a consumer group and XACKs an entry
only after the optimizer step that used it, so a crashed learner finds its unacknowledged
entries still pending (at-least-once; the entry id is the idempotency key). A read whose reply
was lost with the connection (Redis restarted mid-call) leaves its entries pending for this
consumer without the reader seeing them: every read first picks those up.
"""

from __future__ import annotations

import redis

from rollout.codec import CodecError, decode_group, encode_group
from rollout.keys import dead_letter_count, dead_letter_stream
from rollout.types import TrajectoryGroup

FIELD = b"group"
GROUP_ID = b"group_id"
"""The group's id in plain text beside its payload: a dead letter still names its group."""


class RedisTrajectoryStream:
    """Writer side: `put(group)` returns the stream entry id."""

    def __init__(self, client: redis.Redis, stream: str):
        self.client = client
        self.stream = stream

    def put(self, group: TrajectoryGroup) -> str:
        entry = self.client.xadd(
            self.stream, {FIELD: encode_group(group), GROUP_ID: group.group_id}
        )
        return entry.decode() if isinstance(entry, bytes) else entry


class RedisGroupReader:
    """Learner side: a consumer in a consumer group. `stop_key`: a key whose existence tells
    the learner that the run is stopping (`stopped`)."""

    def __init__(
        self,
        client: redis.Redis,
        stream: str,
        *,
        group: str,
        consumer: str,
        stop_key: str | None = None,
    ):
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.stop_key = stop_key
        self.dead_letters = 0
        self.dead_ids: list[str] = []
        """Group ids of dead letters not yet taken (`take_dead_letters`)."""
        self.held: set[str] = set()
        """Entries returned by `read` and not acked yet."""
        try:
            self.client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, *, block_ms: int) -> list[tuple[str, TrajectoryGroup]]:
        """Up to `count` groups, waiting at most `block_ms` for the first: entries delivered to
        this consumer but never seen (a lost reply), else new ones."""
        reply = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: "0"}, count=count + len(self.held)
        )
        unseen = [
            (_text(e), f)
            for _, entries in reply or []
            for e, f in entries
            if _text(e) not in self.held
        ]
        if not unseen:
            reply = self.client.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            )
            unseen = [(_text(e), f) for _, entries in reply or [] for e, f in entries]
        out = []
        for key, fields in unseen[:count]:
            try:
                out.append((key, decode_group((fields or {}).get(FIELD, b""))))
            except CodecError as exc:
                self._dead_letter(key, fields or {}, str(exc))
        self.held.update(key for key, _ in out)
        return out

    def _dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        """A poison entry goes to `<stream>:dead` (rollout/keys.py) with the reason, counted,
        and never blocks the group; its group id (when the entry names one) is handed to the
        learner, which fails it in the ledger."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(dead_letter_stream(self.stream), {**fields, b"reason": reason, b"id": entry_id})
        pipe.xack(self.stream, self.group, entry_id)
        pipe.incr(dead_letter_count(self.stream))
        pipe.execute()
        self.dead_letters += 1
        if fields.get(GROUP_ID):
            self.dead_ids.append(_text(fields[GROUP_ID]))

    def take_dead_letters(self) -> list[str]:
        """The group ids of the entries dead-lettered since the last call."""
        out, self.dead_ids = self.dead_ids, []
        return out

    def stopped(self) -> bool:
        """Whether the driver has stopped the run (its stop key exists): read no more, ack
        nothing."""
        return self.stop_key is not None and bool(self.client.exists(self.stop_key))

    def ack(self, entry_ids: list[str]) -> int:
        self.held.difference_update(entry_ids)
        return int(self.client.xack(self.stream, self.group, *entry_ids)) if entry_ids else 0

    def skip_to_end(self, after: str) -> int:
        """Resume support: forget every entry past `after` (the checkpoint's last acked id; they
        are regenerated) by acking the pending ones and moving the group to the stream's end.
        Returns how many entries were discarded."""
        stale = self.client.xrange(self.stream, min=f"({after}", max="+")
        pending = self.client.xpending_range(
            self.stream, self.group, min="-", max="+", count=1 << 30
        )
        if pending:
            self.client.xack(self.stream, self.group, *[p["message_id"] for p in pending])
        self.held.clear()
        self.client.xgroup_setid(self.stream, self.group, id="$")
        return len(stale)

    def rewind(self, after: str) -> int:
        """Resume support without losing anything: every entry past `after` (the checkpoint's
        last acked id) is delivered again, pending or acked (the steps that consumed them were
        lost with the crash; the learner's trained set skips any it did train). Returns how
        many entries will be redelivered."""
        pending = self.client.xpending_range(
            self.stream, self.group, min="-", max="+", count=1 << 30
        )
        if pending:
            self.client.xack(self.stream, self.group, *[p["message_id"] for p in pending])
        self.held.clear()
        self.client.xgroup_setid(self.stream, self.group, id=after)
        return len(self.client.xrange(self.stream, min=f"({after}", max="+"))

    def trim(self, upto: str) -> int:
        """Delete entries before `upto` (consumed and checkpointed): Redis memory stays bounded.
        Returns how many were deleted."""
        return int(self.client.xtrim(self.stream, minid=upto, approximate=False))

    def pending(self) -> int:
        return int(self.client.xpending(self.stream, self.group)["pending"])


def dead_letter_total(client: redis.Redis, stream: str) -> int:
    """Entries of `stream` dead-lettered so far, trimmed ones included (a run from before the
    counter: the dead-letter stream's length)."""
    counted = int(client.get(dead_letter_count(stream)) or 0)
    return max(counted, int(client.xlen(dead_letter_stream(stream))))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value
