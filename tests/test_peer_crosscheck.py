"""Cross-check of our dBitFlipPM against an independent implementation, multi-freq-ldpy 0.2.5 (peer).

Both run one round on the same n = 5,000 inputs (a fixed skewed histogram over k = 16 buckets, one empty),
d = 2, eps = 1, in R = 200 independent repetitions (ours: DBitFlipDevices seeds; peer: numba's np.random
reseeded per repetition). The peer's aggregator clips at 0 and renormalizes; ours gets
scenarios.metrics.clip_renormalize. Per repetition we take the max-bucket error and the errors of two fixed
buckets (the heaviest, and a light one where clipping bites), and require the two samples of each to agree:
a two-sample Kolmogorov-Smirnov statistic below c(alpha) sqrt((n1 + n2)/(n1 n2)) with
c(alpha) = sqrt(-ln(alpha/2)/2), alpha = 0.001, and means within Z = 4.5 standard errors. A negative control
shows the same comparison rejects our estimator when it assumes an eps 10% off. Our raw (unclipped) estimate
is also checked against theory: means within Z SE and variances within Z sqrt(2/(R - 1)) relative of the
closed-form histogram_variance, per bucket.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from multi_freq_ldpy.long_freq_est.dBitFlipPM import dBitFlipPM_Aggregator_MI, dBitFlipPM_Client

from protocols.dbitflip import DBITFLIPPM, DBitFlipDevices, DBitFlipParams, estimate_histogram, histogram_variance
from scenarios.metrics import clip_renormalize

Z = 4.5
ALPHA = 0.001
K, D, EPS, N, R = 16, 2, 1.0, 5_000, 200
HEAVY, LIGHT = 0, 12  # true frequencies about 0.30 and 0.004


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    """Buckets of the N devices (exact counts of a geometric histogram with ratio 0.7, last bucket empty,
    shuffled once) and their true frequencies."""
    w = 0.7 ** np.arange(K)
    w[-1] = 0.0
    counts = np.floor(w / w.sum() * N).astype(np.int64)
    counts[0] += N - counts.sum()
    buckets = np.random.default_rng(0).permutation(np.repeat(np.arange(K), counts))
    return buckets, counts / N


@numba.njit
def _seed_numba(seed):
    # The peer draws with np.random inside numba, whose generator is separate from numpy's:
    # np.random.seed called from Python does not reach it, so it is seeded from jitted code.
    np.random.seed(seed)


@pytest.fixture(scope="module")
def inputs() -> tuple[np.ndarray, np.ndarray]:
    return _inputs()


def _ours_raw(buckets: np.ndarray, est_epsilon: float = EPS) -> np.ndarray:
    """R raw estimates; values are bucket midpoints on [0, K] so that bucket_of gives back the bucket."""
    params = DBitFlipParams(DBITFLIPPM, EPS, float(K), K, D)
    x = buckets + 0.5
    out = np.empty((R, K))
    for r in range(R):
        dev = DBitFlipDevices(params, seed=1000 + r, device_ids=np.arange(N))
        bits, _ = dev.report_bits(1, x)
        out[r] = estimate_histogram(dev.J, bits, K, est_epsilon)
    return out


@pytest.fixture(scope="module")
def ours_raw(inputs) -> np.ndarray:
    return _ours_raw(inputs[0])


@pytest.fixture(scope="module")
def peer(inputs) -> np.ndarray:
    """R clipped-and-renormalized estimates from the peer's client (one call per device) and aggregator."""
    values = [int(v) for v in inputs[0]]  # the peer checks isinstance(..., int)
    _seed_numba(1)
    first = dBitFlipPM_Client(values[0], K, K, D, EPS)
    _seed_numba(1)
    assert np.array_equal(first, dBitFlipPM_Client(values[0], K, K, D, EPS)), "peer not reproducibly seeded"
    out = np.empty((R, K))
    for r in range(R):
        _seed_numba(r)
        out[r] = dBitFlipPM_Aggregator_MI([dBitFlipPM_Client(v, K, K, D, EPS) for v in values], K, D, EPS)
    return out


def _errors(est: np.ndarray, truth: np.ndarray) -> dict[str, np.ndarray]:
    e = est - truth
    return {"max_bucket": np.abs(e).max(axis=1), "heavy_bucket": e[:, HEAVY], "light_bucket": e[:, LIGHT]}


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """sup_x |F_a(x) - F_b(x)| over the pooled sample points (empirical CDFs are right-continuous)."""
    a, b = np.sort(a), np.sort(b)
    pts = np.concatenate([a, b])
    fa = np.searchsorted(a, pts, side="right") / a.size
    fb = np.searchsorted(b, pts, side="right") / b.size
    return float(np.abs(fa - fb).max())


def ks_critical(n1: int, n2: int, alpha: float = ALPHA) -> float:
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n1 + n2) / (n1 * n2))


def _mean_z(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.mean() - b.mean()) / math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size))


def test_ks_statistic_by_hand() -> None:
    assert ks_statistic(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])) == 0.0
    assert ks_statistic(np.array([0.0, 1.0]), np.array([2.0, 3.0])) == 1.0
    assert ks_statistic(np.array([0.0, 2.0]), np.array([1.0, 3.0])) == 0.5
    assert ks_critical(200, 200) == pytest.approx(1.9495 * 0.1, abs=1e-4)


@pytest.mark.parametrize("stat", ["max_bucket", "heavy_bucket", "light_bucket"])
def test_clipped_error_distributions_match_peer(inputs, ours_raw, peer, stat: str) -> None:
    truth = inputs[1]
    ours = _errors(np.array([clip_renormalize(e) for e in ours_raw]), truth)[stat]
    theirs = _errors(peer, truth)[stat]
    d, crit = ks_statistic(ours, theirs), ks_critical(R, R)
    assert d < crit, f"KS {d:.3f} >= {crit:.3f}"
    z = _mean_z(ours, theirs)
    assert abs(z) < Z, f"means differ by {z:.2f} SE (ours {ours.mean():.5f}, peer {theirs.mean():.5f})"


def test_comparison_rejects_an_estimator_assuming_eps_ten_percent_off(inputs, peer) -> None:
    truth = inputs[1]
    wrong = _errors(np.array([clip_renormalize(e) for e in _ours_raw(inputs[0], est_epsilon=1.1 * EPS)]), truth)
    theirs = _errors(peer, truth)
    assert ks_statistic(wrong["heavy_bucket"], theirs["heavy_bucket"]) > ks_critical(R, R)
    assert abs(_mean_z(wrong["heavy_bucket"], theirs["heavy_bucket"])) > Z


def test_raw_estimate_unbiased_with_closed_form_variance(inputs, ours_raw) -> None:
    truth = inputs[1]
    var = histogram_variance(truth, N, K, D, EPS)
    z = (ours_raw.mean(axis=0) - truth) / np.sqrt(var / R)
    assert np.all(np.abs(z) < Z), z
    rel = ours_raw.var(axis=0, ddof=1) / var - 1
    assert np.all(np.abs(rel) < Z * math.sqrt(2 / (R - 1))), rel
