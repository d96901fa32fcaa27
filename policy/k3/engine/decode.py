"""Fused forward of K3ForCausalLM over a K3Cache: the rollout hot path (prefill and decode).

Same math as `K3ForCausalLM.forward(ids, attention_mask=mask, cache=cache)`, the reference
(parity tested to 1e-10 in float64), on weights packed once per weight version (plan.py), so
that a step is a short list of large ops instead of many small module calls:
- T == 1 without padding (decode): KDA's single-step delta rule in place on the cached state
  with the packed conv window; absorbed MLA writes the token's latent into its slot and
  attends with one [B, H, L] @ [B, L, S] matmul;
- T > 1 (prefill chunks, left padding allowed): the q|k|v short conv as W shifted
  multiply-adds, chunked KDA in the factored form below (kda.kda_chunked for unbounded
  gates), absorbed MLA over all slots by blocks with online softmax (flash.py: no [T, S]
  scores or mask, the causal and key masks built per block);
- token-local parts (norms, AttnRes, MLPs) run on the B*T tokens flattened;
- MoE experts (float32), by the number A of token-expert assignments: A < E (small decode
  batches) batched matmuls on the gathered experts' weights; A <= 4E (decode) each expert's
  tokens in a padded bucket, one bmm per projection over all experts; more (prefill) two
  grouped matmuls over the assignments sorted by expert. float64 (tests) runs every expert on
  every token with the routing weights zero outside the selection.
Norms are x * rsqrt(addcmul(eps, |x|, |x|, value)) (four ops); a constant factor c before an
RMSNorm moves into its eps (rms(c x, eps) == rms(x, eps / c^2)).

Letters: B rows, T new tokens, N = B*T tokens, D hidden, H heads, K KDA head dim, X packed q|k|v
channels, W conv width, R kv_lora_rank, L MLA latent width (R + rope dim) or MoE latent width,
S slots, F expert intermediate size, M MoE layers, Kx experts per token, J AttnRes sources.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from policy.k3.attn_res import closes_block
from policy.k3.cache import K3Cache
from policy.k3.engine.plan import DecodePlan, ExpertsPlan, KDAPlan, MLAPlan, MLPPlan
from policy.k3.flash import flash_attention
from policy.k3.kda import kda_chunked, unit_lower_solve
from policy.k3.routing import top_k_indices
from policy.k3.situ import scaled_tanh

KDA_CHUNK = 32  # kda_chunked's chunk for unbounded gates (faster than 64 on CPU at K = 32)
FACTORED_CHUNK = 16  # kda_factored's chunk: the in-chunk log decay stays within FACTORED_SPAN
FACTORED_SPAN = 80.0  # e^80 and e^-80 are normal float32 numbers


@dataclass(frozen=True, slots=True)
class _Step:
    """What every layer of one forward shares."""

    batch: int
    length: int
    start: int  # first slot of the new tokens
    mask_BT: Tensor | None  # None: every new token is real
    mask_N1: Tensor | None
    blocked_B1S: Tensor | None  # MLA decode (T == 1): True where the query must not see a slot


def forward_tokens(
    plan: DecodePlan,
    cache: K3Cache,
    ids_BT: Tensor,
    mask_BT: Tensor | None = None,
    *,
    record: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Feed T tokens per row -> (logits of the last position [B, V], routed experts
    [B, T, M, Kx] or None). mask_BT (1 = real token) allows left padding."""
    batch, length = ids_BT.shape
    if mask_BT is not None and bool(mask_BT.all()):
        mask_BT = None
    start = cache.length
    cache.begin(mask_BT, length)
    step = _Step(batch, length, start, mask_BT, _mask_n1(mask_BT, plan.dtype),
                 _blocked(cache, start, length))  # fmt: skip
    x_ND = F.embedding(ids_BT.reshape(-1), plan.embed)
    blocks: list[Tensor] = []
    partial_ND, routed = x_ND, []
    for i, (mixer, mlp) in enumerate(zip(plan.mixers, plan.mlps, strict=True)):
        h_ND = partial_ND
        if plan.res is not None:
            h_ND = _attn_res(blocks, partial_ND, plan.res[i][0], plan.eps)
            if closes_block(i, plan.block_size):
                blocks, partial_ND = [*blocks, partial_ND], None
        a_ND = _mix(mixer, _rms(h_ND, plan.eps), cache, i, step)
        partial_ND = a_ND if partial_ND is None else partial_ND + a_ND
        h_ND = partial_ND
        if plan.res is not None:
            h_ND = _attn_res(blocks, partial_ND, plan.res[i][1], plan.eps)
        m_ND, indices_NK = _mlp(mlp, _rms(h_ND, plan.eps))
        partial_ND = partial_ND + m_ND
        if indices_NK is not None:
            routed.append(indices_NK)
    cache.commit(length)
    last = [x.view(batch, length, -1)[:, -1] for x in (*blocks, partial_ND)]
    h_BD = last[-1] if plan.res_out is None else _attn_res(last[:-1], last[-1], plan.res_out,
                                                            plan.eps)  # fmt: skip
    logits_BV = _rms(h_BD, plan.eps) @ plan.w_head
    if not (record and routed):
        return logits_BV, None
    return logits_BV, torch.stack(routed, 1).view(batch, length, len(routed), -1)


def _mask_n1(mask_BT: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if mask_BT is None else mask_BT.reshape(-1, 1).to(dtype)


def _blocked(cache: K3Cache, start: int, length: int) -> Tensor | None:
    """[B, 1, S] for one token; None for T > 1 (flash.py builds the mask per block) and for
    paged caches (each row reads its own pages, policy/k3/paged.py)."""
    if length > 1 or not isinstance(cache, K3Cache):
        return None
    return ~cache.key_mask[:, None, : start + 1]


def _scaled(x: Tensor, eps: Tensor, value: float) -> Tensor:
    """x * rsqrt(value * sum(x^2) + eps) over the last dim; eps a 0-dim tensor. Four ops (3-4x
    faster on small CPU tensors than mean-based code or F.rms_norm)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * torch.rsqrt(torch.addcmul(eps, norm, norm, value=value))


def _rms(x: Tensor, eps: Tensor, weight: Tensor | None = None) -> Tensor:
    """RMSNorm: x * rsqrt(mean(x^2) + eps) (* weight)."""
    x = _scaled(x, eps, 1.0 / x.shape[-1])
    return x if weight is None else x * weight


def _attn_res(blocks: list[Tensor], partial_ND: Tensor, query_D: Tensor, eps: Tensor) -> Tensor:
    """softmax_j(RMSNorm(V_j) . w) weighted sum of V = [blocks..., partial] (attn_res.py)."""
    if not blocks:
        return partial_ND
    sources, value = [*blocks, partial_ND], 1.0 / query_D.shape[0]
    if partial_ND.shape[0] > 64:  # many tokens: per-source ops beat stacking and tiny bmms
        logits = []
        for v_ND in sources:
            norm_N = torch.linalg.vector_norm(v_ND, dim=-1)
            logits.append(
                (v_ND @ query_D) * torch.rsqrt(torch.addcmul(eps, norm_N, norm_N, value=value))
            )
        p_NJ = torch.softmax(torch.stack(logits, -1), -1)
        out_ND = sources[0] * p_NJ[:, :1]
        for j in range(1, len(sources)):
            out_ND = out_ND.addcmul_(sources[j], p_NJ[:, j : j + 1])
        return out_ND
    values_NJD = torch.stack([*blocks, partial_ND], 1)
    norm_NJ = torch.linalg.vector_norm(values_NJD, dim=-1)
    inv_rms_NJ = torch.rsqrt(torch.addcmul(eps, norm_NJ, norm_NJ, value=1.0 / query_D.shape[0]))
    p_NJ = torch.softmax((values_NJD @ query_D) * inv_rms_NJ, -1)
    return (p_NJ[:, None, :] @ values_NJD)[:, 0]


def _mix(mixer: KDAPlan | MLAPlan, x_ND: Tensor, cache: K3Cache, layer: int, step: _Step):
    if isinstance(mixer, MLAPlan):
        return _mla(mixer, x_ND, cache, layer, step)
    if step.length == 1 and step.mask_BT is None:
        return _kda_step(mixer, x_ND, cache, layer)
    return _kda_chunk(mixer, x_ND, cache, layer, step)


def _kda_step(p: KDAPlan, x_BD: Tensor, cache: K3Cache, layer: int) -> Tensor:
    """One token: S = Diag(alpha) S; S += k beta (v - S^T k)^T; o = S^T q (kda_recurrent)."""
    batch, heads, dim = x_BD.shape[0], p.heads, p.head_dim
    qkv_BX, fa_BK, b_gate_BX = (x_BD @ p.w_in).split((*p.splits[:2], sum(p.splits[2:])), -1)
    beta_BH, gate_BX = torch.sigmoid(b_gate_BX).split(p.splits[2:], -1)  # b | g adjacent
    window_BWX = torch.cat([cache.conv[layer], qkv_BX[:, None]], 1)
    cache.conv[layer] = window_BWX[:, 1:]
    y_BX = F.silu((window_BWX * p.conv_w).sum(1))
    qk_BGK = _scaled(y_BX[:, : 2 * heads * dim].view(batch, 2 * heads, dim), p.l2_eps, 1.0)
    q_BHK, k_BHK = qk_BGK.split(heads, 1)
    v_BHK = y_BX[:, 2 * heads * dim :].view(batch, heads, dim)
    S_BHKK = cache.state[layer]
    S_BHKK.mul_(_log_decay(p, fa_BK @ p.w_fb).exp().view(batch, heads, dim, 1))
    err_BH1K = v_BHK[:, :, None, :] - k_BHK[:, :, None, :] @ S_BHKK
    S_BHKK.addcmul_(k_BHK[..., None], beta_BH[..., None, None] * err_BH1K)
    o_BHK = (q_BHK[:, :, None, :] @ S_BHKK)[:, :, 0]  # o without the 1/sqrt(K) scale
    o_BHK = _rms(o_BHK, p.o_eps_step) * gate_BX.view(batch, heads, dim)
    return o_BHK.view(batch, -1) @ p.w_o


def _log_decay(p: KDAPlan, f_NX: Tensor) -> Tensor:
    if p.lower_bound is None:
        return -p.gate_a * F.softplus(f_NX + p.gate_c)
    return p.lower_bound * torch.sigmoid(torch.addcmul(p.gate_c, f_NX, p.gate_a))


def _kda_chunk(p: KDAPlan, x_ND: Tensor, cache: K3Cache, layer: int, step: _Step) -> Tensor:
    """T tokens (masked ones leave the state and conv window as a sequence start would)."""
    batch, length, heads, dim = step.batch, step.length, p.heads, p.head_dim
    if step.mask_N1 is not None:
        x_ND = x_ND * step.mask_N1
    qkv_BTX, fa_BTK, b_BTH, gate_BTX = (x_ND @ p.w_in).view(batch, length, -1).split(p.splits, -1)
    full_BTX = torch.cat([cache.conv[layer], qkv_BTX], 1)  # [B, W-1+T, X]
    cache.conv[layer] = full_BTX[:, length:]
    y_BTX = full_BTX[:, :length] * p.conv_w[0]  # causal depthwise conv: W shifted products
    for tap in range(1, p.conv_w.shape[0]):
        y_BTX.addcmul_(full_BTX[:, tap : tap + length], p.conv_w[tap])
    y_BTX = F.silu(y_BTX)
    qk_BTGK = _scaled(y_BTX[..., : 2 * heads * dim].unflatten(-1, (2 * heads, dim)), p.l2_eps, 1.0)
    q_BTHK, k_BTHK = qk_BTGK.split(heads, 2)
    v_BTHK = y_BTX[..., 2 * heads * dim :].unflatten(-1, (heads, dim))
    g_BTHK = _log_decay(p, fa_BTK @ p.w_fb).unflatten(-1, (heads, dim))
    args = (q_BTHK, k_BTHK, v_BTHK, g_BTHK, torch.sigmoid(b_BTH))
    if p.lower_bound is not None and p.lower_bound >= -FACTORED_SPAN / FACTORED_CHUNK:
        o_BTHK, cache.state[layer] = kda_factored(
            *args, cache.state[layer], step.mask_BT, FACTORED_CHUNK
        )  # o without the 1/sqrt(K) scale: o_eps_step
        eps = p.o_eps_step
    else:  # unbounded (softplus) gate: the general chunked form
        o_BTHK, cache.state[layer] = kda_chunked(
            *args, scale=dim**-0.5, initial_state=cache.state[layer], mask=step.mask_BT,
            chunk_size=KDA_CHUNK,
        )  # fmt: skip
        eps = p.o_eps
    o_BTHK = _rms(o_BTHK, eps) * torch.sigmoid(gate_BTX).unflatten(-1, (heads, dim))
    return o_BTHK.reshape(batch * length, -1) @ p.w_o


def _chunks(x_BTHX: Tensor, chunk: int) -> Tensor:
    """[B, T, H, X] -> [B, H, N, C, X], T zero-padded to N * C."""
    batch, length, heads, width = x_BTHX.shape
    pad = (-length) % chunk
    if pad:
        x_BTHX = F.pad(x_BTHX, (0, 0, 0, 0, 0, pad))
    return x_BTHX.view(batch, -1, chunk, heads, width).permute(0, 3, 1, 2, 4).contiguous()


def kda_factored(q, k, v, g, beta, state_BHKV: Tensor, mask_BT: Tensor | None, chunk: int):
    """Inference-only chunked KDA for bounded decay: the WY form of kda.kda_chunked with the
    decay factored as exp(gam_r - gam_s) = exp(gam_r) * exp(-gam_s) inside each chunk, which
    is exact as long as chunk * min(g) >= -FACTORED_SPAN (K3's gate: g > -5, chunk 16).
    q, k [B, T, H, K] (q unscaled), v [B, T, H, V], g [B, T, H, K], beta [B, T, H];
    -> (o [B, T, H, V] without the K^-0.5 scale, final state). Parity with kda_recurrent is
    tested (float64 1e-12); no autograd (prefill only)."""
    batch, length, heads, dim = q.shape
    if mask_BT is not None:
        keep_BT = mask_BT.to(g.dtype)
        g, beta = g * keep_BT[..., None, None], beta * keep_BT[..., None]
    q_, k_, v_, g_ = (_chunks(x, chunk) for x in (q, k, v, g))  # [B, H, N, C, *]
    beta_BHNC1 = _chunks(beta[..., None], chunk)
    decay_BHNCK = g_.cumsum(-2).exp()
    k_scaled, k_inv_t = k_ * decay_BHNCK, (k_ / decay_BHNCK).transpose(-1, -2)
    q_scaled = q_ * decay_BHNCK
    L_BHNCC = (k_scaled @ k_inv_t) * beta_BHNC1  # diagonal and above unused (unitriangular)
    Aqk_BHNCC = (q_scaled @ k_inv_t).tril()
    rhs = torch.cat([k_scaled, v_], -1) * beta_BHNC1
    wu = unit_lower_solve(L_BHNCC, rhs)
    w_BHNCK, u_BHNCV = wu.split([dim, v.shape[-1]], -1)
    last_BHN1K = decay_BHNCK[..., -1:, :]
    kd_t_BHNKC = k_inv_t * last_BHN1K.transpose(-1, -2)
    S_BHKV, states, vnews = state_BHKV, [], []
    for n in range(w_BHNCK.shape[2]):
        states.append(S_BHKV)
        vnew_BHCV = u_BHNCV[:, :, n] - w_BHNCK[:, :, n] @ S_BHKV
        vnews.append(vnew_BHCV)
        S_BHKV = last_BHN1K[:, :, n, 0, :, None] * S_BHKV + kd_t_BHNKC[:, :, n] @ vnew_BHCV
    o_BHNCV = q_scaled @ torch.stack(states, 2) + Aqk_BHNCC @ torch.stack(vnews, 2)
    o_BTHV = o_BHNCV.permute(0, 2, 3, 1, 4).reshape(batch, -1, heads, v.shape[-1])[:, :length]
    if mask_BT is not None:
        o_BTHV = o_BTHV * mask_BT.to(o_BTHV.dtype)[..., None, None]
    return o_BTHV, S_BHKV


def _mla(p: MLAPlan, x_ND: Tensor, cache: K3Cache, layer: int, step: _Step) -> Tensor:
    """Absorbed NoPE MLA: the new tokens' latents go into their slots, then every new query
    attends over the row's allowed slots in the latent space."""
    batch, length, rank, heads = step.batch, step.length, p.kv_rank, p.heads
    q_NQ, kv_NL, gate_NX = (x_ND @ p.w_in).split(p.splits, -1)
    if p.w_q is not None:
        q_NQ = _rms(q_NQ, p.q_eps) @ p.w_q
    if not isinstance(cache, K3Cache):  # paged (policy/k3/paged.py): any rows, no padding
        new_BTL = kv_NL.view(batch, length, -1)
        normed_BTR = _rms(new_BTL[..., :rank], p.kv_eps, p.kv_norm_w)
        new_BTL = torch.cat([normed_BTR, new_BTL[..., rank:]], -1)
        q_BTHL = q_NQ.view(batch, length, heads, -1)
        o_lat_BTHR = cache.attend(layer, q_BTHL, new_BTL, rank)
        o_NX = torch.einsum("bthr,hrv->bthv", o_lat_BTHR, p.w_uv).reshape(batch * length, -1)
        return _mla_out(p, o_NX, gate_NX)
    slots_BSL = cache.latent[layer][:, : step.start + length]
    new_BTL = slots_BSL[:, step.start :]
    new_BTL.copy_(kv_NL.view(batch, length, -1))
    new_BTL[..., :rank] = _rms(new_BTL[..., :rank], p.kv_eps, p.kv_norm_w)
    if length == 1:
        scores_BHS = q_NQ.view(batch, heads, -1) @ slots_BSL.transpose(1, 2)
        scores_BHS = scores_BHS.masked_fill_(step.blocked_B1S, torch.finfo(q_NQ.dtype).min)
        p_BHS = torch.softmax(scores_BHS, -1)
        o_lat_BHR = p_BHS @ slots_BSL[..., :rank]
        o_NX = (o_lat_BHR.transpose(0, 1) @ p.w_uv).transpose(0, 1).reshape(batch, -1)
    else:  # by blocks: no [B, H, T, S] scores, no [B, T, S] mask (flash.py)
        o_lat_BTHR = flash_attention(
            q_NQ.view(batch, length, heads, -1), slots_BSL, slots_BSL[..., :rank], scale=1.0,
            offset=step.start, key_mask_BS=cache.key_mask[:, : step.start + length],
        )  # fmt: skip
        o_NX = torch.einsum("bthr,hrv->bthv", o_lat_BTHR, p.w_uv).reshape(batch * length, -1)
    if step.mask_N1 is not None:
        o_NX = o_NX * step.mask_N1
    return _mla_out(p, o_NX, gate_NX)


def _mla_out(p: MLAPlan, o_NX: Tensor, gate_NX: Tensor) -> Tensor:
    if p.gated:
        o_NX = o_NX * torch.sigmoid(gate_NX)
    return o_NX @ p.w_o


def _situ(gate_up_NF: Tensor, inv_beta: float | None, capped_up: bool) -> Tensor:
    """SiTU-GLU hidden activation with the output scales folded away (see plan.py)."""
    gate_NF, up_NF = gate_up_NF.chunk(2, dim=-1)
    capped_NF = gate_NF if inv_beta is None else scaled_tanh(gate_NF, inv_beta)
    return capped_NF * torch.sigmoid(gate_NF) * (scaled_tanh(up_NF) if capped_up else up_NF)


def _mlp(p: MLPPlan, x_ND: Tensor) -> tuple[Tensor, Tensor | None]:
    if p.experts is None:
        return _situ(x_ND @ p.w_in, p.inv_beta, p.capped_up) @ p.w_out, None
    e = p.experts
    logits_NE, z_NL, shared_NF = (x_ND @ p.w_in).split(p.splits, -1)
    if e.latent_in_w is not None:  # plain MoE: experts read the normed hidden state itself
        z_NL = x_ND * e.latent_in_w
    scores_NE = torch.sigmoid(logits_NE) if e.sigmoid else torch.softmax(logits_NE, -1)
    indices_NK = top_k_indices(scores_NE + e.bias, e.top_k)  # as the router chooses
    weights_NK = scores_NE.gather(1, indices_NK)
    if e.renormalize:  # == w / (sum w + 1e-20) for positive scores (routing.combine_weights)
        weights_NK = F.normalize(weights_NK, p=1.0, dim=-1, eps=1e-20)
    y_NL = _experts(p, e, z_NL, indices_NK, weights_NK * e.scale)
    if e.norm_eps is not None:
        y_NL = _rms(y_NL, e.norm_eps)
    if shared_NF.shape[-1]:
        y_NL = torch.cat([y_NL, _situ(shared_NF, p.inv_beta, p.capped_up)], -1)
    return y_NL @ p.w_out, indices_NK


def _experts(p: MLPPlan, e: ExpertsPlan, z_NL, indices_NK, weights_NK) -> Tensor:
    """Weighted sum over each token's experts."""
    tokens, top_k = indices_NK.shape
    num_experts = e.bias.shape[0]
    if not e.grouped:  # every expert on every token, zero weight off the selection
        gate_up_NEF = (z_NL @ e.gate_up_flat).view(tokens, num_experts, -1)
        h_NEF = _situ(gate_up_NEF, p.inv_beta, p.capped_up)
        mix_NE = torch.zeros_like(h_NEF[..., 0]).scatter_(1, indices_NK, weights_NK)
        return (h_NEF * mix_NE[..., None]).view(tokens, -1) @ e.down_flat
    flat_A = indices_NK.reshape(-1)
    if flat_A.shape[0] > 4 * num_experts:  # many tokens per expert: grouped matmuls
        return _experts_grouped(p, e, z_NL, flat_A, weights_NK)
    if flat_A.shape[0] < num_experts:  # fewer assignments than experts: gather their weights
        z_A1L = z_NL.repeat_interleave(top_k, 0)[:, None, :]
        h_A1F = _situ(z_A1L @ e.gate_up[flat_A], p.inv_beta, p.capped_up)
        y_NKL = (h_A1F @ e.down[flat_A]).view(tokens, top_k, -1)
        return (y_NKL * weights_NK[..., None]).sum(1)
    # a few tokens per expert (decode): padded per-expert buckets, one bmm per projection
    hit_AE = flat_A[:, None] == torch.arange(num_experts, device=flat_A.device)
    rank_A = hit_AE.cumsum(0).gather(1, flat_A[:, None])[:, 0] - 1  # its expert's earlier rows
    capacity = int(rank_A.max()) + 1
    slot_A = flat_A * capacity + rank_A
    z_AL = z_NL.repeat_interleave(top_k, 0)
    z_ECL = z_NL.new_zeros(num_experts * capacity, z_NL.shape[1]).index_copy_(0, slot_A, z_AL)
    h_ECF = _situ(z_ECL.view(num_experts, capacity, -1) @ e.gate_up, p.inv_beta, p.capped_up)
    y_AL = (h_ECF @ e.down).view(num_experts * capacity, -1)[slot_A]
    return (y_AL.view(tokens, top_k, -1) * weights_NK[..., None]).sum(1)


def _experts_grouped(p: MLPPlan, e: ExpertsPlan, z_NL, flat_A, weights_NK) -> Tensor:
    """Assignments sorted by expert, two grouped matmuls (one small matmul per expert)."""
    order_A = torch.argsort(flat_A, stable=True)
    offsets_E = torch.bincount(flat_A, minlength=e.bias.shape[0]).cumsum(0).to(torch.int32)
    token_A = order_A // weights_NK.shape[1]
    h_AF = _situ(F.grouped_mm(z_NL[token_A], e.gate_up, offs=offsets_E), p.inv_beta,
                 p.capped_up)  # fmt: skip
    y_AL = F.grouped_mm(h_AF, e.down, offs=offsets_E) * weights_NK.reshape(-1)[order_A, None]
    return torch.zeros_like(z_NL).index_add_(0, token_A, y_AL)
