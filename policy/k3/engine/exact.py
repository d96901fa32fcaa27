"""Exact mode (`trainer.exact_logprobs`): the logprobs the rollout engine records and the ones
the learner computes come from one computation on the same shapes, so they are equal bit for
bit for the same tokens and weights (K3 on CPU in float32).

What a token's logits depend on in the pooled K3Session also includes the prefill chunk that
carried it, the rows decoded beside it and the holes other episodes left in the shared cache
(different shapes, so different reduction orders). Here none of that exists: every episode has
its own one-row K3Cache, and every token goes through K3Policy.forward alone (one row, one
token, the same fused or module path as the pooled session). A token's logits are then a
function of the tokens before it and the weights only (after a weight change a live episode's
cache is rebuilt with the new weights before it samples again):
- ExactSession samples that way (a DecodeSession, opened for a K3Policy built with exact=True);
- exact_logprobs scores a finished sequence the same way (the learner's values in exact mode).
Both take the logprob with `scaled_logprob`, the one formula of policy.sampling (log_softmax of
the float logits over T). The price is one forward per token and per episode (the speed is in
docs/benchmarks.md, `benchmarks/exact_logprobs.py`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from policy.k3.cache import K3Cache
from policy.k3.engine.runner import K3Policy, routes_array
from policy.sampling import SamplingParams, sample_next
from policy.session import PolicyBound, Sampled, check_keys


def scaled_logprob(logits_1V: Tensor, token: int, temperature: float) -> float:
    """log_softmax(logits / T)[token], as policy.sampling.sample_next computes it."""
    logp_1V = torch.log_softmax(logits_1V.float() / temperature, -1)
    return float(logp_1V[0, token])


@dataclass(slots=True)
class _Row:
    cache: K3Cache
    version: int  # the weights that built the cache
    tokens: list[int] = field(default_factory=list)  # fed so far
    pending: int | None = None  # sampled, not fed yet
    logits_1V: Tensor | None = None  # next-token logits after the last fed token


def _empty(policy: K3Policy) -> K3Cache:
    dtype = policy.model.get_input_embeddings().weight.dtype
    return K3Cache.empty(policy.model.config, 1, dtype=dtype, device=policy.device)


def _one(policy: K3Policy, row: _Row, token: int, plan) -> Tensor | None:
    """Feed one token to one row -> its route, int16 [1, M, Kx] (None when not recording)."""
    ids_11 = torch.tensor([[token]], dtype=torch.long, device=policy.device)
    row.logits_1V, routed_11MK = policy.forward(row.cache, ids_11, None, plan)
    row.tokens.append(token)
    return None if routed_11MK is None else routed_11MK[0].to("cpu", torch.int16)


def _recorded(policy: K3Policy, parts: list[Tensor | None]) -> np.ndarray | None:
    """The routes of one call, int16 [n, M, Kx], or None when the policy does not record."""
    return routes_array(parts, policy.model.config) if policy.record_routing else None


class ExactSession(PolicyBound):
    """A DecodeSession whose every token is its own one-row, one-token forward."""

    def __init__(self, policy: K3Policy) -> None:
        self.policy = policy
        self.rows: dict[Hashable, _Row] = {}

    @torch.inference_mode()
    def add(self, keys: list[Hashable], token_ids: list[list[int]]) -> list[np.ndarray | None]:
        check_keys(keys, token_ids)
        plan, out = self._plan(), []
        for key, tokens in zip(keys, token_ids, strict=True):
            row = self.rows.setdefault(key, _Row(_empty(self.policy), self.policy.version))
            self._refresh(row, plan)
            feed = ([] if row.pending is None else [row.pending]) + [int(t) for t in tokens]
            row.pending = None
            routes = [_one(self.policy, row, token, plan) for token in feed]
            out.append(_recorded(self.policy, routes))
        return out

    @torch.inference_mode()
    def step(self, keys: list[Hashable], params: SamplingParams) -> list[Sampled]:
        check_keys(keys)
        plan, out = self._plan(), []
        temperature = 1.0 if params.greedy else params.temperature
        for key in keys:
            row = self._row(key)
            self._refresh(row, plan)
            routes = [] if row.pending is None else [_one(self.policy, row, row.pending, plan)]
            if row.logits_1V is None:
                raise ValueError(f"key {key!r} has an empty context: add() its prompt first")
            token = int(sample_next(row.logits_1V, params, self.policy.generator)[0][0])
            logprob = scaled_logprob(row.logits_1V, token, temperature)
            row.pending, row.logits_1V = token, None
            recorded = _recorded(self.policy, routes)
            out.append(Sampled(token=token, logprob=logprob, routes=recorded))
        return out

    def _refresh(self, row: _Row, plan) -> None:
        """After a weight change, rebuild the row's cache with the new weights (one token per
        forward, routes not recorded again: those of the old tokens stay as sampled), so that
        what is sampled next depends on the current weights alone, as the learner scores it."""
        if row.version == self.policy.version:
            return
        tokens, row.cache, row.tokens = row.tokens, _empty(self.policy), []
        row.version, row.logits_1V = self.policy.version, None
        for token in tokens:
            _one(self.policy, row, token, plan)

    def drop(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.rows.pop(key, None)

    def context_length(self, key: Hashable) -> int:
        row = self._row(key)
        return len(row.tokens) + (row.pending is not None)

    def cache_bytes(self, key: Hashable) -> int:
        cache = self._row(key).cache
        total = sum(x.numel() * x.element_size() for x in (*cache.conv, *cache.state)
                    if x is not None)  # fmt: skip
        return total + sum(cache.length * x.shape[-1] * x.element_size() for x in cache.latent
                           if x is not None)  # fmt: skip

    def bytes_for(self, tokens: int) -> int:
        dtype = self.policy.model.get_input_embeddings().weight.dtype
        return K3Cache.row_bytes(self.policy.model.config, tokens, dtype)

    def reserve_for(self, tokens: int) -> int:
        """Twice bytes_for: each row's slots grow by doubling, and copy as they grow."""
        return 2 * self.bytes_for(tokens)

    def _row(self, key: Hashable) -> _Row:
        if key not in self.rows:
            raise KeyError(f"no context for key {key!r}")
        return self.rows[key]

    def _plan(self):
        return self.policy.plan() if self.policy.fused else None


@torch.no_grad()
def exact_logprobs(
    policy: K3Policy, token_ids: list[int], targets: list[int], temperature: float
) -> Tensor:
    """[len(token_ids) - 1] float32: at each position p in `targets`, the logprob of token
    p + 1 after token_ids[: p + 1], computed as ExactSession computed it when it sampled that
    token (0 elsewhere)."""
    row, plan = _Row(_empty(policy), policy.version), policy.plan() if policy.fused else None
    wanted, out_T = set(targets), torch.zeros(len(token_ids) - 1)
    for p, token in enumerate(token_ids[:-1]):
        _one(policy, row, token, plan)
        if p in wanted:
            out_T[p] = scaled_logprob(row.logits_1V, token_ids[p + 1], temperature)
    return out_T
