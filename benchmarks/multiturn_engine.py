"""Per-turn cost of a multi-turn rollout: the decode session (policy/session.py, caches kept
across turns) against re-prefilling every episode's whole history each turn (K3Policy.generate,
what rollout/episode.py did).

Run: .venv/bin/python benchmarks/multiturn_engine.py [--turns 4 16 64] [--episodes 8]

k3-tiny (float32, the quickstart's preset), 1 torch thread, greedy, no stop tokens. Each of
--episodes episodes starts with a random prompt (--prompt tokens on average, +-50%); every
turn samples --tokens tokens and then appends an observation of --obs tokens on average
(+-8) to each episode. Session: turn 1 = add(prompts) + --tokens step()s over all episodes;
turn t > 1 = add(observations) (each key's pending last token + its observation) + --tokens
step()s. Re-prefill: one generate(histories, max_new_tokens=--tokens) per turn over the whole
histories. Both run the same script on the same model, turn by turn interleaved (load on a
shared machine hits both alike); the table gives the median seconds per turn over the first 4
and over the last 4 turns of a run of --turns turns, and how often the two produced the same
greedy tokens (float rounding differs between a cached and a re-prefilled context).
Seconds are CPU seconds of the one compute thread (time.thread_time; torch runs 1 thread), which
other jobs on a shared machine inflate much less than wall time; --clock wall for wall time.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np
import torch

from policy.engines import open_session
from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams


def script(args, turns: int, vocab: int, seed: int = 0):
    """Prompts and per-turn observations of every episode (fixed for both engines)."""
    rng = np.random.default_rng(seed)
    low, high = args.prompt // 2, args.prompt * 3 // 2
    prompts = [rng.integers(1, vocab, size=int(rng.integers(low, high + 1))).tolist()
               for _ in range(args.episodes)]  # fmt: skip
    observations = [[rng.integers(1, vocab, size=int(rng.integers(args.obs - 8, args.obs + 9)))
                     .tolist() for _ in range(args.episodes)] for _ in range(turns)]  # fmt: skip
    return prompts, observations


class SessionRun:
    """The session side: one turn = add (prompt or observation) + --tokens steps."""

    def __init__(self, policy: K3Policy, prompts, observations, args) -> None:
        self.session = open_session(policy)
        self.keys = list(range(len(prompts)))
        self.prompts, self.observations, self.args = prompts, observations, args
        self.params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)

    def turn(self, turn: int) -> tuple[float, list[list[int]]]:
        """-> (seconds, the tokens sampled for each episode)."""
        start = self.args.timer()
        feeds = self.prompts if turn == 0 else self.observations[turn - 1]
        self.session.add(self.keys, feeds)
        sampled = [[] for _ in self.keys]
        for _ in range(self.args.tokens):
            for key, out in zip(self.keys, self.session.step(self.keys, self.params), strict=True):
                sampled[key].append(out.token)
        return self.args.timer() - start, sampled


class ReprefillRun:
    """The re-prefill side: one turn = generate(whole histories, --tokens new tokens)."""

    def __init__(self, policy: K3Policy, prompts, observations, args) -> None:
        self.policy, self.observations, self.timer = policy, observations, args.timer
        self.histories = [list(p) for p in prompts]
        self.params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)

    def turn(self, turn: int) -> tuple[float, list[list[int]]]:
        if turn:
            for history, obs in zip(self.histories, self.observations[turn - 1], strict=True):
                history += obs
        start = self.timer()
        outs = self.policy.generate(self.histories, self.params)
        seconds = self.timer() - start
        for history, out in zip(self.histories, outs, strict=True):
            history += out.token_ids
        return seconds, [o.token_ids for o in outs]


def compare(policies, args, turns: int, vocab: int, seed: int = 0):
    """Both sides turn by turn (interleaved, so that load on the machine hits both alike) ->
    (session seconds per turn, re-prefill seconds per turn, turns with equal tokens, final
    mean context length)."""
    prompts, observations = script(args, turns, vocab, seed)
    ours = SessionRun(policies[0], prompts, observations, args)
    theirs = ReprefillRun(policies[1], prompts, observations, args)
    s_sec, r_sec, same = [], [], 0
    for turn in range(turns):
        s, s_tokens = ours.turn(turn)
        r, r_tokens = theirs.turn(turn)
        s_sec.append(s)
        r_sec.append(r)
        same += s_tokens == r_tokens
    context = float(np.mean([len(h) for h in theirs.histories]))
    return s_sec, r_sec, same, context


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--obs", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    args.timer = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = k3_preset("k3-tiny")
    model = K3ForCausalLM(cfg).eval()
    policies = (K3Policy(model), K3Policy(model))
    compare(policies, args, 2, cfg.vocab_size, seed=99)  # warm-up
    print(f"# multi-turn engine: {platform.processor() or platform.machine()}, {os.cpu_count()} "
          f"CPUs, torch {torch.__version__}, 1 thread, k3-tiny fp32, {args.episodes} episodes, "
          f"{args.tokens} sampled + ~{args.obs} observation tokens per turn, prompts "
          f"~{args.prompt} tokens, greedy, {args.clock} seconds\n")  # fmt: skip
    print("| turns | final context (tokens) | session s/turn, first 4 | session s/turn, last 4 | "
          "re-prefill s/turn, first 4 | re-prefill s/turn, last 4 | re-prefill / session, "
          "last 4 | same greedy tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for turns in args.turns:
        s_sec, r_sec, same, context = compare(policies, args, turns, cfg.vocab_size)
        s_first, s_last = np.median(s_sec[:4]), np.median(s_sec[-4:])
        r_first, r_last = np.median(r_sec[:4]), np.median(r_sec[-4:])
        print(
            f"| {turns} | {context:,.0f} | {s_first:.3f} | {s_last:.3f} | {r_first:.3f} | "
            f"{r_last:.3f} | {r_last / s_last:.2f}x | {same}/{turns} turns |",
            flush=True,
        )


if __name__ == "__main__":
    main()
