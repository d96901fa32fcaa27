"""Training-step speed of one Stable LatentMoE block: 2-way expert parallel on 2 gloo ranks against
one process, on the same global batch, one torch thread per process (CPU).

    .venv/bin/python benchmarks/ep_speed.py [--tokens 4096 --experts 16 --top-k 2 ...]

One process runs forward+backward (loss = mean square of the output) of the whole block on all
T tokens. The 2-rank run goes through policy.parallel.parallelize (FSDP2 for the block's dense
parameters: router, latent projections, norm, shared expert; 2-way EP for the routed experts):
each rank routes T/2 tokens, holds E/2 experts, and exchanges tokens by two all-to-alls per
forward (two more in backward) plus FSDP's all-gather and reduce-scatter. A step's time is the
slowest rank's; each number is the best of --repeats steps after a warm-up. "ideal" is 2x the
1-process rate; "no communication" runs the same per-rank work (T/2 tokens on a block with E/2
experts) without any collective, so the gap to the EP row is the cost of the all-to-alls and
FSDP's all-gathers and reduce-scatters on this machine (and of FSDP's and DTensor's Python
work). Gloo over loopback TCP on a shared CPU makes communication far
costlier than NCCL over NVLink: read the gap as an upper bound on the overhead, not a GPU
forecast. Other processes on the machine skew the 2-rank rows most (the header prints the load).

Letters: T tokens, D hidden size, L latent size, F expert intermediate size, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policy.k3.moe import StableLatentMoE
from policy.parallel import build_meshes, parallelize
from rl.run.launch import free_port


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="global batch T")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--latent", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256, help="moe_intermediate_size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dispatch", default="grouped")
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def build(args) -> tuple[StableLatentMoE, torch.Tensor]:
    config = StableLatentMoE.Config(
        hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
        top_k=args.top_k, latent_size=args.latent, num_shared_experts=1,
        routed_scaling_factor=2.5, init_std=0.05, dispatch=args.dispatch,
    )  # fmt: skip
    torch.manual_seed(0)
    x_TD = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1))
    return StableLatentMoE(config), x_TD


def best_step_seconds(
    models: dict[str, torch.nn.Module], x_TD: torch.Tensor, repeats: int, distributed: bool
) -> dict[str, float]:
    """Best of `repeats` forward+backward steps per model (slowest rank's time when
    distributed), the models interleaved round-robin so load spikes hit them alike."""
    best = dict.fromkeys(models, float("inf"))
    for i in range(repeats + 1):
        for name, moe in models.items():
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            moe(x_TD).square().mean().backward()
            elapsed = torch.tensor(time.perf_counter() - start)
            if distributed:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            moe.zero_grad(set_to_none=True)
            if i > 0:  # round 0 is the warm-up
                best[name] = min(best[name], float(elapsed))
    return best


def _rank_main(rank: int, world: int, port: int, args, out_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the block is the root
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        share = args.tokens // world
        moe, x_TD = build(args)
        x_TD = x_TD[rank * share : (rank + 1) * share]
        local, _ = build(argparse.Namespace(**vars(args) | {"experts": args.experts // world}))
        models = {
            "compute_only": local,
            "ep": parallelize(moe, build_meshes(ep_size=world), layers=[]),
        }
        seconds = best_step_seconds(models, x_TD, args.repeats, distributed=True)
        if rank == 0:
            torch.save(seconds, out_file)
    finally:
        dist.destroy_process_group()


def two_rank_seconds(args) -> dict[str, float]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "seconds.pt")
        mp.spawn(_rank_main, args=(2, port, args, out_file), nprocs=2)
        return torch.load(out_file)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    moe, x_TD = build(args)
    one = best_step_seconds({"one": moe}, x_TD, args.repeats, distributed=False)["one"]
    two = two_rank_seconds(args)
    print(
        f"T={args.tokens} D={args.hidden} L={args.latent} F={args.ffn} E={args.experts} "
        f"K={args.top_k} dispatch={args.dispatch}, 1 thread per process, fwd+bwd, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    print("| setup | step ms | tokens/s | vs 1 process |")
    print("|---|---|---|---|")
    rows = (
        ("1 process, all T tokens and E experts", one),
        ("2 ranks, no communication (T/2 tokens, E/2 experts each)", two["compute_only"]),
        ("2 ranks, FSDP2 + 2-way EP", two["ep"]),
        ("ideal 2 ranks", one / 2),
    )
    for name, seconds in rows:
        rate = args.tokens / seconds
        print(f"| {name} | {seconds * 1e3:.1f} | {rate:,.0f} | {one / seconds:.2f}x |")


if __name__ == "__main__":
    main()
