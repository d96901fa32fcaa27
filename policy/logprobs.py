"""Per-token logprobs and entropy of a causal LM, computed in chunks.

Letters: B = batch, T = sequence length, D = hidden size, V = vocabulary, C = chunk length.

Never materialises `[B, T, V]` float32 logits: the decoder's hidden states are projected through
the LM head `chunk` positions at a time (only at the positions asked for), and large chunks are
recomputed in the backward pass (activation checkpointing), so peak memory is `[C, V]` whatever
T is.
"""

from __future__ import annotations

import bisect

import torch
from torch.utils.checkpoint import checkpoint

from policy.shared_prefix import PrefixPlan, prefix_hidden

HEAD_RECOMPUTE_ELEMENTS = 1 << 24
"""head_logprobs recomputes its chunks in the backward (a checkpoint each; inside a segment's
checkpoint, nested in it) when the selected rows x vocabulary exceed this many logits."""


def _chunk_stats(hidden_CD, targets_C, head, temperature: float):
    logits_CV = head(hidden_CD).float() / temperature
    logp_CV = torch.log_softmax(logits_CV, -1)
    token_logp_C = logp_CV.gather(-1, targets_C[..., None])[..., 0]
    entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return token_logp_C, entropy_C


def decoder_hidden(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    segment_tokens: int = 0,
    **moe,
) -> torch.Tensor:
    """[B, T-1, D]: the final hidden state at every position that predicts a next token.
    `moe` (MoE policies only): replay_experts / return_routing, passed through to the model;
    with return_routing the result is (hidden, the router's own choices [M, B*T, K]: the experts
    it picks, whether the forward replayed others or not).
    segment_tokens > 0 and T > segment_tokens: the decoder runs in segments of that many tokens
    with activation checkpointing (policy/k3/segments.py; K3 policies only, ValueError else)."""
    hidden_BTD, routed = all_hidden(
        model, input_ids_BT, attention_mask_BT, segment_tokens=segment_tokens, **moe
    )
    if moe.get("return_routing"):
        return hidden_BTD[:, :-1], routed
    return hidden_BTD[:, :-1]


def all_hidden(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    segment_tokens: int = 0,
    **moe,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden [B, T, D] at every position, the last one included, the router's own choices
    [M, B*T, K] or None): `decoder_hidden` before it drops the last position (same arguments)."""
    extra = {k: v for k, v in moe.items() if v is not None and v is not False}
    if segment_tokens and input_ids_BT.shape[1] > segment_tokens:
        return _segmented(model, input_ids_BT, attention_mask_BT, segment_tokens, extra)
    out = model.get_decoder()(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=(attention_mask_BT.cumsum(-1) - 1).clamp(min=0),
        use_cache=False,
        **extra,
    )
    return out.last_hidden_state, getattr(out, "router_choice", None)


def _segmented(model, input_ids_BT, attention_mask_BT, segment_tokens: int, extra: dict):
    """(hidden [B, T, D], routed experts or None) of a K3 decoder run segment by segment."""
    from policy.k3.modeling import K3Model
    from policy.k3.segments import segmented_hidden

    decoder = model.get_decoder()
    if not isinstance(decoder, K3Model):
        raise ValueError(
            f"segment_tokens={segment_tokens} needs a K3 policy (the segments carry K3's KDA "
            f"state and MLA latents); {type(decoder).__name__} has no such carry: set it to 0"
        )
    return segmented_hidden(
        decoder, input_ids_BT, attention_mask_BT, segment=segment_tokens, **extra
    )


def segmented_logprobs(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    segment: int,
    temperature: float = 1.0,
    select_BT: torch.Tensor | None = None,
    selected_only: bool = False,
    **moe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprobs [B, T-1], entropy [B, T-1], routed experts or None) of a K3 policy run in
    segments of `segment` tokens with the LM head inside each segment's checkpoint: what
    `head_logprobs(decoder_hidden(...))` gives, keeping per token only these results.

    selected_only (with select_BT, an MLA last layer and no padding): the last layer attends
    and runs its MLP only at the positions selected in some row (`K3Model.forward(positions=
    ...)`): the same values and gradients at the selected positions, O(U * T) instead of
    O(T^2) attention in that layer; the other positions' values are 0. Its router's calls
    are left out of Quantile Balancing's statistics (policy/parallel.py RouterStats); its
    routed experts are -1 at the other positions."""
    layers = getattr(model.get_decoder(), "layers", None)
    selected_only = (
        selected_only
        and select_BT is not None
        and layers is not None
        and not getattr(layers[-1], "is_kda", True)
        and bool(attention_mask_BT.all())  # the router statistics' token mask stays aligned
    )
    head = _SegmentLogprobs(model, input_ids_BT[:, 1:], select_BT, temperature, selected_only)
    extra = {k: v for k, v in moe.items() if v is not None and v is not False}
    (logp_BT, entropy_BT), routed = _segmented(
        model, input_ids_BT, attention_mask_BT, segment, {**extra, "head": head}
    )
    return logp_BT, entropy_BT, routed


class _SegmentLogprobs:
    """segmented_logprobs' head (policy/k3/segments.py SegmentHead): the segment t0..t1-1
    predicts targets t0+1 .. (the sequence's last position predicts none)."""

    def __init__(self, model, targets_BT, select_BT, temperature: float, selected_only: bool):
        self.model, self.targets_BT, self.select_BT = model, targets_BT, select_BT
        self.temperature, self.predicting = temperature, targets_BT.shape[1]
        self.wanted = select_BT.any(0).nonzero()[:, 0].tolist() if selected_only else None

    def positions(self, t0: int, t1: int) -> list[int] | None:
        if self.wanted is None:
            return None
        lo, hi = bisect.bisect_left(self.wanted, t0), bisect.bisect_left(self.wanted, t1)
        return [p - t0 for p in self.wanted[lo:hi]]

    def __call__(self, hidden_BXD, t0: int, t1: int, positions: list[int] | None):
        n = min(t1, self.predicting) - t0
        if positions is None:
            return self._logprobs(hidden_BXD[:, :n], slice(t0, t0 + n))
        index_U = torch.tensor(positions, dtype=torch.long, device=hidden_BXD.device) + t0
        logp_BU, entropy_BU = self._logprobs(hidden_BXD, index_U)
        shape = (hidden_BXD.shape[0], n)
        logp_Bn = logp_BU.new_zeros(shape).index_copy(1, index_U - t0, logp_BU)
        return logp_Bn, entropy_BU.new_zeros(shape).index_copy(1, index_U - t0, entropy_BU)

    def _logprobs(self, hidden_BXD, where):
        select = None if self.select_BT is None else self.select_BT[:, where]
        return head_logprobs(
            self.model, hidden_BXD, self.targets_BT[:, where], temperature=self.temperature,
            select_BT=select,
        )  # fmt: skip


def head_logprobs(
    model,
    hidden_BTD: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 4096,
    select_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target and the entropy ([B, T] each), through the LM head `chunk`
    positions at a time. `select_BT` (bool) limits the work to the positions that matter (e.g.
    the sampled tokens of an agent trajectory); the others are 0."""
    temperature = temperature or 1.0
    head = model.get_output_embeddings()
    if select_BT is None:
        select_BT = torch.ones_like(targets_BT, dtype=torch.bool)
    where = select_BT.nonzero(as_tuple=True)
    hidden_MD, targets_M = hidden_BTD[where], targets_BT[where]
    big = hidden_MD.shape[0] * head.weight.shape[0] > HEAD_RECOMPUTE_ELEMENTS
    logps, entropies = [], []
    for start in range(0, hidden_MD.shape[0], chunk):
        args = (
            hidden_MD[start : start + chunk],
            targets_M[start : start + chunk],
            head,
            temperature,
        )
        if torch.is_grad_enabled() and big:
            logp_C, ent_C = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            logp_C, ent_C = _chunk_stats(*args)
        logps.append(logp_C)
        entropies.append(ent_C)
    logp_BT = hidden_BTD.new_zeros(targets_BT.shape, dtype=torch.float32)
    entropy_BT = hidden_BTD.new_zeros(targets_BT.shape, dtype=torch.float32)
    if logps:
        logp_BT = logp_BT.index_put(where, torch.cat(logps))
        entropy_BT = entropy_BT.index_put(where, torch.cat(entropies))
    return logp_BT, entropy_BT


def token_logprobs(
    model,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of token t given tokens < t, for t >= 1: returns ([B, T-1], entropy [B, T-1])."""
    hidden_BTD = decoder_hidden(model, input_ids_BT, attention_mask_BT)
    return head_logprobs(
        model, hidden_BTD, input_ids_BT[:, 1:], temperature=temperature, chunk=chunk
    )


class TokenLogprobs(torch.nn.Module):
    """`policy` as one module whose forward returns (logprobs, entropy, hidden) for every next
    token. Sharded training wraps this module, not the bare causal LM: calling the decoder and
    the LM head separately would bypass the root's all-gather of the embedding and head."""

    def __init__(self, policy, *, segment_tokens: int = 0, context=None, selected_only=False):
        super().__init__()
        self.policy = policy
        self.segment_tokens = segment_tokens  # decoder_hidden's segments (0 = one forward)
        self.selected_only = selected_only
        """segmented_logprobs' switch, for forwards with keep_hidden=False: the last (MLA)
        layer works at the selected positions alone."""
        self.context = context
        """A process group of context ranks (K3 policies; policy/k3/context.py) or None: each
        rank runs its shard of every sequence (`context_span`), and the logprobs and entropy
        come back whole on every rank of the group (hidden None)."""

    def forward(
        self,
        input_ids_BT,
        attention_mask_BT,
        temperature: float = 1.0,
        select_BT=None,
        replay_experts=None,
        return_routing: bool = False,
        keep_hidden: bool = True,
        prefix: PrefixPlan | None = None,
    ):
        """(logprobs [B, T-1], entropy [B, T-1], hidden [B, T, D], routed experts or None).

        hidden keeps the last position (which predicts no token): the decoder's own output, not
        a slice of it, since a view returned by an FSDP2-wrapped root would let a later in-place
        op drop the root's pre-backward hook. Index it at positions < T-1 as [B, T-1, D].
        With `context`: (logprobs, entropy, None, None), the same on every context rank.

        keep_hidden=False (a learner without a value head): hidden may come back None, and a
        segmented forward then runs the LM head inside each segment's checkpoint, so that no
        position's hidden state (nor its gradient) outlives its segment.

        prefix (policy/shared_prefix.py, keep_hidden=False, no segments or context ranks): the
        rows' common prefix runs once per distinct prefix; logprobs and entropy are 0 at its
        positions (which the plan leaves unselected)."""
        if prefix is not None:
            return self._prefix_forward(
                input_ids_BT, attention_mask_BT, temperature, select_BT, replay_experts,
                return_routing, prefix,
            )  # fmt: skip
        if self.context is not None:
            return self._context_forward(
                input_ids_BT, attention_mask_BT, temperature, select_BT, replay_experts
            )
        if not keep_hidden and 0 < self.segment_tokens < input_ids_BT.shape[1]:
            logp_BT, entropy_BT, routed = segmented_logprobs(
                self.policy, input_ids_BT, attention_mask_BT, segment=self.segment_tokens,
                temperature=temperature, select_BT=select_BT, replay_experts=replay_experts,
                return_routing=return_routing, selected_only=self.selected_only,
            )  # fmt: skip
            return logp_BT, entropy_BT, None, routed
        hidden_BTD, routed = all_hidden(
            self.policy,
            input_ids_BT,
            attention_mask_BT,
            segment_tokens=self.segment_tokens,
            replay_experts=replay_experts,
            return_routing=return_routing,
        )
        logp_BT, entropy_BT = head_logprobs(
            self.policy,
            hidden_BTD[:, :-1],
            input_ids_BT[:, 1:],
            temperature=temperature,
            select_BT=select_BT,
        )
        return logp_BT, entropy_BT, hidden_BTD, routed if return_routing else None

    def _prefix_forward(self, input_ids_BT, attention_mask_BT, temperature, select_BT, replay,
                        return_routing, plan):  # fmt: skip
        """forward's result with the shared prefix run once (hidden None)."""
        hidden_BSD, routed = prefix_hidden(
            self.policy, input_ids_BT, attention_mask_BT, plan, replay_experts=replay,
            return_routing=return_routing,
        )  # fmt: skip
        p = plan.length
        logp_BS, entropy_BS = head_logprobs(
            self.policy,
            hidden_BSD[:, :-1],
            input_ids_BT[:, p + 1 :],
            temperature=temperature,
            select_BT=None if select_BT is None else select_BT[:, p:],
        )
        before = (p, 0)  # the prefix's positions: 0 (unselected)
        logp_BT = torch.nn.functional.pad(logp_BS, before)
        entropy_BT = torch.nn.functional.pad(entropy_BS, before)
        return logp_BT, entropy_BT, None, routed if return_routing else None

    def _context_forward(self, input_ids_BT, attention_mask_BT, temperature, select_BT, replay):
        """This rank's shard [a, b) through the decoder (the carry relayed from the ranks
        before it), its logprobs [B, n] for the n positions that predict a token, then every
        rank's summed into [B, T-1] (each rank's loss is then the whole loss; the relay's
        anchor rides on the logprobs so that the carry's gradient goes back)."""
        import torch.distributed as dist

        from policy.k3.context import context_hidden, context_span, replicated_sum

        group, length = self.context, input_ids_BT.shape[1]
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        a, b = context_span(self.policy.config, length, ranks, rank, self.segment_tokens)
        hidden_BSD, anchor = context_hidden(
            self.policy.get_decoder(), input_ids_BT[:, a:b], attention_mask_BT[:, a:b],
            group=group, segment=self.segment_tokens or b - a,
            replay_experts=None if replay is None else [r[:, a:b] for r in replay],
        )  # fmt: skip
        n = min(b, length - 1) - a  # positions that predict a token (the last rank: one less)
        logp_Bn, entropy_Bn = _shard_logprobs(
            self.policy, hidden_BSD, input_ids_BT, a, n, temperature, select_BT
        )
        spread = (a, length - 1 - a - n)  # zeros at the other ranks' positions
        logp_BT = replicated_sum(torch.nn.functional.pad(logp_Bn, spread) + anchor, group)
        entropy_BT = replicated_sum(torch.nn.functional.pad(entropy_Bn, spread), group)
        return logp_BT, entropy_BT, None, None


def _shard_logprobs(policy, hidden_BSD, input_ids_BT, a: int, n: int, temperature, select_BT):
    """(logprobs, entropy) [B, n] of a context rank's n predicting positions from position a.
    The LM head runs on every rank whatever the data: a rank with no wanted position (n = 0,
    or none selected) runs it on a stand-in position whose values are dropped (gradient 0), so
    that every parameter has a gradient on every rank and sharded ranks, whose FSDP2 reduces
    each parameter group when its gradients are ready, reduce in the same order."""
    if n:
        targets_Bm, m = input_ids_BT[:, a + 1 : a + 1 + n], n
        wanted_Bm = None if select_BT is None else select_BT[:, a : a + n].bool()
    else:  # the last rank's single token predicts nothing
        targets_Bm, m = input_ids_BT[:, a : a + 1], 1
        wanted_Bm = torch.zeros_like(targets_Bm, dtype=torch.bool)
    run_Bm = wanted_Bm
    if wanted_Bm is not None and not wanted_Bm.any():
        run_Bm = wanted_Bm.clone()
        run_Bm[0, 0] = True
    logp_Bm, entropy_Bm = head_logprobs(
        policy, hidden_BSD[:, :m], targets_Bm, temperature=temperature, select_BT=run_Bm
    )
    if wanted_Bm is not None:  # the stand-in's values are not the caller's (where: no NaN)
        logp_Bm = torch.where(wanted_Bm, logp_Bm, 0.0)
        entropy_Bm = torch.where(wanted_Bm, entropy_Bm, 0.0)
    return logp_Bm[:, :n], entropy_Bm[:, :n]
