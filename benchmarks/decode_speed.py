"""Rollout decode speed: K3Policy (k3-tiny) vs transformers' KimiLinear and a dense Qwen3.

Run: .venv/bin/python benchmarks/decode_speed.py [--batches 1 16] [--threads 1 0] [--repeats 3]
     [--device cpu | cuda]   (cuda: every model on the GPU, timings synchronised; threads moot)

All three models are built from configs (no downloads) on the same k3-tiny-sized shapes and
get the same prompts (--prompt-len random tokens per row) and generate --new-tokens tokens
each, greedily, without stopping early:
- ours: policy.k3.engine.K3Policy.generate (chunked prefill, fused cached decode);
- KimiLinearForCausalLM.generate: transformers' Kimi-Linear with the closest config it allows
  (same hidden size, layers, KDA/MLA pattern, heads, head dims, MLA ranks, experts, top-k, shared
  expert, dense first layer; it has no AttnRes, no latent MoE (its experts run at the full
  hidden size, so it has more parameters) and SiLU instead of SiTU); torch fallbacks for KDA;
- Qwen3ForCausalLM.generate: dense, same hidden size and depth, intermediate size chosen so
  that its total parameter count equals k3-tiny's.
End-to-end tokens/s = rows * new tokens / wall time of the whole call (prefill included);
decode-only tokens/s = rows * (new tokens - 1) / (that time - the time of a one-token call).
Best of --repeats runs; the engines are interleaved within each repeat so that load on these
shared machines hits all of them alike. `--threads 0` means torch's default thread count.
A second table measures our prefill strategies on prompts of mixed lengths.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from policy.k3 import K3ForCausalLM, count_parameters, k3_preset
from policy.k3.engine import K3Policy
from policy.sampling import SamplingParams


def kimi_linear_peer(cfg):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # silence the "falling back to torch" notices
    la = cfg.linear_attn_config
    peer = KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, layer_types=cfg.layer_types,
        linear_attn_config={"num_heads": la["num_heads"], "head_dim": la["head_dim"],
                            "short_conv_kernel_size": la["short_conv_kernel_size"]},
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token, n_shared_experts=cfg.num_shared_experts,
        moe_intermediate_size=cfg.moe_intermediate_size, intermediate_size=cfg.intermediate_size,
        first_k_dense_replace=cfg.first_k_dense_replace,
        routed_scaling_factor=cfg.routed_scaling_factor, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return KimiLinearForCausalLM(peer).eval()


def qwen3_peer(cfg, total: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def build(intermediate: int):
        return Qwen3Config(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=intermediate, num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_attention_heads,
            head_dim=cfg.hidden_size // cfg.num_attention_heads, tie_word_embeddings=False,
            pad_token_id=0, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip

    with torch.device("meta"):
        base = sum(p.numel() for p in Qwen3ForCausalLM(build(0)).parameters())
    per_unit = 3 * cfg.hidden_size * cfg.num_hidden_layers
    intermediate = round((total - base) / per_unit)
    return Qwen3ForCausalLM(build(intermediate)).eval(), intermediate


def hf_generate(model, ids_BP: torch.Tensor, new_tokens: int) -> None:
    with torch.inference_mode():
        model.generate(
            ids_BP, attention_mask=torch.ones_like(ids_BP), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )  # fmt: skip


class _Runs(dict):
    """name -> run(ids, new_tokens), plus our K3Policy for the prefill table."""

    def __init__(self, runs, policy: K3Policy) -> None:
        super().__init__(runs)
        self.policy = policy


def engines(seed: int = 0, device: str = "cpu"):
    cfg = k3_preset("k3-tiny")
    torch.manual_seed(seed)
    ours = K3Policy(K3ForCausalLM(cfg).eval().to(device), max_batch=64)
    total = count_parameters(cfg)["total"]
    kimi = kimi_linear_peer(cfg).to(device)
    qwen, intermediate = qwen3_peer(cfg, total)
    qwen = qwen.to(device)
    sizes = {
        "ours (K3Policy, k3-tiny)": total,
        "KimiLinearForCausalLM.generate": sum(p.numel() for p in kimi.parameters()),
        f"Qwen3ForCausalLM.generate (intermediate {intermediate})": sum(
            p.numel() for p in qwen.parameters()
        ),
    }
    runs = {
        "ours (K3Policy, k3-tiny)": lambda ids, n: ours.generate(
            ids.tolist(), SamplingParams(temperature=0.0, max_new_tokens=n)
        ),
        "KimiLinearForCausalLM.generate": lambda ids, n: hf_generate(kimi, ids, n),
        f"Qwen3ForCausalLM.generate (intermediate {intermediate})": lambda ids, n: hf_generate(
            qwen, ids, n
        ),
    }
    return _Runs(runs, ours), sizes


def measure(runs, batch: int, args) -> dict[str, tuple[float, float]]:
    """name -> (end-to-end tokens/s, decode-only tokens/s). Decode-only divides the tokens after
    the first by the time a full run takes beyond a one-token run (prefill + first token)."""
    gen = torch.Generator().manual_seed(batch)
    ids_BP = torch.randint(1, 768, (batch, args.prompt_len), generator=gen).to(args.device)
    for run in runs.values():
        run(ids_BP, 2)  # warm-up
    full, first = dict.fromkeys(runs, float("inf")), dict.fromkeys(runs, float("inf"))
    for _ in range(args.repeats):
        for name, run in runs.items():
            for new_tokens, best in ((args.new_tokens, full), (1, first)):
                start = time.perf_counter()
                run(ids_BP, new_tokens)
                sync(args.device)
                best[name] = min(best[name], time.perf_counter() - start)
    tokens = batch * args.new_tokens
    return {
        name: (tokens / full[name], batch * (args.new_tokens - 1) / (full[name] - first[name]))
        for name in runs
    }


def sync(device: str) -> None:
    """Wait for the GPU's queued work (a CUDA call returns before it has run)."""
    if device == "cuda":
        torch.cuda.synchronize()


def machine(device: str) -> str:
    cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    return f"{torch.cuda.get_device_name()}, {cpu}" if device == "cuda" else cpu


def prefill_strategies(policy: K3Policy, repeats: int) -> None:
    """Our prefill of 16 prompts of mixed lengths (16..512 tokens): one left-padded batch vs one
    prompt at a time vs length-sorted groups of 4 (real prompt tokens per second)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 513, (16,), generator=gen).tolist()
    prompts = [torch.randint(1, 768, (n,), generator=gen).tolist() for n in lengths]
    by_length = sorted(prompts, key=len)
    strategies = {
        "one left-padded batch of 16": [prompts],
        "each prompt alone": [[p] for p in prompts],
        "length-sorted groups of 4": [by_length[i : i + 4] for i in range(0, 16, 4)],
    }
    best = dict.fromkeys(strategies, float("inf"))
    with torch.inference_mode():
        plan = policy.plan()
        for _ in range(repeats):
            for name, groups in strategies.items():
                start = time.perf_counter()
                for group in groups:
                    policy.prefill(group, plan)
                sync(policy.device.type)
                best[name] = min(best[name], time.perf_counter() - start)
    print(f"\nprefill, 16 prompts of {min(lengths)}..{max(lengths)} tokens ({sum(lengths):,} in "
          f"all), {torch.get_num_threads()} thread(s):\n")  # fmt: skip
    print("| strategy | prompt tokens/s |\n|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {sum(lengths) / seconds:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-prefill-table", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    runs, sizes = engines(device=args.device)
    print(f"# decode speed: {machine(args.device)}, "
          f"torch {torch.__version__}, prompts {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, greedy, best of {args.repeats}\n")  # fmt: skip
    for name, size in sizes.items():
        print(f"- {name}: {size:,} parameters")
    print("\n| threads | batch | engine | tokens/s end-to-end | ours / this | tokens/s decode "
          "only | ours / this |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads or default_threads)
        for batch in args.batches:
            speeds = measure(runs, batch, args)
            ours, ours_decode = speeds["ours (K3Policy, k3-tiny)"]
            for name, (speed, decode) in speeds.items():
                print(f"| {threads or default_threads} | {batch} | {name} | {speed:,.0f} | "
                      f"{ours / speed:.2f}x | {decode:,.0f} | {ours_decode / decode:.2f}x |",
                      flush=True)  # fmt: skip
    if not args.no_prefill_table:
        torch.set_num_threads(1)
        prefill_strategies(runs.policy, args.repeats)


if __name__ == "__main__":
    main()
