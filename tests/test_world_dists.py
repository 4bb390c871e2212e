"""Counter distributions of the world model: the truncated normal is exact, not clipped."""

from __future__ import annotations

import math

import numpy as np

from agents.world import Dist


def test_truncated_normal_matches_rejection_sampling() -> None:
    """Two-sample Kolmogorov-Smirnov against numpy's normal restricted to [0, 24] by rejection; the
    statistic stays below its alpha = 1e-4 critical value. A clipped normal (mass piled at 24) fails it."""
    n = 200_000
    ours = np.sort(Dist("normal", mean=20, sd=6, truncate=True).sample(7, np.arange(n), 24.0))
    ref = np.random.default_rng(1).normal(20, 6, 3 * n)
    ref = np.sort(ref[(ref >= 0) & (ref <= 24)][:n])
    crit = math.sqrt(-math.log(1e-4 / 2) / 2) * math.sqrt(2 / n)

    def ks(a: np.ndarray, b: np.ndarray) -> float:
        grid = np.concatenate([a, b])
        return float(np.max(np.abs(np.searchsorted(a, grid, "right") / a.size
                                   - np.searchsorted(b, grid, "right") / b.size)))

    assert ours.min() >= 0 and ours.max() <= 24
    assert ks(ours, ref) < crit
    clipped = np.sort(np.clip(Dist("normal", mean=20, sd=6).sample(7, np.arange(n)), 0, 24))
    assert ks(clipped, ref) > crit


def test_a_days_values_are_the_level_plus_sd_times_the_keyed_normal_clipped() -> None:
    """World.values against numpy on keyed.normal (the element-wise inverse CDF): a world with no binary, data-set
    or behavior-shaped device takes the blocked vector kernel, whose every value, its clipped count and its tails
    must be the element-wise ones bit for bit; groups clip at 0 and at max_value, one has no jitter at all, and
    a population that is no multiple of the kernel's block leaves a short last block."""
    from agents.world import Group, World
    from protocols import keyed
    from protocols.keyed import Purpose, stream_key

    m, n = 1000.0, 20_011
    groups = [Group("low", 0.4, Dist("normal", mean=50, sd=100), jitter_sd=80.0),
              Group("high", 0.4, Dist("normal", mean=950, sd=100), jitter_sd=80.0),
              Group("flat", 0.2, Dist("uniform", low=0, high=m), jitter_sd=0.0)]
    world = World(5, n, groups, [], m)
    for day in (1, 2, 3):
        world.advance_to(day)
        got, clipped = world.values(np.arange(n))
        z = keyed.normal(stream_key(5, Purpose.JITTER, day), np.arange(n))
        raw = world.levels + np.where(world.sds > 0, world.sds * z, 0.0)
        want = np.clip(raw, 0.0, m)
        assert np.array_equal(got.view(np.int64), want.view(np.int64))
        assert clipped == np.count_nonzero(raw < 0) + np.count_nonzero(raw > m) > 1000
        tails = (np.abs(z) > 1.97)  # the inverse CDF's tail branch (p < 0.02425 or p > 0.97575)
        assert tails.sum() > 0.04 * n
