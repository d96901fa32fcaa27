"""KDA on CPU: our chunked form vs transformers' torch fallback vs our recurrent reference.

Run: .venv/bin/python benchmarks/kda_speed.py [--lengths 4096 16384] [--threads 1]

One intra-op thread by default: on shared, busy cores multi-threaded timings of many small ops
are dominated by threads waiting for each other and vary by 10x from run to run.

Times forward and forward+backward (float32, B=1, H=HV=2, K=V=64, lower-bound gate), checks in
the same run that every implementation agrees with ours (outputs, final state, dq), and prints a
markdown table. Times are the best of `repeats` runs (one run when a run takes over SLOW_S);
ratios are "times slower than ours". The default run takes several minutes, almost all of it in
the two peers' backward passes at 16K.

Letters: B batch, T time, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from policy.k3.kda import kda_chunked, kda_gate_lower_bound, kda_recurrent, l2_normalize

B, H, K, V = 1, 2, 64, 64
SLOW_S = 5.0  # a run slower than this is not repeated (the peers' backward at 16K takes minutes)


def make_inputs(length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q_BTHK = l2_normalize(torch.randn(B, length, H, K, generator=gen))
    k_BTHK = l2_normalize(torch.randn(B, length, H, K, generator=gen))
    v_BTHV = torch.randn(B, length, H, V, generator=gen)
    f_BTHK = torch.randn(B, length, H, K, generator=gen)
    g_BTHK = kda_gate_lower_bound(f_BTHK, torch.zeros(H), torch.zeros(H * K))
    beta_BTH = torch.rand(B, length, H, generator=gen)
    return [q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH]


def implementations() -> dict[str, Callable]:
    from transformers.models.kimi_linear import modeling_kimi_linear as hf
    from transformers.utils import logging

    logging.set_verbosity_error()  # silence the "falling back to torch" notice
    scale = K**-0.5
    return {
        "ours kda_chunked (C=64)": lambda *x: kda_chunked(*x, scale=scale, chunk_size=64),
        "transformers chunk_kimi_delta_attention": lambda *x: hf.chunk_kimi_delta_attention(
            *x, chunk_size=64, output_final_state=True
        ),
        "ours kda_recurrent (reference loop)": lambda *x: kda_recurrent(*x, scale=scale),
    }


def run_once(fn: Callable, inputs: list[torch.Tensor], backward: bool):
    leaves = [x.clone().requires_grad_(backward) for x in inputs]
    start = time.perf_counter()
    o_BTHV, state_BHKV = fn(*leaves)
    if backward:
        (o_BTHV.square().sum() + state_BHKV.square().sum()).backward()
    elapsed = time.perf_counter() - start
    dq = leaves[0].grad if backward else None
    return elapsed, o_BTHV.detach(), state_BHKV.detach(), dq


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def best_of(fn: Callable, inputs: list[torch.Tensor], backward: bool, repeats: int):
    """Best time of up to `repeats` runs (one run if it takes over SLOW_S) and the first result."""
    times, first = [], None
    for _ in range(repeats):
        result = run_once(fn, inputs, backward)
        times.append(result[0])
        first = first or result
        if result[0] > SLOW_S:
            break
    return min(times), first


def bench_length(length: int, repeats: int) -> list[dict]:
    inputs = make_inputs(length)
    rows, ours = [], None
    for name, fn in implementations().items():
        fwd, _ = best_of(fn, inputs, False, repeats)
        both, (_, o, s, dq) = best_of(fn, inputs, True, repeats)
        if ours is None:
            ours = {"fwd": fwd, "both": both, "o": o, "s": s, "dq": dq}
        err = max(rel_err(o, ours["o"]), rel_err(s, ours["s"]), rel_err(dq, ours["dq"]))
        assert err < 1e-4, f"{name} disagrees with ours at T={length}: rel err {err:.2e}"
        ratios = {"ratio_fwd": fwd / ours["fwd"], "ratio_both": both / ours["both"]}
        rows.append({"T": length, "impl": name, "fwd": fwd, "both": both, "err": err, **ratios})
        print(f"  T={length:>6} {name}: fwd {fwd:.3f}s, fwd+bwd {both:.3f}s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads of {os.cpu_count()} cores,"
          f" {cpu}, load average {load}")  # fmt: skip
    print(f"B={B} H=HV={H} K={K} V={V} float32, lower-bound gate, chunk 64; best of {args.repeats}")
    rows = [row for length in args.lengths for row in bench_length(length, args.repeats)]
    print("\n| T | implementation | forward (s) | x ours | forward+backward (s) | x ours "
          "| max rel err vs ours |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['impl']} | {r['fwd']:.3f} | {r['ratio_fwd']:.1f} | {r['both']:.3f} "
              f"| {r['ratio_both']:.1f} | {r['err']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
