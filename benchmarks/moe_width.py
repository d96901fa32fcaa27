"""Where the MoE policy's training-step cost against a dense one comes from: k3-tiny widened by
factors s, each against a dense Qwen3 with about its active parameter count, forward + backward
of one batch (labels = inputs), in one process, the two models alternating, best of N.

    .venv/bin/python benchmarks/moe_width.py [--widths 1,2,4] [--batch 16] [--length 192]
        [--rounds 6] [--threads 2]

k3 at width s: k3-tiny (policy/k3/configuration.py) with hidden 96 s, KDA and MLA heads 2 s
(head dims as k3-tiny's), q_lora 48 s, kv_lora 32 s, the experts' intermediate 96 s and latent
48 s, the dense layer's intermediate 256 s (48 experts, top-2, 4 layers, 3:1 KDA:MLA as in
k3-tiny). Its active count is `count_parameters(config)["active"]` (top-2 routed experts,
embeddings and head included).

The dense peer: the template's Qwen3 shape (3 layers, head_dim 32, kv heads = heads / 2,
intermediate 3 x hidden, tied embeddings) at the hidden size (a multiple of 64) whose parameter
count is closest to k3's active count; at s = 1 that is the template's own model (hidden 128,
0.66M against k3-tiny's 0.59M active), the peer of benchmarks/train_speed.py.

What it shows: the ratio of step times against the width. k3's extra work per token is mostly
elementwise and small batched ops (decay factors, AttnRes, the short convolutions, norms, the
routing), which grow with the hidden size; the matmuls both models share grow with its square.
So the ratio falls as the models widen, and k3-tiny, the narrowest, pays the most.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.hf import build_model
from policy.k3.configuration import count_parameters

VOCAB = 518
"""The quickstart tokenizer's vocabulary (what train_speed.py builds)."""


def k3_config(s: int) -> dict:
    """k3-tiny widened by s (head dims, expert count, depth and layer kinds unchanged)."""
    return {
        "preset": "k3-tiny",
        "hidden_size": 96 * s,
        "linear_attn_config": {
            "num_heads": 2 * s,
            "head_dim": 48,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
        },
        "num_attention_heads": 2 * s,
        "q_lora_rank": 48 * s,
        "kv_lora_rank": 32 * s,
        "moe_intermediate_size": 96 * s,
        "routed_expert_hidden_size": 48 * s,
        "intermediate_size": 256 * s,
    }


def dense_config(hidden: int) -> dict:
    """The template's dense Qwen3 shape at `hidden` (a multiple of 64)."""
    heads = hidden // 32
    return {
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": 3,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": 32,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    }


def dense_params(hidden: int) -> int:
    """Parameters of dense_config(hidden) at VOCAB, from the shapes (no model built)."""
    kv = hidden // 2
    attn = hidden * hidden * 2 + hidden * kv * 2 + 2 * 32  # q, o; k, v; q/k norms
    mlp = 3 * hidden * 3 * hidden
    return VOCAB * hidden + 3 * (attn + mlp + 2 * hidden) + hidden


def matched_dense(active: int) -> int:
    """The hidden size (multiple of 64) whose dense model is closest to `active` parameters."""
    return min(range(64, 4097, 64), key=lambda h: abs(dense_params(h) - active))


def step_seconds(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def compare(s: int, args: argparse.Namespace) -> str:
    """One markdown row: k3 at width s against its active-matched dense peer."""
    k3 = build_model("agentrl_k3", k3_config(s), vocab_size=VOCAB, seed=0)
    active = count_parameters(k3.config)["active"]
    hidden = matched_dense(active)
    dense = build_model("qwen3", dense_config(hidden), vocab_size=VOCAB, seed=0)
    assert sum(p.numel() for p in dense.parameters()) == dense_params(hidden)
    seeded = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (args.batch, args.length), generator=seeded)  # [B, T]
    best = {"k3": float("inf"), "dense": float("inf")}
    for model in (k3, dense):
        model.train()
        step_seconds(model, ids)  # warm-up
    for _ in range(args.rounds):
        for name, model in (("k3", k3), ("dense", dense)):
            best[name] = min(best[name], step_seconds(model, ids))
            model.zero_grad(set_to_none=True)
    total = sum(p.numel() for p in k3.parameters())
    return (
        f"| {s} | {96 * s} | {active / 1e6:.2f}M / {total / 1e6:.2f}M | {best['k3'] * 1e3:.0f} "
        f"| {hidden} | {dense_params(hidden) / 1e6:.2f}M | {best['dense'] * 1e3:.0f} "
        f"| **{best['k3'] / best['dense']:.2f}x** |"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="1,2,4", help="comma-separated width factors s")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=192)
    p.add_argument("--rounds", type=int, default=6, help="timed steps per model (best is kept)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, forward + "
        f"backward at [{args.batch}, {args.length}], best of {args.rounds}\n"
    )
    print("| s | k3 hidden | k3 active / total | k3 ms | dense hidden | dense params | dense ms "
          "| k3 / dense |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for s in (int(w) for w in args.widths.split(",")):
        print(compare(s, args), flush=True)


if __name__ == "__main__":
    main()
