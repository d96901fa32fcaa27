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
    settle push k-1 (it travelled while
      step k trained); start push k
      (staged by the workers); publish
      the learner version; start step k+1
      (no barrier) unless step k saves or
      evaluates
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

from rl import faults
from rl.learner.checkpoint import read_json
from rl.learner.group_ids import GroupIds
from rl.learner.ledger import group_ids
from rl.observe.evaluate import EVAL_SEED_OFFSET
from rl.observe.metrics import rollout_metrics
from rl.run.build import sampling
from rl.run.failures import stops_on_skips
from rl.run.fleet import Fleet
from rl.run.interrupts import handled, raise_if_interrupted
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
    fleet = Fleet(learner, workers, client, keys, cfg.weights)
    late: list = []  # workers' counters asked for and not answered yet: read at a later step
    ahead = None  # (step, ref): the next learner step, started before this step's bookkeeping
    limit = cfg.metrics.trajectories
    last = time.perf_counter()
    try:
        for step in range(state.step + 1, t.steps + 1):
            _check_serving(serving)
            feeder.top_up(version=step - 1)
            started = ahead[1] if ahead else None
            metrics, entry, records = _learner_step(learner, serving, limit, started)
            ahead = None  # booked below
            asked = [*late, *((i, w.drain.remote()) for i, w in enumerate(workers))]
            metrics.update(fleet.settle())  # push step-1 travelled while this step trained
            publish = time.perf_counter()
            metrics.update(fleet.start())
            publish = time.perf_counter() - publish
            client.set(keys.learner_version, step)
            feeder.top_up(version=step)
            # no barrier: the learner trains step+1 while the driver books this one, unless
            # this step saves a checkpoint or evaluates (those need the learner as it is now),
            # or its skipped steps stop the run (step+1 would ack groups no ledger line names)
            pause = tail.pauses_after(step) or stops_on_skips(metrics, t.max_skipped_steps)
            ahead = None if pause else (step + 1, learner.step_with_records.remote(limit))
            tail.write_records(step, entry, records)
            faults.slow_driver(cfg.testing.faults)  # testing.faults (rl/faults.py)
            now = time.perf_counter()
            seconds, last = now - last, now
            metrics.update(_worker_metrics(len(workers), asked, seconds, late))
            metrics.update(idle_share(metrics, seconds, publish))
            metrics["step/seconds"] = seconds
            metrics["tasks/issued"] = float(feeder.issued())
            metrics["tasks/backlog"] = float(feeder.queue.backlog())
            tail.finish(step, metrics)
        fleet.settle()  # the last version reaches every worker before the run ends
    except (Exception, KeyboardInterrupt):  # the run stops (RunAborted, a dead worker, Ctrl-C)
        handled()  # stopping now: only a further Ctrl-C interrupts the stop
        if ahead is not None:  # started in this iteration (step + 1) or the last (step)
            _stop_ahead(client, keys, *ahead, tail)
        raise
    finally:
        bar.close()
        _stop_serving(workers, serving)


def _stop_serving(workers: list, serving: list) -> None:
    """Tell every serve loop to stop and wait up to 60 s for them; what comes next on a worker
    (the final evaluation) waits for its own loop's end (rl/run/actors.py _after_serving)."""
    for w in workers:
        w.stop_serving.remote()
    _, running = ray.wait(serving, num_returns=len(serving), timeout=60)
    if running:
        logger.warning(f"{len(running)} serve loop(s) still stopping after 60 s")


def idle_share(metrics: dict, seconds: float, publish: float) -> dict[str, float]:
    """The share of the step's wall time in which the learner computed nothing: waiting for
    groups, or for the driver (a push it starts is the learner's work: it exports)."""
    if "learner/seconds" not in metrics or seconds <= 0:
        return {}
    busy = metrics["learner/seconds"] - metrics.get("learner/wait_seconds", 0.0) + publish
    return {"learner/busy_seconds": busy, "learner/idle_share": max(0.0, 1.0 - busy / seconds)}


def trim_at_checkpoint(client, keys: RunKeys, checkpoint: Path) -> dict[str, int]:
    """The books below the committed checkpoint's trained watermark (rollout/books.py): read
    from its learner.json, which is what a resume from it restores."""
    trained = GroupIds.from_json(read_json(checkpoint / "learner.json").get("trained", []))
    below = trained.watermark(TASK_FAMILY)
    trimmed = trim_books(client, keys, family=TASK_FAMILY, below=below)
    logger.debug(f"books trimmed below {TASK_FAMILY}{below} at {checkpoint.name}: {trimmed}")
    return trimmed


STOP_WAIT_S = 600.0
"""How long a stopping run waits for a learner step it had started to stop or finish."""


def _wait_interruptibly(ref, timeout_s: float) -> list:
    """ray.wait([ref], timeout=timeout_s) in WAIT_SLICE_S slices; a Ctrl-C raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, _ = ray.wait([ref], timeout=max(0.0, min(WAIT_SLICE_S, deadline - time.monotonic())))
        if done or time.monotonic() >= deadline:
            return done
        raise_if_interrupted()


def _stop_ahead(client, keys: RunKeys, step: int, ahead, tail: StepTail) -> None:
    """The run stops while learner step `step` runs: tell the learner (it reads no more and
    acks nothing, so the step's groups stay pending for a resume), then book the step if it
    finished before it saw the stop: its groups are acked, and the ledger must name them. A
    stopped step's ledger names only what it acked while reading (duplicates, dead letters).
    Never raises: the error that stopped the run is the one to report."""
    try:
        client.set(keys.learner_stop, 1)
        done, _ = ray.wait([ahead], timeout=2.0)
        if not done:  # a step mid-training ends first (minutes at long context)
            logger.info(f"stopping: waiting for learner step {step} (Ctrl-C again: leave now)")
            done = _wait_interruptibly(ahead, STOP_WAIT_S)
        if not done:
            logger.warning(f"learner step {step} did not stop within {STOP_WAIT_S:g} s")
            return
        metrics, entry, records = ray.get(ahead)
        if not metrics.get("learner/stopped"):
            tail.write_records(step, entry, records)  # it finished first: its ledger line
            logger.info(f"learner step {step} ended before the stop; its ledger line is written")
        elif group_ids(entry):
            tail.write_records(step, entry, [])
    except ray.exceptions.RayError:  # the learner died: what it had not acked stays pending
        logger.debug(f"learner step {step} ended with its process")
    except Exception as exc:  # Redis lost, the disk full...
        logger.warning(f"while stopping learner step {step}: {type(exc).__name__}: {exc}")


def _check_serving(serving: list) -> None:
    """A worker's serve loop never returns while the run goes on: if one did, raise its error
    (a crash that Ray restarts is retried by Ray and does not show up here)."""
    done, _ = ray.wait(serving, num_returns=len(serving), timeout=0)
    for ref in done:
        ray.get(ref)
        raise RuntimeError("a rollout worker stopped serving before the run ended")


def _learner_step(learner, serving: list, limit: int, ahead=None) -> tuple[dict, dict, list]:
    """learner.step() with its ledger entry and trajectory records (`ahead`: the step already
    started), watching the workers meanwhile: a serve loop that dies with an error (not a crash
    Ray restarts) fails the run now instead of the learner timing out later."""
    raise_if_interrupted()  # a Ctrl-C some library call swallowed (rl/run/interrupts.py)
    ref = ahead if ahead is not None else learner.step_with_records.remote(limit)
    while True:
        ready, _ = ray.wait([ref, *serving], num_returns=1, timeout=WAIT_SLICE_S)
        if ref in ready:
            return ray.get(ref)
        raise_if_interrupted()
        if ready:
            _check_serving(serving)


WAIT_SLICE_S = 1.0
"""The driver's waits on Ray are cut into slices this long, checking between them for a Ctrl-C
that a library call swallowed (rl/run/interrupts.py)."""


COUNTERS = {
    "workers/idle_seconds": "idle_seconds",
    "workers/paused_seconds": "paused_seconds",
    "workers/restored_episodes": "restored_episodes",
    "workers/restore_failures": "restore_failures",
    "workers/refused_groups": "refused_groups",
    "workers/caught_up": "caught_up",
    "workers/sampled_tokens": "sampled_tokens",
}
"""Metric -> the key summed over the workers' drained counters (`workers/restarted`, a gauge
of each worker's restarts so far, is summed over workers, once each)."""


DRAIN_WAIT_S = 2.0
"""How long the driver waits for the workers' counters (asked for as the learner's step ended,
answered while the push starts): a busy or restarting worker is read at a later step."""


def _worker_metrics(count: int, asked: list, seconds: float, late: list) -> dict[str, float]:
    """The workers' counters since the last step (`asked`: (worker index, reference) pairs).
    A worker that has not answered within DRAIN_WAIT_S (busy, or restarting) is read at a later
    step, so its drained counters are never dropped. `late` is refilled with the pairs still
    unanswered."""
    refs = [ref for _, ref in asked]
    ready, _ = ray.wait(refs, num_returns=len(asked), timeout=DRAIN_WAIT_S)
    ready = set(ready)
    late[:] = [(i, ref) for i, ref in asked if ref not in ready]
    answers = [(i, _answer(ref)) for i, ref in asked if ref in ready]
    stats = [s for _, s in answers if s is not None]
    missing = {i for i, _ in late} | {i for i, s in answers if s is None}
    tokens = {
        i: None if i in missing else sum(s.get("sampled_tokens", 0.0) for j, s in answers if j == i)
        for i in range(count)
    }
    out = {name: sum(s.get(key, 0.0) for s in stats) for name, key in COUNTERS.items()}
    restarts: dict[int, float] = {}  # a gauge per worker: a late and a fresh answer count once
    for i, s in answers:
        if s is not None:
            restarts[i] = max(restarts.get(i, 0.0), s.get("restarts", 0.0))
    out["workers/restarted"] = sum(restarts.values())
    out["workers/answering"] = float(len({i for i, s in answers if s is not None}))
    out.update(token_share_min(tokens))
    episodes = [{**s, "seconds": seconds} for s in stats if s.get("episodes")]
    if episodes:
        out.update(rollout_metrics(episodes))
    return out


def _answer(ref) -> dict | None:
    """A worker's counters, or None when it died with the call (its restart reports). A call
    that raised is a bug in the worker: it stops the run, as in sync mode, rather than leave
    the step's rollout metrics, and the env-error check on them, silently out."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError:
        raise
    except ray.exceptions.RayError:
        return None


def token_share_min(tokens: dict[int, float | None]) -> dict[str, float]:
    """The smallest share of the tokens sampled since the last step (in finished episodes or
    not) that one worker sampled: 1/N when N workers share the work evenly, 0 when one sat
    idle. Only when every worker answered."""
    counts = list(tokens.values())
    if len(counts) < 2 or None in counts or not sum(counts):
        return {}
    return {"workers/token_share_min": min(counts) / sum(counts)}
