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
