"""The Redis key layout of a run (rollout/keys.py): pinned, since a run's Redis outlives the code
that wrote it (a resumed run, the chaos books, `agentrl monitor --redis` on another machine)."""

from __future__ import annotations

import dataclasses

import pytest

from rollout.keys import LEARNER_GROUP, WORKER_GROUP, RunKeys, dead_letter_stream

LAYOUT = {
    "prefix": "agentrl:run-7",
    "tasks": "agentrl:run-7:tasks",
    "attempts": "agentrl:run-7:attempts",
    "produced": "agentrl:run-7:produced",
    "issued": "agentrl:run-7:issued",
    "trajectories": "agentrl:run-7:trajectories",
    "dead_letters": "agentrl:run-7:trajectories:dead",
    "dead_letter_count": "agentrl:run-7:trajectories:dead:count",
    "trimmed": "agentrl:run-7:trimmed",
    "metrics": "agentrl:run-7:metrics",
    "learner_version": "agentrl:run-7:learner_version",
    "learner_stop": "agentrl:run-7:learner_stop",
    "killed_worker": "agentrl:run-7:fault:killed-worker",
}


def names(keys: RunKeys) -> dict[str, str]:
    """Every name `keys` gives: each property, and each per-item key for one sample item."""
    props = [n for n, v in vars(RunKeys).items() if isinstance(v, property)]
    return {
        **{n: getattr(keys, n) for n in props},
        "episodes": keys.episodes("g3"),
        "worker_starts": keys.worker_starts(2),
    }


def test_the_layout_of_a_run():
    keys = RunKeys("run-7")
    assert names(keys) == {
        **LAYOUT,
        "episodes": "agentrl:run-7:episodes:g3",
        "worker_starts": "agentrl:run-7:starts:worker-2",
    }
    assert dead_letter_stream(keys.trajectories) == keys.dead_letters
    assert (WORKER_GROUP, LEARNER_GROUP) == ("workers", "learner")


def test_names_are_distinct_and_under_the_run_prefix():
    keys = RunKeys("run-7")
    got = [v for n, v in names(keys).items() if n != "prefix"]
    assert len(set(got)) == len(got)
    assert all(v.startswith(keys.prefix + ":") for v in got)
    other = set(names(RunKeys("run-8")).values())
    assert not other & set(got)  # two runs sharing one Redis never touch each other's keys


def test_run_keys_are_frozen_values():
    keys = RunKeys("a")
    assert keys == RunKeys("a") and hash(keys) == hash(RunKeys("a"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        keys.run_id = "b"  # type: ignore[misc]


def test_a_pattern_run_id_matches_every_run():
    """`RunKeys("*")` spells glob patterns for KEYS/SCAN over every run in a Redis."""
    assert RunKeys("*").episodes("*") == "agentrl:*:episodes:*"
