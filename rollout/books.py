"""Bounded books: at each async checkpoint, delete the exactly-once bookkeeping that no resume
from it can need, so Redis holds what is in flight, not the whole run.

`trim_books` runs after a checkpoint commits (rl/run/async_loop.py), given the watermark of the
checkpoint's trained set for the task family: every task group `<family><i>` with i < `below`
has its ledger entry in that checkpoint (rl/learner/group_ids.py). It deletes

- the task stream's entries before the first one that must stay: every entry before it was
  delivered to the `workers` group, acked there (its group completed, or the task was issued
  again under a new entry) and names a group below the watermark. A pending entry (a dead job's
  task, issued again on resume by `TaskQueue.requeue_all_pending`, or a live worker's) and an
  undelivered one stay, and so does everything after them;
- the `:attempts` and `:produced` fields of the groups below the watermark (their tasks are
  acked: no claim counts an attempt again); the `:produced` counts deleted are added up in
  `:trimmed` with the watermark ("produced", "below"), so the books still balance
  (tests/chaos/books.py);
- the saved episodes of the groups below the watermark (`complete` deletes a group's own; a
  worker whose task was taken over may save a turn after the other completed it);
- the dead letters written before the trim (the learner is idle during a checkpoint, so before
  the checkpoint); each was counted when it was written (`:trajectories:dead:count`, the metric
  `stream/dead_letters`).

A resume from that checkpoint rewinds the learner's consumer group to the checkpoint's last
acked trajectory entry (the trajectory stream is trimmed only before it: rl/run/runstate.py
save_checkpoint), re-issues the pending tasks, and skips every group below the watermark through
the restored trained set: nothing above is touched.
"""

from __future__ import annotations

import redis

from rollout.keys import WORKER_GROUP as GROUP
from rollout.keys import RunKeys

TRIM_HASHES = """
local produced = 0
for i = 2, #ARGV do
  local n = redis.call('HGET', KEYS[2], ARGV[i])
  if n then produced = produced + tonumber(n) end
end
local attempts, counted = 0, 0
if #ARGV > 1 then
  attempts = redis.call('HDEL', KEYS[1], unpack(ARGV, 2))
  counted = redis.call('HDEL', KEYS[2], unpack(ARGV, 2))
end
redis.call('HINCRBY', KEYS[3], 'produced', produced)
local below = tonumber(redis.call('HGET', KEYS[3], 'below') or '0')
if tonumber(ARGV[1]) > below then redis.call('HSET', KEYS[3], 'below', ARGV[1]) end
return {attempts, counted}
"""
"""KEYS: attempts, produced, trimmed; ARGV: the watermark, then the fields to delete. Atomic, so
a count is never deleted without being added to "produced"."""

CHUNK = 1000


def trim_books(
    client: redis.Redis,
    keys: RunKeys,
    *,
    family: str,
    below: int,
    dead_before_ms: int | None = None,
) -> dict[str, int]:
    """Trim the books of the groups `<family><i>`, i < `below` (see the module docstring), and
    the dead letters older than `dead_before_ms` (Redis time; default: now). Returns how many
    task entries, attempts and produced fields, saved episodes and dead letters were deleted."""
    out = {"tasks": 0, "attempts": 0, "produced": 0, "episodes": 0, "dead_letters": 0}
    bound = _first_kept_task(client, keys, family, below)
    if bound is not None:
        out["tasks"] = int(client.xtrim(keys.tasks, minid=bound, approximate=False))
    fields = {
        _text(f)
        for key in (keys.attempts, keys.produced)
        for f in client.hkeys(key)
        if _below(_text(f), family, below)
    }
    chunks = [sorted(fields)[i : i + CHUNK] for i in range(0, len(fields), CHUNK)] or [[]]
    hashes = [keys.attempts, keys.produced, keys.trimmed]
    for chunk in chunks:  # EVAL, not EVALSHA: a restarted redis-server has no script cache
        attempts, produced = client.eval(TRIM_HASHES, len(hashes), *hashes, below, *chunk)
        out["attempts"] += int(attempts)
        out["produced"] += int(produced)
    head = keys.episodes("")
    episodes = [
        key
        for key in client.scan_iter(match=_glob_escape(head) + "*", count=CHUNK)
        if _below(_text(key)[len(head) :], family, below)
    ]
    for i in range(0, len(episodes), CHUNK):
        out["episodes"] += int(client.delete(*episodes[i : i + CHUNK]))
    if dead_before_ms is None:
        seconds, micros = client.time()
        dead_before_ms = int(seconds) * 1000 + int(micros) // 1000
    out["dead_letters"] = int(
        client.xtrim(keys.dead_letters, minid=f"{dead_before_ms}-0", approximate=False)
    )
    return out


def trimmed(client: redis.Redis, keys: RunKeys) -> tuple[int, int]:
    """(below, produced) of `:trimmed`: the task groups t0..t<below - 1> have no :produced field
    any more, and their counts added up to `produced`."""
    raw = {_text(k): int(v) for k, v in client.hgetall(keys.trimmed).items()}
    return raw.get("below", 0), raw.get("produced", 0)


def _first_kept_task(client: redis.Redis, keys: RunKeys, family: str, below: int) -> str | None:
    """The id below which every task entry may go (an XTRIM MINID); None: no worker group."""
    try:
        groups = client.xinfo_groups(keys.tasks)
    except redis.ResponseError:  # no task stream yet
        return None
    info = next((g for g in groups if _text(g["name"]) == GROUP), None)
    if info is None:
        return None
    delivered = _text(info["last-delivered-id"])
    summary = client.xpending(keys.tasks, GROUP)
    pending = _id(_text(summary["min"])) if summary["pending"] else None
    start = "-"
    while True:
        entries = client.xrange(keys.tasks, min=start, max=delivered, count=CHUNK)
        for entry_id, fields in entries:
            entry = _text(entry_id)
            if pending is not None and _id(entry) >= pending:
                return entry
            if not _below(_text(fields.get(b"group_id", b"")), family, below):
                return entry
        if len(entries) < CHUNK:
            break
        start = "(" + _text(entries[-1][0])
    ms, seq = _id(delivered)
    return f"{ms}-{seq + 1}"  # every delivered entry may go; the undelivered ones stay


def _below(group_id: str, family: str, below: int) -> bool:
    """`group_id` is `<family><i>` (canonical i) with i < `below`."""
    digits = group_id[len(family) :] if group_id.startswith(family) else ""
    if not (digits.isascii() and digits.isdigit()) or (digits != "0" and digits[0] == "0"):
        return False
    return int(digits) < below


def _glob_escape(text: str) -> str:
    """`text` matched literally by a SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _id(entry: str) -> tuple[int, int]:
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
