"""The async worker's loop, assembled inside a rollout worker actor (rl/run/actors.py WorkerHost).

The staleness gate lives here: a worker generates only while its weights are at most
`trainer.max_staleness` versions behind the learner's (published in Redis by the driver after
every step). A worker that Ray restarted comes back with its first weights and so waits for the
next push instead of producing far-off-policy tokens.
"""

from __future__ import annotations

import os
import signal
import time

import redis

from policy.sampling import SamplingParams
from rl import faults
from rl.run.launch import connect
from rollout.agent import AgentLoop
from rollout.keys import RunKeys
from rollout.serve import AsyncRollouts, ServeOptions
from rollout.tasks import TaskQueue


def serve_worker(host, params: SamplingParams) -> None:
    cfg, keys = host.cfg, RunKeys(host.run_id)
    client = connect(host.redis_url)
    worker = host.worker
    loop = AgentLoop(
        worker.session(),
        worker.renderer,
        worker.limits,
        tool_timeout_s=cfg.rollout.tool_timeout_s,
        deterministic=False,
        cache_budget=worker.cache_budget,
        tool_threads=worker.tool_threads,
    )
    host.rollouts = AsyncRollouts(
        worker,
        TaskQueue(client, keys),
        loop,
        ServeOptions(
            consumer=f"worker-{host.index}",
            group_size=cfg.trainer.group_size,
            max_episodes=max(cfg.rollout.max_episodes, cfg.trainer.group_size),
            token_budget=cfg.rollout.token_budget,
            workers=cfg.rollout.num_workers,
        ),
    )
    gate = StalenessGate(client, keys, cfg.trainer, loop.session)
    stop = host.stop_event.is_set
    kill = faults.kill_worker(cfg.testing.faults, host.index, host.starts)
    if kill is not None:
        groups, anyone = kill
        stop = _killer(host, groups, client, keys.killed_worker if anyone else None)
    host.rollouts.run(
        params,
        should_stop=stop,
        install=host._install_staged,
        may_generate=gate,
        starving=gate.starving,
    )


def _killer(host, groups: int, client, chosen: str | None):
    """Fault injection for the worker-crash tests: testing.faults.kill_worker="<index>:<groups>"
    SIGKILLs worker <index> (its first incarnation) once it has finished <groups> groups and
    holds an unfinished episode saved to Redis (so the crash is mid-episode): it saves its live
    episodes first, as a turn boundary or a spent token budget would, whether or not one came.
    <index> `any`: the first worker to get there (a Redis SET NX in `chosen` picks one), so the
    kill does not wait on which worker claims the tasks."""
    state = {"armed": True}

    def stop() -> bool:
        r = host.rollouts
        if state["armed"] and r.produced_groups >= groups and r.save_live():
            if chosen is None or client.set(chosen, host.index, nx=True):
                held = [RunKeys(host.run_id).episodes(g) for g in r.groups]
                faults.poison_saved(host.cfg.testing.faults, client, held)
                os.kill(os.getpid(), signal.SIGKILL)
            state["armed"] = False  # another worker was chosen
        return host.stop_event.is_set()

    return stop


class StalenessGate:
    """True while this worker's policy version is within `max_staleness` of the learner's.
    `starving()`: the learner has fewer than a batch of groups waiting (then a worker keeps
    generating past its token budget: a budget must never stall the run)."""

    def __init__(self, client, keys: RunKeys, trainer, session, every_s: float = 0.25):
        self.client, self.keys, self.session = client, keys, session
        self.max_staleness, self.batch = trainer.max_staleness, trainer.tasks_per_step
        self.every_s, self.checked, self.learner, self.waiting = every_s, 0.0, 0, 0

    def _refresh(self) -> None:
        if time.monotonic() - self.checked <= self.every_s:
            return
        self.learner = int(self.client.get(self.keys.learner_version) or 0)
        try:
            groups = self.client.xinfo_groups(self.keys.trajectories)
        except redis.ResponseError:  # the learner has not created the stream yet
            groups = []
        self.waiting = sum(int(g.get("lag") or 0) for g in groups)
        self.checked = time.monotonic()

    def __call__(self) -> bool:
        self._refresh()
        return self.learner - self.session.version <= self.max_staleness

    def starving(self) -> bool:
        self._refresh()
        return self.waiting < self.batch
