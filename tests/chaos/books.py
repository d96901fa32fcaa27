"""The books of a run: every trajectory group produced is trained, filtered, failed or still
buffered, never lost and never trained twice (reliability.md G1).

`account(run_dir)` reads the ledger and the run's Redis (restarted from its AOF), so it works on
a finished, a failed and a SIGKILLed run alike; `check_books` prints one line and asserts.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rl.run.launch import start_redis
from rollout.books import trimmed
from rollout.codec import decode_group
from rollout.keys import LEARNER_GROUP, WORKER_GROUP, RunKeys


def account(run_dir: Path) -> dict:
    """Read the run's Redis (from its AOF) and ledger; return the books."""
    lines = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines() if x]
    trained = [g for line in lines for g in line["trained"]]
    filtered = [g for line in lines for ids in line["filtered"].values() for g in ids]
    failed = [g for line in lines for ids in line["failed"].values() for g in ids]
    server = start_redis(run_dir / "redis")
    try:
        c = server.client()
        keys = RunKeys(run_dir.name)  # the run id is the run directory's name
        produced = {k.decode(): int(v) for k, v in c.hgetall(keys.produced).items()}
        below, gone = trimmed(c, keys)  # the checkpoint trim's share (rollout/books.py)
        stream = keys.trajectories
        (learner,) = [g for g in c.xinfo_groups(stream) if g["name"].decode() == LEARNER_GROUP]
        last = learner["last-delivered-id"].decode()
        pending = c.xpending_range(stream, LEARNER_GROUP, min="-", max="+", count=10**6)
        buffered_ids = {p["message_id"] for p in pending}
        buffered_ids |= {e for e, _ in c.xrange(stream, min=f"({last}", max="+")}
        buffered = [
            decode_group(f[b"group"]).group_id for _, f in c.xrange(stream) if _ in buffered_ids
        ]
        issued = int(c.get(keys.issued))
        tasks = keys.tasks
        held = {p["message_id"] for p in c.xpending_range(tasks, WORKER_GROUP, "-", "+", 10**6)}
        unread = _id(c.xinfo_groups(tasks)[0]["last-delivered-id"])
        in_flight = {
            f[b"group_id"].decode() for e, f in c.xrange(tasks) if e in held or _id(e) > unread
        }
    finally:
        server.stop()
    return {
        "produced": produced,
        "trimmed": {"ids": {f"t{i}" for i in range(below)}, "produced": gone},
        "trained": trained,
        "filtered": filtered,
        "failed": failed,
        "buffered": buffered,
        "issued": issued,
        "in_flight": in_flight,
        "steps": [line["step"] for line in lines],
    }


def _id(entry: bytes) -> tuple[int, int]:
    ms, _, seq = entry.decode().partition("-")
    return int(ms), int(seq or 0)


def produced_total(books: dict) -> int:
    """Groups produced, counting the copies whose :produced fields the trim deleted."""
    return sum(books["produced"].values()) + books["trimmed"]["produced"]


def produced_ids(books: dict) -> set[str]:
    return set(books["produced"]) | books["trimmed"]["ids"]


def books_line(books: dict) -> str:
    produced = produced_total(books)
    kept = len(books["trained"]) + len(books["filtered"]) + len(books["failed"])
    lost = produced - kept - len(books["buffered"])
    return (
        f"produced {produced} = trained {len(books['trained'])} + filtered "
        f"{len(books['filtered'])} + failed {len(books['failed'])} + buffered "
        f"{len(books['buffered'])}; lost {lost} (issued {books['issued']}, "
        f"in flight {len(books['in_flight'])})"
    )


def check_books(books: dict, steps: int, scenario: str = "") -> None:
    """Print the books line; assert 0 lost, none trained twice, every issued task somewhere,
    and a ledger line for each of steps 1..`steps` (no gap, no duplicate after a resume)."""
    print(f"[{scenario}] " * bool(scenario) + books_line(books))
    produced = produced_total(books)
    kept = len(books["trained"]) + len(books["filtered"]) + len(books["failed"])
    assert books["steps"] == list(range(1, steps + 1))
    assert not [g for g, n in Counter(books["trained"]).items() if n > 1]  # never twice
    assert produced - kept - len(books["buffered"]) == 0  # lost
    accounted = set(books["trained"]) | set(books["filtered"]) | set(books["failed"])
    assert produced_ids(books) == accounted | set(books["buffered"])
    issued = {f"t{i}" for i in range(books["issued"])}
    assert issued == produced_ids(books) | books["in_flight"]  # every task is somewhere
