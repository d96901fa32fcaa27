"""WorkerHost (rl/run/actors.py) methods that run beside an async serve loop, in process: the
actor's state is set by hand (no Ray, no model), the worker is a small fake."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rl.run.actors import WorkerHost


def host_with_fake_worker(calls: list) -> WorkerHost:
    host = WorkerHost.__new__(WorkerHost)  # __init__ builds a real worker; these need none
    host.index = 0
    host.serve_ended = threading.Event()  # a serve loop still winding down
    host.worker = SimpleNamespace(
        policy=SimpleNamespace(reseed=lambda seed: None),
        evaluate=lambda *args: calls.append(args) or ([], {}),
    )
    return host


def test_an_evaluation_waits_until_the_serve_loop_has_ended():
    """The final evaluation uses the serve loop's decode session; the driver waits only 60 s
    for the loops to stop, so a worker whose loop is still in a long decode step must not start
    evaluating beside it."""
    calls: list = []
    host = host_with_fake_worker(calls)
    evaluating = threading.Thread(target=host.evaluate, args=([7], 1, None))
    evaluating.start()
    time.sleep(0.5)
    assert calls == [] and evaluating.is_alive()  # held while the loop runs
    host.serve_ended.set()
    evaluating.join(10)
    assert calls == [([7], 1, None)]


def test_a_serve_loop_that_never_ends_fails_the_evaluation_by_name():
    host = host_with_fake_worker([])
    with pytest.raises(RuntimeError, match=r"worker-0: its serve loop did not stop within 0.2 s"):
        host._after_serving(limit_s=0.2)


@pytest.mark.distributed
def test_a_drain_that_raises_stops_the_run_and_a_dead_worker_does_not():
    """The async driver's read of a worker's counters (rl/run/async_loop.py _answer): a worker
    that died with the call reports after its restart (None), but a call that raised is a bug
    that must stop the run; it had been taken for a death, leaving the step's rollout metrics
    and the env-error check on them silently out."""
    import ray

    from rl.run.async_loop import _answer

    @ray.remote
    class Drains:
        def drain(self):
            raise AttributeError("'NoneType' object has no attribute 'startswith'")

        def die(self):
            import os

            os._exit(1)

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="error")
    try:
        worker = Drains.remote()
        with pytest.raises(ray.exceptions.RayTaskError, match="startswith"):
            _answer(worker.drain.remote())
        assert _answer(worker.die.remote()) is None
    finally:
        ray.shutdown()
