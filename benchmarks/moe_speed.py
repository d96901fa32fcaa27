"""Speed of the K3 Stable LatentMoE layer per expert-dispatch path, on the same weights and tokens.

    .venv/bin/python benchmarks/moe_speed.py [--tokens 4096 --hidden 256 --latent 128 ...]

Times forward (no grad) and forward+backward of the whole layer (router, latent projections,
routed experts, norm, shared expert) for the paths in policy/k3/moe.py: "naive" (loop over
experts), "dense" (every expert on every token, masked), "segment" (sorted tokens, one matmul per
expert) and "grouped" (sorted tokens, torch.nn.functional.grouped_mm). Outputs are compared with
the naive loop in the same run; the table is markdown. Each number is the best of --repeats
runs after a warm-up, the paths interleaved round-robin (a shared machine adds noise).

Letters: T tokens, D hidden size, L latent size, F expert intermediate size, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from policy.k3.moe import DISPATCHES, StableLatentMoE, grouped_mm_supported


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=128, help="moe_intermediate_size")
    parser.add_argument("--shapes", default="16x2,32x4,64x8", help="experts x top-k, comma list")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default=",".join(DISPATCHES))
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    return parser.parse_args()


def build(args, num_experts: int, top_k: int) -> tuple[StableLatentMoE, torch.Tensor]:
    config = StableLatentMoE.Config(
        hidden_size=args.hidden,
        moe_intermediate_size=args.ffn,
        num_experts=num_experts,
        top_k=top_k,
        latent_size=args.latent,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        init_std=0.05,
    )
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    moe = StableLatentMoE(config).to(dtype)
    moe.gate.float()  # the router stays in fp32, as in the model
    x_TD = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    return moe, x_TD.to(dtype)


def path_fns(moe, x_TD, dispatch: str) -> dict[str, Callable[[], object]]:
    def forward():
        with torch.no_grad():
            return moe(x_TD, dispatch=dispatch)

    def forward_backward():
        moe.zero_grad(set_to_none=True)
        moe(x_TD, dispatch=dispatch).square().mean().backward()

    return {"fwd": forward, "fwd_bwd": forward_backward}


def best_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best of `repeats` per function, run round-robin so load spikes hit all paths alike."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def rows_for_shape(args, num_experts: int, top_k: int) -> list[str]:
    moe, x_TD = build(args, num_experts, top_k)
    paths = args.paths.split(",")
    fns = {(p, kind): fn for p in paths for kind, fn in path_fns(moe, x_TD, p).items()}
    secs = best_seconds(fns, args.repeats)
    outs = {p: fns[(p, "fwd")]().float() for p in paths}
    ref = "naive" if "naive" in paths else paths[0]
    scale = outs[ref].abs().max().item()
    rows = []
    for p in paths:
        fwd, both = secs[(p, "fwd")], secs[(p, "fwd_bwd")]
        diff = (outs[p] - outs[ref]).abs().max().item() / scale
        rows.append(
            f"| {num_experts} | {top_k} | {p} | {args.tokens / fwd:,.0f} "
            f"| {args.tokens / both:,.0f} | {secs[(ref, 'fwd')] / fwd:.2f}x "
            f"| {secs[(ref, 'fwd_bwd')] / both:.2f}x | {diff:.1e} |"
        )
    return rows


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    usable = grouped_mm_supported(
        torch.zeros(8, args.latent, dtype=dtype),
        torch.zeros(2, 2 * args.ffn, args.latent, dtype=dtype),
    ) and grouped_mm_supported(
        torch.zeros(8, args.ffn, dtype=dtype), torch.zeros(2, args.latent, args.ffn, dtype=dtype)
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"T={args.tokens} D={args.hidden} L={args.latent} F={args.ffn}, "
        f"grouped_mm usable: {usable}\n"
    )
    print("| experts | top-k | path | fwd tok/s | fwd+bwd tok/s | fwd vs naive "
          "| fwd+bwd vs naive | max rel diff vs naive |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        num_experts, top_k = (int(v) for v in shape.split("x"))
        for row in rows_for_shape(args, num_experts, top_k):
            print(row, flush=True)


if __name__ == "__main__":
    main()
