"""`trainer.mode: async`: the workers never wait for the learner, the learner never waits for
the slowest episode.

    driver                                   rollout workers (rl/run/serving.py, rollout/serve.py)
    ------                                   ---------------
    release tasks up to                      claim tasks, run episodes (no barrier), XADD a
      (version + max_staleness + 1) x B      group + XACK its task in one transaction; install
      (admission control: generation         pushed weights between two decode steps; pause
      pauses, nothing is discarded)          while > max_staleness versions behind
    learner.step(): the next B groups as
      they arrive (ids already trained are
      skipped), ppo_epochs x mini-batches
    push weights (staged by the workers);
      publish the learner version
    metrics, ledger line, checkpoint (then
      trim the consumed stream entries and
      the finished books: rollout/books.py)

Tasks live in a Redis stream (AOF, fsync always), so a resume finds every task that was issued:
the ones a dead worker held are issued again (their episodes continue from the saved turns).
Task seeds are a function of (run seed, task index) alone, so no sampler state is needed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import ray
from tqdm import tqdm

from rl.learner.checkpoint import read_json
from rl.learner.group_ids import GroupIds
from rl.observe.evaluate import EVAL_SEED_OFFSET
from rl.observe.metrics import rollout_metrics
from rl.run.build import sampling
from rl.run.step import StepTail
from rollout.books import trim_books
from rollout.keys import RunKeys
from rollout.tasks import TaskQueue

logger = logging.getLogger(__name__)

TASK_FAMILY = "t"
"""Task i's group id is `t<i>` (rl/learner/group_ids.py keeps a watermark per such family)."""


def task_seed(run_seed: int, index: int) -> int:
    """Training task seeds stay below the evaluation range (held out)."""
    return int(np.random.default_rng([run_seed, index]).integers(0, EVAL_SEED_OFFSET))


class Feeder:
    """Releases tasks while started groups < (learner version + max_staleness + 1) x B."""

    def __init__(self, cfg, client, run_id: str) -> None:
        keys = RunKeys(run_id)
        self.cfg, self.client = cfg, client
        self.queue = TaskQueue(client, keys)
        self.issued_key = keys.issued

    def issued(self) -> int:
        return int(self.client.get(self.issued_key) or 0)

    def top_up(self, version: int) -> int:
        t = self.cfg.trainer
        allowed = (version + t.max_staleness + 1) * t.tasks_per_step
        start = self.issued()
        if start >= allowed:
            return 0
        tasks = [(f"{TASK_FAMILY}{i}", task_seed(self.cfg.seed, i)) for i in range(start, allowed)]
        self.queue.issue(tasks)
        self.client.set(self.issued_key, allowed)
        return len(tasks)


def async_train(cfg, learner, workers, renderer, log, state, run_dir: Path, client) -> None:
    t, keys = cfg.trainer, RunKeys(run_dir.name)
    feeder = Feeder(cfg, client, run_dir.name)
    requeued = feeder.queue.requeue_all_pending()  # tasks held by a dead job's workers
    if requeued:
        logger.info(f"{requeued} unfinished tasks issued again")
    client.set(keys.learner_version, state.step)
    serving = [w.serve.remote(sampling(cfg.rollout, renderer)) for w in workers]
    bar = tqdm(total=t.steps, initial=state.step, desc=f"{t.algorithm.upper()} async", unit="step")
    tail = StepTail(cfg, run_dir, learner, workers, renderer, log, state, bar)
    tail.on_checkpoint = lambda path: trim_at_checkpoint(client, keys, path)
    late: list = []  # workers' counters that did not answer in time: read at the next step
    try:
        for step in range(state.step + 1, t.steps + 1):
            start = time.perf_counter()
            _check_serving(serving)
            feeder.top_up(version=step - 1)
            metrics = _learner_step(learner, serving)
            metrics.update(tail.record(step))
            client.set(keys.learner_version, step)
            feeder.top_up(version=step)
            seconds = time.perf_counter() - start
            metrics.update(_worker_metrics(workers, seconds, late))
            metrics["step/seconds"] = seconds
            metrics["tasks/issued"] = float(feeder.issued())
            metrics["tasks/backlog"] = float(feeder.queue.backlog())
            tail.finish(step, metrics)
    finally:
        bar.close()
        for w in workers:
            w.stop_serving.remote()
        ray.wait(serving, num_returns=len(serving), timeout=60)


def trim_at_checkpoint(client, keys: RunKeys, checkpoint: Path) -> dict[str, int]:
    """The books below the committed checkpoint's trained watermark (rollout/books.py): read
    from its learner.json, which is what a resume from it restores."""
    trained = GroupIds.from_json(read_json(checkpoint / "learner.json").get("trained", []))
    below = trained.watermark(TASK_FAMILY)
    trimmed = trim_books(client, keys, family=TASK_FAMILY, below=below)
    logger.debug(f"books trimmed below {TASK_FAMILY}{below} at {checkpoint.name}: {trimmed}")
    return trimmed


def _check_serving(serving: list) -> None:
    """A worker's serve loop never returns while the run goes on: if one did, raise its error
    (a crash that Ray restarts is retried by Ray and does not show up here)."""
    done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
    for ref in done:
        ray.get(ref)
        raise RuntimeError("a rollout worker stopped serving before the run ended")


def _learner_step(learner, serving: list) -> dict:
    """learner.step(), watching the workers meanwhile: a serve loop that dies with an error
    (not a crash Ray restarts) fails the run now instead of the learner timing out later."""
    ref = learner.step.remote()
    while True:
        ready, _ = ray.wait([ref, *serving], num_returns=1)
        if ref in ready:
            return ray.get(ref)
        _check_serving(serving)


def _worker_metrics(workers, seconds: float, late: list) -> dict[str, float]:
    """The workers' counters since the last step. A worker that does not answer within 10 s
    (busy, or restarting) is read at a later step: its drained counters are never dropped.
    `late` holds (worker index, reference) pairs."""
    pairs = [*late, *((i, w.drain.remote()) for i, w in enumerate(workers))]
    ready, _ = ray.wait([ref for _, ref in pairs], num_returns=len(pairs), timeout=10)
    ready = set(ready)
    late[:] = [(i, ref) for i, ref in pairs if ref not in ready]
    answers = [(i, _answer(ref)) for i, ref in pairs if ref in ready]
    stats = [s for _, s in answers if s is not None]
    missing = {i for i, _ in late} | {i for i, s in answers if s is None}
    tokens = {
        i: None if i in missing else sum(s.get("sampled_tokens", 0.0) for j, s in answers if j == i)
        for i in range(len(workers))
    }
    out = {
        "workers/idle_seconds": sum(s.get("idle_seconds", 0.0) for s in stats),
        "workers/paused_seconds": sum(s.get("paused_seconds", 0.0) for s in stats),
        "workers/restored_episodes": sum(s.get("restored_episodes", 0.0) for s in stats),
        "workers/restore_failures": sum(s.get("restore_failures", 0.0) for s in stats),
        "workers/refused_groups": sum(s.get("refused_groups", 0.0) for s in stats),
        "workers/restarted": sum(s.get("restarts", 0.0) for s in stats),
        "workers/answering": float(len(stats)),
        "workers/sampled_tokens": sum(s.get("sampled_tokens", 0.0) for s in stats),
        **token_share_min(tokens),
    }
    episodes = [{**s, "seconds": seconds} for s in stats if s.get("episodes")]
    if episodes:
        out.update(rollout_metrics(episodes))
    return out


def _answer(ref) -> dict | None:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:  # the worker died with the call: its restart reports
        return None


def token_share_min(tokens: dict[int, float | None]) -> dict[str, float]:
    """The smallest share of the tokens sampled since the last step (in finished episodes or
    not) that one worker sampled: 1/N when N workers share the work evenly, 0 when one sat
    idle. Only when every worker answered."""
    counts = list(tokens.values())
    if len(counts) < 2 or None in counts or not sum(counts):
        return {}
    return {"workers/token_share_min": min(counts) / sum(counts)}
