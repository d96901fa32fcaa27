"""Gated Multi-head Latent Attention with NoPE (Kimi Linear / Kimi K3 full-attention layers).

Reference: ../shared/reference/k3-architecture.md sec. 3 (DeepSeek-V2/V3 MLA; transformers
`KimiLinearAttention`; K3 output gate). No rotary embedding anywhere: the "rope" slice of q and
the shared k_rope still exist and take part in the dot product, they are just never rotated.

    q            = W_q x                     or  W_qb RMSNorm(W_qa x)      -> [q_nope | q_rope]
    [c_kv | k_r] = W_kva x;  c_kv <- RMSNorm(c_kv)                         (cached: R + E per token)
    [k_nope | v] = W_kvb c_kv  per head;  k = [k_nope | k_r shared by all heads]
    o            = softmax((q . k) * (Dn + E)^-0.5 + causal/padding mask) @ v
    y            = W_o (o * sigmoid(W_g x))                                 (K3 gate, full rank)

Two forms share the weights: `naive` materialises per-head k and v; `absorbed` folds W_kvb into
the query and the output and attends in the latent space (decode, and any tokens after a
cache: `choose_form`). Each has a dense reference (`attend_naive`, `attend_absorbed`: full
[B, H, T, S] scores and [B, T, S] mask) and the blockwise online-softmax `attend` (flash.py:
O(T + S) memory in forward and backward), which `forward` uses unless dense=True.

The cache is one latent tensor (`MLACache`, appended by concatenation) or a tuple of latent
chunks (`ChunkedLatents`: a segmented learner's earlier segments, segments.py), which the
absorbed `attend` reads in place, chunk by chunk (flash.py), and only the naive form and the
dense references concatenate.

Letters:
    B batch, T new tokens, S cached + new tokens (keys), H heads, D hidden size,
    Dn = qk_nope_head_dim, E = qk_rope_head_dim, Q = Dn + E, Dv = v_head_dim,
    R = kv_lora_rank, L = R + E latent width per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from policy.k3.flash import BLOCK_K, BLOCK_Q, flash_attention
from policy.k3.precision import full_precision


@dataclass
class MLACache:
    """Latent KV cache of one MLA layer: exactly R + E values per token.

    latent: [B, S, R + E] = [RMSNorm(c_kv) | k_rope] per token (what the absorbed path reads).
    key_mask: [B, S] bool, False for padding positions (left padding), never attended to.
    """

    latent: Tensor
    key_mask: Tensor

    @property
    def length(self) -> int:
        return self.latent.shape[1]

    def append(self, latent_BTL: Tensor, mask_BT: Tensor | None = None) -> MLACache:
        """Return a new cache with T tokens appended (mask None = all real)."""
        if mask_BT is None:
            mask_BT = torch.ones(latent_BTL.shape[:2], dtype=torch.bool, device=latent_BTL.device)
        latent = torch.cat([self.latent, latent_BTL.to(self.latent.dtype)], dim=1)
        return MLACache(latent, torch.cat([self.key_mask, mask_BT.bool()], dim=1))

    @property
    def chunks(self) -> tuple[Tensor]:
        """The latents as `attend` takes them: one chunk [B, S, L]."""
        return (self.latent,)


@dataclass
class ChunkedLatents:
    """An MLA cache kept as chunks along S, never concatenated into one growing copy.

    chunks: latents [B, S_i, L] in order (segments.py: one per segment, each its own autograd
    node); key_mask: [B, S] bool over all of them (False = padding).
    """

    chunks: tuple[Tensor, ...]
    key_mask: Tensor

    @property
    def length(self) -> int:
        return sum(chunk.shape[1] for chunk in self.chunks)

    @property
    def latent(self) -> Tensor:
        """[B, S, L], concatenated (a copy): for the dense references and the naive form."""
        return torch.cat(self.chunks, dim=1)

    def append(self, latent_BTL: Tensor, mask_BT: Tensor | None = None) -> ChunkedLatents:
        """Return a new cache with the T tokens as one more chunk (mask None = all real)."""
        if mask_BT is None:
            mask_BT = torch.ones(latent_BTL.shape[:2], dtype=torch.bool, device=latent_BTL.device)
        key_mask = torch.cat([self.key_mask, mask_BT.bool()], dim=1)
        return ChunkedLatents((*self.chunks, latent_BTL), key_mask)


class GatedMLA(nn.Module):
    """MLA with NoPE and K3's sigmoid output gate; parameter names follow transformers/DeepSeek."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        output_gate: bool = True,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scaling = self.qk_head_dim**-0.5
        q_size = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        if output_gate:
            self.g_proj = nn.Linear(hidden_size, num_heads * v_head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.block_q, self.block_k = BLOCK_Q, BLOCK_K  # blocks of `attend` (flash.py)
        self.fused_max_scores = FUSED_MAX_SCORES  # `attend`'s limit for torch's attention
        self.absorb_past = True  # tokens after a cache attend over the latents (`choose_form`)

    def query(self, x_BTD: Tensor) -> Tensor:
        """Per-head queries [B, T, H, Q] (no rotation)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        return q.unflatten(-1, (self.num_heads, self.qk_head_dim))

    def latent(self, x_BTD: Tensor) -> Tensor:
        """What the cache stores per token: [RMSNorm(c_kv) | k_rope], [B, T, R + E]."""
        c_kv_BTR, k_rope_BTE = self.kv_a_proj_with_mqa(x_BTD).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        return torch.cat([self.kv_a_layernorm(c_kv_BTR), k_rope_BTE], dim=-1)

    def expand(self, latent_BSL: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys [B, S, H, Q] (k_rope shared by the heads) and values [B, S, H, Dv]."""
        c_kv_BSR, k_rope_BSE = latent_BSL.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        kv_BSHX = self.kv_b_proj(c_kv_BSR).unflatten(-1, (self.num_heads, -1))
        k_nope_BSHN, v_BSHV = kv_BSHX.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_rope_BSHE = k_rope_BSE[:, :, None, :].expand(-1, -1, self.num_heads, -1)
        return torch.cat([k_nope_BSHN, k_rope_BSHE], dim=-1), v_BSHV

    def absorb(self, q_BTHQ: Tensor) -> tuple[Tensor, Tensor]:
        """Latent queries [B, T, H, L] = [q_nope W_UK | q_rope] (q_lat . c_kv == q_nope . k_nope)
        and W_UV [H, Dv, R] (o = W_UV o_lat)."""
        q_nope_BTHN, q_rope_BTHE = q_BTHQ.split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        w_HXR = self.kv_b_proj.weight.unflatten(0, (self.num_heads, -1))
        w_uk_HNR, w_uv_HVR = w_HXR.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_lat_BTHR = torch.einsum("bthn,hnr->bthr", q_nope_BTHN, w_uk_HNR)
        return torch.cat([q_lat_BTHR, q_rope_BTHE], dim=-1), w_uv_HVR

    def attend_naive(self, q_BTHQ: Tensor, latent_BSL: Tensor, allowed_BTS: Tensor) -> Tensor:
        """Reference path: expand the latent to per-head keys and values. -> [B, T, H, Dv]."""
        k_BSHQ, v_BSHV = self.expand(latent_BSL)
        scores_BHTS = torch.einsum("bthq,bshq->bhts", q_BTHQ, k_BSHQ) * self.scaling
        p_BHTS = _masked_softmax(scores_BHTS, allowed_BTS).to(v_BSHV.dtype)
        return torch.einsum("bhts,bshv->bthv", p_BHTS, v_BSHV)

    def attend_absorbed(self, q_BTHQ: Tensor, latent_BSL: Tensor, allowed_BTS: Tensor) -> Tensor:
        """Dense latent path: W_UK folded into q, W_UV applied after attending over c_kv.

        -> [B, T, H, Dv]. Same weights and result as `attend_naive` (tested to 1e-10 in fp64).
        """
        q_BTHL, w_uv_HVR = self.absorb(q_BTHQ)
        scores_BHTS = torch.einsum("bthl,bsl->bhts", q_BTHL, latent_BSL)
        p_BHTS = _masked_softmax(scores_BHTS * self.scaling, allowed_BTS).to(latent_BSL.dtype)
        o_lat_BTHR = torch.einsum("bhts,bsr->bthr", p_BHTS, latent_BSL[..., : self.kv_lora_rank])
        return torch.einsum("bthr,hvr->bthv", o_lat_BTHR, w_uv_HVR)

    def attend(
        self,
        q_BTHQ: Tensor,
        latent_BSL: Tensor | tuple[Tensor, ...],
        key_mask_BS: Tensor,
        *,
        past: int,
        absorbed: bool,
    ) -> Tensor:
        """Fast path: `attend_absorbed` (absorbed) or `attend_naive` by blocks (flash.py), with
        no [B, H, T, S] scores and no [B, T, S] mask; O(T + S) memory in forward and backward.
        Short sequences without a cache and with padding on the right only (naive form,
        B * H * T * S up to FUSED_MAX_SCORES: SFT and learner batches) go through
        `fused_causal_attention` instead.

        latent: [B, S, L] or its chunks [B, S_i, L] along S (ChunkedLatents), which the absorbed
        form reads in place (the naive form concatenates them). Query i sits at position
        past + i; key_mask [B, S] False = padding. -> [B, T, H, Dv] (zero for a query that sees
        no key).
        """
        chunks = (latent_BSL,) if isinstance(latent_BSL, Tensor) else tuple(latent_BSL)
        blocks = {"scale": self.scaling, "offset": past, "key_mask_BS": key_mask_BS,
                  "block_q": self.block_q, "block_k": self.block_k}  # fmt: skip
        if absorbed:
            q_BTHL, w_uv_HVR = self.absorb(q_BTHQ)
            c_kv = tuple(chunk_BSL[..., : self.kv_lora_rank] for chunk_BSL in chunks)  # [B, S_i, R]
            o_lat_BTHR = flash_attention(q_BTHL, chunks, c_kv, **blocks)
            return torch.einsum("bthr,hvr->bthv", o_lat_BTHR, w_uv_HVR)
        latent_BSL = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)
        k_BSHQ, v_BSHV = self.expand(latent_BSL)
        if _fits_fused_causal(q_BTHQ, k_BSHQ, key_mask_BS, past, self.fused_max_scores):
            o_BTHV = fused_causal_attention(q_BTHQ, k_BSHQ, v_BSHV, scale=self.scaling)
            return o_BTHV * key_mask_BS[:, :, None, None].to(o_BTHV.dtype)  # padding queries: 0
        return flash_attention(q_BTHQ, k_BSHQ, v_BSHV, **blocks)

    def choose_form(self, length: int, past: int) -> bool:
        """Absorbed (True) or naive: absorbed for one token (decode) and, while absorb_past,
        for tokens after a cache (a later training segment, a context rank's shard, a prefill
        chunk): attending over the latents, no per-head keys or values of the S earlier tokens
        are made, and the blockwise backward saves only the latents (L values per key instead
        of H * (Q + Dv)). Naive for a sequence from its start, where torch's fused attention
        is fastest. The forms differ in work: absorbed costs H * (L + R) multiply-adds per
        query-key pair, naive H * (Q + Dv) plus H * R * (Dn + Dv) per key to expand (FLOPs at
        k3-tiny: absorbed fewer, though measured no faster, docs/benchmarks.md; full K3: about
        2.4x naive's at 1,024-token segments, 3.1x at 4,096, for 1,152 instead of 87,168 bytes
        saved per earlier key, docs/scale.md)."""
        return length == 1 or (self.absorb_past and past > 0)

    def forward(
        self,
        hidden_BTD: Tensor,
        *,
        cache: MLACache | ChunkedLatents | None = None,
        mask: Tensor | None = None,
        absorbed: bool | None = None,
        dense: bool = False,
    ) -> tuple[Tensor, MLACache | ChunkedLatents]:
        """hidden [B, T, D] -> (out [B, T, D], cache with the T new tokens appended).

        mask [B, T] (1 = real token) marks padding among the new tokens; padded keys are never
        attended to and padded queries output zero. The new tokens sit at positions
        cache.length .. cache.length + T - 1 for the causal mask. absorbed: None ->
        `choose_form` (absorbed after a cache, naive from a sequence's start). dense: the
        reference paths over the full [B, H, T, S] scores (`attend_naive` / `attend_absorbed`)
        instead of the blockwise `attend`.
        """
        length = hidden_BTD.shape[1]
        cache = self.empty_cache(hidden_BTD) if cache is None else cache
        past = cache.length
        cache = cache.append(self.latent(hidden_BTD), mask)
        if absorbed is None:
            absorbed = self.choose_form(length, past)
        q_BTHQ = self.query(hidden_BTD)
        if dense:
            rows_T = torch.arange(past, past + length, device=hidden_BTD.device)
            causal_TS = torch.arange(cache.length, device=rows_T.device)[None, :] <= rows_T[:, None]
            allowed_BTS = causal_TS[None] & cache.key_mask[:, None, :]
            attend = self.attend_absorbed if absorbed else self.attend_naive
            o_BTHV = attend(q_BTHQ, cache.latent, allowed_BTS)
        else:
            o_BTHV = self.attend(q_BTHQ, cache.chunks, cache.key_mask, past=past, absorbed=absorbed)
        return self.output(o_BTHV, hidden_BTD, mask), cache

    def output(self, o_BTHV: Tensor, x_BTD: Tensor, mask_BT: Tensor | None) -> Tensor:
        """Attention output [B, T, H, Dv] -> [B, T, D]: padded queries zeroed, K3's sigmoid
        gate of the layer input x, o_proj."""
        if mask_BT is not None:
            o_BTHV = o_BTHV * mask_BT.to(o_BTHV.dtype)[:, :, None, None]
        if hasattr(self, "g_proj"):
            gate_BTHV = torch.sigmoid(self.g_proj(x_BTD)).unflatten(-1, (self.num_heads, -1))
            o_BTHV = o_BTHV * gate_BTHV
        return self.o_proj(o_BTHV.flatten(-2))

    def empty_cache(self, hidden_BTD: Tensor) -> MLACache:
        """No latents yet (a forward from the sequence's start)."""
        batch = hidden_BTD.shape[0]
        empty = hidden_BTD.new_zeros(batch, 0, self.kv_lora_rank + self.qk_rope_head_dim)
        return MLACache(empty, torch.ones(batch, 0, dtype=torch.bool, device=empty.device))

    def forward_at(
        self,
        hidden_BTD: Tensor,
        positions: list[int],
        *,
        cache: MLACache | ChunkedLatents | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, MLACache | ChunkedLatents]:
        """`forward`'s output at `positions` only (sorted indices into the T new tokens) ->
        (out [B, U, D], cache with all T new tokens appended). Every token's latent is cached
        (the keys of later queries), but only the U queries attend, each over the keys up to
        its own position: run by run of consecutive positions, in the absorbed form. What a
        loss on a few positions needs of the last token-mixing layer (policy/k3/modeling.py
        `K3Model.forward(positions=...)`): O(U * S) attention instead of O(T * S). Equal to
        `forward` at those positions up to rounding: in float32 / float64; under bf16 the
        absorbed form rounds differently from the naive one a first segment would use."""
        cache = self.empty_cache(hidden_BTD) if cache is None else cache
        past = cache.length
        cache = cache.append(self.latent(hidden_BTD), mask)
        index_U = torch.tensor(positions, dtype=torch.long, device=hidden_BTD.device)
        x_BUD = hidden_BTD[:, index_U]
        q_BUHQ = self.query(x_BUD)
        outs, start = [], 0
        for stop in _run_ends(positions):
            end = past + positions[stop - 1] + 1  # keys up to the run's last query
            o_BRHV = self.attend(
                q_BUHQ[:, start:stop], _first_keys(cache.chunks, end), cache.key_mask[:, :end],
                past=past + positions[start], absorbed=True,
            )  # fmt: skip
            outs.append(o_BRHV)
            start = stop
        o_BUHV = (
            torch.cat(outs, dim=1) if outs else q_BUHQ.new_zeros(*q_BUHQ.shape[:3], self.v_head_dim)
        )
        return self.output(o_BUHV, x_BUD, None if mask is None else mask[:, index_U]), cache


def _first_keys(chunks: tuple[Tensor, ...], end: int) -> tuple[Tensor, ...]:
    """The first `end` keys of the latent chunks [B, S_i, L], as views (no copy)."""
    out, first = [], 0
    for chunk_BSL in chunks:
        if first >= end:
            break
        out.append(chunk_BSL[:, : end - first])
        first += chunk_BSL.shape[1]
    return tuple(out)


def _run_ends(positions: list[int]) -> list[int]:
    """Exclusive ends of the runs of consecutive values in sorted `positions`."""
    ends = [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    return [*ends, len(positions)] if positions else []


FUSED_MAX_SCORES = 1 << 24
"""Largest B * H * T * S that `attend` hands to torch's attention (a few short sequences, such
as an SFT or learner batch: at most 64 MiB of float32 scores should torch take its math path);
above it the blockwise path keeps memory O(T + S)."""


def _fits_fused_causal(
    q_BTHQ: Tensor, k_BSHQ: Tensor, key_mask_BS: Tensor, past: int, max_scores: int
) -> bool:
    """Whether `attend` can use `fused_causal_attention`: no cache before these tokens, padding
    on the right only (a causal query never reaches a key after it, so only padding queries see
    padding keys, and their outputs are zeroed), and few enough scores that even an unfused
    backend stays small."""
    batch, length, heads, _ = q_BTHQ.shape
    if past != 0 or k_BSHQ.shape[1] != length or batch * heads * length * length > max_scores:
        return False
    return not bool((key_mask_BS[:, 1:] & ~key_mask_BS[:, :-1]).any())  # no pad before a token


@full_precision
def fused_causal_attention(q_BTHQ: Tensor, k_BSHQ: Tensor, v_BSHV: Tensor, *, scale: float):
    """Causal softmax(scale q . k) v through torch's scaled_dot_product_attention, in (at least)
    float32 (autocast off), for T == S: the fast path of `attend` for short sequences. On a CPU
    torch takes its flash kernel when the q/k and v widths are equal (k3-tiny: 31 -> 16 ms for
    the MLA layer's forward + backward at [16, 192]) and its math path (a [B, H, T, S] score
    tensor, hence FUSED_MAX_SCORES) otherwise. Every query sees every key up to its own
    position: the caller zeroes padding queries. Same result as `attend_naive` (tested in
    float64 and float32, outputs and gradients). -> [B, T, H, Dv] in q's dtype."""
    dtype = torch.promote_types(q_BTHQ.dtype, torch.float32)
    q_BHTQ, k_BHSQ, v_BHSV = (x.to(dtype).transpose(1, 2) for x in (q_BTHQ, k_BSHQ, v_BSHV))
    o_BHTV = torch.nn.functional.scaled_dot_product_attention(
        q_BHTQ, k_BHSQ, v_BHSV, is_causal=True, scale=scale
    )
    return o_BHTV.transpose(1, 2).to(q_BTHQ.dtype)


@full_precision
def _masked_softmax(scores_BHTS: Tensor, allowed_BTS: Tensor) -> Tensor:
    """Softmax over keys in (at least) fp32.

    Disallowed keys get the dtype's min, not -inf, so a fully masked row (a padded query) stays
    finite, in value and gradient; the caller zeroes its output.
    """
    scores = scores_BHTS.to(torch.promote_types(scores_BHTS.dtype, torch.float32))
    scores = scores.masked_fill(~allowed_BTS[:, None], torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)
