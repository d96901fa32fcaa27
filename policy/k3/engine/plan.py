"""Packed weights of a K3ForCausalLM for the fused forward in decode.py (`build_plan`).

Packing is exact algebra on the module parameters, done once per weight version:
- each pre-norm weight is folded into the projection that follows it
  (RMSNorm(x) * w @ W^T == RMSNorm(x) @ (W * w)^T), as are the KDA o_norm, the MoE latent norm
  and the final norm weights;
- projections that read the same input are concatenated (KDA q|k|v|f_a|b|g; MLA q_a|kv_a|g;
  MoE router|latent-down|shared gate-up);
- the MLA query is absorbed: W_UK and the softmax scale are folded into the query projection,
  so scores are taken directly against the cached latent [RMSNorm(c_kv) | k_rope];
- SiTU's caps: beta * tanh(g / beta) * sigmoid(g) * lb * tanh(u / lb) keeps tanh(g / beta) and
  tanh(u') with the up rows divided by lb and beta * lb folded into the down projection.
Matrices are stored [in, out] (contiguous), for x @ W: on CPU that is 1.5-2.5x faster than
F.linear on the [out, in] weight at decode sizes. Everything is float32 (float64 for a float64
model).

Letters: D hidden, H heads, K KDA head dim, Kd = K (f_a rank), X = 3*H*K packed q|k|v, W conv
width, R kv_lora_rank, E qk_rope_head_dim (MLA) or experts (MoE), L latent width (MLA R + E;
MoE routed_expert_hidden_size), Rq q_lora_rank, Dv MLA value head dim, F expert intermediate
size, Fs shared-expert intermediate size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policy.k3.moe import grouped_mm_supported


@dataclass(frozen=True, slots=True)
class KDAPlan:
    w_in: Tensor  # [D, X + Kd + H + H*K]: q | k | v | f_a | b | g (input norm folded)
    splits: tuple[int, ...]
    conv_w: Tensor  # [W, X]
    w_fb: Tensor  # [Kd, H*K]
    gate_a: Tensor  # [H*K] exp(A_log) per channel
    gate_c: Tensor  # [H*K] exp(A_log) * dt_bias (lower-bound gate) or dt_bias (softplus)
    lower_bound: float | None
    heads: int
    head_dim: int
    l2_eps: Tensor  # 0-dim 1e-6 (q, k l2 normalisation)
    o_eps: Tensor  # 0-dim o_norm eps
    o_eps_step: Tensor  # 0-dim o_norm eps * K (decode step: o computed without 1/sqrt(K))
    w_o: Tensor  # [H*K, D] (o_norm weight folded)


@dataclass(frozen=True, slots=True)
class MLAPlan:
    w_in: Tensor  # [D, Rq | R + E | H*Dv] (input norm folded); Rq = q_lora_rank or H*(R+E)
    splits: tuple[int, ...]
    w_q: Tensor | None  # [Rq, H*(R+E)] absorbed query (q_a norm weight, W_UK, scale folded)
    q_eps: Tensor  # 0-dim
    kv_norm_w: Tensor  # [R]
    kv_eps: Tensor  # 0-dim
    heads: int
    kv_rank: int
    w_uv: Tensor  # [H, R, Dv]
    w_o: Tensor  # [H*Dv, D]
    gated: bool


@dataclass(frozen=True, slots=True)
class ExpertsPlan:
    bias: Tensor  # [E] e_score_correction_bias
    top_k: int
    sigmoid: bool
    renormalize: bool
    scale: float
    gate_up: Tensor  # [E, L, 2F] (up columns / linear_beta)
    down: Tensor  # [E, F, L] (times beta * linear_beta)
    gate_up_flat: Tensor  # [L, E*2F]
    down_flat: Tensor  # [E*F, L]
    grouped: bool  # torch's grouped_mm serves these weights (float32 on CPU)
    norm_eps: Tensor | None  # 0-dim latent RMSNorm eps (weight folded into w_out), None = off
    latent_in_w: Tensor | None  # [D] post-attention norm weight when there is no latent proj


@dataclass(frozen=True, slots=True)
class MLPPlan:
    """A SiTU-GLU MLP (dense layer) or a Stable LatentMoE (experts is not None)."""

    w_in: Tensor  # [D, E + L + 2Fs] router | latent down | shared gate-up  (dense: [D, 2F])
    splits: tuple[int, ...]
    inv_beta: float | None  # SiTU: tanh(g * inv_beta); the caps' scales are folded into w_out
    capped_up: bool
    w_out: Tensor  # [L + Fs, D] latent up (norm folded) | shared down  (dense: [F, D])
    experts: ExpertsPlan | None = None


@dataclass(frozen=True, slots=True)
class DecodePlan:
    embed: Tensor  # [V, D]
    mixers: tuple[KDAPlan | MLAPlan, ...]
    mlps: tuple[MLPPlan, ...]
    res: tuple[tuple[Tensor, Tensor], ...] | None  # per layer (in, mid) AttnRes queries [D]
    res_out: Tensor | None
    block_size: int | None
    eps: Tensor  # 0-dim rms_norm_eps (pre-norms, AttnRes keys, final norm)
    w_head: Tensor  # [D, V] (final norm folded)
    dtype: torch.dtype


@torch.no_grad()
def build_plan(model) -> DecodePlan:
    """Pack the weights of a K3ForCausalLM (float32 or float64) for decode.forward_tokens."""
    base, cfg = model.get_decoder(), model.config
    dtype = base.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"the fused path computes in float32/float64, the model is {dtype}")
    mixers, mlps, res = [], [], []
    for layer in base.layers:
        norm_in = layer.input_layernorm.weight
        if layer.is_kda:
            mixers.append(_kda_plan(layer.self_attn, norm_in))
        else:
            mixers.append(_mla_plan(layer.self_attn, norm_in))
        mlps.append(_mlp_plan(layer.mlp, layer.post_attention_layernorm.weight, layer.is_sparse))
        if cfg.attn_res_block_size is not None:
            res.append((_query(layer.self_attention_res), _query(layer.mlp_res)))
    return DecodePlan(
        embed=base.embed_tokens.weight.detach(),
        mixers=tuple(mixers),
        mlps=tuple(mlps),
        res=tuple(res) if res else None,
        res_out=None if not res else _query(base.output_attn_res),
        block_size=cfg.attn_res_block_size,
        eps=_scalar(cfg.rms_norm_eps, norm_in),
        w_head=_t(model.get_output_embeddings().weight * base.norm.weight),
        dtype=dtype,
    )


def _t(w_OI: Tensor) -> Tensor:
    """[out, in] -> contiguous [in, out]."""
    return w_OI.detach().t().contiguous()


def _scalar(value: float, like: Tensor) -> Tensor:
    """A 0-dim tensor (the eps of x * rsqrt(addcmul(eps, n, n, value=1/D)))."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _query(site) -> Tensor:
    return (site.norm.weight * site.proj.weight.reshape(-1)).detach()


def _kda_plan(kda, norm_w_D: Tensor) -> KDAPlan:
    if kda.num_v_heads != kda.num_heads:
        raise ValueError("the fused KDA path assumes as many value heads as key heads")
    if hasattr(kda, "g_proj"):
        gate_w = kda.g_proj.weight
    else:
        gate_w = kda.g_b_proj.weight @ kda.g_a_proj.weight
    blocks = [kda.q_proj.weight, kda.k_proj.weight, kda.v_proj.weight]
    blocks += [kda.f_a_proj.weight, kda.b_proj.weight, gate_w]
    head_dim = kda.head_dim
    a_X = kda.A_log.to(norm_w_D.dtype).exp().repeat_interleave(head_dim)
    dt_X = kda.dt_bias.to(norm_w_D.dtype)
    conv_w = torch.cat([c.weight[:, 0] for c in (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d)])
    conv_w = conv_w.t().contiguous()
    return KDAPlan(
        w_in=_t(torch.cat(blocks) * norm_w_D),
        splits=(conv_w.shape[1], head_dim, kda.num_heads, gate_w.shape[0]),
        conv_w=conv_w,
        w_fb=_t(kda.f_b_proj.weight),
        gate_a=a_X,
        gate_c=dt_X if kda.gate_lower_bound is None else a_X * dt_X,
        lower_bound=kda.gate_lower_bound,
        heads=kda.num_heads,
        head_dim=head_dim,
        l2_eps=_scalar(1e-6, norm_w_D),
        o_eps=_scalar(kda.o_norm.eps, norm_w_D),
        o_eps_step=_scalar(kda.o_norm.eps * head_dim, norm_w_D),
        w_o=_t(kda.o_proj.weight * kda.o_norm.weight.repeat(kda.num_heads)),
    )


def _mla_plan(mla, norm_w_D: Tensor) -> MLAPlan:
    heads, rank, rope = mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
    w_HXR = mla.kv_b_proj.weight.unflatten(0, (heads, -1))
    w_uk_HNR, w_uv_HVR = w_HXR.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    lora = not hasattr(mla, "q_proj")
    w_q_HQI = (mla.q_b_proj if lora else mla.q_proj).weight.unflatten(0, (heads, -1))
    q_nope_HNI, q_rope_HEI = w_q_HQI.split([mla.qk_nope_head_dim, rope], dim=1)
    absorbed_HLI = torch.cat([w_uk_HNR.transpose(1, 2) @ q_nope_HNI, q_rope_HEI], 1)
    w_q = absorbed_HLI.flatten(0, 1) * mla.scaling
    if lora:
        w_q = w_q * mla.q_a_layernorm.weight
    first = mla.q_a_proj.weight if lora else w_q
    blocks = [first, mla.kv_a_proj_with_mqa.weight]
    if hasattr(mla, "g_proj"):
        blocks.append(mla.g_proj.weight)
    return MLAPlan(
        w_in=_t(torch.cat(blocks) * norm_w_D),
        splits=(first.shape[0], rank + rope, blocks[2].shape[0] if len(blocks) == 3 else 0),
        w_q=_t(w_q) if lora else None,
        q_eps=_scalar(mla.q_a_layernorm.eps if lora else 0.0, norm_w_D),
        kv_norm_w=mla.kv_a_layernorm.weight.detach(),
        kv_eps=_scalar(mla.kv_a_layernorm.eps, norm_w_D),
        heads=heads,
        kv_rank=rank,
        w_uv=w_uv_HVR.transpose(1, 2).contiguous(),
        w_o=_t(mla.o_proj.weight),
        gated=hasattr(mla, "g_proj"),
    )


def _situ_scales(beta, linear_beta) -> tuple[float | None, float, float]:
    """(1/beta or None, scale of the up rows, scale of the down columns)."""
    inv_beta = None if beta is None else 1.0 / beta
    up = 1.0 if linear_beta is None else 1.0 / linear_beta
    return inv_beta, up, (beta or 1.0) * (linear_beta or 1.0)


def _mlp_plan(mlp, norm_w_D: Tensor, sparse: bool) -> MLPPlan:
    if not sparse:
        inv_beta, up_scale, down_scale = _situ_scales(mlp.beta, mlp.linear_beta)
        return MLPPlan(
            w_in=_t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight * up_scale]) * norm_w_D),
            splits=(),
            inv_beta=inv_beta,
            capped_up=mlp.linear_beta is not None,
            w_out=_t(mlp.down_proj.weight * down_scale),
        )
    c = mlp.config
    inv_beta, up_scale, down_scale = _situ_scales(c.situ_beta, c.situ_linear_beta)
    latent = mlp.routed_expert_down_proj is not None
    blocks = [mlp.gate.weight.to(norm_w_D.dtype)]
    if latent:
        blocks.append(mlp.routed_expert_down_proj.weight)
        up_w = mlp.routed_expert_up_proj.weight
        outs = [up_w if mlp.routed_expert_norm is None else up_w * mlp.routed_expert_norm.weight]
    else:
        outs = [torch.eye(c.hidden_size, dtype=norm_w_D.dtype, device=norm_w_D.device)]
    shared = mlp.shared_experts
    if shared is not None:
        blocks.append(torch.cat([shared.gate_proj.weight, shared.up_proj.weight * up_scale]))
        outs.append(shared.down_proj.weight * down_scale)
    sizes = [b.shape[0] for b in blocks]
    splits = (sizes[0], sizes[1] if latent else 0, sizes[-1] if shared is not None else 0)
    return MLPPlan(
        w_in=_t(torch.cat(blocks) * norm_w_D),
        splits=splits,
        inv_beta=inv_beta,
        capped_up=c.situ_linear_beta is not None,
        w_out=_t(torch.cat(outs, 1)),
        experts=_experts_plan(mlp, up_scale, down_scale, norm_w_D),
    )


def _experts_plan(mlp, up_scale: float, down_scale: float, norm_w_D: Tensor) -> ExpertsPlan:
    c, experts = mlp.config, mlp.experts
    inter = experts.down_proj.shape[-1]
    gate_up_EOI = torch.cat(
        [experts.gate_up_proj[:, :inter], experts.gate_up_proj[:, inter:] * up_scale], 1
    )
    down_EOI = experts.down_proj * down_scale
    grouped = not gate_up_EOI.is_cuda and all(
        grouped_mm_supported(w.new_empty(1, w.shape[-1]), w) for w in (gate_up_EOI, down_EOI)
    )
    gate_up, down = (w.transpose(1, 2).contiguous() for w in (gate_up_EOI, down_EOI))
    latent_norm = mlp.routed_expert_norm
    return ExpertsPlan(
        bias=mlp.gate.e_score_correction_bias.to(norm_w_D.dtype),
        top_k=c.top_k,
        sigmoid=c.score_func == "sigmoid",
        renormalize=c.renormalize,
        scale=c.routed_scaling_factor,
        gate_up=gate_up,
        down=down,
        gate_up_flat=gate_up.transpose(0, 1).flatten(1).contiguous(),
        down_flat=down.flatten(0, 1),
        grouped=grouped,
        norm_eps=None if latent_norm is None else _scalar(latent_norm.eps, norm_w_D),
        latent_in_w=None if mlp.routed_expert_down_proj is not None else norm_w_D.detach(),
    )
