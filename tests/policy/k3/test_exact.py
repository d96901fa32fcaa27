"""Exact mode (policy/k3/engine/exact.py): the logprobs ExactSession records while it samples
equal exact_logprobs' scoring of the finished sequences bit for bit (K3, CPU, float32), fused and
module paths, whatever the prefill chunk, the rows decoded together and the episodes beside."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from policy.engines import open_session
from policy.k3.engine import K3Policy
from policy.k3.engine.exact import ExactSession, exact_logprobs
from policy.sampling import SamplingParams
from tests.policy.k3.test_engine import make_model

VOCAB = 512
PARAMS = SamplingParams(temperature=0.9, max_new_tokens=64)


def play(session, seed: int, stride: int) -> list[tuple[list[int], list[int], list[float]]]:
    """Five interleaved episodes of 3 turns: prompts added together, turns of 2-6 sampled tokens
    stepped over changing subsets of the keys (`stride` picks who waits), an observation after
    each turn. Returns each episode's (tokens, sampled positions, recorded logprobs)."""
    rng = np.random.default_rng(seed)
    keys = [f"ep{i}" for i in range(5)]
    tokens = {k: rng.integers(1, VOCAB, size=int(rng.integers(3, 30))).tolist() for k in keys}
    session.add(keys, [list(tokens[k]) for k in keys])
    budget = {k: int(rng.integers(2, 7)) for k in keys}
    positions: dict = {k: [] for k in keys}
    logprobs: dict = {k: [] for k in keys}
    turns, tick = dict.fromkeys(keys, 0), 0
    while any(t < 3 for t in turns.values()):
        live = [k for i, k in enumerate(keys) if turns[k] < 3 and (tick + i) % stride]
        tick += 1
        for key, out in zip(live, session.step(live, PARAMS), strict=True):
            positions[key].append(len(tokens[key]) - 1)
            tokens[key].append(out.token)
            logprobs[key].append(out.logprob)
            budget[key] -= 1
            if budget[key] == 0:
                turns[key] += 1
                observation = rng.integers(1, VOCAB, size=int(rng.integers(1, 9))).tolist()
                session.add([key], [observation])
                tokens[key] += observation
                budget[key] = int(rng.integers(2, 7))
    return [(tokens[k], positions[k], logprobs[k]) for k in keys]


def scored(policy: K3Policy, tokens: list[int], positions: list[int]) -> list[float]:
    out_T = exact_logprobs(policy, tokens, positions, PARAMS.temperature)
    return out_T[positions].tolist()


@pytest.mark.parametrize("fused", [True, False])
def test_recorded_logprobs_equal_the_scored_ones_bit_for_bit(fused):
    model = make_model(torch.float32)
    scorer = K3Policy(model, fused=fused)
    runs = []
    for chunk, batch, stride in ((256, 64, 3), (1, 1, 3), (5, 2, 4)):
        policy = K3Policy(model, fused=fused, exact=True, prefill_chunk=chunk, max_batch=batch)
        session = open_session(policy)
        assert isinstance(session, ExactSession)
        runs.append(play(session, seed=0, stride=stride))
        for tokens, positions, logprobs in runs[-1]:
            assert len(positions) >= 6
            assert scored(scorer, tokens, positions) == logprobs  # every bit of every token
    # the same draws under another prefill chunk and rows per forward: the same tokens and bits
    # (other neighbours, stride 4, change the draws, so the tokens: scored exactly above)
    assert runs[0] == runs[1]


def test_the_pooled_session_is_close_but_not_exact():
    """The contrast exact mode removes: the pooled K3Session (chunked prefill, batched rows,
    shared cache) records logprobs that differ from the exact scoring in the last bits."""
    model = make_model(torch.float32)
    pooled = play(open_session(K3Policy(model, seed=0)), seed=1, stride=3)
    gaps = []
    for tokens, positions, logprobs in pooled:
        want = scored(K3Policy(model), tokens, positions)
        gaps += [abs(a - b) for a, b in zip(want, logprobs, strict=True)]
    assert max(gaps) < 1e-4 and max(gaps) > 0.0


def test_a_weight_change_mid_episode_rebuilds_the_cache_so_later_tokens_stay_exact():
    """An async push lands between two steps of live episodes: the tokens sampled after it
    are scored exactly by the new weights over the whole sequence (the cache the old weights
    built was rebuilt), the ones before it by the old weights."""
    model = make_model(torch.float32)
    policy = K3Policy(model, exact=True)
    session = open_session(policy)
    rng = np.random.default_rng(3)
    keys = ["a", "b"]
    tokens = {k: rng.integers(1, VOCAB, size=12).tolist() for k in keys}
    session.add(keys, [list(tokens[k]) for k in keys])
    before, after = {k: [] for k in keys}, {k: [] for k in keys}
    for phase in (before, after):
        if phase is after:
            old = copy.deepcopy(model)
            with torch.no_grad():  # the push: new weights in place, a new version
                for param in model.parameters():
                    param.add_(0.05 * torch.randn_like(param))
            policy.version += 1
        for _ in range(5):
            for key, out in zip(keys, session.step(keys, PARAMS), strict=True):
                phase[key].append((len(tokens[key]) - 1, out.logprob))
                tokens[key].append(out.token)
    for key in keys:
        for weights, phase in ((old, before), (model, after)):
            positions = [p for p, _ in phase[key]]
            got = scored(K3Policy(weights), tokens[key][: positions[-1] + 2], positions)
            assert got == [lp for _, lp in phase[key]], key
