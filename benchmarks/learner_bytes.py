"""Where the segmented learner's bytes go, per token of one long trajectory (issue 19 item 4).

Run: PYTHONPATH=. .venv/bin/python benchmarks/learner_bytes.py [--lengths 8192 16384]
     [--segment 1024] [--sampled 0.004]

k3-tiny, float32, batch 1, the learner's own path (policy.logprobs.TokenLogprobs in segments of
--segment tokens; the loss on the last --sampled share of positions, an agent's own tokens in a
long agentic episode), forward + backward. Every figure is a slope between the two lengths
(bytes per token of the trajectory; what one segment costs whatever T is cancels out):
- modelled, by part: what policy/k3/footprint.py says the learner keeps per token while it runs
  the last segment's backward (`learner_carry`: the decoder's output and its gradient, the MLA
  latents, the KDA state at segment boundaries, the router's choices, ids and masks;
  `learner_keys`: what the MLA layers save per earlier key; `head_row_bytes` x the loss share);
- measured, live tensors: the peak of the storages alive at once (`footprint.PeakBytes`, a
  TorchDispatchMode that sees every tensor an op creates);
- measured, process: the peak RSS growth of the step in a fresh child process (Linux: the
  high-water mark reset before the step, VmHWM - VmRSS), with the C
  heap's free pages released per segment (policy/k3/host_memory.py, the default) and kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from benchmarks.long_learner import batch, reset_peak_rss, status_bytes
from policy.k3 import K3ForCausalLM, footprint, k3_preset
from policy.logprobs import TokenLogprobs


def trunk(segment: int, release: bool = True) -> TokenLogprobs:
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny"))
    model.model.release_heap = release
    return TokenLogprobs(model, segment_tokens=segment)


def step(learner: TokenLogprobs, length: int, sampled: float) -> None:
    ids_BT, select_BT = batch(length, sampled)
    logp_BT, _, _, _ = learner(ids_BT, torch.ones_like(ids_BT), 1.0, select_BT, keep_hidden=False)
    (-(logp_BT * select_BT).sum() / select_BT.sum()).backward()
    learner.zero_grad(set_to_none=True)


def live_peak(length: int, args) -> int:
    learner = trunk(args.segment)
    with footprint.PeakBytes() as meter:
        step(learner, length, args.sampled)
    return meter.peak


def rss_growth(length: int, args, release: bool) -> int:
    """Peak RSS growth (bytes) of one step in a fresh child process (after a warm-up step)."""
    cmd = [sys.executable, __file__, "--child", str(length), str(int(release)),
           "--segment", str(args.segment), "--sampled", str(args.sampled)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def child(length: int, release: bool, args) -> None:
    """One step's peak RSS over the RSS before it: the kernel's high-water mark is reset first
    (what model building and imports reached must not hide a smaller step)."""
    torch.set_num_threads(1)
    learner = trunk(args.segment, release)
    step(learner, 1024, args.sampled)
    before = reset_peak_rss()
    step(learner, length, args.sampled)
    print(status_bytes("VmHWM") - before)


def modelled(args) -> dict[str, float]:
    config = k3_preset("k3-tiny")
    carry = footprint.learner_carry(
        config, args.segment, torch.float32, replay=False, keep_hidden=False
    )
    rates = footprint.segment_rates(config, torch.float32)
    keys = footprint.learner_keys(config, rates, dtype=torch.float32)
    parts = {f"carried: {k}": v for k, v in carry.items() if k != "total"}
    parts["MLA, per earlier key: every layer's latents"] = keys["all_layers"]
    parts["MLA, per earlier key: one layer's fp32 gradients"] = keys["one_layer"]
    parts["LM head rows x loss share"] = footprint.head_row_bytes(config, torch.float32) * (
        args.sampled
    )
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs=2, default=[8192, 16384])
    parser.add_argument("--segment", type=int, default=1024)
    parser.add_argument("--sampled", type=float, default=0.004)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # length release
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1] == "1", args)
        return
    short, long = args.lengths
    slope = lambda f: (f(long) - f(short)) / (long - short)  # noqa: E731
    parts = modelled(args)
    rows = [*parts.items(), ("modelled total", sum(parts.values()))]
    rows.append(("measured: peak live tensors", slope(lambda n: live_peak(n, args))))
    rows.append(("measured: peak RSS, heap released per segment",
                 slope(lambda n: rss_growth(n, args, True))))  # fmt: skip
    rows.append(("measured: peak RSS, heap kept (glibc default)",
                 slope(lambda n: rss_growth(n, args, False))))  # fmt: skip
    print(f"k3-tiny fp32, segments of {args.segment}, loss on {args.sampled:g} of positions, "
          f"slope {short:,} -> {long:,} tokens")  # fmt: skip
    print("| part | bytes per token |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:,.0f} |")
    print(json.dumps(dict(rows)))


if __name__ == "__main__":
    main()
