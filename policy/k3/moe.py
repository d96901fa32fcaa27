"""K3 Stable LatentMoE (k3-architecture.md 5.2): route on the full hidden state, run the routed
experts in a smaller latent space, normalise the combined latent output, project back, add the
shared experts.

    routing  = router(x_TD)                              scores, top-k on scores + bias (routing.py)
    z_TL     = routed_expert_down_proj(x_TD)             D -> L
    y_TL     = sum_k w_TK * E_k(z_TL)                    SiTU-GLU experts L -> F -> L
    y_TL     = routed_expert_norm(y_TL)                  RMSNorm, once, on the combined output
    out_TD   = routed_expert_up_proj(y_TL) + shared_experts(x_TD)

`latent_size=None` gives a plain DeepSeek-style MoE (experts at width D, no projections, no norm).

Expert dispatch, all on the same 3D weights (`gate_up_proj` [E, 2F, L], `down_proj` [E, L, F],
dim 0 = experts so expert parallelism can shard it later):
- "naive":   loop over experts, gather their tokens, index_add the weighted outputs (reference);
- "dense":   run every expert on every token and mask with the routing weights (reference);
- "segment": sort the T*K assignments by expert, run each expert's whole MLP on its segment;
- "grouped": same sort, but one `torch.nn.functional.grouped_mm` per projection. grouped_mm
  (torch 2.13) serves float32/bfloat16/float16 on CPU and needs row strides that are multiples
  of 16 bytes (L and 2F, F multiples of 4 in float32, 8 in bf16); on CUDA it wants bf16. Where it
  cannot serve (float64, odd widths) "grouped" falls back to "segment".
On a CPU core (benchmarks/moe_speed.py) "segment" runs ~1.1x the naive loop and "grouped"
0.8-1.1x forward, 1.15-1.5x forward+backward; "dense" ~0.1x. The grouped path is meant for
accelerators; the CUDA bf16 route is untested here.

Letters: T tokens, D hidden size, L latent size (routed_expert_hidden_size), F expert
intermediate size, E experts, K experts per token, S = T*K sorted token-expert assignments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from policy.k3.routing import Routing, TopKRouter
from policy.k3.situ import SituGLU, situ_glu

DISPATCHES = ("naive", "dense", "segment", "grouped")


def _expert_mlp(z_NL, gate_up_FL, down_LF, betas):
    """One SiTU-GLU expert on its tokens (used by the naive loop)."""
    gate_NF, up_NF = (z_NL @ gate_up_FL.T).chunk(2, dim=-1)
    return situ_glu(gate_NF, up_NF, *betas) @ down_LF.T


def naive_experts(z_TL, indices_TK, weights_TK, gate_up_EFL, down_ELF, betas):
    """Reference: for each expert, gather its tokens, run it, add back weighted."""
    y_TL = torch.zeros_like(z_TL)
    for e in range(gate_up_EFL.shape[0]):
        token_N, slot_N = torch.where(indices_TK == e)
        if token_N.numel() == 0:
            continue
        out_NL = _expert_mlp(z_TL[token_N], gate_up_EFL[e], down_ELF[e], betas)
        w_N1 = weights_TK[token_N, slot_N, None].to(out_NL.dtype)
        y_TL = y_TL.index_add(0, token_N, out_NL * w_N1)
    return y_TL


def dense_experts(z_TL, indices_TK, weights_TK, gate_up_EFL, down_ELF, betas):
    """Reference: every expert on every token, combined with a dense [T, E] weight matrix that
    is zero outside the selection."""
    gate_ETF, up_ETF = torch.einsum("tl,efl->etf", z_TL, gate_up_EFL).chunk(2, dim=-1)
    out_ETL = torch.einsum("etf,elf->etl", situ_glu(gate_ETF, up_ETF, *betas), down_ELF)
    mix_TE = torch.zeros(
        z_TL.shape[0], gate_up_EFL.shape[0], dtype=out_ETL.dtype, device=z_TL.device
    ).scatter_add(1, indices_TK, weights_TK.to(out_ETL.dtype))
    return torch.einsum("te,etl->tl", mix_TE, out_ETL)


def grouped_mm_supported(x_SI: torch.Tensor, w_EOI: torch.Tensor) -> bool:
    """Whether torch's grouped_mm can compute x_SI @ w_EOI[e].T per segment here."""
    ok_dtypes = (
        (torch.bfloat16,) if x_SI.is_cuda else (torch.float32, torch.bfloat16, torch.float16)
    )
    if x_SI.dtype not in ok_dtypes or w_EOI.dtype != x_SI.dtype or x_SI.stride(-1) != 1:
        return False
    size = x_SI.element_size()
    strides_ok = (x_SI.stride(0) * size) % 16 == 0
    return strides_ok and (w_EOI.shape[1] * size) % 16 == 0 and (w_EOI.shape[2] * size) % 16 == 0


def grouped_linear(x_SI, w_EOI, counts_E, use_grouped_mm: bool = True):
    """Rows of x_SI sorted by expert (counts_E rows each) times their expert's w[e].T."""
    if use_grouped_mm and grouped_mm_supported(x_SI, w_EOI):
        offs_E = counts_E.cumsum(0).to(torch.int32)
        return F.grouped_mm(x_SI, w_EOI.transpose(-2, -1), offs=offs_E)
    segments = torch.split(x_SI, counts_E.tolist())
    return torch.cat([seg_NI @ w_EOI[e].T for e, seg_NI in enumerate(segments)])


def sorted_experts(z_TL, indices_TK, weights_TK, gate_up_EFL, down_ELF, betas, use_grouped_mm):
    """Fast paths: sort the T*K assignments by expert, run the experts on contiguous segments
    (grouped_mm: two grouped matmuls over all segments; otherwise one whole expert MLP per
    segment, which keeps each segment's activations in cache on CPU), unsort, weighted sum."""
    num_tokens, top_k = indices_TK.shape
    flat_S = indices_TK.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    counts_E = torch.bincount(flat_S, minlength=gate_up_EFL.shape[0])
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    z_SL = _Dispatch.apply(z_TL, order_S, inverse_S, top_k)
    if use_grouped_mm and grouped_mm_supported(z_SL, gate_up_EFL):
        gate_SF, up_SF = grouped_linear(z_SL, gate_up_EFL, counts_E).chunk(2, dim=-1)
        out_SL = grouped_linear(situ_glu(gate_SF, up_SF, *betas), down_ELF, counts_E)
    else:
        segments = torch.split(z_SL, counts_E.tolist())
        out_SL = torch.cat([
            _expert_mlp(seg_NL, gate_up_EFL[e], down_ELF[e], betas)
            for e, seg_NL in enumerate(segments)
        ])  # fmt: skip
    out_TKL = _Permute.apply(out_SL, inverse_S, order_S)
    out_TKL = out_TKL.view(num_tokens, top_k, out_SL.shape[-1])  # T may be 0 (EP)
    return (out_TKL * weights_TK.to(out_TKL.dtype).unsqueeze(-1)).sum(dim=1)


class _Dispatch(torch.autograd.Function):
    """z_SL = z_TL[order_S // K]: each token's row once per selected expert, sorted by expert.
    Backward gathers instead of scattering: token t's K copies sit at inverse_S[t K : t K + K],
    so dz_TL = dz_SL[inverse_S] summed over K (autograd's index backward is an accumulating
    index_put, ~6x slower on the CPU)."""

    @staticmethod
    def forward(ctx, z_TL, order_S, inverse_S, top_k: int):
        ctx.save_for_backward(inverse_S)
        ctx.top_k = top_k
        return z_TL[order_S // top_k]

    @staticmethod
    def backward(ctx, grad_SL):
        (inverse_S,) = ctx.saved_tensors
        grad_TKL = grad_SL[inverse_S].view(-1, ctx.top_k, grad_SL.shape[-1])
        return grad_TKL.sum(1), None, None, None


class _Permute(torch.autograd.Function):
    """x[index_S] for a permutation index_S whose inverse is inverse_S; backward gathers by the
    inverse (autograd's would scatter)."""

    @staticmethod
    def forward(ctx, x_SL, index_S, inverse_S):
        ctx.save_for_backward(inverse_S)
        return x_SL[index_S]

    @staticmethod
    def backward(ctx, grad_SL):
        (inverse_S,) = ctx.saved_tensors
        return grad_SL[inverse_S], None, None


class GroupedExperts(nn.Module):
    """E SiTU-GLU experts L -> F -> L stored as 3D tensors. `gate_up_proj` fuses gate (first F
    rows) and up (last F rows) like transformers' KimiLinearExperts, so one grouped matmul
    serves both."""

    def __init__(
        self,
        num_experts: int,
        width: int,
        intermediate_size: int,
        betas: tuple[float | None, float | None] = (4.0, 25.0),
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.betas = betas
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=init_std)
        nn.init.normal_(self.down_proj, std=init_std)

    def forward(self, z_TL, indices_TK, weights_TK, dispatch: str = "grouped") -> torch.Tensor:
        """Weighted sum over each token's K experts, [T, L]."""
        args = (z_TL, indices_TK, weights_TK, self.gate_up_proj, self.down_proj, self.betas)
        if dispatch == "naive":
            return naive_experts(*args)
        if dispatch == "dense":
            return dense_experts(*args)
        if dispatch in ("segment", "grouped"):
            return sorted_experts(*args, use_grouped_mm=dispatch == "grouped")
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")


class StableLatentMoE(nn.Module):
    """Router on x, latent routed experts with a norm on their combined output, shared experts.

    forward(x [..., D], *, replay_indices_TK=None, dispatch=None, return_routing=False)
    returns the output [..., D], or (output, Routing) with return_routing=True. Routing holds the
    [T, K] expert indices to record for replay and the dense scores for load metrics / QB
    (T = all leading dims flattened)."""

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class Config:
        hidden_size: int
        moe_intermediate_size: int
        num_experts: int
        top_k: int
        latent_size: int | None = None  # routed_expert_hidden_size; None: no latent space
        use_latent_norm: bool = True  # RMSNorm on the combined latent output (if latent)
        num_shared_experts: int = 0  # fused into one SituGLU of width n * moe_intermediate_size
        routed_scaling_factor: float = 1.0
        renormalize: bool = True
        score_func: str = "sigmoid"
        num_expert_group: int = 1
        topk_group: int = 1
        situ_beta: float | None = 4.0
        situ_linear_beta: float | None = 25.0
        rms_norm_eps: float = 1e-5
        init_std: float = 0.02
        dispatch: str = "grouped"  # default expert dispatch, see DISPATCHES

        def __post_init__(self) -> None:
            if self.dispatch not in DISPATCHES:
                raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")

        @classmethod
        def from_k3(cls, config: Any, **overrides: Any) -> StableLatentMoE.Config:
            """Read the MoE fields of a K3Config (policy.k3.configuration)."""
            beta, linear_beta = config.situ_betas
            fields = dict(
                hidden_size=config.hidden_size,
                moe_intermediate_size=config.moe_intermediate_size,
                num_experts=config.num_experts,
                top_k=config.num_experts_per_token,
                latent_size=config.routed_expert_hidden_size,
                use_latent_norm=config.latent_moe_use_norm,
                num_shared_experts=config.num_shared_experts,
                routed_scaling_factor=config.routed_scaling_factor,
                renormalize=config.moe_renormalize,
                score_func=config.moe_router_activation_func,
                num_expert_group=config.num_expert_group,
                topk_group=config.topk_group,
                situ_beta=beta,
                situ_linear_beta=linear_beta,
                rms_norm_eps=config.rms_norm_eps,
                init_std=config.initializer_range,
            )
            return cls(**(fields | overrides))

    def __init__(self, config: StableLatentMoE.Config) -> None:
        super().__init__()
        self.config = c = config
        betas = (c.situ_beta, c.situ_linear_beta)
        width = c.hidden_size if c.latent_size is None else c.latent_size
        self.gate = TopKRouter(
            c.hidden_size,
            c.num_experts,
            c.top_k,
            score_func=c.score_func,
            renormalize=c.renormalize,
            routed_scaling_factor=c.routed_scaling_factor,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            init_std=c.init_std,
        )
        self.experts = GroupedExperts(c.num_experts, width, c.moe_intermediate_size, betas)
        self.routed_expert_down_proj = self.routed_expert_up_proj = self.routed_expert_norm = None
        if c.latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(c.hidden_size, c.latent_size, bias=False)
            self.routed_expert_up_proj = nn.Linear(c.latent_size, c.hidden_size, bias=False)
            if c.use_latent_norm:
                self.routed_expert_norm = nn.RMSNorm(c.latent_size, eps=c.rms_norm_eps)
        self.shared_experts = None
        if c.num_shared_experts > 0:
            shared_width = c.num_shared_experts * c.moe_intermediate_size
            self.shared_experts = SituGLU(c.hidden_size, shared_width, *betas)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every matrix, ones for the norm (transformers' convention)."""
        std = self.config.init_std
        nn.init.normal_(self.gate.weight, std=std)
        for name, param in self.named_parameters():
            if name != "gate.weight" and not name.startswith("routed_expert_norm"):
                nn.init.normal_(param, std=std)

    def forward(
        self,
        x: torch.Tensor,
        *,
        replay_indices_TK: torch.Tensor | None = None,
        dispatch: str | None = None,
        return_routing: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, Routing]:
        x_TD = x.reshape(-1, x.shape[-1])
        routing = self.gate(x_TD, replay_indices_TK)
        z_TL = x_TD if self.routed_expert_down_proj is None else self.routed_expert_down_proj(x_TD)
        y_TL = self.experts(
            z_TL, routing.indices_TK, routing.weights_TK, dispatch or self.config.dispatch
        )
        if self.routed_expert_norm is not None:
            y_TL = self.routed_expert_norm(y_TL)
        y_TD = y_TL if self.routed_expert_up_proj is None else self.routed_expert_up_proj(y_TL)
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        out = y_TD.reshape(x.shape)
        return (out, routing) if return_routing else out
