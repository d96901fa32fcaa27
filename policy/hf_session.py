"""HFSession: every live episode keeps its transformers cache across turns (policy.session's
DecodeSession for HFPolicy, any causal LM).

Letters: B keys of one forward, H key/value heads, L cached tokens (Lmax the longest), T new
tokens (Tmax the longest), D head dim, V vocabulary.

Each key keeps the cache object its model returned. When every key of a forward holds plain
full-attention DynamicCache layers, the forward is batched: the caches are left-padded to Lmax
and stacked, the new tokens left-padded to Tmax, a 2D attention mask zeroes both paddings,
position_ids give each key its own positions. The stacked cache then stays stacked (the
session's batch): the next forwards that feed one token to each of at least half of its keys
run on it directly (the other rows get a masked pad token), so a run of decode steps over the
same episodes copies no cache. Any other forward first cuts each key's real slots back out of
the batch (so a key's own cache holds exactly its tokens), then stacks again. Other caches
(sliding windows, linear attention, K3Cache) are fed one key at a time. A prompt `add`ed to
several new keys at once (a GRPO group's samples) is prefilled once and its cache shared. This is
the generic engine; the K3 one (policy/k3/engine/session.py) keeps its rows in place.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from policy.hf import HFPolicy
from policy.k3.cache import K3Cache
from policy.sampling import SamplingParams, sample_next
from policy.session import PolicyBound, Sampled, check_keys, same_prompts


@dataclass(slots=True, eq=False)  # identity: contexts are found in the batch by `is`
class _Context:
    cache: Any = None  # the model's cache object; None before the first forward or when batched
    fed: int = 0  # tokens in the cache
    pending: int | None = None  # sampled by step(), not fed yet
    logits_V: Tensor | None = None  # next-token logits after the last fed token
    batched: bool = False  # its cache is a row of the session's batch


@dataclass(slots=True)
class _Batch:
    """The caches of the last stacked forward, left stacked: row b is contexts[b]'s."""

    contexts: list[_Context]
    cache: DynamicCache  # [B, H, W, D] per layer
    mask_BW: Tensor  # long: 1 at each row's real slots (padding and idle steps are 0)


class HFSession(PolicyBound):
    """Per-key transformers caches over an HFPolicy's model, generator and version."""

    def __init__(self, policy: HFPolicy) -> None:
        self.policy = policy
        self.model = policy.model
        self.device = next(policy.model.parameters()).device
        self.contexts: dict[Hashable, _Context] = {}
        self.batched_forwards = 0
        self._plain: bool | None = None  # does the model return plain DynamicCaches?
        self._batch: _Batch | None = None

    @torch.inference_mode()
    def add(self, keys: list[Hashable], token_ids: list[list[int]]) -> list[None]:
        """Feed each key's pending token and `token_ids`; no routing is recorded (None)."""
        check_keys(keys, token_ids)
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= int(t) < vocab for tokens in token_ids for t in tokens):
            raise ValueError(f"token ids must be in [0, {vocab})")
        entries = []
        for key, tokens in zip(keys, token_ids, strict=True):
            ctx = self.contexts.setdefault(key, _Context())
            feed = ([] if ctx.pending is None else [ctx.pending]) + [int(t) for t in tokens]
            if feed:
                ctx.pending, ctx.logits_V = None, None
                entries.append((ctx, feed))
        entries, copies = same_prompts(
            entries, lambda ctx: ctx.fed == 0 and ctx.cache is None and not ctx.batched
        )
        self._forward(entries)
        if any(source.batched for _, source in copies):
            self._release()  # the prompt's cache out of the batch, to be shared
        for ctx, source in copies:  # same prompt: the cache object copied, its tensors shared
            layers = source.cache.layers
            ctx.cache = DynamicCache(ddp_cache_data=[(x.keys, x.values) for x in layers])
            ctx.logits_V, ctx.fed = source.logits_V, source.fed
        return [None] * len(keys)

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
        entries = [(ctx, [ctx.pending]) for ctx in contexts if ctx.pending is not None]
        for ctx, _ in entries:
            ctx.pending = None
        self._forward(entries)
        logits_BV = torch.stack([ctx.logits_V for ctx in contexts])
        tokens_B, logps_B = sample_next(logits_BV, params, self.policy.generator)
        out = []
        for ctx, token, logp in zip(contexts, tokens_B.tolist(), logps_B.tolist(), strict=True):
            ctx.pending, ctx.logits_V = token, None
            out.append(Sampled(token=token, logprob=logp, routes=None))
        return out

    def drop(self, keys: list[Hashable]) -> None:
        """Forget these contexts (unknown keys are ignored; a batched one's row idles on)."""
        for key in keys:
            ctx = self.contexts.pop(key, None)
            if ctx is not None:
                ctx.batched = False

    def context_length(self, key: Hashable) -> int:
        ctx = self._context(key)
        return ctx.fed + (ctx.pending is not None)

    def bytes_for(self, tokens: int) -> int:
        """Keys and values of every attention layer for `tokens` tokens (K3 models: K3Cache)."""
        config, dtype = self.model.config, self.model.get_input_embeddings().weight.dtype
        if hasattr(config, "linear_attn_config"):
            return K3Cache.row_bytes(config, tokens, dtype)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        item = torch.finfo(dtype).bits // 8
        return config.num_hidden_layers * 2 * heads * head_dim * item * tokens

    def reserve_for(self, tokens: int) -> int:
        """Twice bytes_for: a cache grows by doubling its capacity, and copies as it grows."""
        return 2 * self.bytes_for(tokens)

    def cache_bytes(self, key: Hashable) -> int:
        """Bytes of key's cached keys and values (K3Cache: KDA state + conv + MLA slots)."""
        ctx = self._context(key)
        if ctx.batched:  # its real slots in the batch
            row = self._batch.contexts.index(ctx)
            return int(self._batch.mask_BW[row].sum()) * self._slot_bytes()
        cache = ctx.cache
        if cache is None:
            return 0
        if hasattr(cache, "nbytes"):  # K3Cache
            sizes = cache.nbytes()
            return sizes["kda_state"] + sizes["kda_conv"] + sizes["mla_latent"]
        return sum(
            x.numel() * x.element_size()
            for layer in getattr(cache, "layers", ())
            for x in (layer.keys, layer.values)
            if isinstance(x, Tensor)
        )

    def _context(self, key: Hashable) -> _Context:
        if key not in self.contexts:
            raise KeyError(f"no context for key {key!r}")
        return self.contexts[key]

    def _slot_bytes(self) -> int:
        """Bytes of one cached token in the batch (keys and values of every layer)."""
        layers = self._batch.cache.layers
        return sum((x.keys[0, :, 0].numel() + x.values[0, :, 0].numel()) * x.keys.element_size()
                   for x in layers)  # fmt: skip

    # -- forwards -------------------------------------------------------------------------------
    def _forward(self, entries: list[tuple[_Context, list[int]]]) -> None:
        if not entries or self._decode_in_batch(entries):
            return
        self._release()
        if len(entries) > 1 and self._plain and all(_plain(c.cache) for c, _ in entries):
            self._forward_stacked(entries)
            self.batched_forwards += 1
        else:
            for ctx, tokens in entries:
                self._forward_one(ctx, tokens)

    def _run(self, ids_BT: Tensor, mask_BS: Tensor, pos_BT: Tensor, cache) -> tuple[Tensor, Any]:
        out = self.model(input_ids=ids_BT, attention_mask=mask_BS, position_ids=pos_BT,
                         cache=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1], getattr(out, "cache", None) or out.past_key_values

    def _forward_one(self, ctx: _Context, tokens: list[int]) -> None:
        total = ctx.fed + len(tokens)
        ids_1T = torch.tensor([tokens], dtype=torch.long, device=self.device)
        mask_1S = torch.ones(1, total, dtype=torch.long, device=self.device)
        pos_1T = torch.arange(ctx.fed, total, device=self.device)[None]
        logits_1V, ctx.cache = self._run(ids_1T, mask_1S, pos_1T, ctx.cache)
        ctx.logits_V, ctx.fed = logits_1V[0], total
        if self._plain is None:
            self._plain = _plain(ctx.cache)

    def _forward_stacked(self, entries: list[tuple[_Context, list[int]]]) -> None:
        """One left-padded forward over all entries (every cache plain or None)."""
        lengths = [ctx.fed for ctx, _ in entries]
        news = [len(tokens) for _, tokens in entries]
        width, new = max(lengths), max(news)
        batch, device = len(entries), self.device
        ids_BT = torch.full((batch, new), self.policy.pad_token_id, dtype=torch.long)
        mask_BS = torch.zeros((batch, width + new), dtype=torch.long)
        pos_BT = torch.zeros((batch, new), dtype=torch.long)
        for b, ((_, tokens), length, count) in enumerate(zip(entries, lengths, news, strict=True)):
            ids_BT[b, new - count :] = torch.tensor(tokens)
            mask_BS[b, width - length : width] = 1
            mask_BS[b, width + new - count :] = 1
            pos_BT[b, new - count :] = torch.arange(length, length + count)
        cache = _stack([ctx.cache for ctx, _ in entries], lengths, width) if width else None
        logits_BV, batched = self._run(ids_BT.to(device), mask_BS.to(device), pos_BT.to(device),
                                       cache)  # fmt: skip
        for b, (ctx, tokens) in enumerate(entries):
            ctx.cache, ctx.batched = None, True
            ctx.logits_V, ctx.fed = logits_BV[b], ctx.fed + len(tokens)
        self._batch = _Batch([ctx for ctx, _ in entries], batched, mask_BS.to(device))

    def _decode_in_batch(self, entries: list[tuple[_Context, list[int]]]) -> bool:
        """One token for each entry, all rows of the batch, and at least half of its rows:
        one forward on the batch (the others' rows get a masked pad token); else False."""
        batch = self._batch
        if batch is None or 2 * len(entries) < len(batch.contexts):
            return False
        rows = {id(ctx): b for b, ctx in enumerate(batch.contexts) if ctx.batched}
        index = [rows.get(id(ctx)) for ctx, _ in entries]
        if None in index or any(len(tokens) != 1 for _, tokens in entries):
            return False
        size = len(batch.contexts)
        ids_B1 = torch.full((size, 1), self.policy.pad_token_id, dtype=torch.long)
        new_B1, pos_B1 = torch.zeros((size, 1), dtype=torch.long), torch.zeros_like(ids_B1)
        for (ctx, tokens), b in zip(entries, index, strict=True):
            ids_B1[b, 0], new_B1[b, 0], pos_B1[b, 0] = tokens[0], 1, ctx.fed
        mask_BW = torch.cat([batch.mask_BW, new_B1.to(self.device)], 1)
        logits_BV, batch.cache = self._run(ids_B1.to(self.device), mask_BW,
                                           pos_B1.to(self.device), batch.cache)  # fmt: skip
        batch.mask_BW = mask_BW
        for (ctx, _), b in zip(entries, index, strict=True):
            ctx.logits_V, ctx.fed = logits_BV[b], ctx.fed + 1
        self.batched_forwards += 1
        return True

    def _release(self) -> None:
        """Cut each live row's real slots out of the batch into its own cache; no batch after."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        keep_BW = batch.mask_BW.bool()
        for b, ctx in enumerate(batch.contexts):
            if not ctx.batched:
                continue
            slots_S = keep_BW[b].nonzero()[:, 0]
            ctx.cache = DynamicCache(
                ddp_cache_data=[
                    (layer.keys[b : b + 1, :, slots_S], layer.values[b : b + 1, :, slots_S])
                    for layer in batch.cache.layers
                ]
            )
            ctx.batched = False


def _plain(cache) -> bool:
    """None, or a DynamicCache of full-attention DynamicLayers only (stackable)."""
    if cache is None:
        return True
    return isinstance(cache, DynamicCache) and all(
        type(layer) is DynamicLayer for layer in cache.layers
    )


def _stack(caches: list, lengths: list[int], width: int) -> DynamicCache:
    """Per-key caches ([1, H, L, D] per layer; None = no tokens) -> one [B, H, Lmax, D] cache,
    each left-padded with zeros to `width` slots."""
    some = next(c for c in caches if c is not None)
    data = []
    for j, layer in enumerate(some.layers):
        keys, values = [], []
        for cache, length in zip(caches, lengths, strict=True):
            if cache is None:
                shape = (1, layer.keys.shape[1], width, layer.keys.shape[-1])
                keys.append(layer.keys.new_zeros(shape))
                values.append(layer.values.new_zeros((*shape[:3], layer.values.shape[-1])))
                continue
            pad = (0, 0, width - length, 0)
            keys.append(F.pad(cache.layers[j].keys, pad))
            values.append(F.pad(cache.layers[j].values, pad))
        data.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=data)
