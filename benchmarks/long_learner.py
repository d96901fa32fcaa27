"""The learner's forward + backward on one long trajectory: one forward vs segments.

Run: PYTHONPATH=. .venv/bin/python benchmarks/long_learner.py [--lengths 4096 16384]
     [--segment 1024] [--threads 2] [--sampled 0.5]
     [--modes whole segmented loss-positions expanded kept-heap kimilinear qwen3]

k3-tiny (hidden 96, 4 layers: KDA, KDA, KDA, MLA; 48 experts), float32, batch 1, the learner's
own path (policy.logprobs.TokenLogprobs: decoder, then the LM head at the sampled positions
only, here the second half of the trajectory) and a policy-gradient-shaped loss, backward.
"whole" is trainer.segment_tokens 0 (one decoder forward over T), "segmented" is
trainer.segment_tokens = --segment (policy/k3/segments.py: carried KDA state and MLA latents,
one activation checkpoint per segment, the LM head inside it; a later segment's MLA attends over
the earlier latents, absorbed: mla.py `choose_form`) with every position through every layer;
"loss-positions" is "segmented" with the last layer (MLA) at the loss positions only
(trainer.loss_positions_only, the learner's default on one rank: `K3Model.forward(positions)`);
"expanded" is "segmented" with the later segments' MLA in its naive form (per-head keys and
values of every earlier token: the learner before issue 19); "kept-heap" is "segmented"
without handing the C heap's free pages back to the OS between segments
(policy/k3/host_memory.py; also the learner before issue 19). All but "whole" run the LM head
inside the segments (`keep_hidden=False`, as the learner does without a value head).
Each (mode, length) runs in a fresh subprocess so that
its peak RSS is its own; printed: peak RSS growth over the RSS just before the step (the
kernel's high-water mark VmHWM, reset before the step, minus VmRSS then) and the
wall time of forward + backward (one run after a warm-up at T = 512).

Peers (`--modes kimilinear qwen3`), the same loss on the same tokens: transformers'
KimiLinearForCausalLM with the closest config it allows (benchmarks/decode_speed.py; torch
fallbacks for KDA, SDPA for MLA) and a dense Qwen3ForCausalLM with k3-tiny's parameter count
(SDPA attention); the LM head on the second half's positions only, as ours. Each child runs
under an address-space cap (`--mem-gb`) and a wall-time limit (`--time-limit`): a peer that
passes either is reported as out of memory or out of time, not as a crash of the benchmark.
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


def batch(length: int, sampled: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [1, T] and the loss positions [1, T-1]: the last `sampled` share of them (an
    agent's own tokens; about 0.004 of a long agentic episode, the rest tool output)."""
    ids_BT = torch.randint(1, 768, (1, length), generator=torch.Generator().manual_seed(0))
    select_BT = torch.zeros(1, length - 1, dtype=torch.bool)
    select_BT[:, length - 1 - max(1, int((length - 1) * sampled)) :] = True
    return ids_BT, select_BT


def step(trunk: TokenLogprobs, length: int, sampled: float) -> None:
    ids_BT, select_BT = batch(length, sampled)
    logp_BT, _, _, _ = trunk(ids_BT, torch.ones_like(ids_BT), 1.0, select_BT, keep_hidden=False)
    (-(logp_BT * select_BT).sum() / select_BT.sum()).backward()


def peer_step(model, length: int, sampled: float) -> None:
    """The same loss through a transformers model: its decoder, the head on selected rows."""
    ids_BT, select_BT = batch(length, sampled)
    hidden_BTD = model.model(input_ids=ids_BT, use_cache=False).last_hidden_state[:, :-1]
    logits_ND = model.lm_head(hidden_BTD[select_BT]).float()
    logp_N = logits_ND.log_softmax(-1).gather(-1, ids_BT[:, 1:][select_BT][:, None])[:, 0]
    (-logp_N.mean()).backward()


def build(mode: str, segment: int, sampled: float):
    """(model, one step at length T) for a mode."""
    cfg = k3_preset("k3-tiny")
    if mode in ("whole", "segmented", "expanded", "kept-heap", "loss-positions"):
        model = K3ForCausalLM(cfg).eval()
        model.model.release_heap = mode != "kept-heap"  # segments.py: malloc_trim per segment
        for layer in model.model.layers:  # expanded: later segments' MLA in its naive form
            if not layer.is_kda:
                layer.self_attn.absorb_past = mode != "expanded"
        trunk = TokenLogprobs(
            model,
            segment_tokens=0 if mode == "whole" else segment,
            selected_only=mode == "loss-positions",  # trainer.loss_positions_only
        )
        return model, lambda length: step(trunk, length, sampled)
    from benchmarks.decode_speed import kimi_linear_peer, qwen3_peer

    if mode == "kimilinear":
        model = kimi_linear_peer(cfg)
    else:
        model = qwen3_peer(cfg, sum(p.numel() for p in K3ForCausalLM(cfg).parameters()))[0]
    model.config._attn_implementation = "sdpa"
    return model, lambda length: peer_step(model, length, sampled)


def measure(mode: str, length: int, args) -> dict:
    cap = int(args.mem_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, run = build(mode, args.segment, args.sampled)
    run(512)  # warm-up
    model.zero_grad(set_to_none=True)
    before = reset_peak_rss()
    start = time.perf_counter()
    try:
        run(length)
    except (RuntimeError, MemoryError) as exc:
        if "memory" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        return {"mode": mode, "T": length, "oom": True}
    seconds = time.perf_counter() - start
    return {"mode": mode, "T": length, "fwd_bwd_s": round(seconds, 2),
            "peak_rss_growth_MiB": round((status_bytes("VmHWM") - before) / 2**20)}  # fmt: skip


def reset_peak_rss() -> int:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS and return it, in
    bytes (Linux), so that what imports and model building reached cannot hide a smaller step."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def status_bytes(key: str) -> int:
    """A memory line of /proc/self/status (kB), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def child(mode: str, length: int, args) -> str:
    """One (mode, T) in a fresh process: its table cells."""
    cmd = [sys.executable, __file__, "--one", mode, str(length), "--segment", str(args.segment),
           "--threads", str(args.threads), "--mem-gb", str(args.mem_gb),
           "--sampled", str(args.sampled)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit)
    except subprocess.TimeoutExpired:
        return f"- | out of time (> {args.time_limit:.0f} s)"
    if out.returncode != 0:
        oom = out.returncode == -9 or "memory" in out.stderr.lower()
        return "out of memory | -" if oom else f"failed: {out.stderr.strip()[-200:]} | -"
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if r.get("oom"):
        return f"out of memory (> {args.mem_gb:g} GiB) | -"
    return f"{r['peak_rss_growth_MiB']} MiB | {r['fwd_bwd_s']} s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--segment", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    modes = ["whole", "segmented", "loss-positions", "expanded", "kept-heap", "kimilinear", "qwen3"]
    parser.add_argument("--modes", nargs="+", default=modes[:2], choices=modes)
    parser.add_argument("--sampled", type=float, default=0.5,
                        help="share of positions in the loss (the last ones)")  # fmt: skip
    parser.add_argument("--mem-gb", type=float, default=16.0, help="address-space cap per case")
    parser.add_argument("--time-limit", type=float, default=1800.0, help="seconds per case")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child: mode length
    args = parser.parse_args()
    if args.one:
        mode, length = args.one[0], int(args.one[1])
        print(json.dumps(measure(mode, length, args)))
        return
    print(f"| mode (segment {args.segment}, sampled {args.sampled:g}) | T | peak RSS growth "
          "| fwd+bwd |")  # fmt: skip
    print("|---|---|---|---|")
    for length in args.lengths:
        for mode in args.modes:
            print(f"| {mode} | {length} | {child(mode, length, args)} |", flush=True)


if __name__ == "__main__":
    main()
