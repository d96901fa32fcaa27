"""Weight push: learner -> object store -> every rollout worker, verified, with a deadline."""

from __future__ import annotations

import time

import ray


class WeightPushTimeout(TimeoutError):
    """Some workers did not install the new weights in time (their names are in the message)."""


def push_weights(learner, workers, *, timeout_s: float) -> tuple[int, float]:
    """Export the learner's weights once and install them on all workers; (version, seconds)."""
    start = time.perf_counter()
    package = learner.export.remote()  # stays in the object store; workers read it zero-copy
    pending = {w.load_weights.remote(package): i for i, w in enumerate(workers)}
    ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if not_ready:
        names = ", ".join(f"worker-{pending[ref]}" for ref in not_ready)
        for ref in not_ready:
            ray.cancel(ref, force=False)
        raise WeightPushTimeout(
            f"weight push not acknowledged within {timeout_s:.0f} s by: {names}"
        )
    versions = ray.get(ready)  # raises here if a worker rejected the weights (bad checksum)
    if len(set(versions)) != 1:
        raise RuntimeError(f"workers report different versions after a push: {versions}")
    return versions[0], time.perf_counter() - start
