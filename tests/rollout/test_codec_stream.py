from __future__ import annotations

import msgpack
import numpy as np
import pytest

from rollout.codec import CodecError, decode_group, encode_group
from rollout.keys import dead_letter_stream
from rollout.stream import RedisGroupReader, RedisTrajectoryStream
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup


def sample_group(n=3) -> TrajectoryGroup:
    trajs = []
    for i in range(n):
        t = Trajectory(
            task_id="agentrl/Calculator-v0#7", messages=[{"role": "user", "content": "é→中"}]
        )
        t.append([1, 2, 3], sampled=False)
        t.append([40000 + i, 5], sampled=True, logprobs=[-0.25, -1.5], version=3)
        t.status, t.outcome, t.reward = (
            RolloutStatus.COMPLETED,
            {"success": i == 0, "details": {}},
            float(i == 0),
        )
        t.reward_parts, t.num_tool_calls = {"task_completion": float(i == 0)}, 1
        t.env_reward = 0.75 - i  # the env's own step rewards, summed
        trajs.append(t)
    return TrajectoryGroup(group_id="1-0", task_id="agentrl/Calculator-v0#7", trajectories=trajs)


def test_round_trip_is_exact():
    group = sample_group()
    back = decode_group(encode_group(group))
    assert back == group


def test_routes_round_trip_as_int16_arrays():
    group = sample_group()
    routes_TMK = (np.arange(4 * 3 * 2) * 1400 - 1).astype(np.int16).reshape(4, 3, 2)
    group.trajectories[0].routed_experts = routes_TMK  # [T-1, M, K], -1 and 32199 included
    back = decode_group(encode_group(group)).trajectories
    got = back[0].routed_experts
    assert got.dtype == np.int16 and got.flags.writeable and back[1].routed_experts is None
    np.testing.assert_array_equal(got, routes_TMK)
    payload = msgpack.unpackb(encode_group(group))
    payload["trajectories"][0]["routed_experts"]["shape"] = [5, 3, 2]
    with pytest.raises(CodecError):
        decode_group(msgpack.packb(payload))


def test_codec_rejects_foreign_payloads():
    for bad in [
        b"",
        b"\x93\x01\x02",
        msgpack.packb({"v": 99}),
        msgpack.packb({"v": 1, "trajectories": [{}]}),
    ]:
        with pytest.raises(CodecError):
            decode_group(bad)


def test_stream_delivers_and_keeps_unacked_entries_pending(redis_server):
    client = redis_server.client()
    writer = RedisTrajectoryStream(client, "s")
    reader = RedisGroupReader(client, "s", group="learner", consumer="c0")
    ids = [writer.put(sample_group()) for _ in range(3)]
    got = reader.read(10, block_ms=100)
    assert [entry_id for entry_id, _ in got] == ids
    assert got[0][1] == sample_group()
    assert reader.pending() == 3
    assert reader.ack(ids[:2]) == 2
    assert reader.pending() == 1
    assert reader.read(10, block_ms=50) == []  # delivered once to this group


def test_the_reader_sees_the_run_stop_through_its_key(redis_server):
    client = redis_server.client()
    reader = RedisGroupReader(client, "s", group="learner", consumer="c0", stop_key="s:stop")
    assert not reader.stopped()
    client.set("s:stop", 1)  # the driver stopping an async run (rl/run/async_loop.py)
    assert reader.stopped()
    assert not RedisGroupReader(client, "s", group="learner", consumer="c1").stopped()


def test_poison_entry_goes_to_dead_letters(redis_server):
    client = redis_server.client()
    reader = RedisGroupReader(client, "s", group="learner", consumer="c0")
    client.xadd("s", {"group": b"not msgpack \xff"})
    RedisTrajectoryStream(client, "s").put(sample_group())
    got = reader.read(10, block_ms=100)
    assert len(got) == 1 and reader.dead_letters == 1
    assert client.xlen(dead_letter_stream("s")) == 1 and reader.pending() == 1


def test_entries_whose_reply_was_lost_are_read_again(redis_server):
    """Redis restarted mid-XREADGROUP: it recorded the delivery, the reader never saw the reply.
    The next read returns those entries (and never the ones the reader already holds)."""
    client = redis_server.client()
    writer = RedisTrajectoryStream(client, "s")
    reader = RedisGroupReader(client, "s", group="learner", consumer="c0")
    first = writer.put(sample_group())
    assert [e for e, _ in reader.read(10, block_ms=100)] == [first]
    lost = [writer.put(sample_group()) for _ in range(2)]
    client.xreadgroup("learner", "c0", {"s": ">"}, count=10)  # the reply that never arrived
    later = writer.put(sample_group())
    assert [e for e, _ in reader.read(10, block_ms=100)] == lost
    assert [e for e, _ in reader.read(10, block_ms=100)] == [later]
    reader.ack([first, *lost, later])
    assert reader.pending() == 0 and reader.read(10, block_ms=50) == []
