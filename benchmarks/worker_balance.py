"""How evenly two async rollout workers share the work, and what an idle one costs, through the
real CLI (real local Ray, the embedded redis-server), against a peer checkout in the same run.

    .venv/bin/python benchmarks/worker_balance.py [--steps 16] [--repeats 3] [--peer DIR]

Each run is `python -m rl.cli train configs/quickstart.yaml` in async mode with a small batch
and room for many episodes per worker (a tiny dense Qwen3, no SFT, 4 tasks x group 4 per step,
`rollout.max_episodes` 64, max_staleness 1, 2 workers x 0.5 CPU + a 1-CPU learner): the case
where one worker has room for every task that is out. `--peer DIR` runs the same command from
another checkout alternately with this one, so both see the same machine at the same time. The
peer for the figures in docs/benchmarks.md is this checkout with the share off (every worker
takes all the new tasks it has room for, as before):

    git worktree add ../agentrl-greedy HEAD
    sed -i 's/workers=cfg.rollout.num_workers,/workers=1,/' ../agentrl-greedy/rl/run/serving.py
    .venv/bin/python benchmarks/worker_balance.py --peer ../agentrl-greedy

Reported per run, from metrics.jsonl: the mean of `workers/token_share_min` (the least share of
the tokens sampled since the last step that one worker sampled: 0.5 is even, 0 is one worker
idle; steps where a worker did not answer in time have none), the steps where it was 0, the RL
wall time (the sum of `step/seconds`), the seconds the learner waited for groups
(`learner/wait_seconds`) and the finished tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
MODEL = (
    "{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 16, tie_word_embeddings: true, "
    "max_position_embeddings: 1024}"
)


def overrides(out: Path, steps: int) -> list[str]:
    return [
        f"output_dir={out}",
        "name=balance",
        "policy.model_type=qwen3",
        f"policy.config={MODEL}",
        "policy.vocab_size=512",
        "sft.enabled=false",
        f"trainer.steps={steps}",
        "trainer.batch_size=16",
        "trainer.group_size=4",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        "rollout.max_new_tokens=48",
        "rollout.max_turns=2",
        "rollout.num_workers=2",
        "rollout.cpus_per_worker=0.5",
        "trainer.cpus=1.0",
        "ray.num_cpus=2",
        "eval.tasks=0",
        "checkpoint_every=0",
    ]


def run(repo: Path, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="balance-"))
    cmd = [sys.executable, "-m", "rl.cli", "train", "configs/quickstart.yaml"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [*cmd, *overrides(out, steps)], cwd=repo, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"run in {repo} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    (run_dir,) = out.glob("balance-*")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, filter(None, lines)) if r["phase"] == "train"]
    shares = [r["workers/token_share_min"] for r in records if "workers/token_share_min" in r]
    seconds = sum(r["step/seconds"] for r in records)
    tokens = sum(
        r.get("rollout/tokens_per_s", 0.0) * r.get("rollout/seconds", 0.0) for r in records
    )
    return {
        "share": mean(shares) if shares else None,
        "zero": sum(s == 0 for s in shares),
        "with_share": len(shares),
        "seconds": seconds,
        "wait": sum(r.get("learner/wait_seconds", 0.0) for r in records),
        "tokens_per_s": tokens / seconds,
    }


def row(name: str, r: dict) -> str:
    share = "n/a" if r["share"] is None else f"{r['share']:.2f}"
    return (
        f"| {name} | {share} | {r['zero']}/{r['with_share']} | {r['seconds']:.1f} | "
        f"{r['wait']:.1f} | {r['tokens_per_s']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", type=Path, help="another checkout, run alternately")
    args = parser.parse_args()
    repos = {"this": ROOT, **({"peer": args.peer.resolve()} if args.peer else {})}
    results: dict[str, list[dict]] = {name: [] for name in repos}
    print("| code | mean min share | steps at 0 | RL seconds | learner wait s | tokens/s |")
    print("|---|---|---|---|---|---|")
    for i in range(args.repeats):
        for name, repo in repos.items():
            results[name].append(run(repo, args.steps))
            print(row(f"{name} #{i + 1}", results[name][-1]), flush=True)
    for name, rs in results.items():
        known = [r["share"] for r in rs if r["share"] is not None]
        summary = {
            "share": mean(known) if known else None,
            "zero": sum(r["zero"] for r in rs),
            "with_share": sum(r["with_share"] for r in rs),
            **{k: mean(r[k] for r in rs) for k in ("seconds", "wait", "tokens_per_s")},
        }
        print(row(f"{name}, mean of {len(rs)}", summary))


if __name__ == "__main__":
    main()
