"""K3Session: every live episode keeps its K3Cache row across turns (policy.session's
DecodeSession for K3Policy).

Letters: B rows of the pool (live keys), b rows of one forward, T new tokens per row of one
forward, S slots, V vocabulary, M MoE layers, Kx experts per token.

One K3Cache, the pool, holds a row per live key. A forward for some keys runs on their rows
only, through the same forward as K3Policy (the fused one of decode.py on the policy's packed
weights, or K3ForCausalLM.forward when fused=False):
- rows that are contiguous in the pool (one key, or all of them) run on views of the pool's
  tensors, without copies; the KDA conv windows and states the forward replaces (rather than
  updates in place) are copied back;
- other subsets are gathered (their rows, MLA slots up to the new ones), run, and only what
  the forward changed is scattered back: KDA conv windows and states, the T new MLA slots and
  their key mask.
Either way the pool gains T slots in every row; rows outside the forward get holes there
(key_mask False; MLA is NoPE, so a row's slots are a set, not positions), squeezed out by
K3Cache.compact once over a third of the slots are holes (K3Policy's rule). Memory thus stays
within ~1.5x the longest live context per row, and capacity shrinks back after drops.

Tokens of several keys in one `add` cannot share a left-padded forward: a key with history
would get the pads' zeros in its KDA short-conv window between its history and its new tokens.
They are fed as a staircase instead: the longest feed runs alone until it is as long as the
next one, then both run, and so on, so that every key ends in the last forward; that is one
forward per distinct length (times chunks of prefill_chunk tokens), and no padding is computed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from policy.k3.cache import K3Cache
from policy.k3.engine.plan import DecodePlan
from policy.k3.engine.runner import K3Policy, routes_array
from policy.k3.paged import PagedBatch, PagePool
from policy.sampling import SamplingParams, sample_next
from policy.session import PolicyBound, Sampled, check_keys, same_prompts

_MIN_COMPACT = 64  # slots below which holes are not worth a compaction


@dataclass(slots=True)
class _Context:
    row: int  # the key's row in the pool
    fed: int = 0  # tokens in the cache
    pending: int | None = None  # sampled by step(), not fed yet
    logits_V: Tensor | None = None  # next-token logits after the last fed token
    pages: list[int] = field(default_factory=list)  # block table (paged mode)


class K3Session(PolicyBound):
    """Per-key K3Cache rows over a K3Policy's model, generator, version and routing setting."""

    def __init__(self, policy: K3Policy) -> None:
        self.policy = policy
        self.contexts: dict[Hashable, _Context] = {}
        self.pool: K3Cache | None = None  # paged mode: KDA rows only, no MLA slots
        self.pages: PagePool | None = None
        if policy.paged:
            param = policy.model.get_input_embeddings().weight
            self.pages = PagePool(policy.model.config, dtype=param.dtype, device=param.device,
                                  page_size=policy.page_size)  # fmt: skip
        self.stats: Counter[str] = Counter()  # forwards on "view"s / "gather"ed rows, compactions
        self._plan: DecodePlan | None = None
        self._plan_key: tuple | None = None
        self._tensors: list[Tensor] = []

    # -- the policy's state ---------------------------------------------------------------------
    # -- the session API ------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, keys: list[Hashable], token_ids: list[list[int]]) -> list[np.ndarray | None]:
        """Feed each key's pending token and `token_ids` (see policy.session.DecodeSession)."""
        check_keys(keys, token_ids)
        vocab = self.policy.model.config.vocab_size
        if any(not 0 <= int(t) < vocab for tokens in token_ids for t in tokens):
            raise ValueError(f"token ids must be in [0, {vocab})")
        self._open([key for key in keys if key not in self.contexts])
        feeds: dict[Hashable, list[int]] = {}
        for key, tokens in zip(keys, token_ids, strict=True):
            ctx = self.contexts[key]
            feed = ([] if ctx.pending is None else [ctx.pending]) + [int(t) for t in tokens]
            if feed:
                feeds[key], ctx.pending, ctx.logits_V = feed, None, None
        copies = self._same_prompts(feeds)  # fed once, then copied row to row
        routes = self._feed(feeds)
        for key, source in copies:
            self._copy_row(self.contexts[source], self.contexts[key])
            if routes is not None:
                routes[key] = list(routes[source])
        return [self._routes(routes, key) for key in keys]

    @torch.inference_mode()
    def step(self, keys: list[Hashable], params: SamplingParams) -> list[Sampled]:
        """Feed the pending tokens (one batched one-token forward), sample one token per key."""
        check_keys(keys)
        if not keys:
            return []
        contexts = [self._context(key) for key in keys]
        for key, ctx in zip(keys, contexts, strict=True):
            if ctx.pending is None and ctx.logits_V is None:
                raise ValueError(f"key {key!r} has an empty context: add() its prompt first")
        feeds = {}
        for key, ctx in zip(keys, contexts, strict=True):
            if ctx.pending is not None:
                feeds[key], ctx.pending = [ctx.pending], None
        routes = self._feed(feeds)
        logits_BV = torch.stack([ctx.logits_V for ctx in contexts])
        tokens_B, logps_B = sample_next(logits_BV, params, self.policy.generator)
        out = []
        for key, ctx, token, logp in zip(keys, contexts, tokens_B.tolist(), logps_B.tolist(),
                                         strict=True):  # fmt: skip
            ctx.pending, ctx.logits_V = token, None
            out.append(Sampled(token=token, logprob=logp, routes=self._routes(routes, key)))
        return out

    @torch.inference_mode()
    def drop(self, keys: list[Hashable]) -> None:
        """Forget these contexts (unknown keys are ignored); their rows leave the pool."""
        dropped = [self.contexts.pop(key) for key in set(keys) if key in self.contexts]
        if not dropped:
            return
        if self.pages is not None:
            self.pages.release([page for ctx in dropped for page in ctx.pages])
        gone = {ctx.row for ctx in dropped}
        if not self.contexts:
            self.pool = None
            return
        keep = [row for row in range(self.pool.num_rows) if row not in gone]
        self.pool.select(torch.tensor(keep, device=self.policy.device))
        moved = {old: new for new, old in enumerate(keep)}
        for ctx in self.contexts.values():
            ctx.row = moved[ctx.row]
        self._maybe_compact()

    def context_length(self, key: Hashable) -> int:
        ctx = self._context(key)
        return ctx.fed + (ctx.pending is not None)

    def bytes_for(self, tokens: int) -> int:
        """What an episode of `tokens` tokens holds: its row of the shared pool, or (paged) its
        KDA row and its pages."""
        dtype = self.policy.model.get_input_embeddings().weight.dtype
        if self.pages is None:
            return K3Cache.row_bytes(self.policy.model.config, tokens, dtype)
        pages = self.pages
        slots = pages.pages_for(tokens) * pages.page
        return K3Cache.row_bytes(self.policy.model.config, 0, dtype) + slots * pages.token_bytes()

    def reserve_for(self, tokens: int) -> int:
        """Bytes to set aside for an episode that may grow to `tokens` tokens: twice its row
        (the pool's rows are copied when episodes join or leave, and the slot pool's capacity
        doubles as it grows); paged, twice its KDA row plus its pages (pages never move)."""
        if self.pages is None:
            return 2 * self.bytes_for(tokens)
        return self.bytes_for(tokens) + self.bytes_for(0)

    def cache_bytes(self, key: Hashable) -> int:
        """KDA states and conv windows of key's row + its MLA latents in use."""
        ctx, pool = self._context(key), self.pool
        total = sum(x[ctx.row].numel() * x.element_size() for x in (*pool.conv, *pool.state)
                    if x is not None)  # fmt: skip
        if self.pages is not None:
            return total + ctx.fed * self.pages.token_bytes()
        used = int(pool.key_mask[ctx.row, : pool.length].sum())
        total += sum(used * x.shape[-1] * x.element_size() for x in pool.latent if x is not None)
        return total

    # -- contexts -------------------------------------------------------------------------------
    def _context(self, key: Hashable) -> _Context:
        if key not in self.contexts:
            raise KeyError(f"no context for key {key!r}")
        return self.contexts[key]

    def _open(self, keys: list[Hashable]) -> None:
        """New, empty rows (zero KDA state, MLA slots all holes) at the end of the pool."""
        if not keys:
            return
        param = self.policy.model.get_input_embeddings().weight
        fresh = K3Cache.empty(self.policy.model.config, len(keys), dtype=param.dtype,
                              device=param.device)  # fmt: skip
        start = 0 if self.pool is None else self.pool.num_rows
        if self.pool is None:
            self.pool = fresh
        else:
            self.pool.extend(fresh)
        for i, key in enumerate(keys):
            self.contexts[key] = _Context(row=start + i)

    def _same_prompts(self, feeds: dict[Hashable, list[int]]) -> list[tuple[Hashable, Hashable]]:
        """Takes out of `feeds` every new key (nothing fed) whose tokens an earlier new key
        of the same call has: [(that key, the earlier one)] (a GRPO group's samples). Not in
        paged mode (a copy would need its own pages)."""
        if self.pages is not None:
            return []
        _, copies = same_prompts(list(feeds.items()), lambda key: not self.contexts[key].fed)
        for key, _ in copies:
            del feeds[key]
        return copies

    def _copy_row(self, source: _Context, ctx: _Context) -> None:
        """ctx's row becomes a copy of source's (KDA conv windows and state, MLA slots, key
        mask), with its logits and length."""
        pool = self.pool
        for x in (*pool.conv, *pool.state, *pool.latent, pool.key_mask):
            if x is not None:
                x[ctx.row] = x[source.row]
        ctx.fed, ctx.logits_V = source.fed, source.logits_V

    def _routes(
        self, routes: dict[Hashable, list[Tensor]] | None, key: Hashable
    ) -> np.ndarray | None:
        """Key's routes of this call, int16 [n, M, Kx] (n = 0 if nothing was fed), or None."""
        if routes is None:
            return None
        return routes_array(routes.get(key, []), self.policy.model.config)

    # -- forwards -------------------------------------------------------------------------------
    def _feed(self, feeds: dict[Hashable, list[int]]) -> dict[Hashable, list[Tensor]] | None:
        """Feed every key its tokens (staircase, see the module docstring) -> routes per key
        ([T, M, Kx] pieces in order) or None when not recording."""
        routes: dict[Hashable, list[Tensor]] = {key: [] for key in feeds}
        plan = self._current_plan() if feeds else None
        left = {key: len(tokens) for key, tokens in feeds.items()}
        while left:
            top = max(left.values())
            below = max((n for n in left.values() if n < top), default=0)
            width = min(top - below, self.policy.prefill_chunk)
            group = [key for key, n in left.items() if n == top]
            for start in range(0, len(group), self.policy.max_batch):
                part = group[start : start + self.policy.max_batch]
                ids = [feeds[k][len(feeds[k]) - top : len(feeds[k]) - top + width] for k in part]
                for key, routed_TMK in self._forward(part, ids, plan).items():
                    routes[key].append(routed_TMK)
            for key in group:
                left[key] -= width
                if not left[key]:
                    del left[key]
        self._maybe_compact()
        return routes if self.policy.record_routing else None

    def _forward(self, keys: list[Hashable], ids: list[list[int]], plan: DecodePlan | None):
        """One forward of these keys' rows (T tokens each) -> {key: routing [T, M, Kx]}; sets
        their logits."""
        order = sorted(range(len(keys)), key=lambda i: self.contexts[keys[i]].row)
        keys, rows = [keys[i] for i in order], [self.contexts[keys[i]].row for i in order]
        ids_BT = torch.tensor([ids[i] for i in order], dtype=torch.long, device=self.policy.device)
        sub, index = self._gather(rows, ids_BT.shape[1])
        if self.pages is not None:
            sub = self._paged(sub, keys, ids_BT.shape[1])
        logits_BV, routed_BTMK = self.policy.forward(sub, ids_BT, None, plan)
        self._scatter(sub, index, ids_BT.shape[1])
        for b, key in enumerate(keys):
            ctx = self.contexts[key]
            ctx.fed, ctx.logits_V = ctx.fed + ids_BT.shape[1], logits_BV[b]
        if routed_BTMK is None:
            return {}
        routed_BTMK = routed_BTMK.to("cpu", torch.int16)
        return {key: routed_BTMK[b] for b, key in enumerate(keys)}

    def _gather(self, rows: list[int], width: int) -> tuple[K3Cache, slice | Tensor]:
        """The rows' cache, with room for `width` new slots: views of the pool when the rows
        are contiguous, else gathered copies (MLA slots up to the new ones only)."""
        pool = self.pool
        if self.pages is None:
            pool.reserve(width)
        end = pool.length + width
        if rows[-1] - rows[0] + 1 == len(rows):
            index: slice | Tensor = slice(rows[0], rows[-1] + 1)
            self.stats["view"] += 1

            def take(x: Tensor, slots: bool = False) -> Tensor:
                return x[index]
        else:
            index = torch.tensor(rows, device=pool.key_mask.device)
            self.stats["gather"] += 1

            def take(x: Tensor, slots: bool = False) -> Tensor:
                return (x[:, :end] if slots else x).index_select(0, index)

        sub = K3Cache(
            [None if x is None else take(x) for x in pool.conv],
            [None if x is None else take(x) for x in pool.state],
            [None if x is None else take(x, True) for x in pool.latent],
            take(pool.key_mask, True), pool.length, pool.splits,
        )  # fmt: skip
        return sub, index

    def _scatter(self, sub: K3Cache, index: slice | Tensor, width: int) -> None:
        """Write back what a forward on `sub` changed; the pool gains `width` slots."""
        pool = self.pool
        start, end = pool.length, pool.length + width
        for store, new in ((pool.conv, sub.conv), (pool.state, sub.state)):
            for i, x in enumerate(new):
                if x is not None:
                    _put(store[i], index, x)
        if self.pages is not None:  # the forward wrote its latents into their pages
            return
        if isinstance(index, Tensor):  # views already wrote their MLA slots and key mask
            for i, x in enumerate(sub.latent):
                if x is not None:
                    pool.latent[i][index, start:end] = x[:, start:end]
            pool.key_mask[index, start:end] = sub.key_mask[:, start:end]
        pool.length = end

    def _paged(self, sub: K3Cache, keys: list[Hashable], width: int) -> PagedBatch:
        """The rows' KDA state with their block tables, pages for `width` more tokens added."""
        contexts = [self.contexts[key] for key in keys]
        for ctx in contexts:
            need = self.pages.pages_for(ctx.fed + width) - len(ctx.pages)
            if need > 0:
                ctx.pages.extend(self.pages.allocate(need))
        tables, lengths = [ctx.pages for ctx in contexts], [ctx.fed for ctx in contexts]
        return PagedBatch(sub.conv, sub.state, sub.splits, self.pages, tables, lengths)

    def _maybe_compact(self) -> None:
        """Squeeze out holes once they are over a third of the slots; shrink spare capacity."""
        pool = self.pool
        if pool is None or pool.length < _MIN_COMPACT:
            return
        used = int(pool.key_mask[:, : pool.length].sum(1).max())
        if 2 * pool.length > 3 * used:
            pool.compact()
            self.stats["compact"] += 1
        room = 2 * max(pool.length, _MIN_COMPACT)
        if pool.capacity > 2 * room:
            pool.key_mask = pool.key_mask[:, :room].clone()
            pool.latent = [None if x is None else x[:, :room].clone() for x in pool.latent]

    def _current_plan(self) -> DecodePlan | None:
        """policy.plan() (packed weights, rebuilt on any weight change), checked cheaply."""
        if not self.policy.fused:
            return None
        if self._plan_key is None or self._plan_key[0] != self.policy.version:
            self._tensors = list(self.policy.model.state_dict().values())
        key = (self.policy.version, *((t.data_ptr(), t._version) for t in self._tensors))
        if key != self._plan_key:
            self._plan, self._plan_key = self.policy.plan(), key
        return self._plan


def _put(dst: Tensor, index: slice | Tensor, src: Tensor) -> None:
    """dst[index] = src along dim 0, skipped when src already is that view."""
    if isinstance(index, Tensor):
        dst.index_copy_(0, index, src)
        return
    view = dst[index]
    if view.data_ptr() != src.data_ptr() or view.stride() != src.stride():
        view.copy_(src)
