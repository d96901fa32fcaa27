"""One LongHorizon-v0 episode that the policy itself drives past a million tokens, through the
worker path a run uses (issue 19 item 2).

    .venv/bin/python benchmarks/policy_driven_episode.py [--tokens 1040000] [--out runs/pde]

1. SFT warm start (once; kept in `--out/sft-model`): `configs/long_horizon.yaml`'s k3-tiny, on
   its expert's demonstrations (short documents), through `rl.run.train.warm_start`, with
   `max_position_embeddings` raised so the policy accepts a 1M-token context (NoPE MLA: the
   positions bound nothing else).
2. The episode: `rl.run.build.build_worker` (the run's own RolloutWorker: agent loop, K3 decode
   session with a persistent cache, routing recorded) runs `RolloutWorker.collect` on one task
   of an archive sized so the whole of it is longer than `--tokens` (hops 4, distance 20,
   16,000-token documents: 81 documents, ~1.4M tokens). Every turn is sampled by the policy
   (temperature of the run file), parsed, and executed by the env: the context grows only by the
   documents the policy's own `read` / `read_next` calls return. `rollout.max_seq_len` is
   `--tokens`: an episode that reads on ends "context full" there, as a run's would.

Reported: tokens, turns, tool calls, status; wall time split into prefill (`session.add`),
decode (`session.step`), the tools (env steps; the reset, which draws the archive, apart) and
the rest (rendering, parsing, scoring, bookkeeping); the peak RSS of the episode and its growth
over the RSS before it; the cache the episode uses at its end (`session.cache_bytes`: the pool
may have allocated more, growing by doubling) against the admission model
(`session.bytes_for`).
The scored group is written with the rollout codec to `--out/group.bin` (the RL step's input).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.long_learner import reset_peak_rss, status_bytes  # noqa: E402

SFT = ["sft.demonstrations=400", "sft.epochs=2"]  # the policy must only call the tools well


def rss_mib() -> float:
    """The process's resident memory now, MiB."""
    return status_bytes("VmRSS") / 2**20


def config(tokens: int, temperature: float):
    from rl.config.runfile import load_config

    turns = 200  # more than the archive's documents: the context, not the turns, ends it
    return load_config(
        ROOT / "configs/long_horizon.yaml",
        [
            *SFT,
            "policy.config.max_position_embeddings=2097152",
            f"rollout.max_seq_len={tokens}",
            f"rollout.max_turns={turns}",
            f"rollout.temperature={temperature}",
            "rollout.record_routing=true",
            "rollout.num_workers=1",
            "rollout.threads_per_worker=2",
            "env.kwargs.hops=4",
            "env.kwargs.distance=20",
            "env.kwargs.doc_tokens=16000",
            f"env.kwargs.max_turns={turns}",
        ],
    )


def sft_model(cfg, out: Path) -> Path:
    from rl.run.train import warm_start

    model_dir = out / "sft-model"
    if not (model_dir / "config.json").exists():
        sft_cfg = cfg.model_copy(
            update={"env": cfg.env.model_copy(update={"kwargs": _short_kwargs()})}
        )
        start = time.perf_counter()
        _, report = warm_start(sft_cfg, out)
        print(f"SFT: {time.perf_counter() - start:.0f} s, {json.dumps(report)}", flush=True)
    return model_dir


def _short_kwargs() -> dict:
    from rl.config.runfile import load_config

    return dict(load_config(ROOT / "configs/long_horizon.yaml", []).env.kwargs)


class Timed:
    """The worker's decode session with its calls timed (prefill = add, decode = step), and
    each episode's cache bytes read before the session drops it."""

    def __init__(self, session, quiet: bool = False):
        self.inner, self.seconds, self.caches = session, {"prefill": 0.0, "decode": 0.0}, {}
        self.quiet = quiet

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add(self, keys, token_ids):
        try:
            return self._timed("prefill", self.inner.add, keys, token_ids)
        finally:
            if not self.quiet and sum(len(t) for t in token_ids) > 1000:  # a document read
                self._progress(keys)

    def step(self, keys, params):
        return self._timed("decode", self.inner.step, keys, params)

    def _timed(self, key: str, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.seconds[key] += time.perf_counter() - start

    def drop(self, keys):
        for key in keys:
            length = self.inner.context_length(key)
            self.caches[key] = (length, self.inner.cache_bytes(key), self.inner.bytes_for(length))
        return self.inner.drop(keys)

    def _progress(self, keys) -> None:
        length = self.inner.context_length(keys[0])
        print(f"  context {length:,} tokens, prefill {self.seconds['prefill']:.0f} s, decode "
              f"{self.seconds['decode']:.0f} s, RSS {rss_mib():,.0f} MiB", flush=True)  # fmt: skip


class TimedEnv:
    """An env whose reset and steps (the tool calls) are timed."""

    def __init__(self, env, clock: dict):
        self.env, self.clock = env, clock

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, *args, **kwargs):
        return self._timed("reset", self.env.reset, *args, **kwargs)

    def step(self, action):
        return self._timed("tools", self.env.step, action)

    def _timed(self, key: str, call, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.clock[key] = self.clock.get(key, 0.0) + time.perf_counter() - start


def run_episode(cfg, model_dir: Path, seed: int, quiet: bool = False) -> tuple[dict, object]:
    """(the figures, the scored TrajectoryGroup) of one episode (see the module docstring)."""
    from rl.run.build import build_worker, make_env, sampling
    from rollout.worker import Task

    groups, clock = [], {}
    worker = build_worker(cfg, model_dir, None, "pde", 0)
    worker.sink = type("Sink", (), {"put": lambda self, g: groups.append(g) or "0-0"})()
    worker.env_factory = lambda: TimedEnv(make_env(cfg), clock)
    timed = Timed(worker.session(), quiet)
    worker._session = timed  # the worker's own session, its calls timed
    base, start = reset_peak_rss() / 2**20, time.perf_counter()  # SFT's peak must not count
    stats = worker.collect(
        [Task(seed=seed, group_id="0-0")], 1, sampling(cfg.rollout, worker.renderer)
    )
    wall = time.perf_counter() - start
    traj = groups[0].trajectories[0]
    if not timed.caches:
        raise RuntimeError(f"the episode never reached the session: {traj.finish_detail}")
    length, cache, model = next(iter(timed.caches.values()))
    peak = status_bytes("VmHWM") / 2**20
    tools = clock.get("tools", 0.0) + clock.get("reset", 0.0)
    return dict(
        tokens=len(traj.token_ids), context=length, turns=traj.num_turns,
        tool_calls=traj.num_tool_calls, tool_errors=traj.num_tool_errors,
        parse_errors=traj.num_parse_errors, generated=traj.num_generated,
        status=traj.status.value, detail=traj.finish_detail, reward=traj.reward,
        routes=None if traj.routed_experts is None else list(traj.routed_experts.shape),
        wall_s=wall, prefill_s=timed.seconds["prefill"], decode_s=timed.seconds["decode"],
        tools_s=clock.get("tools", 0.0), reset_s=clock.get("reset", 0.0),
        other_s=wall - sum(timed.seconds.values()) - tools,
        peak_rss_mib=peak, peak_rss_growth_mib=peak - base,
        cache_in_use_mib=cache / 2**20, admission_model_mib=model / 2**20,
        episodes=stats["episodes"],
    ), groups[0]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1_040_000, help="rollout.max_seq_len")
    p.add_argument("--seed", type=int, default=1, help="the task's reset seed")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs/policy-driven-episode")
    args = p.parse_args()
    from rollout.codec import encode_group

    args.out.mkdir(parents=True, exist_ok=True)
    cfg = config(args.tokens, args.temperature)
    model_dir = sft_model(cfg, args.out)
    row, group = run_episode(cfg, model_dir, args.seed)
    data = encode_group(group)
    row["group_bytes"] = len(data)
    (args.out / "group.bin").write_bytes(data)
    (args.out / "episode.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
