"""Balanced context shards (policy/k3/context.py shard_bounds, pair_cost): whole segments, at
least one per rank, the largest rank cost (tokens plus pair_cost per query-key pair) the
smallest any cut achieves; by tokens below min_length."""

from __future__ import annotations

import itertools

import pytest

from policy.k3 import k3_preset
from policy.k3.context import context_span, min_length, pair_cost, shard_bounds


def rank_costs(bounds: list[int], cost: float) -> list[float]:
    """Each shard's tokens plus `cost` per query-key pair (query t meets t + 1 keys)."""
    return [(b - a) * (1 + cost * (a + b + 1) / 2) for a, b in itertools.pairwise(bounds)]


def best_max_cost(length: int, ranks: int, segment: int, cost: float) -> float:
    """The smallest largest-rank cost over every cut into whole segments (exhaustive)."""
    edges = [*range(0, length, segment), length]
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(edges) - 1), ranks - 1):
        bounds = [0, *(edges[i] for i in cuts), length]
        best = min(best, max(rank_costs(bounds, cost)))
    return best


@pytest.mark.parametrize("length", [13, 23, 40, 61])
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("cost", [0.0, 0.01, 0.3, 50.0])
def test_balanced_shards_are_optimal_whole_segments(length, ranks, cost):
    segment = 4
    assert length >= min_length(ranks, segment)  # (shorter ones are split by tokens: below)
    bounds = shard_bounds(length, ranks, segment, cost)
    assert bounds[0] == 0 and bounds[-1] == length and len(bounds) == ranks + 1
    assert all(b > a for a, b in itertools.pairwise(bounds)), bounds  # a segment at least
    assert all(b % segment == 0 for b in bounds[:-1]), bounds  # whole segments
    best = best_max_cost(length, ranks, segment, cost)
    assert max(rank_costs(bounds, cost)) == pytest.approx(best, rel=1e-9)


def test_no_pair_cost_splits_segment_counts_within_one():
    assert shard_bounds(20, 2, 4) == [0, 12, 20]  # 5 segments: 3 + 2 (a tie: the later cut)
    assert shard_bounds(24, 3, 4) == [0, 8, 16, 24]
    for segments in range(2, 40):
        for ranks in range(2, min(segments, 8) + 1):
            bounds = shard_bounds(segments * 4, ranks, 4)
            counts = [(b - a) // 4 for a, b in itertools.pairwise(bounds)]
            assert max(counts) - min(counts) <= 1, (segments, ranks, counts)


def test_k3_tiny_balanced_shards_give_earlier_ranks_more_tokens():
    """At 64K, 2 ranks: even segment counts leave the second rank about 2.4 times the first's
    FLOPs (its queries meet every earlier key); the balanced split gives the first rank 45,056
    tokens and keeps the two within one segment's cost."""
    cost = pair_cost(k3_preset("k3-tiny"))
    assert 1 / 4000 < cost < 1 / 2000  # one pair ~ 1 / 3,073 of a token's per-token FLOPs
    even, balanced = shard_bounds(65536, 2, 4096), shard_bounds(65536, 2, 4096, cost)
    assert even == [0, 32768, 65536] and balanced == [0, 45056, 65536]
    low, high = sorted(rank_costs(even, cost))
    assert high / low > 2.3
    costs = rank_costs(balanced, cost)
    assert max(costs) - min(costs) <= max(rank_costs([0, 4096, 65536 - 4096, 65536], cost))
    config = k3_preset("k3-tiny")
    assert [context_span(config, 65536, 2, r, 4096) for r in (0, 1)] == [
        (0, 45056),
        (45056, 65536),
    ]


def test_short_sequences_split_by_tokens_each_within_a_segment():
    """Below min_length the split is by tokens whatever the cost, so no shard is longer than a
    segment (data ranks of unpadded micro-batches then run one forward per shard)."""
    for length in range(3, min_length(3, 8)):
        bounds = shard_bounds(length, 3, 8, pair_cost=10.0)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 8, (length, bounds)
    with pytest.raises(ValueError, match="without a token"):
        shard_bounds(2, 3, 8)
