"""Context parallelism for the K3 decoder: one sequence split over the ranks of a process group,
rank r holding tokens [bounds[r], bounds[r + 1]), the ranks working at the same time.

K3 mixes tokens only through KDA (a recurrent state and a short-conv tail) and MLA (attention
over earlier latents; NoPE, so no positions); everything else is per token (see segments.py).
Each rank runs its shard layer by layer (a wavefront), and per layer takes from rank r - 1
what the layer needs of the tokens before its shard (relay.py):

    KDA layer:  the state and conv tails after rank r - 1's shard; rank r starts the layer
                when rank r - 1 has finished it (and sends its own on when done)
    MLA layer:  the latents of every earlier shard; rank r computes its own shard's latents
                first (a cheap per-token projection), forwards them with the received ones,
                and only then attends: the ranks' attention, the quadratic part, overlaps
    masks:      the key masks of every earlier shard, once, before layer 0

So rank r runs layer l while rank r + 1 runs layer l - 1, and every MLA layer's attention runs
on all ranks at once; the backward runs the same wavefront in reverse (the carries' gradients
come back through relay.py's autograd functions). Inside a layer the shard runs in segments,
each one activation checkpoint (with gradients on), as segments.py does for one rank.

Balanced work: a rank's share of a layer costs a per-token part plus an attention part that
grows with position (query t meets t + 1 keys). `shard_bounds` with `pair_cost(config)` (one
query-key pair's FLOPs over one token's) gives earlier ranks more tokens so that the ranks'
FLOPs are even; with 0 the split is by tokens.

    hidden_BSD, anchor = context_hidden(decoder, ids_BS, mask_BS, group=group, segment=4096)
    loss = shard_loss(hidden_BSD) + anchor   # anchor: 0, ties the carries' gradients to the loss
    loss.backward()                          # then sum the parameter gradients over the group

Rules: every rank of `group` calls `context_hidden` once per forward and runs its backward
once, in the same order (the transfers carry no tags); the decoder may run no collective over
ranks of `group` (FSDP2 all-gathers or EP all-to-alls that include another context rank would
wait for a rank that waits for the carry); the group needs gloo for its small CPU headers
("cpu:gloo,cuda:nccl" on GPUs, as the learner's).

What it is: exact (the hidden states and the summed parameter gradients equal one rank's over
the whole sequence: tests/policy/k3/test_context.py, float64, 2 and 3 ranks); a rank holds its
shard's per-layer residual sources and the earlier shards' latents (O(T)), and one segment's
activations at a time; time: see docs/benchmarks.md (1 rank against 2 context ranks).

Letters: B batch, S tokens of this rank's shard, D hidden size, L MLA latent width, K experts
per token.
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from policy.k3.attn_res import AttnResState
from policy.k3.host_memory import release_free_heap
from policy.k3.kda import KDACache
from policy.k3.relay import Relay
from policy.k3.segments import SegmentCache


def context_hidden(decoder, input_ids_BS: Tensor, attention_mask_BS: Tensor | None, *, group,
                   segment: int, replay_experts=None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """This rank's shard of one sequence through the K3 decoder -> (hidden [B, S, D], anchor).

    Shards are contiguous and in rank order within `group`; every rank calls this once per
    forward. `segment`: checkpointed segments inside the shard; replay_experts: per MoE layer
    the shard's [B, S, K] (routes are not returned). Add the anchor
    (a 0 that carries the relay's backward) to the loss before `backward()`."""
    _batch, length = input_ids_BS.shape
    if length == 0:
        raise ValueError("every context rank needs at least one token of the sequence")
    if segment <= 0:
        raise ValueError(f"segment must be a positive number of tokens, got {segment}")
    mask_BS = torch.ones_like(input_ids_BS) if attention_mask_BS is None else attention_mask_BS
    relay = Relay(group, input_ids_BS.device)
    shard = _Shard(decoder, mask_BS[:, -length:], segment, relay)
    hidden_BSD = decoder.embed_tokens(input_ids_BS)
    state = hidden_BSD if decoder.config.attn_res_block_size is None else (
        AttnResState.start(hidden_BSD))  # fmt: skip
    replays = iter(replay_experts) if replay_experts is not None else None
    for layer in decoder.layers:
        replay_BSK = next(replays) if replays is not None and layer.is_sparse else None
        if layer.is_kda:
            out_BSD = shard.kda_layer(layer, state, replay_BSK)
        else:
            out_BSD = shard.mla_layer(layer, state, replay_BSK)
        state = layer.next_state(state, out_BSD)
    outs = [shard.run(_final, decoder, _slice(state, a, b)) for a, b in shard.spans]
    hidden_BSD = torch.cat(outs, dim=1)
    return hidden_BSD, relay.finish(hidden_BSD)


class _Shard:
    """One rank's shard in segments: its spans, key masks (the earlier ranks' first, received
    once), and how each segment of a layer runs (a checkpoint when gradients are on)."""

    def __init__(self, decoder, mask_BS: Tensor, segment: int, relay: Relay) -> None:
        length = mask_BS.shape[1]
        self.spans = [(a, min(a + segment, length)) for a in range(0, length, segment)]
        self.mask_BS, self.relay = mask_BS, relay
        own = tuple(mask_BS[:, a:b].bool() for a, b in self.spans)
        earlier = tuple(m.bool() for m in relay.receive())
        relay.send(tuple(m.to(torch.uint8) for m in (*earlier, *own)))
        self.earlier_masks, self.own_masks = earlier, own
        self.release = mask_BS.device.type == "cpu" and getattr(decoder, "release_heap", True)
        self.recompute = torch.is_grad_enabled()

    def run(self, fn, *args):
        return checkpoint(fn, *args, use_reentrant=False) if self.recompute else fn(*args)

    def kda_layer(self, layer, state, replay_BSK: Tensor | None) -> Tensor:
        """A KDA layer over the shard from rank r - 1's state; its own state sent on."""
        received = self.relay.receive()
        carry = KDACache(*received) if received else None
        outs = []
        for i, (a, b) in enumerate(self.spans):
            out_BSD, carry = self.run(_unit, layer, _slice(state, a, b), self.mask_BS[:, a:b],
                                      carry, None, (), _cut(replay_BSK, a, b),
                                      self.release and i == 0)  # fmt: skip
            outs.append(out_BSD)
        self.relay.send((carry.conv_q, carry.conv_k, carry.conv_v, carry.state))
        return torch.cat(outs, dim=1)

    def mla_layer(self, layer, state, replay_BSK: Tensor | None) -> Tensor:
        """An MLA layer: own latents first, sent on with the received ones, then attention."""
        received = self.relay.receive()
        own = tuple(self.run(_latent, layer, _slice(state, a, b)) for a, b in self.spans)
        self.relay.send((*received, *own))
        chunks, masks = (*received, *own), (*self.earlier_masks, *self.own_masks)
        outs = []
        for i, (a, b) in enumerate(self.spans):
            before = len(received) + i  # chunks of the tokens before this segment
            out_BSD, _ = self.run(_unit, layer, _slice(state, a, b), self.mask_BS[:, a:b], None,
                                  chunks[:before], masks[:before], _cut(replay_BSK, a, b),
                                  self.release and i == 0)  # fmt: skip
            outs.append(out_BSD)
        return torch.cat(outs, dim=1)


def _unit(layer, state, mask_BS, kda, latents, masks, replay_BSK, release: bool):
    """One layer over one segment -> (its output [B, S, D], the KDA carry after it or None).
    latents / masks: the chunks of every earlier token (MLA)."""
    if release:
        release_free_heap()  # what the previous layer (or its backward) freed
    index = layer.layer_idx
    cache = SegmentCache((None,) * index + (kda,), (None,) * index + (latents,), masks)
    cache.begin(mask_BS, mask_BS.shape[1])
    mask_BS = None if bool(mask_BS.all()) else mask_BS  # as K3Model: identical, cheaper
    out_BSD, _ = layer(state, mask_BT=mask_BS, cache=cache, replay_TK=replay_BSK)
    return out_BSD, cache.kda_out[index]


def _latent(layer, state) -> Tensor:
    """The MLA latents [B, S, L] of one segment (through the layer's call: sharded weights)."""
    return layer(state, latent_only=True)[0]


def _final(decoder, state) -> Tensor:
    """The decoder's output over one segment: AttnRes over the sources, then the final norm."""
    if decoder.config.attn_res_block_size is not None:
        state = decoder.output_attn_res(state)
    return decoder.norm(state)


def _slice(state, a: int, b: int):
    """Positions a..b-1 of a residual state (AttnResState or the hidden [B, S, D])."""
    if isinstance(state, Tensor):
        return state[:, a:b]
    blocks = tuple(x[:, a:b] for x in state.blocks)
    return AttnResState(blocks, None if state.partial is None else state.partial[:, a:b])


def _cut(replay_BSK: Tensor | None, a: int, b: int) -> Tensor | None:
    return None if replay_BSK is None else replay_BSK[:, a:b]


def shard_bounds(length: int, ranks: int, segment: int = 0, pair_cost: float = 0.0) -> list[int]:
    """[0, ..., length]: rank r's shard of a `length`-token sequence is [b[r], b[r + 1]).

    segment > 0 and length >= min_length(ranks, segment): whole segments (so that the ranks
    together make exactly the calls of one rank running the same segments), in contiguous runs
    of at least one per rank whose largest cost is as small as can be, the others as even as
    that allows (`_balanced_cuts`). A segment [a, b) costs its tokens plus `pair_cost` per
    query-key pair (query t meets t + 1 keys): with pair_cost 0 the ranks' segment counts
    differ by one at most; with `pair_cost(config)` earlier ranks take more tokens and the
    ranks' FLOPs are even.
    Otherwise (shorter, or segment 0) `length` split as evenly as tokens allow (each shard then
    no longer than a segment). Raises when a rank would get no token."""
    if length < ranks:
        raise ValueError(
            f"{length} tokens leave one of {ranks} context ranks without a token: pad to {ranks}"
        )
    if not (segment and length >= min_length(ranks, segment)):
        counts = [length // ranks + (r < length % ranks) for r in range(ranks)]
        return [sum(counts[:r]) for r in range(ranks + 1)]
    edges = [*range(0, length, segment), length]
    costs = [(b - a) * (1 + pair_cost * (a + b + 1) / 2) for a, b in itertools.pairwise(edges)]
    return [edges[i] for i in _balanced_cuts(costs, ranks)]


def pair_cost(config) -> float:
    """One query-key pair's FLOPs over one token's per-token FLOPs, for `shard_bounds`: per MLA
    layer the absorbed form's H * (L + R) multiply-adds (scores over the latent, values over
    c_kv), against 1 per active weight a token touches (embedding and LM head left out: long
    trajectories put few positions through the head). k3-tiny: about 1 / 3,073."""
    from policy.k3.configuration import count_parameters

    counts = count_parameters(config)
    per_token = counts["active_non_embedding"] - counts["lm_head"]
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    per_pair = config.num_attention_heads * (latent + config.kv_lora_rank)
    return config.layer_types.count("full_attention") * per_pair / per_token


def context_span(config, length: int, ranks: int, rank: int, segment: int) -> tuple[int, int]:
    """Rank `rank`'s shard [a, b) of a `length`-token sequence of a K3 `config`: the learner's
    split (`shard_bounds` with `pair_cost(config)`): whole segments balanced by FLOPs, or by
    tokens for sequences shorter than `min_length` or with `segment` 0."""
    return shard_span(length, ranks, rank, segment, pair_cost(config))


def _balanced_cuts(costs: list[float], parts: int) -> list[int]:
    """[0, ..., n]: `costs` cut into `parts` non-empty contiguous runs. The largest run's sum is
    the smallest any cut achieves (to a relative 1e-12: bisection on that cap); within the cap,
    each cut sits where the running total is closest to its share k / parts of the whole (ties:
    the later cut), so that the other runs are as even as the cap allows too. Every run's sum
    is a difference of the same prefix sums, so the checks below agree to the last bit."""
    prefix = list(itertools.accumulate(costs, initial=0.0))
    low, high = max(costs), prefix[-1]
    while high - low > 1e-12 * high:
        cap = (low + high) / 2
        low, high = (low, cap) if _runs(prefix, 0, cap) <= parts else (cap, high)
    cuts = [0]
    for k in range(1, parts):
        start, later = cuts[-1], parts - k  # later: runs after this one, one item each at least
        last = start + 1  # the run [start, last): as long as the cap and the later runs allow
        while last < len(costs) - later and prefix[last + 1] - prefix[start] <= high:
            last += 1
        fits = functools.partial(_suffix_fits, prefix, high, later)
        first = _bisect_feasible(start + 1, last, fits)
        share = prefix[-1] * k / parts
        cuts.append(min(range(first, last + 1), key=lambda p: (abs(prefix[p] - share), -p)))
    return [*cuts, len(costs)]


def _bisect_feasible(low: int, high: int, ok) -> int:
    """The smallest p in [low, high] with ok(p), for ok monotone (false, then true); high if
    none is."""
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if ok(mid) else (mid + 1, high)
    return high


def _suffix_fits(prefix: list[float], cap: float, parts: int, start: int) -> bool:
    """Whether the items from `start` fit in `parts` runs of at most `cap`."""
    return _runs(prefix, start, cap) <= parts


def _runs(prefix: list[float], start: int, cap: float) -> int:
    """How many runs, each filled up to `cap` from the left, hold the items from `start` (whose
    costs are the steps of the prefix sums `prefix`); an item above the cap has its own run."""
    runs, begin = 1, start
    for i in range(start + 1, len(prefix) - 1):
        if prefix[i + 1] - prefix[begin] > cap:
            runs, begin = runs + 1, i
    return runs


def shard_span(length: int, ranks: int, rank: int, segment: int = 0,
               pair_cost: float = 0.0) -> tuple[int, int]:  # fmt: skip
    """Rank `rank`'s shard [a, b) of `shard_bounds(length, ranks, segment, pair_cost)`."""
    bounds = shard_bounds(length, ranks, segment, pair_cost)
    return bounds[rank], bounds[rank + 1]


def min_length(ranks: int, segment: int = 0) -> int:
    """The shortest sequence split into whole segments (`shard_bounds`) with a token per rank."""
    return (ranks - 1) * (segment or 1) + 1


def replicated_sum(x: Tensor, group) -> Tensor:
    """x summed over `group`, for a loss that every rank of the group then computes the same
    way from the sum: the backward hands each rank the sum's gradient unchanged (its own
    summand's), so the ranks' parameter gradients add up to the whole loss's."""
    return _ReplicatedSum.apply(x, group)


class _ReplicatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None
