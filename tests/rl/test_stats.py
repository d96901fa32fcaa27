"""Wilson intervals against published values and the closed form, and the task clustering."""

from __future__ import annotations

import math

import pytest

from rl.observe.stats import Z95, effective_samples, success_interval, wilson_interval

# The worked examples of Newcombe (1998), "Two-sided confidence intervals for the single
# proportion: comparison of seven methods", Statistics in Medicine 17:857-872, method 3 (Wilson
# score, no continuity correction), 95%: (successes, n) -> (low, high), to 4 decimals.
NEWCOMBE = {
    (81, 263): (0.2553, 0.3662),
    (15, 148): (0.0624, 0.1605),
    (0, 20): (0.0, 0.1611),
    (1, 29): (0.0061, 0.1718),
}


def closed_form(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's interval as the roots of (p - k/n)^2 = z^2 p (1 - p) / n, a quadratic in p."""
    a = 1 + z * z / n
    b = -(2 * k / n + z * z / n)
    c = (k / n) ** 2
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


@pytest.mark.parametrize(("k", "n"), list(NEWCOMBE))
def test_wilson_matches_newcombe(k, n):
    low, high = wilson_interval(k, n)
    assert (round(low, 4), round(high, 4)) == NEWCOMBE[(k, n)]


def test_wilson_at_the_ends_and_the_middle():
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.2775, abs=5e-5))
    assert wilson_interval(10, 10) == (pytest.approx(0.7225, abs=5e-5), 1.0)
    assert wilson_interval(0, 10)[1] == pytest.approx(Z95**2 / (10 + Z95**2), rel=1e-12)
    low, high = wilson_interval(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert wilson_interval(3, 0) == (0.0, 1.0)


@pytest.mark.parametrize(("k", "n"), [(0, 1), (1, 3), (7, 10), (50, 200), (199, 200), (3, 1000)])
def test_wilson_equals_the_closed_form(k, n):
    expected = closed_form(k, n, Z95)
    assert wilson_interval(k, n) == pytest.approx(expected, abs=1e-12)
    assert wilson_interval(k, n, z=2.575829) == pytest.approx(closed_form(k, n, 2.575829))


def test_the_interval_keeps_a_width_at_zero_and_full_success():
    for per_task in ([[False] * 4] * 200, [[True] * 4] * 200, [[True]] * 200):
        mean, low, high = success_interval(per_task)
        assert high - low > 0.015 and low <= mean <= high
    # all tasks fail: as wide as 0 of 200 independent samples (a task's 4 samples agree)
    assert success_interval([[False] * 4] * 200)[2] == pytest.approx(Z95**2 / (200 + Z95**2))


def test_correlated_samples_count_once_independent_ones_fully():
    assert effective_samples([[True] * 4, [False] * 4] * 50) == 100  # tasks decide: 100 tasks
    assert effective_samples([[True, False]] * 100) == 200  # no task effect: all 200 samples
    mixed = [[True, True, True, False], [True, False, False, False]] * 50
    assert 100 < effective_samples(mixed) < 400
    assert effective_samples([[True], [False], [True]]) == 3  # one sample per task: plain n


def test_clustered_interval_is_wilson_at_the_effective_n():
    same = success_interval([[True] * 4, [False] * 4] * 50)
    assert same[0] == 0.5 and same[1:] == pytest.approx(wilson_interval(50, 100))
    assert 0.39 < same[1] < 0.41
    assert success_interval([[True, False]] * 100)[1:] == pytest.approx(wilson_interval(100, 200))
