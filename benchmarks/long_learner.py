"""The learner's forward + backward on one long trajectory: one forward vs segments.

Run: PYTHONPATH=. .venv/bin/python benchmarks/long_learner.py [--lengths 4096 16384]
     [--segment 1024] [--threads 2]

k3-tiny (hidden 96, 4 layers: KDA, KDA, KDA, MLA; 48 experts), float32, batch 1, the learner's
own path (policy.logprobs.TokenLogprobs: decoder, then the LM head at the sampled positions
only, here the second half of the trajectory) and a policy-gradient-shaped loss, backward.
"whole" is trainer.segment_tokens 0 (one decoder forward over T), "segmented" is
trainer.segment_tokens = --segment (policy/k3/segments.py: carried KDA state and MLA latents,
one activation checkpoint per segment). Each (mode, length) runs in a fresh subprocess so that
its peak RSS is its own; printed: peak RSS growth over the RSS just before the step and the
wall time of forward + backward (one run after a warm-up at T = 512).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from policy.k3 import K3ForCausalLM, k3_preset
from policy.logprobs import TokenLogprobs


def step(trunk: TokenLogprobs, length: int) -> None:
    ids_BT = torch.randint(1, 768, (1, length), generator=torch.Generator().manual_seed(0))
    mask_BT = torch.ones_like(ids_BT)
    select_BT = torch.zeros(1, length - 1, dtype=torch.bool)
    select_BT[:, length // 2 :] = True
    logp_BT, _, _, _ = trunk(ids_BT, mask_BT, 1.0, select_BT)
    (-(logp_BT * select_BT).sum() / select_BT.sum()).backward()


def measure(mode: str, length: int, segment: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny")).eval()
    trunk = TokenLogprobs(model, segment_tokens=segment if mode == "segmented" else 0)
    step(trunk, 512)  # warm-up
    model.zero_grad(set_to_none=True)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step(trunk, length)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "T": length, "fwd_bwd_s": round(seconds, 2),
            "peak_rss_growth_MiB": round((peak_kib - before_kib) / 1024)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--segment", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["whole", "segmented"])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child: mode length
    args = parser.parse_args()
    if args.one:
        result = measure(args.one[0], int(args.one[1]), args.segment, args.threads)
        print(json.dumps(result))
        return
    print(f"| mode (segment {args.segment}) | T | peak RSS growth | fwd+bwd |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--one", mode, str(length),
                   "--segment", str(args.segment), "--threads", str(args.threads)]  # fmt: skip
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            print(f"| {mode} | {length} | {r['peak_rss_growth_MiB']} MiB | {r['fwd_bwd_s']} s |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
