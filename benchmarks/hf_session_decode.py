"""HFSession on the end-to-end benchmark's rollout shape: 64 episodes (8 groups of 8 sharing a
~214-token prompt), one prefill `add`, then 64 decode steps over all of them (the quickstart's
dense Qwen3, 1 thread, float32). Prints seconds for the add and the steps, best of 2.

    .venv/bin/python benchmarks/hf_session_decode.py [--profile]

Run it at two commits to compare (docs/benchmarks.md, "End-to-end GRPO against TRL").
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.learner_speed import MODEL
from policy.engines import open_session
from policy.hf import HFPolicy, build_model
from policy.sampling import SamplingParams


def run(policy, prompts, keys, params) -> tuple[float, float]:
    session = open_session(policy)
    start = time.perf_counter()
    session.add(keys, [prompts[k // 8] for k in keys])
    added = time.perf_counter()
    for _ in range(64):
        session.step(keys, params)
    return added - start, time.perf_counter() - added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = HFPolicy(build_model("qwen3", MODEL, vocab_size=768, seed=0).eval(), pad_token_id=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 700, (214 + i % 3,), generator=gen).tolist() for i in range(8)]
    keys, params = list(range(64)), SamplingParams(temperature=1.0, max_new_tokens=64)
    best = min((run(policy, prompts, keys, params) for _ in range(2)), key=sum)
    print(f"add (64 prompts, 8 distinct) {best[0]:.3f} s, 64 decode steps {best[1]:.3f} s")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(run, policy, prompts, keys, params)
        pstats.Stats(profile).sort_stats("cumtime").print_stats(25)


if __name__ == "__main__":
    main()
