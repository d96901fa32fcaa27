"""The Redis key layout of a run: every key and stream name, spelled here and nowhere else.

All of a run's keys sit under one prefix, `agentrl:<run id>` (the run id is the run directory's
name). `RunKeys(run_id)` names each of them; product code asks it instead of building names.

    key (after the prefix)   type    written by -> read by
    :tasks                   stream  the driver issues (group id, seed) tasks, and issues again
                                     those a dead job held (rl/run/async_loop.py Feeder, through
                                     rollout/tasks.py TaskQueue) -> the rollout workers
                                     (TaskQueue.claim, consumer group `workers`)
    :attempts                hash    group id -> claims so far: the workers, at each claim
                                     (TaskQueue) -> the same (a task's attempt number)
    :produced                hash    group id -> times completed: the workers
                                     (TaskQueue.complete) -> TaskQueue.produced, the chaos books
                                     (tests/chaos/books.py)
    :trimmed                 hash    what the checkpoint trim deleted (rollout/books.py):
                                     "below" (the fields of task groups t0..t<below - 1> are
                                     gone from :attempts and :produced), "produced" (the sum of
                                     the :produced counts deleted) -> the chaos books
    :episodes:<group id>     hash    episode index -> a saved unfinished episode: the workers
                                     (TaskQueue.save_episodes; deleted by complete) -> a worker
                                     retrying the task (TaskQueue.saved_episodes)
    :issued                  string  tasks issued so far: the driver (Feeder) -> the same
    :trajectories            stream  one entry per group: the workers (TaskQueue.complete; sync
                                     mode rollout/stream.py RedisTrajectoryStream) -> learner
                                     rank 0 (RedisGroupReader, consumer group `learner`), the
                                     workers' staleness gate (the group's lag, rl/run/serving.py),
                                     the driver's redis metrics (rl/observe/metrics.py)
    :trajectories:dead       stream  entries the learner cannot decode, with the reason
                                     (RedisGroupReader) -> people and tests; trimmed at each
                                     async checkpoint (rollout/books.py)
    :trajectories:dead:count string  dead letters so far (INCR with each; kept by the trim)
                                     -> the metric stream/dead_letters (rl/observe/metrics.py)
    :metrics                 stream  metrics.jsonl records: the driver (rl/observe/metrics.py
                                     MetricsLogger) -> `agentrl monitor --redis`
                                     (rl/observe/monitor.py RedisSource)
    :learner_version         string  the learner's version after each step: the driver (async
                                     mode, rl/run/async_loop.py) -> the workers' staleness gate
    :learner_stop            string  set by the driver when an async run stops with a learner
                                     step already started (deleted when a job starts,
                                     rl/run/train.py) -> the learner (RedisGroupReader.stopped):
                                     it reads no more and acks nothing more, so that step's
                                     groups stay pending
    :starts:worker-<index>   string  rollout worker <index>: INCR at each start
                                     (rl/run/actors.py WorkerHost) -> the same (its incarnation)
    :fault:killed-worker     string  fault injection (testing.faults.kill_worker any): SET NX by
                                     the worker chosen to be killed (rl/run/serving.py) -> the
                                     other workers

Consumer groups: `workers` on `:tasks`, `learner` on `:trajectories`.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMESPACE = "agentrl"
WORKER_GROUP = "workers"
"""Consumer group of the rollout workers on the task stream."""
LEARNER_GROUP = "learner"
"""Consumer group of the learner on the trajectory stream."""


def dead_letter_stream(stream: str) -> str:
    """Where a consumer of `stream` puts entries it cannot decode."""
    return f"{stream}:dead"


def dead_letter_count(stream: str) -> str:
    """How many entries of `stream` went to its dead letters (a counter the trim keeps)."""
    return f"{dead_letter_stream(stream)}:count"


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The Redis keys of run `run_id` (see the module docstring for the table)."""

    run_id: str

    @property
    def prefix(self) -> str:
        return f"{NAMESPACE}:{self.run_id}"

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def tasks(self) -> str:
        return self._key("tasks")

    @property
    def attempts(self) -> str:
        return self._key("attempts")

    @property
    def produced(self) -> str:
        return self._key("produced")

    def episodes(self, group_id: str) -> str:
        """The saved unfinished episodes of one group."""
        return self._key("episodes", group_id)

    @property
    def issued(self) -> str:
        return self._key("issued")

    @property
    def trajectories(self) -> str:
        return self._key("trajectories")

    @property
    def dead_letters(self) -> str:
        return dead_letter_stream(self.trajectories)

    @property
    def dead_letter_count(self) -> str:
        return dead_letter_count(self.trajectories)

    @property
    def trimmed(self) -> str:
        return self._key("trimmed")

    @property
    def metrics(self) -> str:
        return self._key("metrics")

    @property
    def learner_version(self) -> str:
        return self._key("learner_version")

    @property
    def learner_stop(self) -> str:
        return self._key("learner_stop")

    def worker_starts(self, index: int) -> str:
        """Counts the starts (incarnations) of rollout worker `index`."""
        return self._key("starts", f"worker-{index}")

    @property
    def killed_worker(self) -> str:
        """Fault injection (testing.faults.kill_worker any): the worker chosen to be killed."""
        return self._key("fault", "killed-worker")
