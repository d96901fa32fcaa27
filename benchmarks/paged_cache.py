"""Paged MLA latent cache against the slot pool (issue 20 item 3): decode tokens/s and peak cache
bytes for 32 live episodes of mixed lengths whose tools finish at random.

Run: .venv/bin/python benchmarks/paged_cache.py [--episodes 32] [--steps 300] [--seeds 0 1 2]

k3-tiny (float32, random weights), one K3Session per cache kind, one torch thread (a rollout
worker's setting), both kinds on the same workload in one process, in turn, per seed:
- 32 episodes with contexts drawn log-uniformly from 1K to 64K tokens. Their caches are filled
  with random latents and KDA states of the right sizes instead of prefilled (a real prefill of
  ~0.5M tokens takes hours here); everything after that is real session calls.
- Each step, the episodes not in a tool decode one token together (`session.step`). After a
  step an episode calls a tool with probability `--tool-rate`; the tool takes 1-10 steps and
  returns a 24-token observation (`session.add`). An episode that reaches its end (its start
  plus 64-512 tokens) is dropped and a new one of 1K-64K starts in its place, filled likewise.
- Reported per kind: decode tokens/s over the session's adds and steps (fills, drops and the
  bookkeeping not timed), the peak cache bytes
  allocated (slot pool: every row's slot buffer; paged: the KDA rows plus the arenas), the
  peak bytes in use, and the paged/slot ratios.
The slot pool (policy/k3/cache.py via K3Session) makes every row as long as the longest and
gathers a non-contiguous subset's whole slot buffers each step; the paged cache
(policy/k3/paged.py) reads each row's own pages.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy, K3Session
from policy.sampling import SamplingParams

OBSERVATION = 24
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=1)


@torch.inference_mode()  # the session's tensors are made in inference mode too
def fill(session: K3Session, key: str, tokens: int, gen: torch.Generator) -> None:
    """Open `key` with a cache of `tokens` random latents (and random KDA state) and one pending
    token, as if its prompt had been prefilled."""
    session._open([key])
    ctx = session.contexts[key]
    pool = session.pool
    for state in pool.state:
        if state is not None:
            state[ctx.row].normal_(0.0, 0.1, generator=gen)
    pages = session.pages
    if pages is not None:
        ctx.pages = pages.allocate(pages.pages_for(tokens))
        for page in ctx.pages:
            arena = pages.arenas[page // pages.arena_pages]
            arena[:, page % pages.arena_pages].normal_(0.0, 1.0, generator=gen)
    else:
        start = pool.length
        pool.reserve(max(tokens - start, 0))
        pool.length = max(start, tokens)
        for latent in pool.latent:
            if latent is not None:
                latent[ctx.row, :tokens].normal_(0.0, 1.0, generator=gen)
        pool.key_mask[ctx.row, :tokens] = True
    ctx.fed, ctx.pending = tokens, 1


def cache_bytes(session: K3Session) -> tuple[int, int]:
    """(allocated, in use) bytes of the session's whole cache."""
    if session.pool is None:
        return 0, 0
    kda = session.pool.nbytes()
    fixed = kda["kda_state"] + kda["kda_conv"]
    if session.pages is None:
        return kda["allocated"], kda["total"]
    paged = session.pages.nbytes()
    return fixed + paged["allocated"], fixed + paged["pages"]


class Workload:
    """The episodes' lengths, tool calls and ends, drawn from one seed (same for both kinds)."""

    def __init__(self, seed: int, tool_rate: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.tool_rate = tool_rate
        self.count = 0

    def length(self) -> int:
        return int(math.exp(self.rng.uniform(math.log(1024), math.log(65536))))

    def new(self) -> dict:
        self.count += 1
        start = self.length()
        end = start + int(self.rng.integers(64, 513))
        return {"key": f"e{self.count}", "start": start, "end": end, "tool": 0}


def run(kind: str, model, args, seed: int) -> dict:
    policy = K3Policy(model, seed=seed, paged=kind == "paged", max_batch=args.episodes)
    session = K3Session(policy)
    work, gen = Workload(seed, args.tool_rate), torch.Generator().manual_seed(seed)
    live = [work.new() for _ in range(args.episodes)]
    for ep in live:
        fill(session, ep["key"], ep["start"], gen)
    peak, tokens, wall = [0, 0], 0, 0.0
    for _ in range(args.steps):
        started = time.perf_counter()
        back = [ep for ep in live if ep["tool"] == 1]
        if back:
            obs = [work.rng.integers(1, 768, OBSERVATION).tolist() for _ in back]
            session.add([ep["key"] for ep in back], obs)
        decoding = [ep for ep in live if ep["tool"] <= 1]
        session.step([ep["key"] for ep in decoding], PARAMS)
        tokens += len(decoding)
        wall += time.perf_counter() - started
        peak = [max(a, b) for a, b in zip(peak, cache_bytes(session), strict=True)]
        for i, ep in enumerate(live):
            ep["tool"] = max(ep["tool"] - 1, 0)
            if session.context_length(ep["key"]) >= ep["end"]:
                session.drop([ep["key"]])
                live[i] = work.new()
                fill(session, live[i]["key"], live[i]["start"], gen)
            elif ep["tool"] == 0 and work.rng.random() < work.tool_rate:
                ep["tool"] = int(work.rng.integers(1, 11)) + 1
    return {"kind": kind, "seed": seed, "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1), "peak_allocated": peak[0],
            "peak_in_use": peak[1], "stats": dict(session.stats)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tool-rate", type=float, default=0.05)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny")).eval()
    rows = []
    for seed in args.seeds:
        pair = {kind: run(kind, model, args, seed) for kind in ("slot", "paged")}
        for row in pair.values():
            print(json.dumps(row), flush=True)
        speed = pair["paged"]["tokens_per_s"] / pair["slot"]["tokens_per_s"]
        memory = pair["paged"]["peak_allocated"] / pair["slot"]["peak_allocated"]
        rows.append((speed, memory))
        mib = [pair[kind]["peak_allocated"] / 2**20 for kind in ("paged", "slot")]
        print(f"seed {seed}: paged/slot decode tokens/s {speed:.2f}x, peak allocated "
              f"{mib[0]:.0f} / {mib[1]:.0f} MiB = {memory:.2f}x", flush=True)  # fmt: skip
    speeds, memories = zip(*rows, strict=True)
    print(
        f"mean over {len(rows)} seeds: decode {np.mean(speeds):.2f}x, "
        f"peak allocated {np.mean(memories):.2f}x (paged / slot)"
    )


if __name__ == "__main__":
    main()
