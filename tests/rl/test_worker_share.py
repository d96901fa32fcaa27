"""The async driver's `workers/token_share_min`: how evenly the rollout workers share the work."""

from __future__ import annotations

from rl.run.async_loop import token_share_min


def test_an_idle_worker_shows_as_a_zero_share():
    assert token_share_min({0: 0.0, 1: 96.0}) == {"workers/token_share_min": 0.0}
    assert token_share_min({0: 48.0, 1: 48.0}) == {"workers/token_share_min": 0.5}
    assert token_share_min({0: 10.0, 1: 30.0, 2: 60.0}) == {"workers/token_share_min": 0.1}


def test_no_share_without_every_worker_or_any_tokens():
    assert token_share_min({0: 48.0, 1: None}) == {}  # worker 1 late or restarting
    assert token_share_min({0: 0.0, 1: 0.0}) == {}
    assert token_share_min({0: 48.0}) == {}  # one worker: nothing to share
