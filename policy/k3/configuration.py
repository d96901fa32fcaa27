"""K3Config: the Kimi-K3-style decoder configuration, named presets and an analytic parameter
count (k3-architecture.md sections 1-6).

Field names follow the released K3 `config.json` (`text_config`, model_type "kimi_linear"), so
`K3Config.from_k3_config_dict(json.load(...))` reads a real one. Our own model_type is
"agentrl_k3" so it never collides with transformers' built-in "kimi_linear". Defaults are the
released K3 shape; `k3_preset("k3-debug" | "k3-tiny" | "k3")` gives named sizes.

The layer pattern lives in `linear_attn_config` as 1-BASED lists (`kda_layers`,
`full_attn_layers`), exactly as released; `layer_types` and `mlp_types` are the derived 0-based
views ("linear_attention" = KDA, "full_attention" = MLA; "dense" / "sparse").

Uncertain values [U in the reference]: routed_scaling_factor (2.5 here, the DeepSeek-V3 value
used by synthetic K3 configs) and rms_norm_eps (1e-5, Kimi-Linear's).

`mla_norm_eps` (not a released key): the eps of MLA's `q_a_layernorm` / `kv_a_layernorm`. The
reference implementations build those two norms without an eps argument, so they take the
RMSNorm default 1e-6 (Moonshot's `KimiRMSNorm`, transformers' `KimiLinearRMSNorm` and
`DeepseekV3RMSNorm`, DeepSeek-V3 `inference/model.py`), not `rms_norm_eps`.

`mla_fan_in_init` (not a released key; initialisation only, no effect on a loaded checkpoint):
MLA's `kv_a_proj_with_mqa`, `q_b_proj` and `kv_b_proj` drawn at std 1 / sqrt(fan_in) instead of
`initializer_range`. At 0.02 a small model's attention logits start ~0.1 and its in-context
copying takes thousands of steps to appear (docs/benchmarks.md "In-context copying").
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, ClassVar

from transformers import PretrainedConfig

# Released K3 keys under other names (DeepSeek / transformers spelling) -> our field.
_ALIASES = MappingProxyType(
    {
        "n_routed_experts": "num_experts",
        "num_local_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
        "scoring_func": "moe_router_activation_func",
    }
)
# Keys of a released config that describe the checkpoint or are derived here; not fields.
_DROPPED = ("model_type", "architectures", "auto_map", "quantization_config", "layer_types",
            "mlp_layer_types", "transformers_version", "_name_or_path", "name_or_path")  # fmt: skip


def default_full_attn_layers(num_layers: int, every: int = 4) -> list[int]:
    """K3's pattern, 1-based: every `every`-th layer plus the last one."""
    return sorted(set(range(every, num_layers + 1, every)) | {num_layers})


def _linear_attn_defaults(num_layers: int) -> dict[str, Any]:
    full = default_full_attn_layers(num_layers)
    return {
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "kda_layers": [i for i in range(1, num_layers + 1) if i not in full],
        "full_attn_layers": full,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    }


class K3Config(PretrainedConfig):
    """Kimi-K3-style hybrid KDA/MLA decoder with Stable LatentMoE, SiTU-GLU and AttnRes."""

    model_type = "agentrl_k3"
    attribute_map: ClassVar[dict[str, str]] = dict(_ALIASES)

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    linear_attn_config: dict | None = None  # KDA heads and the 1-based layer lists
    # MLA (section 3): NoPE, gated output
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (the reference's default eps)
    mla_fan_in_init: bool = False  # init only: MLA's kv_a / q_b / kv_b at std fan_in^-0.5
    # MoE (section 5)
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width; None = plain MoE
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 2.5
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792  # dense (layer < first_k_dense_replace) MLP width
    # activation (section 6) and AttnRes (section 4)
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    attn_res_block_size: int | None = 12  # transformer layers per block; None = plain residual
    # the rest
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.linear_attn_config = _linear_attn_defaults(self.num_hidden_layers) | dict(
            self.linear_attn_config or {}
        )
        super().__post_init__(**kwargs)  # sets the aliased keys (num_experts_per_tok, ...)
        self._check()

    def _check(self) -> None:
        layers = self.num_hidden_layers
        kda, full = (
            self.linear_attn_config["kda_layers"],
            self.linear_attn_config["full_attn_layers"],
        )
        if sorted(kda + full) != list(range(1, layers + 1)):
            raise ValueError(f"kda_layers + full_attn_layers must be 1..{layers} exactly once")
        if not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError("need 0 < num_experts_per_token <= num_experts")
        if self.num_experts > 32767:  # routing records (routing replay) hold expert ids as int16
            raise ValueError(f"num_experts must be <= 32767 (int16 routes), got {self.num_experts}")
        if self.num_experts % self.num_expert_group or self.topk_group > self.num_expert_group:
            raise ValueError("num_experts must split into num_expert_group >= topk_group groups")
        if not 0 <= self.first_k_dense_replace <= layers:
            raise ValueError(f"first_k_dense_replace must be in [0, {layers}]")
        if self.hidden_act not in ("situ", "silu"):
            raise ValueError(f"hidden_act must be 'situ' or 'silu', got {self.hidden_act!r}")
        if self.moe_router_activation_func not in ("sigmoid", "softmax"):
            raise ValueError("moe_router_activation_func must be 'sigmoid' or 'softmax'")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError("attn_res_block_size must be >= 1 or None")

    @property
    def layer_types(self) -> list[str]:
        """0-based token mixer per layer: "linear_attention" (KDA) or "full_attention" (MLA)."""
        full = set(self.linear_attn_config["full_attn_layers"])
        return [
            "full_attention" if i + 1 in full else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]

    @property
    def mlp_types(self) -> list[str]:
        """0-based MLP per layer: "dense" (SituGLU, intermediate_size) or "sparse" (MoE)."""
        return [
            "dense" if i < self.first_k_dense_replace else "sparse"
            for i in range(self.num_hidden_layers)
        ]

    @property
    def situ_betas(self) -> tuple[float | None, float | None]:
        """(beta, linear_beta) for SituGLU; (None, None) = SwiGLU when hidden_act is "silu"."""
        if self.hidden_act == "silu":
            return None, None
        return self.activation_situ_beta, self.activation_situ_linear_beta

    @classmethod
    def from_k3_config_dict(cls, config_dict: dict[str, Any]) -> K3Config:
        """Build from a released K3 config.json dict (top level or nested `text_config`)."""
        source = config_dict.get("text_config", config_dict)
        fields = {}
        for key, value in source.items():
            if key not in _DROPPED:
                fields[_ALIASES.get(key, key)] = value
        return cls(**fields)


def _preset_fields(name: str) -> dict[str, Any]:
    """Fresh field dicts for the named presets (no shared mutable table)."""
    debug = {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "intermediate_size": 128,
        "attn_res_block_size": 2, "max_position_embeddings": 4096,
    }  # fmt: skip
    tiny = {  # sized for the CPU quickstart: ~0.6M active of ~2.5M, a 150-token SFT step ~0.35 s
        "vocab_size": 768, "hidden_size": 96, "num_hidden_layers": 4,
        "linear_attn_config": {"num_heads": 2, "head_dim": 48, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        "num_attention_heads": 2, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 48,
        "num_experts": 48, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 96, "routed_expert_hidden_size": 48, "intermediate_size": 256,
        "attn_res_block_size": 2, "max_position_embeddings": 65536,
    }  # fmt: skip
    presets = {"k3-debug": debug, "k3-tiny": tiny, "k3": {}}
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(presets)}")
    return presets[name]


def k3_preset(name: str, **overrides: Any) -> K3Config:
    """Named config: "k3-debug" (unit tests), "k3-tiny" (CPU quickstart, 2.5M params) or "k3"
    (the released shape), with field overrides."""
    return K3Config(**(_preset_fields(name) | overrides))


def kda_layer_params(c: K3Config) -> int:
    """KDA token mixer (section 2.1): q/k/v, short convs, beta, low-rank f gate, A_log, dt_bias,
    output gate (full rank when use_full_rank_gate), per-head-dim o_norm, o_proj."""
    la, d = c.linear_attn_config, c.hidden_size
    heads, dk = la["num_heads"], la["head_dim"]
    hk = heads * dk  # = HV * Dv, K3 uses HV = H and Dk = Dv
    qkv = 3 * d * hk + la["short_conv_kernel_size"] * 3 * hk
    gates = d * heads + (d * dk + dk * hk) + heads + hk  # beta, f_a/f_b, A_log, dt_bias
    out_gate = d * hk if la.get("use_full_rank_gate", True) else d * dk + dk * hk
    return qkv + gates + out_gate + dk + hk * d


def mla_layer_params(c: K3Config) -> int:
    """MLA (section 3.1) with a q LoRA, plus the gated-output projection (3.3)."""
    d, heads = c.hidden_size, c.num_attention_heads
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = d * heads * qk_head
    else:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * qk_head
    kv = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    out = heads * c.v_head_dim * d * (2 if c.mla_use_output_gate else 1)
    return q + kv + out


def moe_layer_params(c: K3Config) -> tuple[int, int]:
    """(parameters every token uses, parameters of one routed expert) of a sparse layer
    (section 5.2): router, latent projections and norm, shared experts | one SiTU-GLU expert.
    The e_score_correction_bias is a buffer, not a parameter."""
    d, f = c.hidden_size, c.moe_intermediate_size
    latent = c.routed_expert_hidden_size
    width = d if latent is None else latent
    always = c.num_experts * d + 3 * d * c.num_shared_experts * f
    if latent is not None:
        always += 2 * d * latent + (latent if c.latent_moe_use_norm else 0)
    return always, 3 * width * f


def count_parameters(c: K3Config) -> dict[str, int]:
    """Analytic parameter counts from the config alone (no model is built). `active` counts
    what one token touches (top-k routed experts, embeddings and head included);
    `active_non_embedding` leaves out the input embedding table."""
    d, layers = c.hidden_size, c.num_hidden_layers
    kinds = c.layer_types
    num_mla, num_sparse = kinds.count("full_attention"), c.mlp_types.count("sparse")
    moe_always, per_expert = moe_layer_params(c)
    attn_res = 0 if c.attn_res_block_size is None else 4 * d * layers + 2 * d
    counts = {
        "embedding": c.vocab_size * d,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * d,
        "norms": 2 * d * layers + d,  # input/post-attention norms per layer, final norm
        "attn_res": attn_res,
        "kda": (layers - num_mla) * kda_layer_params(c),
        "mla": num_mla * mla_layer_params(c),
        "dense_mlp": (layers - num_sparse) * 3 * d * c.intermediate_size,
        "moe_shared_router_latent": num_sparse * moe_always,
        "moe_routed_experts": num_sparse * c.num_experts * per_expert,
    }
    counts["total"] = sum(counts.values())
    inactive = num_sparse * (c.num_experts - c.num_experts_per_token) * per_expert
    counts["active"] = counts["total"] - inactive
    counts["active_non_embedding"] = counts["active"] - counts["embedding"]
    return counts
