"""BinFlip+ (Bassily-Smith's one-bit protocol on BinFlip): unbiased with its closed-form variance, exactly eps-LDP.

Tolerances as in test_histograms.py: Z = 4.5 standard errors for means, Z sqrt(2/(R - 1)) relative for
variances per bucket (at eps = 1 the summand's tails are light, so the normal-theory bound holds).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from protocols.binflipplus import (BINFLIPPLUS, BinFlipPlusDevices, BinFlipPlusParams, binflipplus_variance,
                                   estimate_binflipplus, public_bits, reference_q, rr_probabilities)
from protocols.dbitflip import histogram, histogram_variance

Z = 4.5
M = 8.0
K = 8


def _values(n: int) -> np.ndarray:
    """A skewed histogram over K buckets of [0, M] (one empty bucket, one holding 40%)."""
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0])
    return rng.choice(K, size=n, p=probs) + rng.uniform(0.05, 0.95, n)


def test_unbiased_with_exact_variance() -> None:
    """Over repetitions (fixed seeds 0..R-1), each bucket's mean is the truth within Z standard errors of
    the closed form, and its sample variance matches the closed form."""
    n, reps, eps = 1000, 1200, 1.0
    params = BinFlipPlusParams(BINFLIPPLUS, eps, M, K)
    x = _values(n)
    truth = histogram(x, K, M)
    est = np.empty((reps, K))
    for r in range(reps):
        rep = BinFlipPlusDevices(params, r, np.arange(n)).report(3, x)
        est[r] = estimate_binflipplus(rep["s"], np.asarray(rep["b"]), K, eps)
    var = binflipplus_variance(truth, n, eps)
    assert np.all(np.abs(est.mean(axis=0) - truth) < Z * np.sqrt(var / reps)), (est.mean(axis=0) - truth)
    rel = est.var(axis=0, ddof=1) / var - 1
    assert np.all(np.abs(rel) < Z * math.sqrt(2 / (reps - 1))), rel
    assert np.allclose(params.estimate_sd(x, n), np.sqrt(var))


def test_variance_against_binflip_and_dbitflip() -> None:
    """The closed form's regimes (what Ding et al. report of BinFlip+): for small eps it is BinFlip's (both
    ~ 4/(n eps^2)); BinFlip stays below it; at large eps 1BitFlip beats it on a flat histogram."""
    h, n = np.full(32, 1 / 32), 1000
    small = binflipplus_variance(h, n, 0.05) / histogram_variance(h, n, 32, 32, 0.05)
    assert np.all(np.abs(small - 1) < 0.01), small
    for eps in (0.1, 1.0, 3.0, 10.0):
        assert np.all(histogram_variance(h, n, 32, 32, eps) < binflipplus_variance(h, n, eps))
    assert np.all(histogram_variance(h, n, 32, 1, 10.0) < binflipplus_variance(h, n, 10.0))
    assert np.all(binflipplus_variance(h, n, 1.0) < histogram_variance(h, n, 32, 1, 1.0))


def test_kernel_draws_match_the_model() -> None:
    """Many devices: the public bits are Bernoulli(q) and the sent bit is hi when y_b = 1, lo when y_b = 0."""
    n, eps = 200_000, 1.3
    params = BinFlipPlusParams(BINFLIPPLUS, eps, M, K)
    x = np.full(n, 2.5)  # every device in bucket 2
    rep = BinFlipPlusDevices(params, 5, np.arange(n)).report(1, x)
    s, b = rep["s"], np.asarray(rep["b"])
    q = reference_q(eps)
    hi, lo = rr_probabilities(eps)
    y = public_bits(s, np.full(n, 2), eps)
    other = public_bits(s, np.full(n, 6), eps)
    for got, expect, size in ((y.mean(), q, n), (other.mean(), q, n), (b[y].mean(), hi, y.sum()),
                              (b[~y].mean(), lo, (~y).sum())):
        assert abs(got - expect) < Z * math.sqrt(expect * (1 - expect) / size), (got, expect)
    assert abs(np.corrcoef(y, other)[0, 1]) < Z / math.sqrt(n)  # public bits of two buckets independent


@pytest.mark.parametrize("eps", [0.4, 1.2, 5.0])
def test_one_report_is_eps_ldp_exactly(eps: float) -> None:
    """Every public vector y in {0,1}^k (the seed matters only through it), every pair of inputs (buckets) and
    both bits: the largest probability ratio is exactly e^eps, the claim (round_epsilon, guarantee)."""
    k = 5
    params = BinFlipPlusParams(BINFLIPPLUS, eps, M, k)
    hi, lo = rr_probabilities(eps)
    worst = 0.0
    for y in itertools.product((0, 1), repeat=k):
        for bit in (0, 1):
            probs = [(hi if y[v] else lo) if bit else 1 - (hi if y[v] else lo) for v in range(k)]
            worst = max(worst, max(probs) / min(probs))
    assert math.isclose(math.log(worst), eps, rel_tol=1e-12)
    assert params.round_epsilon == eps and params.guarantee(31).value == 31 * eps
    mech = params.round_mechanism()
    assert mech.attained


def test_log_likelihood_is_the_bit_law() -> None:
    """The attacker's model: one round, log P[bit | value] is log hi or log lo by the public bit at the value's
    bucket, and 0 where nothing arrived."""
    eps, n = 0.9, 64
    params = BinFlipPlusParams(BINFLIPPLUS, eps, M, K)
    rep = BinFlipPlusDevices(params, 2, np.arange(n)).report(1, np.full(n, 5.5))
    s, b = rep["s"], np.asarray(rep["b"])
    present = np.ones((n, 1), dtype=bool)
    present[0] = False
    ll = params.log_likelihood(np.array([5.5]), [{"s": s[:, None], "b": b[:, None]}], present)
    hi, lo = rr_probabilities(eps)
    p1 = np.where(public_bits(s, np.full(n, 5), eps), hi, lo)
    expect = np.where(b == 1, np.log(p1), np.log1p(-p1))
    expect[0] = 0.0
    assert np.allclose(ll, expect)
