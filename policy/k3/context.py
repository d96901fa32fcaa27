"""Context parallelism for the K3 decoder: one sequence split over the ranks of a process group,
rank r holding tokens [bounds[r], bounds[r + 1]), the token-mixing carry relayed rank to rank.

K3 mixes tokens only through KDA (a recurrent state and a short-conv tail) and MLA (attention
over earlier latents; NoPE, so no positions); everything else is per token (see segments.py).
Rank r therefore runs its shard exactly as `carried_hidden` runs a later segment, given the
carry of everything before it: per KDA layer the state and conv tails, per MLA layer the latent
chunks of every earlier shard, and their key masks. After its forward, rank r - 1 sends that
carry (what it received plus what its shard added) to rank r; in the backward the carry's
gradient flows back the same way, through two autograd functions whose forward and backward
are point-to-point transfers (`_Recv` on the receiving rank, `_Send` on the sending one).

    hidden_BSD, anchor = context_hidden(decoder, ids_BS, mask_BS, group=group, segment=4096)
    loss = shard_loss(hidden_BSD) + anchor   # anchor: 0, ties the carry's gradient to the loss
    loss.backward()                          # then sum the parameter gradients over the group

Rules: every rank of `group` calls `context_hidden` once per forward and runs its backward
once, in the same order (the transfers carry no tags); the decoder may run no collective over
ranks of `group` (FSDP2 all-gathers or EP all-to-alls that include another context rank would
wait for a rank that waits for the carry); the group needs gloo for its small CPU headers
("cpu:gloo,cuda:nccl" on GPUs, as the learner's).

What it is and is not, today:
- exact: the hidden states and the (summed) parameter gradients equal one rank's over the
  whole sequence (tests/policy/k3/test_context.py, float64, 2 and 3 ranks);
- memory: a rank holds its shard's activations (one segment's with checkpointing) plus the
  carry, whose MLA latents are O(T) like the segmented learner's;
- time: the relay is sequential: rank r starts when rank r - 1 has finished its forward, and
  the backward runs back in reverse; nothing overlaps yet, so it splits memory, not time.

Letters: B batch, S tokens of this rank's shard, D hidden size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from policy.k3.kda import KDACache
from policy.k3.segments import Carry, carried_hidden, empty_carry

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8)


def context_hidden(decoder, input_ids_BS: Tensor, attention_mask_BS: Tensor | None, *, group,
                   segment: int, **moe) -> tuple[Tensor, Tensor]:  # fmt: skip
    """This rank's shard of one sequence through the K3 decoder -> (hidden [B, S, D], anchor).

    Shards are contiguous and in rank order within `group`; every rank calls this once per
    forward. `segment`: checkpointed segments inside the shard (segments.py); `moe`:
    replay_experts / return_routing for the shard's tokens (routes are then not returned).
    Add the anchor (a 0 that carries the relay's backward) to the loss before `backward()`."""
    if input_ids_BS.shape[1] == 0:
        raise ValueError("every context rank needs at least one token of the sequence")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    carry = empty_carry(decoder) if rank == 0 else _receive(decoder, group, rank - 1)
    moe.pop("return_routing", None)
    hidden_BSD, _, carry = carried_hidden(
        decoder, input_ids_BS, attention_mask_BS, segment=segment, carry=carry, **moe
    )
    # 0 tied to the shard's last hidden state (so to the received carry): the backward reaches
    # _Recv, whose gradient the previous rank waits for, even if no loss token is in the shard
    if hidden_BSD.requires_grad:
        anchor = _Zero.apply(hidden_BSD[:, -1:, :1])
    else:
        anchor = hidden_BSD.new_zeros(())
    if rank + 1 < world:
        dst, flat = dist.get_global_rank(group, rank + 1), _flatten(carry)
        header = _header(carry, flat)
        dist.send(torch.tensor([len(header)]), dst, group=group)
        dist.send(header, dst, group=group)
        if any(x.requires_grad for x in flat):
            anchor = anchor + _Send.apply(dst, group, *flat).to(anchor.dtype)
        else:
            _send_all(flat, dst, group)  # no graph: no gradient comes back
    return hidden_BSD, anchor


def shard_bounds(length: int, ranks: int, segment: int = 0) -> list[int]:
    """[0, ..., length]: rank r's shard of a `length`-token sequence is [b[r], b[r + 1]).
    segment > 0 and length >= min_length(ranks, segment): whole segments, the
    ceil(length / segment) segments split as evenly as counts allow (earlier ranks take the
    extra one), so that the ranks together make exactly the calls of one rank running the same
    segments; otherwise (shorter, or segment 0) `length` split as evenly as tokens allow (each
    shard then no longer than a segment). Raises when a rank would get no token."""
    if length < ranks:
        raise ValueError(
            f"{length} tokens leave one of {ranks} context ranks without a token: pad to {ranks}"
        )
    unit = segment if segment and length >= min_length(ranks, segment) else 1
    units = -(-length // unit)
    counts = [units // ranks + (r < units % ranks) for r in range(ranks)]
    bounds = [0]
    for count in counts:
        bounds.append(min(length, bounds[-1] + count * unit))
    return bounds


def shard_span(length: int, ranks: int, rank: int, segment: int = 0) -> tuple[int, int]:
    """Rank `rank`'s shard [a, b) of `shard_bounds(length, ranks, segment)`."""
    bounds = shard_bounds(length, ranks, segment)
    return bounds[rank], bounds[rank + 1]


def min_length(ranks: int, segment: int = 0) -> int:
    """The shortest sequence split into whole segments (`shard_bounds`) with a token per rank."""
    return (ranks - 1) * (segment or 1) + 1


def replicated_sum(x: Tensor, group) -> Tensor:
    """x summed over `group`, for a loss that every rank of the group then computes the same
    way from the sum: the backward hands each rank the sum's gradient unchanged (its own
    summand's), so the ranks' parameter gradients add up to the whole loss's."""
    return _ReplicatedSum.apply(x, group)


class _Zero(torch.autograd.Function):
    """0, with a zero gradient for x (never NaN, whatever x holds)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.spec = (x.shape, x.dtype, x.device)
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        shape, dtype, device = ctx.spec
        return torch.zeros(shape, dtype=dtype, device=device)


class _ReplicatedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _flatten(carry: Carry) -> list[Tensor]:
    """The carry's tensors in a fixed order: per layer (conv_q, conv_k, conv_v, state) or its
    latent chunks, then the mask chunks (as uint8)."""
    out = []
    for kda, latents in zip(carry.kda, carry.latents, strict=True):
        out.extend((kda.conv_q, kda.conv_k, kda.conv_v, kda.state) if kda else latents)
    return out + [mask.to(torch.uint8) for mask in carry.masks]


def _header(carry: Carry, flat: list[Tensor]) -> Tensor:
    """[chunks, whether the carry needs a gradient, then per tensor: dtype code, rank, 4 dims]
    as int64."""
    if any(x.dim() > 4 for x in flat):
        raise ValueError("carry tensors have at most 4 dimensions")
    grad = any(x.requires_grad for x in flat)
    rows = [[_DTYPES.index(x.dtype), x.dim(), *x.shape, *[0] * (4 - x.dim())] for x in flat]
    head = [len(carry.masks), int(grad)]
    return torch.tensor(head + [v for row in rows for v in row], dtype=torch.long)


def _receive(decoder, group, source: int) -> Carry:
    """The carry sent by `source` (a rank of `group`), as tensors whose gradient goes back."""
    src = dist.get_global_rank(group, source)
    size = torch.empty(1, dtype=torch.long)
    dist.recv(size, src, group=group)
    header = torch.empty(int(size), dtype=torch.long)
    dist.recv(header, src, group=group)
    chunks, grad, specs = int(header[0]), bool(header[1]), header[2:].view(-1, 6).tolist()
    device = next(decoder.parameters()).device
    anchor = torch.zeros((), requires_grad=grad)  # no gradient: the sender waits for none
    flat = _Recv.apply(anchor, src, group, device, tuple(_spec(row) for row in specs))
    return _unflatten([layer.is_kda for layer in decoder.layers], chunks, list(flat))


def _spec(row: list[int]) -> tuple[tuple[int, ...], torch.dtype]:
    code, ndim, *dims = row
    return tuple(dims[:ndim]), _DTYPES[code]


def _unflatten(kinds: list[bool], chunks: int, flat: list[Tensor]) -> Carry:
    kda, latents = [], []
    for is_kda in kinds:
        if is_kda:
            kda.append(KDACache(*flat[:4]))
            latents.append(None)
            flat = flat[4:]
        else:
            kda.append(None)
            latents.append(tuple(flat[:chunks]))
            flat = flat[chunks:]
    masks = tuple(mask.bool() for mask in flat)
    return Carry(tuple(kda), tuple(latents), masks)


def _send_all(flat, dst: int, group) -> None:
    for x in flat:
        dist.send(x.detach().contiguous(), dst, group=group)


class _Send(torch.autograd.Function):
    """Forward: send the carry to the next rank, return 0. Backward: receive the carry's
    gradient from it (floating tensors only)."""

    @staticmethod
    def forward(ctx, dst: int, group, *flat: Tensor) -> Tensor:
        _send_all(flat, dst, group)
        ctx.dst, ctx.group = dst, group
        ctx.specs = [(x.shape, x.dtype, x.device) for x in flat]
        return flat[0].new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _grad):
        grads = []
        for shape, dtype, device in ctx.specs:
            if not dtype.is_floating_point:
                grads.append(None)
                continue
            grad = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(grad, ctx.dst, group=ctx.group)
            grads.append(grad)
        return None, None, *grads


class _Recv(torch.autograd.Function):
    """Forward: receive the carry from the previous rank. Backward: send its gradient there
    (zeros where this rank's loss does not reach a tensor)."""

    @staticmethod
    def forward(ctx, anchor: Tensor, src: int, group, device, specs) -> tuple[Tensor, ...]:
        del anchor  # only there so that autograd calls backward
        out = []
        for shape, dtype in specs:
            x = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(x, src, group=group)
            out.append(x)
        ctx.src, ctx.group, ctx.device, ctx.specs = src, group, device, specs
        ctx.mark_non_differentiable(*[x for x in out if not x.dtype.is_floating_point])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        for (shape, dtype), grad in zip(ctx.specs, grads, strict=True):
            if dtype.is_floating_point:
                if grad is None:
                    grad = torch.zeros(shape, dtype=dtype, device=ctx.device)
                dist.send(grad.contiguous(), ctx.src, group=ctx.group)
        return None, None, None, None, None
