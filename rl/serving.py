"""The async worker's loop, assembled inside a rollout worker actor (rl/actors.py WorkerHost).

The staleness gate lives here: a worker generates only while its weights are at most
`trainer.max_staleness` versions behind the learner's (published in Redis by the driver after
every step). A worker that Ray restarted comes back with its first weights and so waits for the
next push instead of producing far-off-policy tokens.
"""

from __future__ import annotations

import time

import redis

from policy.sampling import SamplingParams
from rl.build import stream_names
from rollout.agent import AgentLoop
from rollout.serve import AsyncRollouts, ServeOptions
from rollout.tasks import TaskQueue


def serve_worker(host, params: SamplingParams) -> None:
    cfg, names = host.cfg, stream_names(host.run_id)
    client = redis.Redis.from_url(host.redis_url)
    worker = host.worker
    loop = AgentLoop(
        worker.session(),
        worker.renderer,
        worker.limits,
        tool_timeout_s=cfg.rollout.tool_timeout_s,
        deterministic=False,
    )
    host.rollouts = AsyncRollouts(
        worker,
        TaskQueue(client, names["prefix"], names["trajectories"]),
        loop,
        ServeOptions(
            consumer=f"worker-{host.index}",
            group_size=cfg.trainer.group_size,
            max_episodes=max(cfg.rollout.max_episodes, cfg.trainer.group_size),
            token_budget=cfg.rollout.token_budget,
        ),
    )
    gate = StalenessGate(client, names["version"], cfg.trainer.max_staleness, loop.session)
    host.rollouts.run(
        params,
        should_stop=host.stop_event.is_set,
        install=host._install_staged,
        may_generate=gate,
    )


class StalenessGate:
    """True while this worker's policy version is within `max_staleness` of the learner's."""

    def __init__(self, client, key: str, max_staleness: int, session, every_s: float = 0.25):
        self.client, self.key, self.max_staleness, self.session = (
            client,
            key,
            max_staleness,
            session,
        )
        self.every_s, self.checked, self.learner = every_s, 0.0, 0

    def __call__(self) -> bool:
        if time.monotonic() - self.checked > self.every_s:
            value = self.client.get(self.key)
            self.learner, self.checked = int(value or 0), time.monotonic()
        return self.learner - self.session.version <= self.max_staleness
