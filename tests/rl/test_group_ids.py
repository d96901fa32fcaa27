"""The learner's trained-id set (rl/learner/group_ids.py): a watermark plus a sparse set per id
family behaves exactly like a plain set, and stays small when groups finish nearly in order."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rl.learner.group_ids import GroupIds

UNIVERSE = [
    *(f"t{i}" for i in range(40)),  # async tasks
    *(f"{s}-{i}" for s in range(8) for i in range(6)),  # sync steps
    *(f"x{s}-{i}" for s in range(3) for i in range(3)),
    *(f"{i}" for i in range(5)),
    *(f"{i}#{j}" for i in range(3) for j in range(2)),  # tests' ids
    "t007", "t0x", "07-1", "1-2-3", "a", "", "-",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    order=st.permutations(UNIVERSE),
    keep=st.lists(st.booleans(), min_size=len(UNIVERSE), max_size=len(UNIVERSE)),
    cuts=st.sets(st.integers(0, len(UNIVERSE))),
)
def test_membership_equals_a_plain_sets_in_any_order(order, keep, cuts):
    ids, plain = GroupIds(), set()
    for i, (group_id, kept) in enumerate(zip(order, keep, strict=True)):
        if i in cuts:  # a checkpoint and a resume in between
            ids = GroupIds.from_json(json.loads(json.dumps(ids.to_json())))
        if kept:
            ids.add(group_id)
            plain.add(group_id)
        if i % 7 == 0:
            assert [g in ids for g in UNIVERSE] == [g in plain for g in UNIVERSE]
    assert [g in ids for g in UNIVERSE] == [g in plain for g in UNIVERSE]
    assert len(ids) == len(plain)
    assert ids == GroupIds(sorted(plain)) == GroupIds.from_json(sorted(plain))


def test_a_seeded_shuffle_of_many_ids_matches_a_plain_set():
    rng = random.Random(0)
    universe = [f"t{i}" for i in range(3000)] + [f"{s}-{i}" for s in range(60) for i in range(20)]
    chosen = [g for g in universe if rng.random() < 0.9]
    rng.shuffle(chosen)
    ids, plain = GroupIds(), set()
    for n, group_id in enumerate(chosen):
        ids.add(group_id)
        plain.add(group_id)
        if n % 500 == 0:
            ids = GroupIds.from_json(ids.to_json())
    assert all((g in ids) == (g in plain) for g in universe)
    assert len(ids) == len(plain)


def test_ids_finishing_nearly_in_order_stay_small():
    """100,000 async groups finishing up to 64 out of order, and 2,000 sync steps of 64 groups:
    the checkpointed form holds the out-of-order window (a few hundred ids), not the run."""
    rng, ids, largest = random.Random(1), GroupIds(), 0
    window: list[int] = []
    for i in range(100_000):
        window.append(i)
        if len(window) == 64:  # a batch of 64 finishes in random order
            rng.shuffle(window)
            for j in window[:48]:
                ids.add(f"t{j}")
            window = window[48:]
            largest = max(largest, len(json.dumps(ids.to_json())))
    ids.update(f"t{j}" for j in window)
    assert largest < 4_000 and ids.to_json()["families"] == {"t": [100_000, []]}
    for step in range(1, 2001):
        ids.update(f"{step}-{i}" for i in rng.sample(range(64), 64))
    saved = ids.to_json()
    assert len(json.dumps(saved)) < 1_000 and saved["runs"] == [["", "-", 1, 2000, 64]]
    assert "2000-63" in ids and "2000-64" not in ids and "2001-0" not in ids
    ids.add("17-64")  # a late id of a folded step splits the run
    assert "17-64" in ids and "17-65" not in ids and "18-64" not in ids and "16-63" in ids


def test_an_old_checkpoints_plain_list_loads():
    old = sorted(["t0", "t1", "t2", "t5", "3-0", "3-1", "7#0"])  # learner.json before
    ids = GroupIds.from_json(old)
    assert all(g in ids for g in old) and len(ids) == len(old)
    assert "t3" not in ids and "3-2" not in ids and ids.watermark("t") == 3
    assert GroupIds.from_json(ids.to_json()) == ids
