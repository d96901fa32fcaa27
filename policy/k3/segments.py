"""K3's decoder over a long sequence in segments, for training on long trajectories.

`segmented_hidden` gives the same final hidden states as one `K3Model.forward` over [B, T] (and,
through autograd, the same gradients), but runs the decoder over T in segments of `segment`
tokens. Between segments only the token-mixing state crosses the boundary (the carry):

    KDA layer i:  the delta-rule state [B, HV, K, V] and the short-conv tails (KDACache)
    MLA layer i:  the latents [B, T_s, L] of every earlier segment, one chunk per segment
                  (kept as a tuple of chunks, never re-concatenated into a growing copy)
    shared:       the key mask chunks [B, T_s] of the earlier segments

Everything else is per token: AttnRes mixes sources over depth at one position only, the MoE
routes each token alone, the norms are per position. Routing replay is sliced per segment.

With gradients enabled each segment is one activation checkpoint (non-reentrant): after the
forward only the segment boundaries stay alive (the carry above, the segment's input ids and
mask, its output hidden states), and the backward recomputes one segment at a time. Peak memory
is about one segment's activations plus O(T) for the latents and hidden states, instead of all
T positions' activations. Segment s's MLA layers attend over the earlier latent chunks in place
(mla.py `ChunkedLatents`: the absorbed form's blockwise attention walks the chunks one key block
at a time, flash.py, and hands each chunk its own gradient), so no layer copies the O(T)
latents; only the key-mask chunks (bool) are concatenated, once per segment. With a `head` (the
LM head and the per-token loss terms, policy/logprobs.py `segmented_logprobs`) run inside the
checkpoint, a segment's output is its per-token logprobs instead of its hidden states, so
neither the hidden states [B, T, D] nor their gradient outlive their segment.

On a CPU each segment first hands the C heap's free pages back to the OS (host_memory.py): the
survivors of every segment would otherwise fragment glibc's heap, whose resident size grew by
~30 KiB per token over ~1 KiB of live tensors (k3-tiny, docs/benchmarks.md).

Left padding works as in the unsegmented forward: each segment gets its slice of the attention
mask; its MLA queries sit at positions past .. past + S - 1 over all earlier keys, whose key mask
marks the padding; masked tokens do not touch the KDA state or conv window.

Letters: B batch, T tokens, S tokens of one segment, D hidden size, L MLA latent width,
M MoE layers, K experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from policy.k3.host_memory import release_free_heap
from policy.k3.kda import KDACache
from policy.k3.mla import ChunkedLatents


class SegmentHead(Protocol):
    """What `carried_hidden` runs on each segment's hidden states, inside its checkpoint."""

    def positions(self, t0: int, t1: int) -> list[int] | None:
        """Indices (into the segment t0..t1-1) of the positions whose hidden states are
        needed, sorted; None: all of them."""
        ...

    def __call__(self, hidden: Tensor, t0: int, t1: int, positions: list[int] | None) -> tuple:
        """hidden [B, S, D] of the segment t0..t1-1 (positions None) or [B, U, D] at its
        `positions` -> per-token tensors [B, n, ...]."""
        ...


class Carry(NamedTuple):
    """What crosses a segment boundary: per layer the KDACache (KDA) or None; per layer the
    latent chunks [B, T_s, L] of every earlier segment (MLA) or None; the key-mask chunks
    [B, T_s] (bool) of every earlier segment."""

    kda: tuple[KDACache | None, ...]
    latents: tuple[tuple[Tensor, ...] | None, ...]
    masks: tuple[Tensor, ...]


class _Latents:
    """Duck-types MLACache's `length` / `append` for GatedMLA: the earlier chunks plus this
    segment's latent, as a ChunkedLatents (no copy of the latents); records the new chunk on
    the owning SegmentCache."""

    def __init__(self, owner: SegmentCache, layer: int) -> None:
        self.owner, self.layer = owner, layer

    @property
    def length(self) -> int:
        return sum(chunk.shape[1] for chunk in self.owner.masks_in)

    def append(self, latent_BSL: Tensor, mask_BS: Tensor | None = None) -> ChunkedLatents:
        del mask_BS  # the segment's mask was recorded by `begin` (shared by all MLA layers)
        self.owner.latents_out[self.layer] = latent_BSL
        chunks = (*self.owner.latents_in[self.layer], latent_BSL)
        return ChunkedLatents(chunks, self.owner.key_mask)


class SegmentCache:
    """Duck-types K3Cache for one K3Model.forward over one segment, functionally: it reads the
    carry of the earlier segments and records this segment's additions (nothing in place, so
    a checkpoint's recomputation sees exactly the same inputs)."""

    def __init__(self, kda_in, latents_in, masks_in) -> None:
        self.kda_in: tuple[KDACache | None, ...] = kda_in
        self.latents_in: tuple[tuple[Tensor, ...] | None, ...] = latents_in
        self.masks_in: tuple[Tensor, ...] = masks_in
        self.kda_out: list[KDACache | None] = [None] * len(kda_in)
        self.latents_out: list[Tensor | None] = [None] * len(kda_in)
        self.mask_out: Tensor | None = None
        self.key_mask: Tensor | None = None  # [B, T_earlier + S]: every MLA layer's key mask

    def begin(self, mask_BS: Tensor | None, length: int) -> None:
        assert mask_BS is not None and mask_BS.shape[1] == length, "pass the segment's mask"
        self.mask_out = mask_BS.bool()
        self.key_mask = torch.cat((*self.masks_in, self.mask_out), dim=1)

    def commit(self, length: int) -> None:
        del length

    def kda(self, layer: int) -> KDACache | None:
        return self.kda_in[layer]

    def set_kda(self, layer: int, new: KDACache) -> None:
        """Record the layer's new state; the conv tails are views of the segment's whole conv
        input [B, X, S + W-1], so they are copied (the carry must not keep that alive)."""
        tails = (new.conv_q.clone(), new.conv_k.clone(), new.conv_v.clone())
        self.kda_out[layer] = KDACache(*tails, new.state)

    def mla(self, layer: int) -> _Latents:
        return _Latents(self, layer)


def _segment(decoder, ids_BS, mask_BS, kda_in, latents_in, masks_in, replay, routing: bool,
             head=None, t0: int = 0, positions=None, release: bool = True):  # fmt: skip
    """One segment through the decoder -> (hidden [B, S, D], KDA carry, latent chunks, mask
    chunk [B, S], routed experts [M, B*S, K] or None); with `head`, head(hidden, t0, t1,
    positions) in place of the hidden states (computed here, inside the segment's checkpoint;
    positions: the decoder's hidden at those positions only, K3Model.forward). With `release`
    (the sequence runs as several segments) on a CPU the heap's free pages go back to the OS
    first (host_memory.py; the decoder's `release_heap` attribute, default on); a forward of one
    segment leaves the heap to the allocator, which reuses it for the next micro-batch."""
    if release and ids_BS.device.type == "cpu" and getattr(decoder, "release_heap", True):
        release_free_heap()  # what the previous segment (or its backward) freed
    cache = SegmentCache(kda_in, latents_in, masks_in)
    out = decoder(
        ids_BS,
        attention_mask=mask_BS,
        cache=cache,
        replay_experts=replay,
        return_routing=routing,
        positions=positions,
    )
    hidden_BSD = out.last_hidden_state
    return (
        hidden_BSD if head is None else head(hidden_BSD, t0, t0 + ids_BS.shape[1], positions),
        tuple(cache.kda_out),
        cache.latents_out,
        cache.mask_out,
        out.router_choice,
    )


def _replay_slice(replay_experts, batch: int, length: int, t0: int, t1: int):
    """Per MoE layer, the replayed experts of positions t0..t1-1 as [B, t1 - t0, K]."""
    if replay_experts is None:
        return None
    return [r.reshape(batch, length, r.shape[-1])[:, t0:t1] for r in replay_experts]


def segmented_hidden(
    decoder,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor | None,
    *,
    segment: int,
    replay_experts: Tensor | Sequence[Tensor] | None = None,
    return_routing: bool = False,
    recompute: bool | None = None,
    head: SegmentHead | None = None,
) -> tuple[Tensor | tuple[Tensor, ...], Tensor | None]:
    """A K3Model (`decoder`) over [B, T] in segments of `segment` tokens.

    Returns (last hidden state [B, T, D], the router's own choices [M, B*T, K] (what it picks,
    replayed or not) when return_routing, in
    K3Model's b-major token order, else None). replay_experts: per MoE layer [B, T, K] or
    [B*T, K] (or one [M, B*T, K] tensor). recompute: checkpoint each segment (None: when
    gradients are enabled).

    head (a SegmentHead): `head(hidden, t0, t1, positions) -> tensors [B, n, ...]` of the
    segment t0..t1-1 (offsets into this call's input_ids_BT, not positions in a sequence
    continued from a `carry`), run inside the segment's checkpoint (the LM head and loss terms:
    the hidden states then never outlive their segment); the first result is then head's
    tensors, each concatenated over the segments (dim 1), instead of the hidden states.
    `head.positions(t0, t1)`: None, or the positions of the segment whose hidden states the
    head needs (then hidden is [B, U, D] at them: the decoder's last layer works at them
    alone, K3Model.forward).
    """
    out, routed_MXK, _ = carried_hidden(
        decoder, input_ids_BT, attention_mask_BT, segment=segment, replay_experts=replay_experts,
        return_routing=return_routing, recompute=recompute, head=head,
    )  # fmt: skip
    return out, routed_MXK


def empty_carry(decoder) -> Carry:
    """The carry before a sequence's first token."""
    kda = (None,) * len(decoder.layers)
    return Carry(kda, tuple(None if layer.is_kda else () for layer in decoder.layers), ())


def carried_hidden(
    decoder,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor | None,
    *,
    segment: int,
    carry: Carry | None = None,
    replay_experts: Tensor | Sequence[Tensor] | None = None,
    return_routing: bool = False,
    recompute: bool | None = None,
    head: SegmentHead | None = None,
) -> tuple[Tensor | tuple[Tensor, ...], Tensor | None, Carry]:
    """segmented_hidden continuing from `carry` (the state after every earlier token; None: the
    sequence starts here) -> (hidden [B, T, D] or head's tensors, routed [M, B*T, K] or None,
    the carry after the last token). Context parallelism hands the carry from rank to rank
    (context.py)."""
    if segment <= 0:
        raise ValueError(f"segment must be a positive number of tokens, got {segment}")
    batch, length = input_ids_BT.shape
    if attention_mask_BT is None:
        attention_mask_BT = torch.ones_like(input_ids_BT)
    attention_mask_BT = attention_mask_BT[:, -length:]
    if recompute is None:
        recompute = torch.is_grad_enabled()
    run = functools.partial(checkpoint, _segment, use_reentrant=False) if recompute else _segment
    kda, latents, masks = carry or empty_carry(decoder)
    hiddens, routed = [], []
    for t0 in range(0, length, segment):
        t1 = min(t0 + segment, length)
        args = (
            decoder,
            input_ids_BT[:, t0:t1],
            attention_mask_BT[:, t0:t1],
            kda,
            latents,
            masks,
            _replay_slice(replay_experts, batch, length, t0, t1),
            return_routing,
            head,
            t0,
            None if head is None else head.positions(t0, t1),
            length > segment,  # several segments: trim the heap between them
        )
        hidden_BSD, kda, new_latents, mask_BS, routed_MXK = run(*args)
        latents = tuple(
            None if old is None else (*old, new)
            for old, new in zip(latents, new_latents, strict=True)
        )
        masks = (*masks, mask_BS)
        hiddens.append(hidden_BSD)
        if routed_MXK is not None:
            routed.append(routed_MXK.unflatten(1, (batch, t1 - t0)))
    routed_MXK = torch.cat(routed, dim=2).flatten(1, 2) if routed else None
    if head is not None:  # each of head's tensors, whole
        out = tuple(torch.cat(parts, dim=1) for parts in zip(*hiddens, strict=True))
        return out, routed_MXK, Carry(kda, latents, masks)
    return torch.cat(hiddens, dim=1), routed_MXK, Carry(kda, latents, masks)
