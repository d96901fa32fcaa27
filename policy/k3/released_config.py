"""A released Kimi K3 `config.json` <-> K3Config, strictly (k3-architecture.md section 1).

The released file nests the decoder under `text_config` (model_type "kimi_linear"; the top
level is the vision-language wrapper, whose other keys are ignored here). Every key of the
text config is either
- a K3Config field (same spelling, or a DeepSeek/transformers alias from K3Config.attribute_map),
- a key whose value we check because only one value is supported (`_REQUIRED`),
- bookkeeping with no effect on the decoder (`_IGNORED`),
and anything else is refused with an error naming it, as is an unknown `linear_attn_config`
key. Refused on purpose: `quantization_config` (the release's MXFP4 routed experts: dequantize
them first), MTP layers (num_nextn_predict_layers > 0), RoPE MLA (mla_use_nope false).
Ignored because K3's MLA is NoPE: rope_theta, rope_scaling; `head_dim` (a field of Moonshot's
config class that the NoPE MLA does not read [U]).

`K3Config.from_k3_config_dict` stays the lenient reader; this module is the loader's.
"""

from __future__ import annotations

from typing import Any

from policy.k3.configuration import K3Config

# K3Config fields written and read under the released spelling.
_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "linear_attn_config",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "num_experts", "num_experts_per_token", "num_shared_experts", "moe_intermediate_size",
    "routed_expert_hidden_size", "latent_moe_use_norm", "moe_router_activation_func",
    "moe_renormalize", "routed_scaling_factor", "num_expert_group", "topk_group",
    "first_k_dense_replace", "intermediate_size", "hidden_act", "activation_situ_beta",
    "activation_situ_linear_beta", "attn_res_block_size", "rms_norm_eps", "tie_word_embeddings",
    "max_position_embeddings", "initializer_range", "num_nextn_predict_layers", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id",
)  # fmt: skip
_LINEAR_ATTN_KEYS = frozenset(
    ("num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
     "gate_lower_bound", "use_full_rank_gate")
)  # fmt: skip
# Keys with one supported value: key -> (check(value, text_config), what is supported).
_REQUIRED = {
    "model_type": (lambda v, c: v == "kimi_linear", '"kimi_linear"'),
    "attention_bias": (lambda v, c: not v, "false"),
    "attention_dropout": (lambda v, c: not v, "0"),
    "num_key_value_heads": (
        lambda v, c: v in (None, c.get("num_attention_heads", 96)),
        "num_attention_heads",
    ),
    "topk_method": (lambda v, c: v == "noaux_tc", '"noaux_tc"'),
    "moe_layer_freq": (lambda v, c: v == 1, "1"),
    "use_grouped_topk": (lambda v, c: v or c.get("num_expert_group", 1) == 1, "true"),
    "num_nextn_predict_layers": (lambda v, c: not v, "0 (no MTP layers)"),
    "mla_use_nope": (lambda v, c: v is True, "true (NoPE MLA)"),
    "quantization_config": (
        lambda v, c: v is None,
        "absent: MXFP4 routed experts are not decoded here; dequantize to bf16 first",
    ),
}
_IGNORED = frozenset(
    ("architectures", "auto_map", "transformers_version", "_name_or_path", "name_or_path",
     "dtype", "torch_dtype", "rope_theta", "rope_scaling", "head_dim", "pretraining_tp",
     "output_router_logits", "layer_types", "mlp_layer_types", "return_dict",
     "output_hidden_states", "output_attentions", "use_bfloat16", "tokenizer_class",
     "id2label", "label2id", "problem_type", "is_decoder", "is_encoder_decoder",
     "add_cross_attention", "tie_encoder_decoder", "chunk_size_feed_forward")
)  # fmt: skip
# layer_types / mlp_layer_types are transformers' derived views; checked against ours below.


def _text_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    return dict(config_dict.get("text_config", config_dict))


def _check(text: dict[str, Any]) -> list[str]:
    """Problems with the keys of a released text config (empty if every key is understood)."""
    aliases = K3Config.attribute_map
    problems = [
        f"{key}={text[key]!r} (supported: {supported})"
        for key, (ok, supported) in _REQUIRED.items()
        if key in text and not ok(text[key], text)
    ]
    known = set(_FIELDS) | set(aliases) | set(_REQUIRED) | _IGNORED
    unknown = sorted(set(text) - known)
    if unknown:
        problems.append(f"unknown keys {unknown}")
    unknown_la = sorted(set(text.get("linear_attn_config") or {}) - _LINEAR_ATTN_KEYS)
    if unknown_la:
        problems.append(f"unknown linear_attn_config keys {unknown_la}")
    return problems


def _check_derived(text: dict[str, Any], config: K3Config) -> list[str]:
    """transformers-style derived lists, when present, must agree with the 1-based lists."""
    derived = {"layer_types": config.layer_types, "mlp_layer_types": config.mlp_types}
    return [
        f"{key} disagrees with linear_attn_config / first_k_dense_replace"
        for key, ours in derived.items()
        if key in text and list(text[key]) != ours
    ]


def config_from_released(config_dict: dict[str, Any]) -> K3Config:
    """K3Config from a released config.json dict (nested `text_config` or flat); raises
    ValueError naming every unsupported or unknown field."""
    text = _text_config(config_dict)
    problems = _check(text)
    if problems:
        raise ValueError("unsupported released K3 config: " + "; ".join(problems))
    aliases = K3Config.attribute_map
    fields = {aliases.get(k, k): v for k, v in text.items() if k in _FIELDS or k in aliases}
    dtype = text.get("dtype", text.get("torch_dtype"))
    if dtype is not None:
        fields["dtype"] = dtype
    config = K3Config(**fields)
    problems = _check_derived(text, config)
    if problems:
        raise ValueError("inconsistent released K3 config: " + "; ".join(problems))
    return config


def config_to_released(config: K3Config) -> dict[str, Any]:
    """The flat released text config (model_type "kimi_linear") of a K3Config. transformers'
    KimiLinearConfig reads it too (num_key_value_heads = heads, no attention bias).
    `mla_norm_eps` is not a released key: the reference's 1e-6 is implied."""
    out: dict[str, Any] = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "num_key_value_heads": config.num_attention_heads,
        "attention_bias": False,
    }
    out.update({key: getattr(config, key) for key in _FIELDS})
    out["linear_attn_config"] = dict(config.linear_attn_config)
    dtype = config.to_dict().get("dtype")  # a string such as "bfloat16", or None
    if dtype is not None:
        out["dtype"] = dtype
    return out
