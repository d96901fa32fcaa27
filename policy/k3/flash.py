"""Attention without the score matrix: blockwise online softmax (flash-attention style) on CPU.

`flash_attention` gives softmax(scale * q . k + mask) @ v for MLA (mla.py, decode.py) while no
tensor larger than one query block x one key block of scores ever exists, in the forward and in
the backward: memory is O(T + S) instead of O(T * S).

    forward, per query block: for each key block j (left of the causal edge only)
        s   = scale * q k_j^T, disallowed keys set to the dtype's min (as mla._masked_softmax)
        m'  = max(m, rowmax s);  l = l e^(m - m') + rowsum e^(s - m');
        acc = acc e^(m - m') + e^(s - m') v_j;  m = m'
    o = acc / l, lse = m + log l (saved with q, k, v, o: all O(T) or O(S))
    backward (FlashAttention-2), recomputing each block: P = e^(s - lse), D = rowsum(dO * o),
        dv_j += P^T dO;  dS = P * (dO v_j^T - D);  dq += scale dS k_j;  dk_j += scale dS^T q

The mask is built per block from positions: query i sits at position offset + i and may see key
j iff j <= offset + i and key_mask[b, j]. A query that sees no key (a padding query) outputs
zero, with zero gradient.

Keys and values are per head ([B, S, H, K], [B, S, H, V]: MLA's naive form) or shared by every
head ([B, S, K], [B, S, V]: the absorbed form over the latent cache; v may be a slice of k).
Either may come as a sequence of chunks along S (the same lengths for k and v: the latents of a
segmented learner's earlier segments, policy/k3/segments.py), attended as if concatenated with
no copy made: each chunk is cut into its own key blocks (none straddles two chunks) and gets its
own gradient. Where every v chunk is the first V columns of its k chunk (the same memory: the
absorbed form's c_kv, the head of the latent), the backward adds dv into dk's first V columns:
one fp32 gradient buffer per chunk instead of two, and none for autograd to scatter back.
Block math runs in (at least) float32; the output has q's dtype.

Letters: B batch, T queries, S keys, H heads, K query/key width, V value width, I query block,
J key block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from policy.k3.precision import full_precision

BLOCK_Q = 256  # query rows per block
BLOCK_K = 512  # keys per block; one block of scores is B * H * BLOCK_Q * BLOCK_K values


def flash_attention(
    q_BTHK: Tensor,
    k_BSX: Tensor | Sequence[Tensor],
    v_BSX: Tensor | Sequence[Tensor],
    *,
    scale: float,
    offset: int = 0,
    key_mask_BS: Tensor | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> Tensor:
    """softmax(scale q k^T + causal/key mask) v -> [B, T, H, V] (dtype of q).

    k_BSX is [B, S, K] (shared) or [B, S, H, K]; v_BSX likewise [B, S, V] or [B, S, H, V]; or
    each a sequence of chunks [B, S_i, ...] along S (the same S_i for k and v), read in place.
    offset: position of the first query (keys sit at 0 .. S-1); key_mask_BS: False = padding.
    Differentiable in q, k and v, each chunk its own gradient (recomputing backward, O(T + S)
    saved).
    """
    ks = (k_BSX,) if isinstance(k_BSX, Tensor) else tuple(k_BSX)
    vs = (v_BSX,) if isinstance(v_BSX, Tensor) else tuple(v_BSX)
    sizes = tuple(k.shape[1] for k in ks)
    assert sizes == tuple(v.shape[1] for v in vs), "k and v chunks of the same lengths"
    if key_mask_BS is not None and bool(key_mask_BS.all()):
        key_mask_BS = None
    shape = _Shape(offset, block_q, block_k, ks[0].dim() == 3, sizes, _prefix_width(ks, vs))
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q_BTHK, *ks, *vs)):
        values = () if shape.prefix else vs  # prefix values: read from the keys inside
        return _FlashAttention.apply(key_mask_BS, scale, shape, q_BTHK, *ks, *values)
    return _forward(q_BTHK, ks, vs, key_mask_BS, scale, shape)[0]


def _prefix_width(ks: tuple[Tensor, ...], vs: tuple[Tensor, ...]) -> int | None:
    """V if every v chunk is the first V columns of its k chunk (shared keys [B, S, K], the
    same memory, dtype and strides), else None."""
    width = vs[0].shape[-1]
    for k, v in zip(ks, vs, strict=True):
        same = k.dim() == v.dim() == 3 and v.data_ptr() == k.data_ptr() and v.dtype == k.dtype
        if not (same and v.stride() == k.stride() and v.shape == (*k.shape[:-1], width)):
            return None
    return width if width < ks[0].shape[-1] else None


class _Shape:
    """How the blocks are cut (the key chunks' lengths `sizes`) and which einsum layout (shared
    or per-head keys) applies."""

    def __init__(
        self,
        offset: int,
        block_q: int,
        block_k: int,
        shared: bool,
        sizes: tuple[int, ...],
        prefix: int | None = None,
    ) -> None:
        self.offset, self.block_q, self.block_k, self.sizes = offset, block_q, block_k, sizes
        self.prefix = prefix  # values = the keys' first `prefix` columns (_prefix_width)
        ks = "s" if shared else "sh"
        self.qk = f"bthk,b{ks}k->bths"  # scores [B, I, H, J]
        self.pv = f"bths,b{ks}v->bthv"
        self.dv = f"bths,bthv->b{ks}v"
        self.dp = f"bthv,b{ks}v->bths"
        self.dq = f"bths,b{ks}k->bthk"
        self.dk = f"bths,bthk->b{ks}k"

    def blocks(self, length: int):
        """(t0, t1, [_Keys, ...]) per query block; key blocks right of the causal edge of the
        block's last query are skipped (all of their scores are masked)."""
        for t0 in range(0, length, self.block_q):
            t1 = min(t0 + self.block_q, length)
            yield t0, t1, list(self.key_blocks(self.offset + t1))

    def key_blocks(self, end: int):
        """The key blocks of the keys before `end`, chunk by chunk."""
        first = 0  # position of the chunk's first key
        for chunk, size in enumerate(self.sizes):
            stop = min(size, end - first)  # keys of this chunk before `end`
            for a in range(0, stop, self.block_k):
                yield _Keys(chunk, a, min(a + self.block_k, stop), first + a)
            first += size


class _Keys(NamedTuple):
    """One key block: keys a..b-1 of chunk `chunk`, at positions s0 .. s0 + b - a - 1."""

    chunk: int
    a: int
    b: int
    s0: int

    @property
    def s1(self) -> int:
        return self.s0 + self.b - self.a

    def of(self, chunks_BSX) -> Tensor:
        """The block's slice of its chunk, [B, J, ...]."""
        return chunks_BSX[self.chunk][:, self.a : self.b]


def _blocked(shape: _Shape, key_mask_BS, t0: int, t1: int, s0: int, s1: int, device):
    """[B or 1, I, 1, J] True where query t0..t1-1 must not see key s0..s1-1; None if none."""
    blocked = None
    if s1 - 1 > shape.offset + t0:  # the block crosses the causal edge
        rows_I1 = torch.arange(shape.offset + t0, shape.offset + t1, device=device)[:, None]
        blocked = torch.arange(s0, s1, device=device)[None, :] > rows_I1
        blocked = blocked[None, :, None, :]
    if key_mask_BS is not None:
        pad_B11J = ~key_mask_BS[:, None, None, s0:s1]
        blocked = pad_B11J if blocked is None else blocked | pad_B11J
    return blocked


def _scores(shape, q_BIHK, ks, key_mask_BS, t0, t1, keys: _Keys, scale, acc) -> Tensor:
    """Masked scaled scores of one block, [B, I, H, J] in the accumulation dtype."""
    s_BIHJ = torch.einsum(shape.qk, q_BIHK, keys.of(ks).to(acc)) * scale
    blocked = _blocked(shape, key_mask_BS, t0, t1, keys.s0, keys.s1, q_BIHK.device)
    if blocked is not None:
        s_BIHJ = s_BIHJ.masked_fill_(blocked, torch.finfo(acc).min)
    return s_BIHJ


@full_precision
def _forward(q_BTHK, ks, vs, key_mask_BS, scale, shape: _Shape):
    """ks, vs: the key and value chunks -> (o [B, T, H, V] in q's dtype, lse [B, T, H] in acc
    dtype; +inf for rows seeing no key, so that the recomputed probabilities of those rows are
    0 in the backward)."""
    batch, length, heads, _ = q_BTHK.shape
    acc = torch.promote_types(q_BTHK.dtype, torch.float32)
    floor = torch.finfo(acc).min
    o_BTHV = q_BTHK.new_empty(batch, length, heads, vs[0].shape[-1])
    lse_BTH = torch.empty(batch, length, heads, dtype=acc, device=q_BTHK.device)
    for t0, t1, key_blocks in shape.blocks(length):
        q_BIHK = q_BTHK[:, t0:t1].to(acc)
        m_BIH = torch.full(q_BIHK.shape[:3], floor, dtype=acc, device=q_BTHK.device)
        l_BIH = torch.zeros_like(m_BIH)
        acc_BIHV = q_BIHK.new_zeros(*q_BIHK.shape[:3], vs[0].shape[-1])
        for keys in key_blocks:
            s_BIHJ = _scores(shape, q_BIHK, ks, key_mask_BS, t0, t1, keys, scale, acc)
            m_new_BIH = torch.maximum(m_BIH, s_BIHJ.amax(-1))
            p_BIHJ = torch.exp(s_BIHJ.sub_(m_new_BIH[..., None]))
            alpha_BIH = torch.exp(m_BIH - m_new_BIH)
            l_BIH = l_BIH * alpha_BIH + p_BIHJ.sum(-1)
            pv_BIHV = torch.einsum(shape.pv, p_BIHJ, keys.of(vs).to(acc))
            acc_BIHV = acc_BIHV.mul_(alpha_BIH[..., None]).add_(pv_BIHV)
            m_BIH = m_new_BIH
        seen_BIH = m_BIH > floor  # False: every key of the row was masked
        o_BTHV[:, t0:t1] = torch.where(seen_BIH[..., None], acc_BIHV / l_BIH[..., None], 0.0)
        lse_BTH[:, t0:t1] = torch.where(seen_BIH, m_BIH + torch.log(l_BIH), torch.inf)
    return o_BTHV, lse_BTH


@full_precision
def _backward(q_BTHK, ks, vs, key_mask_BS, scale, shape, o_BTHV, lse_BTH, do_BTHV):
    """Recomputing backward -> (dq, dk per chunk, dv per chunk) in the dtypes of q, k, v."""
    acc = lse_BTH.dtype
    do_BTHV = do_BTHV.to(acc)
    delta_BTH = (do_BTHV * o_BTHV.to(acc)).sum(-1)
    dq_BTHK = torch.zeros_like(q_BTHK, dtype=acc)
    dks = [torch.zeros_like(k_BSX, dtype=acc) for k_BSX in ks]
    if shape.prefix:  # dv accumulates into dk's first columns (views)
        dvs = [dk_BSX[..., : shape.prefix] for dk_BSX in dks]
    else:
        dvs = [torch.zeros_like(v_BSX, dtype=acc) for v_BSX in vs]
    for t0, t1, key_blocks in shape.blocks(q_BTHK.shape[1]):
        q_BIHK, do_BIHV = q_BTHK[:, t0:t1].to(acc), do_BTHV[:, t0:t1]
        lse_BIH1, delta_BIH1 = lse_BTH[:, t0:t1, :, None], delta_BTH[:, t0:t1, :, None]
        for keys in key_blocks:
            s_BIHJ = _scores(shape, q_BIHK, ks, key_mask_BS, t0, t1, keys, scale, acc)
            p_BIHJ = torch.exp(s_BIHJ.sub_(lse_BIH1))
            keys.of(dvs).add_(torch.einsum(shape.dv, p_BIHJ, do_BIHV))
            dp_BIHJ = torch.einsum(shape.dp, do_BIHV, keys.of(vs).to(acc))
            ds_BIHJ = p_BIHJ.mul_(dp_BIHJ.sub_(delta_BIH1)).mul_(scale)
            dq_BTHK[:, t0:t1] += torch.einsum(shape.dq, ds_BIHJ, keys.of(ks).to(acc))
            keys.of(dks).add_(torch.einsum(shape.dk, ds_BIHJ, q_BIHK))
    dks = tuple(dk.to(k.dtype) for dk, k in zip(dks, ks, strict=True))
    dvs = () if shape.prefix else tuple(dv.to(v.dtype) for dv, v in zip(dvs, vs, strict=True))
    return dq_BTHK.to(q_BTHK.dtype), dks, dvs


class _FlashAttention(torch.autograd.Function):
    """Saves q, the k and v chunks, o and lse (no block intermediates); the backward recomputes
    the blocks. Inputs: key_mask, scale, shape, q, the k chunks, then the v chunks (each chunk
    its own argument, so that autograd hands each its own gradient; none with `shape.prefix`:
    the values are the keys' first columns, and their gradient goes into the keys')."""

    @staticmethod
    def forward(ctx, key_mask_BS, scale, shape: _Shape, q_BTHK, *chunks):
        ks, vs = _split(chunks, shape)
        o_BTHV, lse_BTH = _forward(q_BTHK, ks, vs, key_mask_BS, scale, shape)
        ctx.save_for_backward(q_BTHK, *chunks, o_BTHV, lse_BTH)
        ctx.key_mask_BS, ctx.scale, ctx.shape = key_mask_BS, scale, shape
        return o_BTHV

    @staticmethod
    def backward(ctx, do_BTHV):
        q_BTHK, *chunks, o_BTHV, lse_BTH = ctx.saved_tensors
        ks, vs = _split(chunks, ctx.shape)
        dq, dks, dvs = _backward(
            q_BTHK, ks, vs, ctx.key_mask_BS, ctx.scale, ctx.shape, o_BTHV, lse_BTH, do_BTHV
        )
        return (None, None, None, dq, *dks, *dvs)


def _split(chunks, shape: _Shape) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """(k chunks, v chunks) from _FlashAttention's chunk arguments."""
    ks = tuple(chunks[: len(shape.sizes)])
    if shape.prefix:
        return ks, tuple(k_BSX[..., : shape.prefix] for k_BSX in ks)
    return ks, tuple(chunks[len(shape.sizes) :])
