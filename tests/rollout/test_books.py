"""Bounded books (rollout/books.py) on a real redis-server: the checkpoint trim deletes the task
entries, attempts and produced fields of the groups below the trained watermark and the old dead
letters, and nothing a resume still needs; dead letters are counted and name their group."""

from __future__ import annotations

import dataclasses

from rollout.books import trim_books, trimmed
from rollout.keys import RunKeys
from rollout.stream import RedisGroupReader, RedisTrajectoryStream, dead_letter_total
from rollout.tasks import TaskQueue
from tests.rollout.test_codec_stream import sample_group

KEYS = RunKeys("books")


def group(group_id: str):
    return dataclasses.replace(sample_group(1), group_id=group_id)


def test_the_trim_keeps_what_a_resume_needs(redis_server):
    client = redis_server.client()
    queue = TaskQueue(client, KEYS)
    queue.issue([(f"t{i}", i) for i in range(10)])
    tasks = queue.claim("w0", 8, idle_ms=60_000)  # t8, t9 stay unread
    for task in tasks[:6]:
        assert queue.complete(task, group(task.group_id), consumer="w0")
    # t0..t3 trained (watermark 4); t4, t5 produced, not yet trained; t6, t7 pending
    backlog = queue.backlog()  # 2 pending + 2 unread (the unread where Redis >= 7 says)
    out = trim_books(client, KEYS, family="t", below=4)
    assert out == {"tasks": 4, "attempts": 4, "produced": 4, "episodes": 0, "dead_letters": 0}
    left = [f[b"group_id"].decode() for _, f in client.xrange(KEYS.tasks)]
    assert left == [f"t{i}" for i in range(4, 10)]
    assert queue.produced() == {"t4": 1, "t5": 1}
    assert sorted(k.decode() for k in client.hkeys(KEYS.attempts)) == [f"t{i}" for i in range(4, 8)]
    assert trimmed(client, KEYS) == (4, 4)
    assert queue.backlog() == backlog

    # a pending entry blocks the trim of everything after it, even when trained
    out = trim_books(client, KEYS, family="t", below=10)
    assert out["tasks"] == 2 and out["produced"] == 2 and trimmed(client, KEYS) == (10, 6)
    assert client.xlen(KEYS.tasks) == 4  # t6, t7 pending; t8, t9 unread
    # a whole-job restart issues the dead job's pending tasks again: they are all still there
    assert queue.requeue_all_pending() == 2
    assert {t.group_id for t in queue.claim("w1", 8, idle_ms=60_000)} == {"t6", "t7", "t8", "t9"}
    assert trim_books(client, KEYS, family="t", below=3)["tasks"] == 0
    assert trimmed(client, KEYS) == (10, 6)  # the watermark recorded never goes back


def test_the_trim_before_any_task_or_letter_is_a_no_op(redis_server):
    client = redis_server.client()
    out = trim_books(client, KEYS, family="t", below=5)
    assert set(out.values()) == {0}
    TaskQueue(client, KEYS)
    assert trim_books(client, KEYS, family="t", below=5)["tasks"] == 0


def test_dead_letters_are_counted_name_their_group_and_are_trimmed(redis_server):
    client = redis_server.client()
    stream = KEYS.trajectories
    reader = RedisGroupReader(client, stream, group="learner", consumer="c0")
    client.xadd(stream, {"group": b"not msgpack \xff", "group_id": "t0"})
    client.xadd(stream, {"group": b"\x00"})  # an entry without its id
    RedisTrajectoryStream(client, stream).put(group("t2"))
    got = reader.read(10, block_ms=100)
    assert [g.group_id for _, g in got] == ["t2"] and reader.take_dead_letters() == ["t0"]
    assert reader.take_dead_letters() == [] and dead_letter_total(client, stream) == 2
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    old = trim_books(client, KEYS, family="t", below=0, dead_before_ms=now_ms - 60_000)
    assert set(old.values()) == {0}
    assert trim_books(client, KEYS, family="t", below=0)["dead_letters"] == 2
    assert client.xlen(KEYS.dead_letters) == 0 and dead_letter_total(client, stream) == 2


def test_only_the_families_own_canonical_ids_are_trimmed(redis_server):
    client = redis_server.client()
    for field in ("t1", "t01", "x1", "t", "tt1", "t12"):
        client.hset(KEYS.produced, field, 1)
    trim_books(client, KEYS, family="t", below=5)
    left = sorted(k.decode() for k in client.hkeys(KEYS.produced))
    assert left == ["t", "t01", "t12", "tt1", "x1"]


def test_saved_episodes_left_behind_below_the_watermark_go(redis_server):
    """A worker whose task was taken over may save a turn after the other completed the group:
    the trim deletes such leftovers of groups below the watermark, never a live group's."""
    client = redis_server.client()
    queue = TaskQueue(client, KEYS)
    for group_id in ("t1", "t3", "t30", "x1"):
        queue.save_episodes(group_id, {0: b"saved"})
    queue.save_episodes("t1", {1: b"saved"})
    assert trim_books(client, KEYS, family="t", below=4)["episodes"] == 2
    assert sorted(k.decode() for k in client.keys(KEYS.episodes("*"))) == [
        KEYS.episodes("t30"),
        KEYS.episodes("x1"),
    ]
    glob = RunKeys("r[1]*")  # a run id with glob characters matches itself only
    TaskQueue(client, glob).save_episodes("t0", {0: b"saved"})
    assert trim_books(client, RunKeys("r1x"), family="t", below=4)["episodes"] == 0
    assert trim_books(client, glob, family="t", below=4)["episodes"] == 1
