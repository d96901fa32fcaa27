"""One long trajectory's learner forward + backward on 1 rank against 2 context ranks (issue 20).

Run: .venv/bin/python benchmarks/context_parallel.py [--tokens 65536] [--segment 4096]
     [--ranks 1 2] [--split balanced|even] [--one-rank-threads 2]

k3-tiny (float32, random weights), batch 1, `--tokens` random ids. Each rank count runs in its
own spawned gloo process group, one torch thread per context rank; the 1-rank run gets
`--one-rank-threads` (default 2: the same two cores the 2 ranks use):
- 1 rank: `carried_hidden` over the whole sequence in checkpointed segments (the segmented
  learner, trainer.segment_tokens = --segment);
- n ranks: `policy/k3/context.py context_hidden`, the ranks working at the same time (layer by
  layer, MLA latents sent before the attention), rank r holding whole segments
  [b[r], b[r + 1]) of `shard_bounds`: balanced by FLOPs (`pair_cost`, the learner's split) or
  `--split even` (equal segment counts).
Every rank then puts its shard's positions through the LM head (the logprob of the next token;
the last rank's last position predicts nothing) and back-propagates the mean over the
sequence. Printed per rank: forward and backward wall time (including waits for the other
rank), the whole step's wall time, and the peak RSS growth over the RSS after the model was
built (`ru_maxrss`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policy.k3 import K3ForCausalLM, k3_preset
from policy.k3.context import context_hidden, pair_cost, shard_bounds
from policy.k3.segments import carried_hidden
from policy.logprobs import head_logprobs


def rank_step(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.one_rank_threads if world == 1 else 1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(hours=2))
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny", max_position_embeddings=2**21)).eval()
    ids_1T = torch.randint(1, 768, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    cost = pair_cost(model.config) if args.split == "balanced" else 0.0
    lo, hi = shard_bounds(args.tokens, world, args.segment, cost)[rank : rank + 2]
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    mask_1S = torch.ones(1, hi - lo, dtype=torch.long)
    if world == 1:
        hidden_1SD = carried_hidden(model.get_decoder(), ids_1T, mask_1S, segment=args.segment)[0]
        anchor = hidden_1SD.new_zeros(())
    else:
        decoder, group = model.get_decoder(), dist.group.WORLD
        hidden_1SD, anchor = context_hidden(
            decoder, ids_1T[:, lo:hi], mask_1S, group=group, segment=args.segment
        )
    forward = time.perf_counter() - started
    predicting = min(hi, args.tokens - 1) - lo  # positions with a next token
    logp_1S, _ = head_logprobs(
        model, hidden_1SD[:, :predicting], ids_1T[:, lo + 1 : lo + 1 + predicting]
    )
    (-logp_1S.sum() / (args.tokens - 1) + anchor).backward()
    total = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {"ranks": world, "rank": rank, "split": args.split, "tokens": hi - lo,
           "forward_s": round(forward, 1), "backward_s": round(total - forward, 1),
           "step_s": round(total, 1),
           "peak_rss_growth_MiB": round((peak_kib - before_kib) / 1024)}  # fmt: skip
    Path(out, f"{world}-{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--segment", type=int, default=4096)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--split", choices=("balanced", "even"), default="balanced")
    parser.add_argument("--one-rank-threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        for world in args.ranks:
            print(f"{world} rank(s), {args.tokens} tokens ...", file=sys.stderr, flush=True)
            ctx = mp.start_processes(rank_step, args=(world, free_port(), args, out),
                                     nprocs=world, join=False, start_method="spawn")  # fmt: skip
            _finish(world, ctx, out)


def _finish(world: int, ctx, out: str) -> None:
    while not ctx.join():
        pass
    for rank in range(world):
        print(Path(out, f"{world}-{rank}.json").read_text(), flush=True)


if __name__ == "__main__":
    main()
