"""Per-episode decode sessions: each live episode keeps its cache across turns.

This module holds what every session shares (the DecodeSession protocol, Sampled, PolicyBound,
check_keys) and imports no implementation: policy/hf_session.py (HFSession) and
policy/k3/engine/session.py (K3Session) import it, and policy.engines.open_session, the one
dispatch from a policy to its session, imports them.

A rollout's agent loop without a barrier: every episode is a key; its prompt is `add`ed once,
then it alternates `step` calls (one sampled token each, batched with whatever other episodes
are generating at that moment) and `add` calls (a tool observation: a chunked prefill of those
tokens only, never of the history). `drop` forgets the episode.

    session = open_session(policy)         # K3Policy -> K3Session, HFPolicy -> HFSession
    session.add([a, b], [prompt_a, prompt_b])
    out = session.step([a, b], params)     # out[i].token is key i's *pending* token
    session.add([a], [observation])        # feeds a's pending token, then the observation
    session.step([a, b], params)           # a and b at different turns, one batched step

Token bookkeeping: a token sampled by `step` is not fed at once; it is the key's pending token
and is fed first by the key's next `step` or `add` (so a finished turn costs no forward for
its last token, exactly like K3Policy.generate, which never feeds its last sample). Hence
context_length(key) counts the pending token, and the positions forwarded for a key over its
whole life are 0 .. context_length - 2: the routes returned by `add` and `step` (K3 with
record_routing) cover each of them exactly once, in order, at the time they were computed.

Logprobs are log_softmax(logits / T) over the full vocabulary at the sampled token (greedy:
T = 1), as policy.sampling.sample_next reports them. SamplingParams.max_new_tokens and
stop_token_ids play no role in a step (the caller decides when a turn ends).

Weights: `load_weights` installs a verified push between two calls; live contexts keep their
caches, whose entries were computed by the weights of their time (the in-flight update's
documented trade-off), and so do the next-token logits a key holds when its last call was an
`add` (no pending token): its next sample still comes from them. A key with a pending token
gets logits of the new weights at its next step.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from policy.sampling import SamplingParams


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float
    """log_softmax(logits / T) at the token over the full vocabulary (greedy: T = 1)."""
    routes: np.ndarray | None = field(compare=False)
    """Routes (int16 [n, M, Kx]: M MoE layers, Kx experts per token) of the positions forwarded
    for this key during this step(): n = 1 if a pending token was fed, 0 if none; None when the
    session records no routing."""


class DecodeSession(Protocol):
    version: int

    def add(self, keys: list[Hashable], token_ids: list[list[int]]) -> list[np.ndarray | None]:
        """Append tokens to each key's context (an unknown key starts a new, empty context),
        the key's pending token first; one chunked prefill of the new tokens only, batched
        across keys. Returns, per key, the routes of every position forwarded (int16
        [n, M, Kx], the pending token's included) or None when not recording. Afterwards every
        key that got tokens has fresh next-token logits."""
        ...

    def step(self, keys: list[Hashable], params: SamplingParams) -> list[Sampled]:
        """One decode step for these keys, batched: the keys with a pending token feed it (one
        one-token forward for all of them), then one token is sampled for every key from its
        logits and becomes that key's pending token (not fed yet)."""
        ...

    def drop(self, keys: list[Hashable]) -> None:
        """Forget these contexts and free their cache."""
        ...

    def load_weights(self, version: int, weights: dict[str, np.ndarray], expected: int) -> None:
        """Install verified weights as `version` between two calls; contexts are kept."""
        ...

    def reseed(self, seed: int) -> None:
        """Make the next draws a function of `seed` alone."""
        ...

    def context_length(self, key: Hashable) -> int:
        """Tokens in key's context, the pending token included."""
        ...

    def cache_bytes(self, key: Hashable) -> int:
        """Bytes of key's cache in use."""
        ...

    def bytes_for(self, tokens: int) -> int:
        """Cache bytes one episode of `tokens` tokens holds."""
        ...

    def reserve_for(self, tokens: int) -> int:
        """Cache bytes to set aside for an episode that may grow to `tokens` tokens: what it
        then holds plus the cache's own slack as it grows (the admission model)."""
        ...


class PolicyBound:
    """What every session delegates to the policy it wraps: version, weights, RNG."""

    policy: Any

    @property
    def version(self) -> int:
        return self.policy.version

    @version.setter
    def version(self, value: int) -> None:
        self.policy.version = value

    def load_weights(self, version: int, weights: dict[str, np.ndarray], expected: int) -> None:
        """Install verified weights as `version` (the policy's too); contexts are kept."""
        self.policy.load_weights(version, weights, expected)

    def reseed(self, seed: int) -> None:
        self.policy.reseed(seed)


def check_keys(keys: list[Hashable], token_ids: list[list[int]] | None = None) -> None:
    """Keys of one call must be distinct (and match token_ids one to one)."""
    if len(set(keys)) != len(keys):
        raise ValueError("a key appears twice in one call")
    if token_ids is not None and len(token_ids) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(token_ids)} token lists")


def same_prompts(entries: list[tuple[Any, list[int]]], fresh) -> tuple[list, list]:
    """(the entries to forward, [(item, the earlier item with the same tokens)]): of the
    `fresh(item)` entries (nothing fed yet) given the same tokens, only the first is forwarded;
    the others copy it (a GRPO group's samples share their prompt)."""
    first: dict[tuple[int, ...], Any] = {}
    keep, copies = [], []
    for item, tokens in entries:
        source = first.setdefault(tuple(tokens), item) if fresh(item) else item
        if source is item:
            keep.append((item, tokens))
        else:
            copies.append((item, source))
    return keep, copies
