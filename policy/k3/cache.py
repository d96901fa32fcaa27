"""K3Cache: the decode-time state of a whole K3 model for a batch of sequences.

Letters: B rows (sequences), T new tokens, S slots in use, C >= S slots allocated,
H KDA heads (= value heads), K/V KDA key/value head dims, X = 2*H*K + H*V packed conv channels,
W short-conv width, L = kv_lora_rank + qk_rope_head_dim MLA latent width.

Layout, per layer (lists indexed by the 0-based layer; None where the layer is the other kind):
    conv[i]    [B, W-1, X]   KDA: the last W-1 pre-conv inputs of q | k | v (oldest first; zeros =
                             sequence start), model dtype; time-major (the decode step's layout;
                             `kda` hands the layer its [B, channels, W-1] views)
    state[i]   [B, H, K, V]  KDA: the delta-rule state, fp32 (fp64 for fp64 models)
    latent[i]  [B, C, L]     MLA: [RMSNorm(c_kv) | k_rope] per slot, model dtype; slots >= S unused
    key_mask   [B, C] bool   shared by every MLA layer: slot j of row b holds a real token of b

A KDA layer costs the same at any length: X * (W-1) + H*K*V values per row. An MLA layer stores
L values per slot. Slots are not positions: MLA is NoPE, so a decoded token attends to the set
of its row's real slots and their order does not matter (prefill chunks are appended in order,
so causality inside a chunk holds). That is what makes continuous batching cheap: rows are
dropped (`select`), rows of another cache are added (`extend`; the shorter side's missing slots
are holes with key_mask False) and holes are squeezed out (`compact`), never shifting positions.
MLA buffers grow by doubling (`reserve`), so decoding does not reallocate every step.

The model's forward uses it through `begin` (reserve + key mask of the new tokens), `kda` /
`set_kda`, `mla` (an MLACache-like view whose `append` writes into the buffer) and `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from policy.k3.kda import KDACache
from policy.k3.mla import MLACache


@dataclass(frozen=True, slots=True)
class _MLASlots:
    """Duck-types MLACache for GatedMLA.forward: `append` writes into the K3Cache buffer."""

    cache: K3Cache
    layer: int

    @property
    def length(self) -> int:
        return self.cache.length

    def append(self, latent_BTL: Tensor, mask_BT: Tensor | None = None) -> MLACache:
        del mask_BT  # written once for all layers by K3Cache.begin
        start, end = self.cache.length, self.cache.length + latent_BTL.shape[1]
        buffer_BCL = self.cache.latent[self.layer]
        buffer_BCL[:, start:end] = latent_BTL
        return MLACache(buffer_BCL[:, :end], self.cache.key_mask[:, :end])


class K3Cache:
    """Per-sequence KDA states and conv windows, and MLA latent slots, for every layer."""

    def __init__(self, conv, state, latent, key_mask_BC: Tensor, length: int, splits) -> None:
        self.conv: list[Tensor | None] = conv
        self.state: list[Tensor | None] = state
        self.latent: list[Tensor | None] = latent
        self.key_mask = key_mask_BC
        self.length = length
        self.splits: tuple[int, int, int] = splits  # q | k | v channels of the packed conv

    @classmethod
    def empty(cls, config, batch: int, *, dtype: torch.dtype, device=None, capacity: int = 0):
        """Zero KDA states, no MLA slots used (`capacity` slots preallocated)."""
        la = config.linear_attn_config
        heads, dim, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        splits = (heads * dim, heads * dim, heads * dim)
        state_dtype = torch.promote_types(dtype, torch.float32)
        latent_width = config.kv_lora_rank + config.qk_rope_head_dim
        conv, state, latent = [], [], []
        for kind in config.layer_types:
            kda = kind == "linear_attention"
            if kda:
                conv.append(torch.zeros(batch, width - 1, sum(splits), dtype=dtype, device=device))
                state.append(torch.zeros(batch, heads, dim, dim, dtype=state_dtype, device=device))
                latent.append(None)
            else:
                conv.append(None)
                state.append(None)
                latent.append(
                    torch.zeros(batch, capacity, latent_width, dtype=dtype, device=device)
                )
        key_mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        return cls(conv, state, latent, key_mask, 0, splits)

    @staticmethod
    def row_bytes(config, tokens: int, dtype: torch.dtype) -> int:
        """Bytes one row (one episode) of `tokens` tokens holds: per KDA layer its state
        [H, K, V] (at least fp32) and conv window [W-1, 3*H*K]; per MLA layer R + E latent values
        per token; one key-mask byte per token (benchmarks/cache_bytes.py checks it to the byte)."""
        la = config.linear_attn_config
        heads, dim, width = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        item = torch.finfo(dtype).bits // 8
        state_item = torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
        kda = config.layer_types.count("linear_attention")
        mla = len(config.layer_types) - kda
        per_kda = heads * dim * dim * state_item + (width - 1) * 3 * heads * dim * item
        per_token = mla * (config.kv_lora_rank + config.qk_rope_head_dim) * item + 1
        return kda * per_kda + tokens * per_token

    # -- shape ------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.key_mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.key_mask.shape[1]

    def reserve(self, extra: int) -> None:
        """Make room for `extra` more slots (capacity at least doubles when it grows)."""
        need = self.length + extra
        if need <= self.capacity:
            return
        capacity = max(need, 2 * self.capacity, 16)
        self.key_mask = _grow(self.key_mask, capacity)
        self.latent = [None if x is None else _grow(x, capacity) for x in self.latent]

    # -- the model's forward --------------------------------------------------------------------
    def begin(self, mask_BT: Tensor | None, length: int) -> None:
        """Before a forward of `length` new tokens: room for them and their key mask."""
        self.reserve(length)
        new_BT = self.key_mask[:, self.length : self.length + length]
        if mask_BT is None:
            new_BT.fill_(True)
        else:
            new_BT.copy_(mask_BT)

    def commit(self, length: int) -> None:
        """After the forward: the new tokens' slots are in use."""
        self.length += length

    def kda(self, layer: int) -> KDACache:
        conv_q, conv_k, conv_v = self.conv[layer].transpose(1, 2).split(self.splits, dim=1)
        return KDACache(conv_q, conv_k, conv_v, self.state[layer])

    def set_kda(self, layer: int, new: KDACache) -> None:
        self.conv[layer] = torch.cat([new.conv_q, new.conv_k, new.conv_v], dim=1).transpose(1, 2)
        self.state[layer] = new.state

    def mla(self, layer: int) -> _MLASlots:
        return _MLASlots(self, layer)

    # -- rows ---------------------------------------------------------------------------------
    def select(self, rows_B: Tensor) -> None:
        """Keep only `rows_B` (indices or a bool mask), in that order. In place."""
        pick = _pick_rows(rows_B)
        self.conv = [None if x is None else pick(x) for x in self.conv]
        self.state = [None if x is None else pick(x) for x in self.state]
        self.latent = [None if x is None else pick(x) for x in self.latent]
        self.key_mask = pick(self.key_mask)

    batch_select_indices = select  # the name transformers' caches use (policy/generate.py)

    def extend(self, other: K3Cache) -> None:
        """Append the rows of `other` after ours. In place; slots are aligned at 0."""
        length = max(self.length, other.length)
        capacity = max(length, self.capacity, other.capacity)
        pieces = [_grow(self.key_mask, capacity), _grow(other.key_mask, capacity)]
        self.key_mask = torch.cat(pieces)
        for i, (mine, theirs) in enumerate(zip(self.latent, other.latent, strict=True)):
            if mine is not None:
                self.latent[i] = torch.cat([_grow(mine, capacity), _grow(theirs, capacity)])
        for store, extra in ((self.conv, other.conv), (self.state, other.state)):
            for i, (mine, theirs) in enumerate(zip(store, extra, strict=True)):
                if mine is not None:
                    store[i] = torch.cat([mine, theirs])
        self.length = length

    def compact(self) -> int:
        """Squeeze out holes: each row's real slots move to the front (order kept). Returns S."""
        used_BS = self.key_mask[:, : self.length]
        length = int(used_BS.sum(1).max()) if self.num_rows else 0
        if length == self.length:
            return length
        order_BS = torch.sort((~used_BS).to(torch.int8), dim=1, stable=True).indices[:, :length]
        for latent in self.latent:
            if latent is not None:
                index_BSL = order_BS[..., None].expand(-1, -1, latent.shape[-1])
                moved_BSL = latent[:, : self.length].gather(1, index_BSL)
                latent[:, :length] = moved_BSL
                latent[:, length : self.length] = 0
        moved_BS = used_BS.gather(1, order_BS)
        self.key_mask[:, :length] = moved_BS
        self.key_mask[:, length : self.length] = False
        self.length = length
        return length

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        """Bytes in use (slots < S), by kind, over all rows; `allocated` counts spare capacity."""

        def size(tensors, used=None):
            total = 0
            for x in tensors:
                if x is not None:
                    part = x if used is None else x[:, :used]
                    total += part.numel() * part.element_size()
            return total

        out = {
            "kda_state": size(self.state),
            "kda_conv": size(self.conv),
            "mla_latent": size(self.latent, self.length),
            "key_mask": self.key_mask[:, : self.length].numel(),
        }
        out["total"] = sum(out.values())
        out["allocated"] = size(self.state) + size(self.conv) + size(self.latent)
        out["allocated"] += self.key_mask.numel()
        return out


def _grow(x: Tensor, capacity: int) -> Tensor:
    """x [B, C_old, ...] -> [B, capacity, ...] with the old slots copied and zeros after."""
    if x.shape[1] == capacity:
        return x
    out = x.new_zeros(x.shape[0], capacity, *x.shape[2:])
    out[:, : x.shape[1]] = x
    return out


def _pick_rows(rows_B: Tensor):
    if rows_B.dtype == torch.bool:
        rows_B = rows_B.nonzero()[:, 0]

    def pick(x: Tensor) -> Tensor:
        return x.index_select(0, rows_B.to(x.device))

    return pick
