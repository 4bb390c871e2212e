"""Several counters at once (Theorem 7): the exact joint privacy loss by brute force, unbiased estimates."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from protocols.ledger import Ledger
from protocols.messages import CollectionRequest
from protocols.multicounter import MULTI, JOINT_REPORT, MultiDevices, MultiParams, joint_epsilon
from protocols.onebit import estimate_mean, mean_variance, p_one

Z = 4.5
M = 60.0


def _feasible(c: int, grid: int) -> np.ndarray:
    """Every x in {0, m/grid, ..., m}^c with sum <= m."""
    pts = [p for p in itertools.product(range(grid + 1), repeat=c) if sum(p) <= grid]
    return np.array(pts, dtype=np.float64) * (M / grid)


def _worst_log_ratio(eps: float, xs: np.ndarray) -> float:
    p1 = p_one(xs, eps, M)  # (points, c)
    worst = 0.0
    for b in itertools.product((0, 1), repeat=xs.shape[1]):
        logp = np.where(np.array(b, dtype=bool), np.log(p1), np.log1p(-p1)).sum(axis=1)
        worst = max(worst, float(logp.max() - logp.min()))
    return worst


@pytest.mark.parametrize("c", [1, 2, 3, 4])
@pytest.mark.parametrize("eps", [0.3, 1.0, 2.5])
def test_joint_epsilon_is_the_exact_worst_case(c: int, eps: float) -> None:
    """On a grid holding every extreme point (1/k shares for k <= 4), the brute-force worst case over all
    outputs and pairs of feasible inputs equals the closed form; it equals 2 eps for c = 2 (output (1, 0)
    for inputs (m, 0) against (0, m)), is below c x eps from c = 3 on, and stays below the c-independent
    bound eps + e^eps - 1."""
    worst = _worst_log_ratio(eps, _feasible(c, 12))
    assert worst == pytest.approx(joint_epsilon(eps, c), rel=1e-12)
    assert joint_epsilon(eps, c) <= eps + math.expm1(eps)
    if c == 2:
        assert joint_epsilon(eps, c) == pytest.approx(2 * eps)
    if c >= 3:
        assert joint_epsilon(eps, c) < c * eps
    # a finer grid cannot exceed it (the closed form is the supremum, not just the grid's maximum)
    if c <= 3:
        assert _worst_log_ratio(eps, _feasible(c, 30)) <= joint_epsilon(eps, c) * (1 + 1e-12)


def test_estimates_unbiased_with_closed_form_variance_and_joint_charges() -> None:
    c, n, reps, eps = 3, 600, 1500, 1.0
    params = MultiParams(MULTI, eps, M, c)
    rng = np.random.default_rng(2)
    total = rng.uniform(0, M, n)
    split = rng.dirichlet([3, 2, 1], n)
    x = total[:, None] * split
    est = np.empty((reps, c))
    for r in range(reps):
        dev = MultiDevices(params, r, np.arange(n))
        batch, charges = dev.respond(CollectionRequest(1, MULTI, 1.0), 1, x, 0.0)
        b = batch.columns["b"]
        est[r] = [estimate_mean(b[:, j], eps, M) for j in range(c)]
    for j in range(c):
        var = mean_variance(x[:, j], eps, M)
        assert abs(est[:, j].mean() - x[:, j].mean()) < Z * math.sqrt(var / reps)
        assert abs(est[:, j].var(ddof=1) / var - 1) < Z * math.sqrt(2 / (reps - 1))
    ledger = Ledger(n)
    for ch in charges:
        ledger.record(ch)
    assert {ch.reason for ch in charges} == {JOINT_REPORT}
    np.testing.assert_allclose(ledger.spend, joint_epsilon(eps, c))


def test_devices_refuse_counters_that_exceed_the_budget() -> None:
    dev = MultiDevices(MultiParams(MULTI, 1.0, M, 2), 0, np.arange(2))
    with pytest.raises(ValueError, match="sum to at most"):
        dev.respond(CollectionRequest(1, MULTI, 1.0), 1, np.array([[40.0, 30.0], [1.0, 1.0]]), 0.0)
    with pytest.raises(ValueError, match="2 counters"):
        dev.respond(CollectionRequest(1, MULTI, 1.0), 1, np.ones(2), 0.0)
