"""Starting a step's harness episodes: side by side on the tool pool (rollout/worker.py) against
one after another (what the worker did before).

Run: .venv/bin/python benchmarks/harness_starts.py [--episodes 64] [--repeats 3]

Each start is `rollout.agent.start_episode` on an agentrl/Harness-v0 env playing
configs/harness/calc_agent.py (an OpenAI Agents SDK agent that connects to the calculator MCP
server over streamable HTTP before its first request): the env's reset launches the agent and
waits for that first request, then the prompt is rendered. Both ways start the same episodes
(same envs, same seeds) and must give the same prompt tokens; the envs are then ended (reset
again by the next repeat, which answers the open requests with 409). Best of --repeats,
interleaved, wall seconds for all --episodes starts.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium

import envs  # noqa: F401  (registers agentrl/Harness-v0)
from policy.tokenizer import build_tokenizer
from rollout.agent import start_episode
from rollout.render import ChatRenderer

ROOT = Path(__file__).resolve().parents[1]
KWARGS = {
    "harness": "configs.harness.calc_agent:run",
    "path": str(ROOT / "configs/harness/tasks.jsonl"),
    "grader": "numeric",
}


def starts(envs_, seeds, renderer, pool) -> tuple[float, list[list[int]]]:
    def one(i):
        return start_episode(envs_[i], seeds[i], f"b/{i}", f"t#{seeds[i]}", renderer)

    begin = time.perf_counter()
    if pool is None:
        episodes = [one(i) for i in range(len(seeds))]
    else:
        episodes = list(pool.map(one, range(len(seeds))))
    return time.perf_counter() - begin, [e.traj.token_ids for e in episodes]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    renderer = ChatRenderer(
        build_tokenizer(["What is 1 + 2? calculate(expression)"], vocab_size=300)
    )
    envs_ = [gymnasium.make("agentrl/Harness-v0", **KWARGS) for _ in range(args.episodes)]
    seeds = list(range(args.episodes))
    best = {"one after another": float("inf"), "side by side (pool of 16)": float("inf")}
    with ThreadPoolExecutor(16) as pool:
        for _ in range(args.repeats):
            serial, ids_a = starts(envs_, seeds, renderer, None)
            pooled, ids_b = starts(envs_, seeds, renderer, pool)
            assert ids_a == ids_b, "the two ways gave different prompts"
            best["one after another"] = min(best["one after another"], serial)
            best["side by side (pool of 16)"] = min(best["side by side (pool of 16)"], pooled)
    base = best["one after another"]
    print(f"{args.episodes} harness episode starts, best of {args.repeats}")
    print("| starts | wall s | per episode ms | speed-up |\n|---|---|---|---|")
    for name, seconds in best.items():
        print(
            f"| {name} | {seconds:.2f} | {1000 * seconds / args.episodes:.0f} "
            f"| {base / seconds:.2f}x |"
        )
    for env in envs_:
        env.close()


if __name__ == "__main__":
    main()
