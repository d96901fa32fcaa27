"""K3Config: round trips, a released-K3-shaped config.json, presets, analytic parameter counts."""

from __future__ import annotations

import json

import pytest
import torch

from policy.k3.configuration import (
    K3Config,
    count_parameters,
    default_full_attn_layers,
    k3_preset,
    moe_layer_params,
)
from policy.k3.moe import StableLatentMoE
from policy.k3.situ import SituGLU


def released_k3_config() -> dict:
    """The K3 text decoder as quoted in k3-architecture.md section 1 (a nested text_config)."""
    full = [*range(4, 93, 4), 93]
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi_linear.KimiLinearConfig"},
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 94) if i not in full], "full_attn_layers": full,
            "gate_lower_bound": -5.0, "use_full_rank_gate": True,
        },
        "num_attention_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "intermediate_size": 33792,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 12, "tie_word_embeddings": False,
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4"},
        "bos_token_id": 163584, "eos_token_id": 163586,
    }  # fmt: skip
    return {"model_type": "kimi_k3", "text_config": text}


def test_released_config_loads():
    raw = json.loads(json.dumps(released_k3_config()))  # as read from config.json
    cfg = K3Config.from_k3_config_dict(raw)
    assert cfg.model_type == "agentrl_k3"
    assert cfg.num_experts == 896 and cfg.num_experts_per_token == 16
    assert cfg.routed_expert_hidden_size == 3584 and cfg.eos_token_id == 163586
    assert not hasattr(cfg, "quantization_config")
    assert cfg.dtype == torch.bfloat16
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [
        *range(3, 92, 4),
        92,
    ]
    assert cfg.layer_types.count("linear_attention") == 69
    assert cfg.mlp_types[:2] == ["dense", "sparse"] and cfg.mlp_types.count("dense") == 1
    flat = K3Config.from_k3_config_dict(raw["text_config"])  # not nested also works
    assert flat.to_dict() == cfg.to_dict()
    assert count_parameters(cfg) == count_parameters(k3_preset("k3"))


def test_deepseek_style_aliases_are_accepted():
    text = released_k3_config()["text_config"]
    text["num_experts_per_tok"] = text.pop("num_experts_per_token")
    text["n_shared_experts"] = text.pop("num_shared_experts")
    text["norm_topk_prob"] = text.pop("moe_renormalize")
    cfg = K3Config.from_k3_config_dict(text)
    assert (cfg.num_experts_per_token, cfg.num_shared_experts, cfg.moe_renormalize) == (16, 2, True)
    direct = K3Config(num_experts_per_tok=4, num_experts=8)
    assert direct.num_experts_per_token == 4 and direct.num_experts_per_tok == 4


def test_dict_and_directory_round_trips(tmp_path):
    cfg = k3_preset("k3-debug", routed_scaling_factor=1.5)
    again = K3Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.layer_types == cfg.layer_types
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "agentrl_k3" and "layer_types" not in saved
    assert saved["linear_attn_config"]["full_attn_layers"] == [4]
    loaded = K3Config.from_pretrained(tmp_path)
    assert loaded.to_dict() == cfg.to_dict() and loaded.routed_scaling_factor == 1.5


def test_presets():
    debug, tiny, full = k3_preset("k3-debug"), k3_preset("k3-tiny"), k3_preset("k3")
    assert debug.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (debug.hidden_size, debug.num_experts, debug.num_experts_per_token) == (64, 8, 2)
    assert (debug.routed_expert_hidden_size, debug.attn_res_block_size) == (32, 2)
    assert tiny.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert tiny.vocab_size == 768
    assert full.linear_attn_config["full_attn_layers"] == default_full_attn_layers(93)
    assert full.to_dict() == K3Config().to_dict()
    assert k3_preset("k3-tiny", num_hidden_layers=4).to_dict() == tiny.to_dict()
    with pytest.raises(ValueError):
        k3_preset("k3-huge")


def test_validation_errors():
    with pytest.raises(ValueError):
        K3Config(num_hidden_layers=4, linear_attn_config={"kda_layers": [1, 2, 3, 4],
                                                          "full_attn_layers": [4]})  # fmt: skip
    with pytest.raises(ValueError):
        K3Config(num_experts=8, num_experts_per_token=9)
    with pytest.raises(ValueError, match="num_experts must be <= 32767"):  # int16 routes
        K3Config(num_experts=32768)
    with pytest.raises(ValueError):
        K3Config(hidden_act="gelu")
    silu = k3_preset("k3-debug", hidden_act="silu")
    assert silu.situ_betas == (None, None) and k3_preset("k3-debug").situ_betas == (4.0, 25.0)


def test_full_k3_parameter_counts_match_the_published_figures():
    counts = count_parameters(k3_preset("k3"))
    # Published: "2.8T total, ~104B active". 2.8T has two significant digits, so the rounding
    # interval [2.75T, 2.85T) is the tolerance. Active: within 1% of 104B without the input
    # embedding (1.17B; a table lookup) and 2% with it; this slack covers what the public
    # material leaves open (which small tensors count, MXFP4 packing, MTP = 0 layers here).
    assert 2.75e12 <= counts["total"] < 2.85e12
    assert abs(counts["active_non_embedding"] / 104e9 - 1) < 0.01
    assert abs(counts["active"] / 104e9 - 1) < 0.02
    # pinned (checked by hand per layer: KDA 443,740,384; MLA 232,196,096; MoE shared part
    # 189,926,912 + 896 experts x 33,030,144)
    assert counts["total"] == 2_779_484_393_568
    assert counts["active"] == 105_363_935_328


def test_counts_add_up_and_presets_are_small():
    for name in ("k3-debug", "k3-tiny", "k3"):
        counts = count_parameters(k3_preset(name))
        parts = sum(v for k, v in counts.items() if not k.startswith(("total", "active")))
        assert counts["total"] == parts
    tiny = count_parameters(k3_preset("k3-tiny"))
    assert 2e6 < tiny["total"] < 5e6 and tiny["active"] < tiny["total"]


def test_moe_and_dense_counts_match_real_modules():
    cfg = k3_preset("k3-debug")
    moe = StableLatentMoE(StableLatentMoE.Config.from_k3(cfg))
    always, per_expert = moe_layer_params(cfg)
    assert sum(p.numel() for p in moe.parameters()) == always + cfg.num_experts * per_expert
    expert_params = moe.experts.gate_up_proj[0].numel() + moe.experts.down_proj[0].numel()
    assert expert_params == per_expert
    dense = SituGLU(cfg.hidden_size, cfg.intermediate_size)
    assert sum(p.numel() for p in dense.parameters()) == count_parameters(cfg)["dense_mlp"]
    plain = k3_preset("k3-debug", routed_expert_hidden_size=None)
    plain_moe = StableLatentMoE(StableLatentMoE.Config.from_k3(plain))
    always, per_expert = moe_layer_params(plain)
    assert sum(p.numel() for p in plain_moe.parameters()) == always + 8 * per_expert
