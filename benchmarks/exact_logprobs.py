"""The price of exact mode (`trainer.exact_logprobs`, policy/k3/engine/exact.py), against the
usual mode in the same run: decode tokens/s of the exact session vs the pooled K3Session, and the
learner's step seconds with and without the exact pass, with learner/logprob_delta_max of each.

    .venv/bin/python benchmarks/exact_logprobs.py [--preset k3-tiny] [--episodes 16] [--tokens 48]

Episodes: a random prompt of 20-60 tokens, then `--tokens` sampled tokens, all episodes decoded
together (the pooled session batches them; the exact one runs each alone). One thread, as a
rollout worker. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.engines import open_session
from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams
from rl.config.runfile import TrainerConfig
from rl.learner.learner import Learner
from rollout.types import RolloutStatus, Trajectory, TrajectoryGroup

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4096)


class OneBatch:
    """A GroupSource of one group (the learner's seam: stream entries, then acks)."""

    def __init__(self, group):
        self.entries = [("1-0", group)]

    def read(self, count, *, block_ms):
        taken, self.entries = self.entries[:count], self.entries[count:]
        return taken

    def ack(self, entry_ids):
        return len(entry_ids)

    def stopped(self):
        return False


def decode(model, exact: bool, episodes: int, tokens: int) -> tuple[float, TrajectoryGroup]:
    """Seconds to sample `tokens` tokens for every episode, and the episodes as a group."""
    session = open_session(K3Policy(model, seed=0, record_routing=True, exact=exact))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    keys = [f"e{i}" for i in range(episodes)]
    prompts = [torch.randint(3, vocab, (int(torch.randint(20, 60, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in keys]  # fmt: skip
    started = time.perf_counter()
    routes = [[r] for r in session.add(keys, prompts)]  # per key: int16 [n, M, Kx] chunks
    sampled = {k: ([], []) for k in keys}
    for _ in range(tokens):
        for key, out in zip(keys, session.step(keys, PARAMS), strict=True):
            sampled[key][0].append(out.token)
            sampled[key][1].append(out.logprob)
            routes[keys.index(key)].append(out.routes)
    seconds = time.perf_counter() - started
    trajs = []
    for i, (key, prompt) in enumerate(zip(keys, prompts, strict=True)):
        traj = Trajectory(task_id="t", status=RolloutStatus.COMPLETED, reward=float(i % 2))
        traj.append(prompt, sampled=False)
        traj.append(sampled[key][0], sampled=True, logprobs=sampled[key][1], version=0)
        traj.routed_experts = np.concatenate(routes[i])[: len(traj.token_ids) - 1]
        trajs.append(traj)
    return seconds, TrajectoryGroup(group_id="1-0", task_id="t", trajectories=trajs)


def learn(model, group, exact: bool) -> tuple[float, float]:
    """(seconds of one learner step, learner/logprob_delta_max) on `group`."""
    n = len(group.trajectories)
    cfg = TrainerConfig(group_size=n, batch_size=n, micro_batch_size=8, lr=1e-4,
                        routing_replay=True, exact_logprobs=exact)  # fmt: skip
    run = Learner(cfg, model=copy.deepcopy(model), source=OneBatch(group), pad_token_id=0,
                  temperature=1.0)  # fmt: skip
    started = time.perf_counter()
    metrics = run.step()
    return time.perf_counter() - started, metrics["learner/logprob_delta_max"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k3-tiny")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset(args.preset, vocab_size=768)).float().eval()
    rows = []
    for exact in (False, True):
        print(f"{'exact' if exact else 'usual'} mode: decoding ...", file=sys.stderr)
        seconds, group = decode(model, exact, args.episodes, args.tokens)
        print(f"{'exact' if exact else 'usual'} mode: a learner step ...", file=sys.stderr)
        step_s, gap = learn(model, group, exact)
        rows.append((exact, args.episodes * args.tokens / seconds, step_s, gap))
    (_, tps, step, _), _ = rows
    print(f"{args.preset}, {args.episodes} episodes x {args.tokens} sampled tokens, 1 thread\n")
    print("| mode | decode tokens/s | x usual | learner step s | x usual | logprob_delta_max |")
    print("|---|---|---|---|---|---|")
    for exact, t, s, gap in rows:
        name = "exact" if exact else "usual"
        print(f"| {name} | {t:.0f} | {t / tps:.2f} | {s:.2f} | {s / step:.2f} | {gap:.3g} |")


if __name__ == "__main__":
    main()
