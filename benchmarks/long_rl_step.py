"""One RL step on the policy-driven million-token episode (issue 19 item 3), phase by phase.

    .venv/bin/python benchmarks/policy_driven_episode.py        # first: the episode (~45 min)
    .venv/bin/python benchmarks/long_rl_step.py [--run runs/policy-driven-episode]

The phases, each timed, each with the peak RSS it reached (the kernel's high-water mark is reset
before each phase; RSS is what the whole process holds then, model and episode included):

1. rollout + score: the million-token episode is benchmarks/policy_driven_episode.py's (its
   figures are read from `--run/episode.json`); here the same policy runs a second episode of
   the same task (`--sibling-tokens`, default 65,536) through the same RolloutWorker path, so
   that GRPO has a group of two.
2. hand-over: the scored group through the run's own Redis stream (`start_redis`, the rollout
   codec, `RedisTrajectoryStream` -> `RedisGroupReader`), as a worker hands it to the learner.
3. learner: one `Learner.step` on that reader: the batch, forward + backward over both whole
   trajectories (segments of `--segment` tokens, routing replay, the LM head inside each
   segment's checkpoint, the last layer at the loss positions only: `trainer.
   loss_positions_only`), the AdamW step, the Redis ack.
4. weight push: the run's `Publisher` (object-store transport, xxh3 checksums) to a `Receiver`
   that installs into the rollout policy (`load_weights`), on a local Ray.

The SFT policy reads on and never answers, so both episodes end truncated: their rewards differ
only by the invalid-tool-call penalties (measured: -2.0 and 0.0, GRPO advantages -1 and +1), on
top of which `trainer.entropy_coef` (`--entropy`, 0.01) reaches every sampled token. It is a
step's full cost (every part of it runs) on real rewards, not a step that learns the task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.long_learner import reset_peak_rss, status_bytes  # noqa: E402
from benchmarks.policy_driven_episode import config, run_episode  # noqa: E402


@contextlib.contextmanager
def phase(name: str, table: dict):
    before = reset_peak_rss()
    start = time.perf_counter()
    print(f"{name} ...", flush=True)
    yield
    seconds, peak = time.perf_counter() - start, status_bytes("VmHWM")
    table[name] = {"seconds": seconds, "peak_rss_mib": peak / 2**20,
                   "growth_mib": (peak - before) / 2**20}  # fmt: skip
    print(f"{name}: {seconds:.1f} s, peak RSS {peak / 2**20:,.0f} MiB", flush=True)


def trainer_config(cfg, args):
    from rl.config.runfile import TrainerConfig

    return TrainerConfig(
        algorithm="grpo", group_size=2, batch_size=2, micro_batch_size=1, lr=cfg.trainer.lr,
        segment_tokens=args.segment, routing_replay=True, entropy_coef=args.entropy,
        threads=args.threads, read_timeout_s=600,
    )  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", type=Path, default=ROOT / "runs/policy-driven-episode")
    p.add_argument("--segment", type=int, default=4096, help="trainer.segment_tokens")
    p.add_argument("--sibling-tokens", type=int, default=65536)
    p.add_argument("--entropy", type=float, default=0.01, help="trainer.entropy_coef")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1, help="the task's reset seed (the episode's)")
    return p.parse_args()


def learner_step(cfg, args, model_dir: Path, table: dict):
    """Phases 1-3: -> (the learner after its step, its metrics, the sibling's figures)."""
    from policy.hf import load_model, load_tokenizer
    from rl.learner.learner import Learner
    from rl.run.launch import start_redis
    from rollout.codec import decode_group
    from rollout.stream import RedisGroupReader, RedisTrajectoryStream

    group = decode_group((args.run / "group.bin").read_bytes())
    with phase("rollout + score: a second episode of the task", table):
        sibling, sibling_group = run_episode(cfg, model_dir, args.seed, quiet=True)
    group.trajectories.extend(sibling_group.trajectories)
    with phase("hand-over: the group through the run's Redis stream", table):
        server = start_redis(args.run / "redis")
        client = server.client()
        RedisTrajectoryStream(client, "pde:trajectories").put(group)
        reader = RedisGroupReader(client, "pde:trajectories", group="learner", consumer="0")
    with phase("learner: batch, forward + backward, AdamW step, ack", table):
        pad = load_tokenizer(model_dir).pad_token_id
        learner = Learner(trainer_config(cfg, args), model=load_model(model_dir), source=reader,
                          pad_token_id=pad, temperature=cfg.rollout.temperature)  # fmt: skip
        metrics = learner.step()
    server.stop()
    return learner, metrics, sibling


def push(learner, cfg, model_dir: Path, table: dict) -> tuple[int, float]:
    """Phase 4 -> (the version installed, the largest weight change it carried)."""
    import ray
    import torch

    from policy.engines import rollout_policy
    from policy.hf import load_model, load_tokenizer
    from rl.run.weights import Publisher, Receiver

    worker_model, pad = load_model(model_dir), load_tokenizer(model_dir).pad_token_id
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    with phase("weight push: object store, checksums, install", table):
        target = rollout_policy(worker_model, pad_token_id=pad, record_routing=True)
        manifest, refs = Publisher(learner.export, bucket_mb=cfg.weights.bucket_mb).publish()
        version = Receiver(target.load_weights).receive_object_store(manifest, refs)
    ray.shutdown()
    with torch.no_grad():
        pairs = zip(worker_model.parameters(), load_model(model_dir).parameters(), strict=True)
        return version, max(float((a - b).abs().max()) for a, b in pairs)


def main() -> None:
    import torch

    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir, table = args.run / "sft-model", {}
    cfg = config(args.sibling_tokens, 1.0)
    learner, metrics, sibling = learner_step(cfg, args, model_dir, table)
    version, moved = push(learner, cfg, model_dir, table)
    out = {
        "episode": json.loads((args.run / "episode.json").read_text()), "sibling": sibling,
        "phases": table, "pushed_version": version, "largest_weight_change": moved,
        "learner": {k: v for k, v in metrics.items() if isinstance(v, int | float)},
    }  # fmt: skip
    (args.run / "rl_step.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["phases"], indent=1))
    keys = ("learner/loss", "learner/grad_norm", "learner/entropy", "learner/loss_tokens",
            "moe/replayed_share")  # fmt: skip
    print({k: metrics.get(k) for k in keys}, f"pushed version {version}, change {moved:.2e}")


if __name__ == "__main__":
    main()
