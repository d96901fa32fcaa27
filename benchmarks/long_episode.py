"""One long agent episode through the rollout engine: k3-tiny on LongHorizon-v0, each stage of
configs/long_context.yaml (8K, 64K, 256K, 1M tokens).

    .venv/bin/python benchmarks/long_episode.py [--stages 8k 64k 256k] [--seed 0]

The episode is the env's scripted expert's (its tool calls read whole documents into the
context), tokenized with a byte-level BPE trained on the task's text. The engine runs it the way a
worker does (`policy.engines.open_session(K3Policy)`): every message is added to the episode's
persistent cache by chunked prefill of its new tokens only, and after every tool result the policy
decodes `--decode` tokens at that context length (what sampling an assistant turn costs; the
expert's own turn is then added as the context's next tokens). Each stage runs in a fresh
subprocess; reported: tokens, turns, wall time, tokens/s, the cache bytes of the episode
(`session.cache_bytes`, and the admission model `session.bytes_for`), and the peak RSS growth of
the process. Growth exponents are fitted over the stages run.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def episode_messages(stage: str, seed: int):
    import gymnasium

    import envs  # noqa: F401
    from envs import make_expert
    from envs.expert import demonstrate
    from rl.config.runfile import load_config
    from rl.run.curriculum import staged

    cfg = load_config(ROOT / "configs/long_context.yaml", [])
    index = [s.name for s in cfg.curriculum].index(stage)
    run = staged(cfg, index)
    env = gymnasium.make(run.env.id, **run.env.kwargs)
    demo = demonstrate(env.unwrapped, make_expert(run.env.id, error_rate=0.0, seed=seed), seed=seed)
    return demo, run.rollout.max_seq_len


def run_stage(stage: str, seed: int, decode: int) -> dict:
    import torch

    from policy.engines import open_session
    from policy.k3 import K3ForCausalLM, k3_preset
    from policy.k3.engine import K3Policy
    from policy.sampling import SamplingParams
    from policy.tokenizer import build_tokenizer

    torch.set_num_threads(2)
    demo, limit = episode_messages(stage, seed)
    texts = [m.get("content") or json.dumps(m.get("tool_calls", "")) for m in demo.messages]
    tokenizer = build_tokenizer(texts[:40], vocab_size=768)
    torch.manual_seed(0)
    config = k3_preset("k3-tiny", vocab_size=len(tokenizer), max_position_embeddings=1 << 21)
    session = open_session(K3Policy(K3ForCausalLM(config).eval()))
    params = SamplingParams(temperature=1.0, max_new_tokens=decode)
    base, start, tokens, turns = rss_mib(), time.perf_counter(), 0, 0
    with torch.inference_mode():
        for message, text in zip(demo.messages, texts, strict=True):
            ids = tokenizer.encode(text, add_special_tokens=False) or [0]
            session.add(["e"], [ids])
            tokens += len(ids)
            if message["role"] == "tool":  # the policy samples its next turn at this length
                for _ in range(decode):
                    session.step(["e"], params)
                tokens, turns = tokens + decode, turns + 1
        seconds = time.perf_counter() - start
        cache = session.cache_bytes("e")
        model = session.bytes_for(session.context_length("e"))
    return dict(
        stage=stage, tokens=tokens, context=session.context_length("e"), turns=turns,
        seconds=seconds, tokens_per_s=tokens / seconds, cache_mib=cache / 2**20,
        model_mib=model / 2**20, peak_rss_growth_mib=rss_mib() - base, stage_limit=limit,
        success=demo.outcome["success"],
    )  # fmt: skip


def fit(xs, ys) -> float:
    """Least-squares slope of log y on log x (the growth exponent)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum(
        (a - mx) ** 2 for a in lx
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", nargs="+", default=["8k", "64k", "256k"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode", type=int, default=16, help="tokens decoded after each tool result")
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one stage in this process
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_stage(args.one, args.seed, args.decode)))
        return
    rows = []
    for stage in args.stages:
        cmd = [sys.executable, __file__, "--one", stage, "--seed", str(args.seed)]
        out = subprocess.run([*cmd, "--decode", str(args.decode)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{stage}: failed\n{out.stderr[-2000:]}")
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"| {r['stage']} | {r['tokens']:,} | {r['turns']} | {r['seconds']:.1f} "
            f"| {r['tokens_per_s']:,.0f} | {r['cache_mib']:.1f} | {r['model_mib']:.1f} "
            f"| {r['peak_rss_growth_mib']:.0f} |",
            flush=True,
        )
    if len(rows) >= 2:
        xs = [r["tokens"] for r in rows]
        print(f"time exponent {fit(xs, [r['seconds'] for r in rows]):.2f}, peak RSS exponent "
              f"{fit(xs, [max(r['peak_rss_growth_mib'], 1) for r in rows]):.2f}, cache exponent "
              f"{fit(xs, [r['cache_mib'] for r in rows]):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
