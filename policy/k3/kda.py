"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi Linear / Kimi K3.

Reference: docs in ../shared/reference/k3-architecture.md sec. 2 (Kimi Linear, arXiv 2510.26692;
fla `fla/ops/kda/naive.py`, transformers `models/kimi_linear`). Per value head the state S [K, V]
follows the gated delta rule with a per-channel decay alpha_t = exp(g_t):

    S'_t = Diag(alpha_t) S_{t-1};  S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T;  o_t = S_t^T q_t

`kda_recurrent` is the obvious token loop (the reference). `kda_chunked` is the WY/UT chunkwise
form used for training and prefill; its parity with the loop (outputs, state, gradients) is tested.

Letters:
    B batch, T time, H query/key heads, HV value heads (HV % H == 0, G = HV // H),
    K key head dim, V value head dim, D hidden size, X channels of one projection,
    N chunks, C chunk size, W conv kernel size; inside a chunk: J sub-blocks of S rows,
    P stacked row operands (k and q), R = P * S.
Layouts follow fla: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log decay);
beta [B, T, HV]; state [B, HV, K, V]. Value head j reads query/key head j // G.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policy.k3.precision import full_precision

# ---------------------------------------------------------------------------------------------
# Gates, norms and the short convolution


def kda_gate_lower_bound(
    f_BTHK: Tensor, A_log_H: Tensor, dt_bias_X: Tensor, lower_bound: float = -5.0
) -> Tensor:
    """K3 gate g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in [lower_bound, 0].

    f: [..., HV, K] logits; A_log: [HV]; dt_bias: [HV*K]. Computed and returned in >= fp32.
    """
    x_BTHK, a_H1 = _gate_inputs(f_BTHK, A_log_H, dt_bias_X)
    return lower_bound * torch.sigmoid(a_H1.exp() * x_BTHK)


def kda_gate_softplus(f_BTHK: Tensor, A_log_H: Tensor, dt_bias_X: Tensor) -> Tensor:
    """Kimi-Linear-48B gate g = -exp(A_log) * softplus(f + dt_bias), in (-inf, 0]. >= fp32."""
    x_BTHK, a_H1 = _gate_inputs(f_BTHK, A_log_H, dt_bias_X)
    return -a_H1.exp() * F.softplus(x_BTHK)


def _gate_inputs(f_BTHK: Tensor, A_log_H: Tensor, dt_bias_X: Tensor) -> tuple[Tensor, Tensor]:
    num_heads, head_dim = f_BTHK.shape[-2:]
    dtype = torch.promote_types(f_BTHK.dtype, torch.float32)
    x_BTHK = f_BTHK.to(dtype) + dt_bias_X.to(dtype).view(num_heads, head_dim)
    return x_BTHK, A_log_H.to(dtype).view(num_heads, 1)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, computed in (at least) fp32 (fla's l2norm)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def short_conv(
    x_BTX: Tensor, weight_X1W: Tensor, cache_BXW: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv (no bias) + SiLU, with a carried cache of the last W-1 inputs.

    cache_BXW holds the W-1 most recent inputs per channel ([B, X, W-1], oldest first; zeros
    = start of sequence). Returns (SiLU(conv(x)) [B, T, X], new cache [B, X, W-1]).
    The conv is W shifted multiply-adds along T in the [B, T, X] layout the projections give
    (`short_conv_reference` is the conv1d; this is ~1.7x faster forward + backward on CPU).
    """
    length, width = x_BTX.shape[1], weight_X1W.shape[-1]
    if cache_BXW is None:
        cache_BXW = x_BTX.new_zeros(x_BTX.shape[0], x_BTX.shape[2], width - 1)
    full_BSX = torch.cat([cache_BXW.transpose(1, 2).to(x_BTX.dtype), x_BTX], dim=1)
    weight_WX = weight_X1W[:, 0, :].t().to(x_BTX.dtype)
    y_BTX = full_BSX[:, :length] * weight_WX[0]
    for tap in range(1, width):
        y_BTX = torch.addcmul(y_BTX, full_BSX[:, tap : tap + length], weight_WX[tap])
    new_cache_BXW = full_BSX[:, length:].transpose(1, 2).contiguous()
    return F.silu(y_BTX), new_cache_BXW


def short_conv_reference(
    x_BTX: Tensor, weight_X1W: Tensor, cache_BXW: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`short_conv` through torch's depthwise conv1d (the obvious form, for parity tests)."""
    batch, _, channels = x_BTX.shape
    width = weight_X1W.shape[-1]
    if cache_BXW is None:
        cache_BXW = x_BTX.new_zeros(batch, channels, width - 1)
    full_BXT = torch.cat([cache_BXW.to(x_BTX.dtype), x_BTX.transpose(1, 2)], dim=-1)
    y_BXT = F.conv1d(full_BXT, weight_X1W.to(x_BTX.dtype), groups=channels)
    new_cache_BXW = full_BXT[..., full_BXT.shape[-1] - (width - 1) :]
    return F.silu(y_BXT).transpose(1, 2), new_cache_BXW


# ---------------------------------------------------------------------------------------------
# The recurrence: reference loop


def _prepare(q, k, v, g, beta, mask):
    """Cast to the compute dtype (>= fp32), expand q/k to value heads, make masked steps no-ops."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    groups = v.shape[2] // q.shape[2]
    q_BTHK, k_BTHK = q.to(dtype), k.to(dtype)
    if groups > 1:
        q_BTHK, k_BTHK = (x.repeat_interleave(groups, dim=2) for x in (q_BTHK, k_BTHK))
    g_BTHK, beta_BTH = g.to(dtype), beta.to(dtype)
    if mask is not None:
        m_BT = mask.to(dtype)
        g_BTHK = g_BTHK * m_BT[:, :, None, None]
        beta_BTH = beta_BTH * m_BT[:, :, None]
    return q_BTHK, k_BTHK, v.to(dtype), g_BTHK, beta_BTH


def _initial_state(initial_state, v_BTHV, key_dim):
    batch, _, heads, value_dim = v_BTHV.shape
    if initial_state is None:
        return v_BTHV.new_zeros(batch, heads, key_dim, value_dim)
    return initial_state.to(v_BTHV.dtype)


@full_precision
def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA (reference). Computes in fp32, or fp64 for fp64 inputs.

    mask [B, T] (1 = real token): masked steps do not decay or update the state, output zero.
    Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] in the compute dtype).
    """
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH = _prepare(q, k, v, g, beta, mask)
    S_BHKV = _initial_state(initial_state, v_BTHV, q.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        k_BHK = k_BTHK[:, t]
        S_BHKV = S_BHKV * g_BTHK[:, t].exp()[..., None]
        err_BHV = v_BTHV[:, t] - torch.einsum("bhk,bhkv->bhv", k_BHK, S_BHKV)
        u_BHV = beta_BTH[:, t, :, None] * err_BHV
        S_BHKV = S_BHKV + k_BHK[..., None] * u_BHV[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q_BTHK[:, t] * scale, S_BHKV))
    o_BTHV = torch.stack(outs, dim=1)
    if mask is not None:
        o_BTHV = o_BTHV * mask.to(o_BTHV.dtype)[:, :, None, None]
    return o_BTHV.to(v.dtype), (S_BHKV if output_final_state else None)


# ---------------------------------------------------------------------------------------------
# The recurrence: chunkwise (WY / UT) form


class _DecayExp(torch.autograd.Function):
    """y = exp(clamp(x, floor, ceiling)) * keep; backward dx = dy * y (the exp derivative).

    The backward treats the clamp as identity: exact inside [floor, ceiling]; below the floor
    the true derivative is < e^floor anyway, and above the ceiling only masked entries lie (y = 0).
    """

    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor | None, floor: float, ceiling: float) -> Tensor:
        y = x.clamp(min=floor, max=ceiling).exp()
        if keep is not None:
            y = y * keep
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (y,) = ctx.saved_tensors
        return dy * y, None, None, None


def _decay_exp(x: Tensor, keep: Tensor | None = None, ceiling: float = 0.0) -> Tensor:
    """exp of a log decay (x <= ceiling), clamped BEFORE exp, zeroed outside `keep` after it.

    Clamping into [floor, ceiling] before exp means entries outside `keep` (future positions,
    whose exponents may be huge and positive) cannot overflow, and no factor, nor the product
    of two (the off-diagonal matmul), is ever a denormal: on CPU denormal (or -inf) arithmetic
    makes exp, matmul and the triangular solve 3-10x slower. floor = -40 (e^-40 ~ 4e-18) in
    fp32, -300 in fp64: factors above the floor are exact; below it the absolute change is
    < 5e-18 (fp32, far under the resolution of O(1) outputs) or < 1e-130 (fp64).
    """
    floor = -300.0 if x.dtype == torch.float64 else -40.0
    return _DecayExp.apply(x, None if keep is None else keep.to(x.dtype), floor, ceiling)


class _UnitLowerSolve(torch.autograd.Function):
    """X = (I + strict_lower(L))^-1 R through the explicit inverse (fla's chunk_kda form).

    On the CPU a batched triangular solve costs per system, not per right-hand side: at
    [16, 2, 6, 32, 32] the solve against the identity takes 0.76 ms and the inverse's matmul
    with 96 right-hand sides 0.34 ms, against 1.9 ms for the solve with them, and the backward
    is two matmuls (dR = inv^T dX, dL = -(dR X^T) strictly lower) instead of a transposed solve
    (2.9 ms) and a matmul. `torch.linalg.solve_triangular(L, R, upper=False,
    unitriangular=True)` is the reference (float64 parity: tests/policy/k3/test_kda.py).
    """

    @staticmethod
    def forward(ctx, L_BCC: Tensor, R_BCX: Tensor) -> Tensor:
        eye_CC = torch.eye(L_BCC.shape[-1], dtype=L_BCC.dtype, device=L_BCC.device)
        inv_BCC = torch.linalg.solve_triangular(
            L_BCC, eye_CC.expand_as(L_BCC), upper=False, unitriangular=True
        )
        X_BCX = inv_BCC @ R_BCX
        ctx.save_for_backward(inv_BCC, X_BCX)
        return X_BCX

    @staticmethod
    def backward(ctx, dX_BCX: Tensor):
        inv_BCC, X_BCX = ctx.saved_tensors
        dR_BCX = inv_BCC.transpose(-1, -2) @ dX_BCX
        dL_BCC = (dR_BCX @ X_BCX.transpose(-1, -2)).tril(-1).neg_()
        return dL_BCC, dR_BCX


def unit_lower_solve(L_BCC: Tensor, R_BCX: Tensor) -> Tensor:
    """Solve (I + strict_lower(L)) X = R over any leading batch dims; L's diagonal and upper
    part are ignored, as with solve_triangular(upper=False, unitriangular=True)."""
    return _UnitLowerSolve.apply(L_BCC, R_BCX)


def _to_chunks(x_BTH_: Tensor, chunk: int) -> Tensor:
    """[B, T, HV, *] -> [B, HV, N, C, *], zero-padding T up to N * C."""
    pad = (-x_BTH_.shape[1]) % chunk
    if pad:
        x_BTH_ = F.pad(x_BTH_, (0, 0) * (x_BTH_.dim() - 2) + (0, pad))
    batch, length, heads = x_BTH_.shape[:3]
    x = x_BTH_.reshape(batch, length // chunk, chunk, heads, *x_BTH_.shape[3:])
    return x.transpose(1, 3).transpose(2, 3)


FACTOR_RANGE = 40.0  # in-block decay up to e^-40 allows the one-matmul form (e^40 fits fp32)


def decayed_grams(
    a_BHNPCK: Tensor, b_BHNCK: Tensor, gam_BHNCK: Tensor, sub: int, *, factored: bool | None = None
) -> Tensor:
    """A[p, r, s] = sum_d a[p, r, d] b[s, d] exp(gam[r, d] - gam[s, d]) for s <= r, else 0.

    gam is the in-chunk cumulative log decay (non-increasing along C); `sub` must divide C.
    Rows are split into J = C / sub blocks with ref_j = gam just before block j. Columns before
    the block factor as exp(gam_r - ref_j) * exp(ref_j - gam_s), both <= 1: one batched matmul.
    Inside the diagonal block, exp(ref_j - gam_s) >= 1 grows with the block's own decay:
      factored=True: keep the same matmul for the diagonal block too (needs the decay inside
        every block >= e^-40, e.g. the K3 gate g >= -5 with sub = 8) and mask s > r after it;
      factored=False: an exact per-pair factor exp(gam_r - gam_s), masked before exp.
    None picks factored when every block satisfies the bound. P row operands (e.g. k and q)
    share all decay factors.
    """
    size, num_ops, blocks = b_BHNCK.shape[-2], a_BHNPCK.shape[-3], b_BHNCK.shape[-2] // sub
    a_BHNJPSK = a_BHNPCK.unflatten(-2, (blocks, sub)).transpose(-4, -3)
    gam_BHNJSK = gam_BHNCK.unflatten(-2, (blocks, sub))
    ref_BHNJK = _block_starts(gam_BHNJSK)
    if factored is None:
        factored = _blocks_factor(gam_BHNJSK, ref_BHNJK)
    left_BHNJPSK = a_BHNJPSK * _decay_exp(gam_BHNJSK - ref_BHNJK[..., None, :])[..., None, :, :]
    cols_C = torch.arange(size, device=b_BHNCK.device)
    ends_J = torch.arange(blocks, device=cols_C.device) * sub + (sub if factored else 0)
    expo_BHNJCK = ref_BHNJK[..., :, None, :] - gam_BHNCK[..., None, :, :]
    right_BHNJCK = b_BHNCK[..., None, :, :] * _decay_exp(
        expo_BHNJCK, keep=(cols_C[None, :] < ends_J[:, None])[..., None], ceiling=FACTOR_RANGE
    )
    A_BHNJRC = left_BHNJPSK.flatten(-3, -2) @ right_BHNJCK.transpose(-1, -2)
    A_BHNJPSJS = A_BHNJRC.unflatten(-2, (num_ops, sub)).unflatten(-1, (blocks, sub))
    if factored:
        causal_CC = torch.ones(size, size, dtype=a_BHNPCK.dtype, device=cols_C.device).tril()
        return A_BHNJPSJS.transpose(-5, -4).reshape(*a_BHNPCK.shape[:-1], size) * causal_CC
    diag_BHNJPSS = _diagonal_blocks(a_BHNJPSK, b_BHNCK.unflatten(-2, (blocks, sub)), gam_BHNJSK)
    eye_JJ = torch.eye(blocks, dtype=diag_BHNJPSS.dtype, device=cols_C.device)
    A_BHNJPSJS = A_BHNJPSJS + diag_BHNJPSS[..., None, :] * eye_JJ[:, None, None, :, None]
    return A_BHNJPSJS.transpose(-5, -4).reshape(*a_BHNPCK.shape[:-1], size)


def one_block_grams(left_BHNPCK: Tensor, right_BHNCK: Tensor) -> Tensor:
    """`decayed_grams` with one row block (sub = C) already factored: left = a exp(gam),
    right = b exp(-gam) (<= e^FACTOR_RANGE, which `_sub_block` checked); A = left right^T, causal.
    """
    size, num_ops = right_BHNCK.shape[-2], left_BHNPCK.shape[-3]
    A_BHNRC = left_BHNPCK.flatten(-3, -2) @ right_BHNCK.transpose(-1, -2)
    causal_CC = torch.ones(size, size, dtype=A_BHNRC.dtype, device=A_BHNRC.device).tril()
    return A_BHNRC.unflatten(-2, (num_ops, size)) * causal_CC


def _block_starts(gam_BHNJSK: Tensor) -> Tensor:
    """The cumulative log decay just before each row block (0 for the first): [B, H, N, J, K]."""
    return torch.cat([torch.zeros_like(gam_BHNJSK[..., :1, 0, :]), gam_BHNJSK[..., :-1, -1, :]], -2)


def _blocks_factor(gam_BHNJSK: Tensor, start_BHNJK: Tensor) -> bool:
    """Whether no row block decays by more than e^-FACTOR_RANGE (the one-matmul form holds)."""
    return bool((gam_BHNJSK[..., -1, :] - start_BHNJK).min() >= -FACTOR_RANGE)


def _sub_block(gam_BHNCK: Tensor, chunk: int) -> tuple[int, bool]:
    """(row-block size, factored) for `decayed_grams`: the largest of chunk, chunk/2, ... that
    divides `chunk` and `_blocks_factor` (a trained k3-tiny's 32-token chunks decay by e^-22 to
    e^-34: one block, ~0.75x the time); else gcd(chunk, 8) with its own check's answer."""

    def factors(sub: int) -> bool:
        gam_BHNJSK = gam_BHNCK.unflatten(-2, (chunk // sub, sub))
        return _blocks_factor(gam_BHNJSK, _block_starts(gam_BHNJSK))

    smallest, sub = math.gcd(chunk, 8), chunk
    while sub > smallest:
        if chunk % sub == 0 and factors(sub):
            return sub, True
        sub //= 2
    return smallest, factors(smallest)


def _diagonal_blocks(a_BHNJPSK: Tensor, b_BHNJSK: Tensor, gam_BHNJSK: Tensor) -> Tensor:
    """Exact in-block part: sum_d a_r b_s exp(gam_r - gam_s) for s <= r in the same block."""
    sub = b_BHNJSK.shape[-2]
    causal_SS1 = torch.ones(sub, sub, dtype=torch.bool, device=b_BHNJSK.device).tril()[..., None]
    diff_BHNJSSK = gam_BHNJSK[..., :, None, :] - gam_BHNJSK[..., None, :, :]
    bd_BHNJSSK = b_BHNJSK[..., None, :, :] * _decay_exp(diff_BHNJSSK, keep=causal_SS1)
    return torch.einsum("...jprk,...jrsk->...jprs", a_BHNJPSK, bd_BHNJSSK)


def _state_scan(S_BHKV, w_NBHCK, u_NBHCV, kd_NBHCK, decay_NBHK):
    """The only sequential part: S_{n+1} = Diag(decay_n) S_n + kd_n^T (u_n - w_n S_n)."""
    states, vnews = [], []
    # unbind (not indexing) so that backward stacks the gradients once instead of N times
    steps = zip(
        w_NBHCK.unbind(0), u_NBHCV.unbind(0), kd_NBHCK.unbind(0), decay_NBHK.unbind(0), strict=True
    )
    for w_BHCK, u_BHCV, kd_BHCK, decay_BHK in steps:
        states.append(S_BHKV)
        vnew_BHCV = u_BHCV - w_BHCK @ S_BHKV
        vnews.append(vnew_BHCV)
        S_BHKV = decay_BHK[..., None] * S_BHKV + kd_BHCK.transpose(-1, -2) @ vnew_BHCV
    return torch.stack(states, dim=2), torch.stack(vnews, dim=2), S_BHKV


@full_precision
def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    mask: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunkwise-parallel KDA, same contract as `kda_recurrent` (reference sec. 2.3).

    Everything inside chunks (decayed Gram matrices, the unit-lower-triangular solve for the WY
    factors w, u) is batched over all chunks at once; only the state recurrence loops over chunks.
    g must be a log decay (<= 0). Decay factors below e^-40 (fp32; e^-300 in fp64) are floored
    there (`_decay_exp`), and when every sub-block decays by less than e^-40 (8-token ones always
    do with the K3 gate; `_sub_block` takes the largest that do) the in-block Gram part uses one
    matmul (`decayed_grams`); else exact pairs.
    """
    length, key_dim = q.shape[1], q.shape[-1]
    q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH = _prepare(q, k, v, g, beta, mask)
    S_BHKV = _initial_state(initial_state, v_BTHV, key_dim)
    chunk = chunk_size
    q_BHNCK, k_BHNCK, v_BHNCV, g_BHNCK = (
        _to_chunks(x, chunk) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTHK)
    )
    beta_BHNC = _to_chunks(beta_BTH[..., None], chunk)[..., 0]
    gam_BHNCK = g_BHNCK.cumsum(dim=-2)

    qs_BHNCK = q_BHNCK * scale
    decay_BHNCK = _decay_exp(gam_BHNCK)  # from the chunk start to each token
    kE_BHNCK, qE_BHNCK = k_BHNCK * decay_BHNCK, qs_BHNCK * decay_BHNCK
    sub, factored = _sub_block(gam_BHNCK, chunk)
    one_block = sub == chunk and factored
    if one_block:  # one row block, factored: the products with exp(gam) serve three uses
        kinv_BHNCK = k_BHNCK * _decay_exp(-gam_BHNCK, ceiling=FACTOR_RANGE)
        A_BHN2CC = one_block_grams(torch.stack([kE_BHNCK, qE_BHNCK], -3), kinv_BHNCK)
    else:
        kq_BHN2CK = torch.stack([k_BHNCK, qs_BHNCK], -3)
        A_BHN2CC = decayed_grams(kq_BHN2CK, k_BHNCK, gam_BHNCK, sub, factored=factored)
    # diagonal of L is ignored by the unit-triangular solve: L is the strictly lower part
    L_BHNCC, Aqk_BHNCC = beta_BHNC[..., None] * A_BHN2CC[..., 0, :, :], A_BHN2CC[..., 1, :, :]
    rhs = beta_BHNC[..., None] * torch.cat([kE_BHNCK, v_BHNCV], dim=-1)
    wu = unit_lower_solve(L_BHNCC, rhs)
    w_BHNCK, u_BHNCV = wu.split([key_dim, v.shape[-1]], dim=-1)

    last_BHN1K = decay_BHNCK[..., -1:, :]  # the whole chunk's decay
    if one_block:  # exp(gam_last - gam) = exp(gam_last) exp(-gam), both in range
        kd_BHNCK = kinv_BHNCK * last_BHN1K
    else:
        gam_last_BHN1K = gam_BHNCK[..., -1:, :]
        kd_BHNCK = k_BHNCK * _decay_exp(gam_last_BHN1K - gam_BHNCK)
    S_BHNKV, vnew_BHNCV, S_BHKV = _state_scan(
        S_BHKV,
        *(x.permute(2, 0, 1, 3, 4) for x in (w_BHNCK, u_BHNCV, kd_BHNCK)),
        last_BHN1K[..., 0, :].permute(2, 0, 1, 3),
    )
    o_BHNCV = qE_BHNCK @ S_BHNKV + Aqk_BHNCC @ vnew_BHNCV
    batch, heads, num_chunks = o_BHNCV.shape[:3]
    o_BHTV = o_BHNCV.reshape(batch, heads, num_chunks * chunk, -1)
    o_BTHV = o_BHTV.transpose(1, 2)[:, :length].contiguous()  # the norm and o_proj read [B, T]
    if mask is not None:
        o_BTHV = o_BTHV * mask.to(o_BTHV.dtype)[:, :, None, None]
    return o_BTHV.to(v.dtype), (S_BHKV if output_final_state else None)


# ---------------------------------------------------------------------------------------------
# The layer


@dataclass
class KDACache:
    """Decode-time state of one KDA layer for a batch of sequences.

    conv_q, conv_k: [B, H*K, W-1] and conv_v: [B, HV*V, W-1], the last W-1 pre-conv inputs per
    channel (oldest first; zeros = sequence start), in the model dtype.
    state: [B, HV, K, V] recurrent state, fp32 (fp64 for fp64 models); fla's layout with key
    rows (Moonshot's K3 serving code uses the transposed [B, HV, V, K]).
    """

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    state: Tensor


class GatedRMSNorm(nn.Module):
    """Head-wise RMSNorm with weight, times sigmoid(gate); fp32 inside (fla FusedRMSNormGated)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * x * torch.sigmoid(gate.to(dtype))


def _inverse_softplus_dt(size: int) -> Tensor:
    """Mamba-style dt_bias: softplus^-1 of dt ~ logU(1e-3, 1e-1), dt >= 1e-4."""
    log_dt = torch.rand(size) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3)
    dt = log_dt.exp().clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class KimiDeltaAttention(nn.Module):
    """KDA token mixer (reference sec. 2.1): projections, short convs, gates, KDA, gated norm.

    gate_lower_bound=-5.0 gives the K3 gate; None gives the Kimi-Linear-48B softplus gate.
    full_rank_output_gate=True gives K3's g_proj (D -> HV*V); False the 48B low-rank g_a/g_b.
    Parameter names follow transformers' KimiLinearDeltaAttention / fla's KimiDeltaAttention.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        num_v_heads: int | None = None,
        conv_size: int = 4,
        gate_lower_bound: float | None = -5.0,
        full_rank_output_gate: bool = True,
        norm_eps: float = 1e-5,
        chunk_size: int = 32,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.chunk_size = chunk_size  # of the chunked (training / prefill) form; 32: CPU's fastest
        self.num_v_heads = num_v_heads or num_heads
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} is not a multiple of {num_heads}")
        self.gate_lower_bound = gate_lower_bound
        key_size, value_size = num_heads * head_dim, self.num_v_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, key_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_size, bias=False)
        self.q_conv1d = _depthwise_conv(key_size, conv_size)
        self.k_conv1d = _depthwise_conv(key_size, conv_size)
        self.v_conv1d = _depthwise_conv(value_size, conv_size)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, self.num_v_heads * head_dim, bias=False)
        a_init = torch.zeros(self.num_v_heads)
        if gate_lower_bound is None:
            a_init = torch.empty(self.num_v_heads).uniform_(1, 16).log()
        self.A_log = nn.Parameter(a_init)
        self.dt_bias = nn.Parameter(_inverse_softplus_dt(self.num_v_heads * head_dim))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        if full_rank_output_gate:
            self.g_proj = nn.Linear(hidden_size, value_size, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, value_size, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_size, hidden_size, bias=False)

    def decay(self, x_BTD: Tensor) -> Tensor:
        """Per-channel log decay g [B, T, HV, K] (fp32) from the low-rank forget-gate projection."""
        f_BTHK = self.f_b_proj(self.f_a_proj(x_BTD)).unflatten(-1, (self.num_v_heads, -1))
        if self.gate_lower_bound is None:
            return kda_gate_softplus(f_BTHK, self.A_log, self.dt_bias)
        return kda_gate_lower_bound(f_BTHK, self.A_log, self.dt_bias, self.gate_lower_bound)

    def output_gate(self, x_BTD: Tensor) -> Tensor:
        """Output gate logits [B, T, HV, V] (sigmoid is applied inside o_norm)."""
        if hasattr(self, "g_proj"):
            gate = self.g_proj(x_BTD)
        else:
            gate = self.g_b_proj(self.g_a_proj(x_BTD))
        return gate.unflatten(-1, (self.num_v_heads, self.head_dim))

    def forward(
        self,
        hidden_BTD: Tensor,
        *,
        cache: KDACache | None = None,
        mask: Tensor | None = None,
        use_chunked: bool | None = None,
    ) -> tuple[Tensor, KDACache]:
        """hidden [B, T, D] -> (out [B, T, D], new cache). mask [B, T]: 1 = real token.

        Masked positions are zeroed before the projections (so, with left padding, the conv sees
        the same zeros as at a sequence start), do not touch the state, and output zero.
        use_chunked: None -> chunked for T > 1, the token loop for T == 1 (decode).
        """
        if mask is not None:
            hidden_BTD = hidden_BTD * mask[..., None].to(hidden_BTD.dtype)
        q_BTX, conv_q = short_conv(
            self.q_proj(hidden_BTD), self.q_conv1d.weight, _get(cache, "conv_q")
        )
        k_BTX, conv_k = short_conv(
            self.k_proj(hidden_BTD), self.k_conv1d.weight, _get(cache, "conv_k")
        )
        v_BTX, conv_v = short_conv(
            self.v_proj(hidden_BTD), self.v_conv1d.weight, _get(cache, "conv_v")
        )
        q_BTHK = l2_normalize(q_BTX.unflatten(-1, (self.num_heads, self.head_dim)))
        k_BTHK = l2_normalize(k_BTX.unflatten(-1, (self.num_heads, self.head_dim)))
        v_BTHV = v_BTX.unflatten(-1, (self.num_v_heads, self.head_dim))
        b_BTH = self.b_proj(hidden_BTD)
        beta_BTH = torch.sigmoid(b_BTH.to(torch.promote_types(b_BTH.dtype, torch.float32)))
        if use_chunked is None:
            use_chunked = hidden_BTD.shape[1] > 1
        kda = kda_recurrent
        if use_chunked:
            kda = functools.partial(kda_chunked, chunk_size=self.chunk_size)
        g_BTHK, state = self.decay(hidden_BTD), _get(cache, "state")
        o_BTHV, state = kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=self.head_dim**-0.5,
                            initial_state=state, mask=mask)  # fmt: skip
        o_BTHV = self.o_norm(o_BTHV, self.output_gate(hidden_BTD))
        out_BTD = self.o_proj(o_BTHV.flatten(-2).to(hidden_BTD.dtype))
        return out_BTD, KDACache(conv_q, conv_k, conv_v, state)


def _depthwise_conv(channels: int, width: int) -> nn.Conv1d:
    """Parameter holder for `short_conv` (weight [X, 1, W]); named like fla's ShortConvolution."""
    return nn.Conv1d(channels, channels, width, groups=channels, bias=False)


def _get(cache: KDACache | None, name: str) -> Tensor | None:
    return None if cache is None else getattr(cache, name)
