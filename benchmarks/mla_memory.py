"""Memory and time of one MLA layer forward + backward: dense scores vs blockwise (flash.py).

Run: .venv/bin/python benchmarks/mla_memory.py [--lengths 4096 16384] [--dense-max 4096]

One GatedMLA with k3-tiny's MLA dims (hidden 96, 2 heads, q_lora 48, kv_lora 32, nope 32,
rope 16, v 48), float32, batch 1, the naive (per-head k, v) form that training uses, one
intra-op thread. Each (mode, length) runs in a fresh subprocess so that its peak RSS is its own;
printed per run: the peak RSS growth over the process's RSS just before the forward, the largest
tensor and the sum of all tensors autograd saved for the backward, and the wall time of the
forward + backward (one run, after a short warm-up at T = 256). The dense path above
--dense-max is skipped: its [B, H, T, T] scores alone take 8 * T^2 bytes per copy
(2 GiB at 16K) and it keeps several copies.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from policy.k3.mla import GatedMLA

TINY = {"q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 48}  # fmt: skip


def step(mla: GatedMLA, length: int, dense: bool) -> list[int]:
    """Forward + backward on [1, length, 96]; returns the numel of every saved tensor."""
    x = torch.randn(1, length, 96, generator=torch.Generator().manual_seed(0)).requires_grad_()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):  # fmt: skip
        out, _ = mla(x, dense=dense)
    out.square().mean().backward()
    return saved


def measure(mode: str, length: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mla = GatedMLA(96, 2, **TINY)
    dense = mode == "dense"
    step(mla, 256, dense)  # warm-up
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    saved = step(mla, length, dense)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "T": length, "peak_rss_growth_MiB": round((peak_kib - before_kib) / 1024),
            "largest_saved_elems": max(saved), "all_saved_MiB": round(4 * sum(saved) / 2**20, 1),
            "fwd_bwd_s": round(seconds, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dense-max", type=int, default=4096)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child: mode length
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    print("| path | T | peak RSS growth | largest saved tensor | all saved | fwd+bwd |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        for mode in ("dense", "blockwise"):
            if mode == "dense" and length > args.dense_max:
                print(f"| {mode} | {length} | skipped (> --dense-max) | | | |")
                continue
            cmd = [sys.executable, __file__, "--one", mode, str(length)]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            print(f"| {mode} | {length} | {r['peak_rss_growth_MiB']} MiB | "
                  f"{r['largest_saved_elems']:,} | {r['all_saved_MiB']} MiB | "
                  f"{r['fwd_bwd_s']} s |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
