"""Shared-prefix forwards: a group's common prompt runs through the decoder once.

The samples of a GRPO group start with the same prompt (system text, tool signatures, the task),
and in an agent task that prompt is often most of a sample's tokens. The usual forward runs it
once per sample; here it runs once per distinct prefix, then every sample's own tokens run on
top of the prefix's carry (an attention layer's keys and values, or K3's KDA state and MLA
latents), expanded to the rows by indexing, so the prefix's gradient is the sum of its rows'.
Same values and gradients as the whole forward (`tests/policy/test_shared_prefix.py`, float64).

    plan = plan_shared_prefix(input_ids_BT, attention_mask_BT, select_BT)  # None: no gain
    hidden_BSD, routed = prefix_hidden(model, input_ids_BT, attention_mask_BT, plan)

The prefix ends before the first position whose prediction is selected (the loss positions)
in any row, so every hidden state the loss reads comes from the second part: hidden_BSD holds
positions P..T-1. Only for right padding (every row's first P tokens real).

Letters: B rows, U distinct prefixes, P prefix tokens, S = T - P, D hidden, M MoE layers,
K experts per token.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

MIN_PREFIX_TOKENS = 8
"""Shorter common prefixes are not worth a second forward."""


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixPlan:
    """The first `length` tokens of row b equal those of row `rows_U[inverse_B[b]]`."""

    length: int
    rows_U: Tensor  # [U] one row per distinct prefix
    inverse_B: Tensor  # [B] each row's prefix, an index into rows_U

    @property
    def saved_tokens(self) -> int:
        return (self.inverse_B.numel() - self.rows_U.numel()) * self.length

    def token_masks(self, attention_mask_BT: Tensor) -> list[tuple[Tensor, Tensor | None]]:
        """The tokens each router call of `prefix_hidden` sees, in call order, for
        RouterStats.record: the prefixes [U, P] (all real) with the row index that copies
        them to the B rows, then the rows' own [B, S]: the statistics of the whole forward."""
        prefix_UP = attention_mask_BT.new_ones(self.rows_U.numel(), self.length)
        return [(prefix_UP, self.inverse_B), (attention_mask_BT[:, self.length :], None)]


def plan_shared_prefix(
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    select_BT: Tensor,
    routes_BT_: Tensor | None = None,
) -> PrefixPlan | None:
    """The plan for a micro-batch (select_BT [B, T-1]: the positions whose prediction the caller
    reads), or None where no two rows share MIN_PREFIX_TOKENS tokens before the first selected
    position, or the prefix has padding (left padding). routes_BT_ ([B, T, ...], routing replay):
    rows share a prefix only if its replayed experts are the same too (a group's samples may
    come from different policy versions in async runs)."""
    selected_B = select_BT.bool().any(1)
    if input_ids_BT.shape[0] < 2 or not selected_B.all():
        return None
    length = int(select_BT.bool().float().argmax(1).min())  # the earliest selected position
    if length < MIN_PREFIX_TOKENS or not bool(attention_mask_BT[:, :length].all()):
        return None
    prefixes_BP = input_ids_BT[:, :length]
    if routes_BT_ is not None:
        routes_BP_ = routes_BT_[:, :length].flatten(1).to(prefixes_BP.dtype)
        prefixes_BP = torch.cat([prefixes_BP, routes_BP_], 1)
    unique_UP, inverse_B = torch.unique(prefixes_BP, dim=0, return_inverse=True)
    if unique_UP.shape[0] == input_ids_BT.shape[0]:
        return None
    rows_U = torch.full((unique_UP.shape[0],), input_ids_BT.shape[0], dtype=torch.long)
    rows_U = rows_U.to(inverse_B.device).scatter_reduce(
        0, inverse_B, torch.arange(inverse_B.numel(), device=inverse_B.device), "amin"
    )
    return PrefixPlan(length, rows_U, inverse_B)


def prefix_hidden(
    model,
    input_ids_BT: Tensor,
    attention_mask_BT: Tensor,
    plan: PrefixPlan,
    *,
    replay_experts: list[Tensor] | None = None,
    return_routing: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(the final hidden states at positions P..T-1 [B, S, D], the router's own choices
    [M, B*T, K] in b-major order or None): the decoder's forward over the prefix once per
    distinct prefix, then the rows' own tokens on its expanded carry. replay_experts: per MoE
    layer [B, T, K] (K3 policies)."""
    from policy.k3.modeling import K3Model

    decoder = model.get_decoder()
    if isinstance(decoder, K3Model):
        return _k3_hidden(decoder, input_ids_BT, attention_mask_BT, plan, replay_experts,
                          return_routing)  # fmt: skip
    if replay_experts is not None or return_routing:
        raise ValueError("routing replay and routing records need a K3 policy")
    return _hf_hidden(decoder, input_ids_BT, attention_mask_BT, plan), None


def _hf_hidden(decoder, input_ids_BT, attention_mask_BT, plan: PrefixPlan) -> Tensor:
    """A transformers decoder: the prefix's cache (keys and values) indexed out to the rows."""
    p, rows_U = plan.length, plan.rows_U
    prefix_UP = input_ids_BT[rows_U, :p]
    positions_UP = torch.arange(p, device=prefix_UP.device).expand_as(prefix_UP)
    out = decoder(
        input_ids=prefix_UP,
        attention_mask=torch.ones_like(prefix_UP),
        position_ids=positions_UP,
        use_cache=True,
    )
    cache = getattr(out, "cache", None)
    if not hasattr(cache, "batch_select_indices"):
        raise ValueError(
            f"{type(decoder).__name__} returns no transformers Cache to share a prompt's keys "
            "and values: set trainer.shared_prefix=false"
        )
    cache.batch_select_indices(plan.inverse_B)  # [U, ...] -> [B, ...], differentiable
    mask_BS = attention_mask_BT[:, p:]
    return decoder(
        input_ids=input_ids_BT[:, p:],
        attention_mask=attention_mask_BT,
        position_ids=(p + mask_BS.cumsum(-1) - 1).clamp(min=p),
        cache=cache,
        use_cache=True,
    ).last_hidden_state


def _k3_hidden(decoder, input_ids_BT, attention_mask_BT, plan, replay_experts, return_routing):
    """K3: the prefix's carry (KDA state and conv tails, MLA latents, key masks) indexed out
    to the rows (policy/k3/segments.py carried_hidden), each part one unsegmented forward."""
    from policy.k3.segments import carried_hidden

    p, rows_U, inverse_B = plan.length, plan.rows_U, plan.inverse_B
    length = input_ids_BT.shape[1]
    replay_U = replay_B = None
    if replay_experts is not None:
        replay_U = [r[rows_U, :p] for r in replay_experts]
        replay_B = [r[:, p:] for r in replay_experts]
    prefix_UP = input_ids_BT[rows_U, :p]
    _, routed_head, carry = carried_hidden(
        decoder, prefix_UP, torch.ones_like(prefix_UP), segment=p, recompute=False,
        replay_experts=replay_U, return_routing=return_routing,
    )  # fmt: skip
    carry = _expand_carry(carry, inverse_B)
    hidden_BSD, routed_tail, _ = carried_hidden(
        decoder, input_ids_BT[:, p:], attention_mask_BT[:, p:], segment=length - p,
        carry=carry, recompute=False, replay_experts=replay_B, return_routing=return_routing,
    )  # fmt: skip
    if not return_routing:
        return hidden_BSD, None
    batch = input_ids_BT.shape[0]
    head_MBPK = routed_head.unflatten(1, (rows_U.numel(), p))[:, inverse_B]
    tail_MBSK = routed_tail.unflatten(1, (batch, length - p))
    return hidden_BSD, torch.cat([head_MBPK, tail_MBSK], dim=2).flatten(1, 2)


def _expand_carry(carry, inverse_B: Tensor):
    """A K3 carry over U prefixes -> over B rows (index_select along the batch dimension)."""
    from policy.k3.segments import Carry

    def rows(tensor):
        return tensor.index_select(0, inverse_B)

    kda = tuple(
        None
        if cache is None
        else dataclasses.replace(
            cache,
            **{f.name: rows(getattr(cache, f.name)) for f in dataclasses.fields(cache)},
        )
        for cache in carry.kda
    )
    latents = tuple(
        None if chunks is None else tuple(rows(c) for c in chunks) for chunks in carry.latents
    )
    masks = tuple(rows(m) for m in carry.masks)
    return Carry(kda, latents, masks)
