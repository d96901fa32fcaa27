"""Decode-time cache size of K3Policy against the analytic size (k3-architecture.md 2.4, 3.1).

Run: .venv/bin/python benchmarks/cache_bytes.py [--lengths 128 1024 8192] [--new-tokens 16]

k3-tiny (float32, measured): K3Policy's prefill of one prompt of each length, then decode
steps, exactly as generate() runs them; the K3Cache bytes in use are compared with
    KDA, per sequence, constant:  (H*K*V state, fp32) + (W-1) * (3*H*K) conv inputs  per KDA layer
    MLA, per token:               (kv_lora_rank + qk_rope_head_dim) latent values   per MLA layer
    plus 1 byte per token of key mask (shared by all MLA layers; padding/holes bookkeeping).
full K3 (bf16 latents and conv windows, fp32 states): the same K3Cache built on the meta device
(real shapes, no memory), against the same formulas, and against what plain multi-head
attention in every layer would cache (each head's 192-dim key and 128-dim value per token).
"""

from __future__ import annotations

import argparse

import torch

from policy.k3 import K3Cache, K3ForCausalLM, k3_preset
from policy.k3.engine import K3Policy


def analytic(cfg, dtype: torch.dtype) -> dict[str, int]:
    """Bytes: per sequence (KDA, constant) and per token (MLA latent, key mask)."""
    la = cfg.linear_attn_config
    heads, dim, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    item = torch.finfo(dtype).bits // 8
    state_item = torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
    kda_layers = cfg.layer_types.count("linear_attention")
    mla_layers = cfg.num_hidden_layers - kda_layers
    per_kda_layer = heads * dim * dim * state_item + (width - 1) * 3 * heads * dim * item
    return {
        "kda_per_seq": kda_layers * per_kda_layer,
        "mla_per_token": mla_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item,
        "mask_per_token": 1,
        "mha_per_token": cfg.num_hidden_layers
        * cfg.num_attention_heads
        * item
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim),
    }


def measure_tiny(lengths: list[int], new_tokens: int) -> list[dict]:
    torch.manual_seed(0)
    model = K3ForCausalLM(k3_preset("k3-tiny")).eval()
    policy = K3Policy(model)
    rows = []
    with torch.inference_mode():
        for length in lengths:
            prompt = torch.randint(1, 768, (length,)).tolist()
            cache, logits_BV, _ = policy.prefill([prompt])
            for _ in range(new_tokens):
                logits_BV, _ = policy.forward(cache, logits_BV.argmax(-1)[:, None])
            rows.append({"tokens": cache.length, **cache.nbytes()})
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 8192])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = analytic(k3_preset("k3-tiny"), torch.float32)
    print("# cache bytes per sequence: K3Policy's K3Cache vs the analytic size\n")
    print("| model | tokens | KDA state+conv (measured / analytic) | MLA latent (measured / "
          "analytic) | MLA bytes/token | key mask | total in use | allocated |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for row in measure_tiny(args.lengths, args.new_tokens):
        kda, mla, n = row["kda_state"] + row["kda_conv"], row["mla_latent"], row["tokens"]
        assert kda == tiny["kda_per_seq"] and mla == n * tiny["mla_per_token"], row
        print(f"| k3-tiny fp32 | {n:,} | {kda:,} / {tiny['kda_per_seq']:,} | "
              f"{mla:,} / {n * tiny['mla_per_token']:,} | {mla / n:,.0f} | {row['key_mask']:,} | "
              f"{mib(row['total'])} | {mib(row['allocated'])} |")  # fmt: skip
    full_cfg = k3_preset("k3")
    full = analytic(full_cfg, torch.bfloat16)
    for n in (4096, 131072, 1048576):
        with torch.device("meta"):
            cache = K3Cache.empty(full_cfg, 1, dtype=torch.bfloat16, capacity=n)
        cache.length = n  # every slot in use
        got = cache.nbytes()
        kda, mla = got["kda_state"] + got["kda_conv"], got["mla_latent"]
        assert kda == full["kda_per_seq"] and mla == n * full["mla_per_token"]
        print(f"| K3 bf16 (meta) | {n:,} | {kda:,} / {full['kda_per_seq']:,} | "
              f"{mla:,} / {n * full['mla_per_token']:,} | {mla / n:,.0f} | {got['key_mask']:,} | "
              f"{mib(got['total'])} | {mib(got['allocated'])} |")  # fmt: skip
    print(f"\nFull K3: KDA {mib(full['kda_per_seq'])} per sequence whatever its length (69 layers),"
          f" MLA {full['mla_per_token']:,} B per token (24 layers x 576 values x 2 B); plain "
          f"multi-head attention in all 93 layers (96 heads x (192 + 128) values, bf16) would "
          f"cache {full['mha_per_token']:,} B per token, "
          f"{full['mha_per_token'] / full['mla_per_token']:,.0f}x more.")  # fmt: skip


if __name__ == "__main__":
    main()
