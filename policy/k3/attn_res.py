"""Attention Residuals (AttnRes), exactly as Kimi K3 implements them (block variant).

Reference: ../shared/reference/k3-architecture.md sec. 4.3 (arXiv 2603.15031; Moonshot
`_apply_attn_res`, `KimiDecoderLayer._forward_attn_residual`). Instead of the plain residual
h_l = h_{l-1} + f(h_{l-1}), each sub-layer input is a softmax-weighted mix, over depth, of
stored sources:

    V    = [b_0, ..., b_{n-1}, P]             b_0 = embedding, b_i = finished block sums,
                                              P = running sum of the current block's outputs
    Khat = V / sqrt(mean(V^2) + eps)          (RMS-normalised sources, no weight)
    w    = norm.weight * proj.weight          (effective pseudo-query, [D])
    h    = sum_j softmax_j(Khat_j . w) V_j    (fp32 inside, cast back)

A block closes every `block_size` transformer layers, at the start of layers 0, S, 2S, ...;
after L layers ceil(L / S) sources are stored (K3: 93 layers, S = 12 -> 8).

How a decoder layer uses it (l = 0-based layer index, S = attn_res_block_size):

    state = AttnResState.start(embedding)           # once, before layer 0
    # per layer:
    h = self.self_attention_res(state)              # AttnRes module; identity if no blocks
    if closes_block(l, S):
        state = state.close_block()
    a, kv_cache = self.self_attn(self.input_layernorm(h), cache=kv_cache, mask=mask)
    state = state.add(a)
    h = self.mlp_res(state)
    state = state.add(self.mlp(self.post_attention_layernorm(h)))
    # (modeling.K3DecoderLayer returns only state.partial; K3Model carries the stored
    #  sources on with state.after_layer, so no layer hands back a tensor it was given)
    # after the last layer:
    h = final_norm(self.output_attn_res(state)); logits = lm_head(h)

`attn_res_layer` below runs exactly that sequence with callables; K3 checkpoint tensors
`model.layers.{l}.self_attention_res_proj.weight` [1, D] / `..._res_norm.weight` [D] map to
`<module>.proj.weight` / `<module>.norm.weight` of an `AttnRes`.

Letters: B batch, T time, D hidden size, J stored sources + 1 (the partial sum).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from policy.k3.precision import full_precision


@full_precision
def attn_res(
    partial_BTD: Tensor,
    blocks: list[Tensor],
    proj_weight: Tensor,
    norm_weight_D: Tensor,
    eps: float,
) -> Tensor:
    """Mix `blocks` ([B, T, D] each) and `partial_BTD` with softmax weights over sources.

    proj_weight: [1, D] or [D]; norm_weight_D: [D]. Token-local: no mixing along B or T.
    Computes in (at least) fp32 and returns partial's dtype. The same function as
    `attn_res_reference`, per source and with a hand-written backward (no [B, T, J, D] stack,
    no normalised copy of the sources: about half the time of the reference's autograd).
    """
    dtype = torch.promote_types(partial_BTD.dtype, torch.float32)
    query_D = norm_weight_D.to(dtype) * proj_weight.to(dtype).reshape(-1)
    sources = [v.to(dtype) for v in (*blocks, partial_BTD)]
    return _SourceMix.apply(query_D, eps, *sources).to(partial_BTD.dtype)


@full_precision
def attn_res_reference(
    partial_BTD: Tensor,
    blocks: list[Tensor],
    proj_weight: Tensor,
    norm_weight_D: Tensor,
    eps: float,
) -> Tensor:
    """`attn_res` written as the reference's pseudocode reads (sec. 4.3), for parity tests."""
    dtype = torch.promote_types(partial_BTD.dtype, torch.float32)
    values_BTJD = torch.stack([*blocks, partial_BTD], dim=-2).to(dtype)
    keys_BTJD = values_BTJD * torch.rsqrt(values_BTJD.pow(2).mean(-1, keepdim=True) + eps)
    query_D = norm_weight_D.to(dtype) * proj_weight.to(dtype).reshape(-1)
    weights_BTJ = torch.softmax(keys_BTJD @ query_D, dim=-1)
    return (weights_BTJ[..., None] * values_BTJD).sum(-2).to(partial_BTD.dtype)


class _SourceMix(torch.autograd.Function):
    """out = sum_j w_j V_j, w = softmax_j(l), l_j = (V_j . q) r_j, r_j = rsqrt(mean(V_j^2) + eps).

    Backward, with G = dL/dout and s_j = G . V_j:
        dl_j = w_j (s_j - sum_k w_k s_k)
        dV_j = w_j G + dl_j r_j q - dl_j (V_j . q) r_j^3 / D V_j
        dq   = sum over tokens and j of dl_j r_j V_j
    """

    @staticmethod
    def forward(ctx, query_D: Tensor, eps: float, *sources: Tensor) -> Tensor:
        dots, inv_rms = [], []
        for v_BTD in sources:
            norm_BT = torch.linalg.vector_norm(v_BTD, dim=-1)
            inv_rms.append(torch.rsqrt(norm_BT * norm_BT / v_BTD.shape[-1] + eps))
            dots.append(v_BTD @ query_D)
        dot_BTJ, inv_rms_BTJ = torch.stack(dots, -1), torch.stack(inv_rms, -1)
        w_BTJ = torch.softmax(dot_BTJ * inv_rms_BTJ, -1)
        out_BTD = sources[0] * w_BTJ[..., :1]
        for j in range(1, len(sources)):
            out_BTD = out_BTD.addcmul_(sources[j], w_BTJ[..., j : j + 1])
        ctx.save_for_backward(query_D, dot_BTJ, inv_rms_BTJ, w_BTJ, *sources)
        return out_BTD

    @staticmethod
    def backward(ctx, grad_BTD: Tensor):
        query_D, dot_BTJ, inv_rms_BTJ, w_BTJ, *sources = ctx.saved_tensors
        s_BTJ = torch.stack([(grad_BTD * v_BTD).sum(-1) for v_BTD in sources], -1)
        dl_BTJ = w_BTJ * (s_BTJ - (w_BTJ * s_BTJ).sum(-1, keepdim=True))
        along_q_BTJ = dl_BTJ * inv_rms_BTJ  # coefficient of q in dV_j, and of V_j in dq
        along_v_BTJ = along_q_BTJ * dot_BTJ * inv_rms_BTJ.square() / query_D.shape[0]
        grads, dq_D = [], torch.zeros_like(query_D)
        for j, v_BTD in enumerate(sources):
            g_BTD = grad_BTD * w_BTJ[..., j, None]
            g_BTD.addcmul_(along_q_BTJ[..., j, None], query_D)
            grads.append(g_BTD.addcmul_(along_v_BTJ[..., j, None], v_BTD, value=-1.0))
            dq_D += along_q_BTJ[..., j].reshape(-1) @ v_BTD.reshape(-1, v_BTD.shape[-1])
        return (dq_D, None, *grads)


@dataclass(frozen=True)
class AttnResState:
    """Residual-stream bookkeeping that replaces the plain residual h across decoder layers.

    blocks: stored sources, each [B, T, D]: the embedding, then each finished block's sum.
    partial: running sum of the current block's sub-layer outputs ([B, T, D]); it is the
    embedding before layer 0 and None right after a block closes (until the next `add`).
    Immutable: methods return new states (safe with activation checkpointing).
    """

    blocks: tuple[Tensor, ...]
    partial: Tensor | None

    @classmethod
    def start(cls, embedding_BTD: Tensor) -> AttnResState:
        return cls(blocks=(), partial=embedding_BTD)

    def close_block(self) -> AttnResState:
        """Store the running sum as a source and start a new block."""
        assert self.partial is not None, "close_block twice without add()"
        return AttnResState(blocks=(*self.blocks, self.partial), partial=None)

    def add(self, out_BTD: Tensor) -> AttnResState:
        """Add a sub-layer output to the running in-block sum."""
        partial = out_BTD if self.partial is None else self.partial + out_BTD
        return AttnResState(blocks=self.blocks, partial=partial)

    def after_layer(self, partial_BTD: Tensor, *, closed: bool) -> AttnResState:
        """The state after a decoder layer that returned only its new running sum
        `partial_BTD` and closed a block at its start if `closed` (this state's partial is then
        stored). Equal to the layer's own close_block/add sequence, built from the caller's
        tensors rather than the copies the layer saw (under FSDP2: views)."""
        blocks = (*self.blocks, self.partial) if closed else self.blocks
        return AttnResState(blocks=blocks, partial=partial_BTD)


def closes_block(layer_idx: int, block_size: int) -> bool:
    """True if a block closes at the start of transformer layer `layer_idx` (0-based)."""
    return layer_idx % block_size == 0


def num_stored_sources(num_layers: int, block_size: int) -> int:
    """Stored sources after `num_layers` layers: ceil(L / S) (embedding + finished blocks)."""
    return math.ceil(num_layers / block_size)


class AttnRes(nn.Module):
    """One AttnRes site: proj (Linear(D, 1), no bias) and norm (RMSNorm weight) parameters.

    Both are zero/one initialised like K3's pseudo-queries: proj.weight = 0 -> uniform mean.
    Only norm.weight is used (it scales the pseudo-query); the sources are normalised without it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        nn.init.zeros_(self.proj.weight)
        self.eps = eps

    def forward(self, state: AttnResState) -> Tensor:
        """Input of the next sub-layer; the partial sum itself when no block is stored yet."""
        assert state.partial is not None, "AttnRes needs a partial sum (call add() first)"
        if not state.blocks:
            return state.partial
        return attn_res(
            state.partial, list(state.blocks), self.proj.weight, self.norm.weight, self.eps
        )


def attn_res_layer(
    state: AttnResState,
    *,
    layer_idx: int,
    block_size: int,
    attn_res_in: AttnRes,
    mixer: Callable[[Tensor], Tensor],
    attn_res_mid: AttnRes,
    ffn: Callable[[Tensor], Tensor],
) -> AttnResState:
    """One K3 decoder layer's residual flow; mixer/ffn include their own pre-norms.

    mixer(h) = self_attn(input_layernorm(h)), ffn(h) = mlp(post_attention_layernorm(h)).
    """
    h_BTD = attn_res_in(state)
    if closes_block(layer_idx, block_size):
        state = state.close_block()
    state = state.add(mixer(h_BTD))
    return state.add(ffn(attn_res_mid(state)))
