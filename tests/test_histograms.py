"""dBitFlip, dBitFlipPM, BinFlip, KFlip and the Laplace mean: unbiasedness, exact variances, exact privacy.

Tolerances as in test_onebit.py: Z = 4.5 standard errors for means, Z sqrt(2/(R - 1)) relative for
variances (per bucket; with at most 8 buckets the family-wise false-failure rate stays below 1e-4).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from protocols import keyed
from protocols.baselines import (KFLIP, LAPLACE, KFlipDevices, KFlipParams, LaplaceDevices, LaplaceParams,
                                 estimate_kflip, kflip_pq, kflip_variance)
from protocols.dbitflip import (BINFLIP, DBITFLIP, DBITFLIPPM, DBitFlipCollector, DBitFlipDevices, DBitFlipParams,
                                bucket_of, estimate_histogram, histogram, histogram_variance)
from protocols.ledger import Ledger
from protocols.messages import CollectionRequest
from protocols import wire
from protocols.onebit import epsilon_prime

Z = 4.5
M = 8.0
K = 8


def _values(n: int) -> np.ndarray:
    """A skewed histogram over K buckets of [0, M] (one empty bucket, one holding 40%)."""
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.05, 0.0])
    b = rng.choice(K, size=n, p=probs)
    return b + rng.uniform(0.05, 0.95, n)


def _check(est: np.ndarray, truth: np.ndarray, var: np.ndarray) -> None:
    reps = est.shape[0]
    se = np.sqrt(var / reps)
    assert np.all(np.abs(est.mean(axis=0) - truth) < Z * se), (est.mean(axis=0) - truth) / se
    rel = est.var(axis=0, ddof=1) / var - 1
    assert np.all(np.abs(rel) < Z * math.sqrt(2 / (reps - 1))), rel


@pytest.mark.parametrize("params", [
    DBitFlipParams(DBITFLIP, 1.0, M, K, 1),
    DBitFlipParams(DBITFLIP, 2.0, M, K, 3),
    DBitFlipParams(DBITFLIPPM, 1.0, M, K, 2, gamma=0.2),
    DBitFlipParams(BINFLIP, 0.5, M, K, K),
], ids=lambda p: f"{p.name}-d{p.bits}-g{p.gamma}")
def test_dbitflip_family_unbiased_with_exact_variance(params: DBitFlipParams) -> None:
    n, reps = 1000, 1200
    x = _values(n)
    truth = histogram(x, K, M)
    est = np.empty((reps, K))
    for r in range(reps):
        dev = DBitFlipDevices(params, seed=r, device_ids=np.arange(n))
        bits, _ = dev.report_bits(3, x)
        est[r] = estimate_histogram(dev.J, bits, K, params.epsilon, params.gamma)
    _check(est, truth, histogram_variance(truth, n, K, params.bits, params.epsilon, params.gamma))


def test_kflip_unbiased_with_exact_variance() -> None:
    n, reps, eps = 1000, 1200, 1.5
    params = KFlipParams(KFLIP, eps, M, K)
    x = _values(n)
    truth = histogram(x, K, M)
    est = np.array([estimate_kflip(KFlipDevices(params, r, np.arange(n)).report(1, x)["y"], K, eps)
                    for r in range(reps)])
    _check(est, truth, kflip_variance(truth, n, K, eps))


def test_laplace_mean_unbiased_with_exact_variance() -> None:
    n, reps = 500, 2000
    params = LaplaceParams(LAPLACE, 0.8, M)
    x = _values(n)
    est = np.array([LaplaceDevices(params, r, np.arange(n)).report(1, x)["y"].mean() for r in range(reps)])
    sd = params.estimate_sd(x, n)
    assert abs(est.mean() - x.mean()) < Z * sd / math.sqrt(reps)
    assert abs(est.var(ddof=1) / sd**2 - 1) < Z * math.sqrt(2 / (reps - 1)) * 1.6  # Laplace kurtosis: sd of s^2 larger


# ------------------------------------------------------------------------------------------- privacy
def _bit_frequencies_match(params: DBitFlipParams) -> tuple[float, float]:
    """The kernel sends bit 1 with probability pe at the device's own bucket and qe elsewhere (checked on
    many devices); returns the kernel's (pe, qe) for the exact ratio checks."""
    n = 200_000
    dev = DBitFlipDevices(params, seed=3, device_ids=np.arange(n))
    x = np.full(n, 0.5)  # every device in bucket 0
    bits, _ = dev.report_bits(1, x)
    own = dev.J == 0
    q = params.gamma + (1 - 2 * params.gamma) * np.array([dev._pe, dev._qe])
    for mask, expect in ((own, q[0]), (~own, q[1])):
        got = bits[mask].mean()
        assert abs(got - expect) < Z * math.sqrt(expect * (1 - expect) / mask.sum())
    return dev._pe, dev._qe


@pytest.mark.parametrize("d,gamma", [(1, 0.0), (2, 0.0), (5, 0.0), (2, 0.2)])
def test_dbitflip_is_eps_ldp_exactly(d: int, gamma: float) -> None:
    """All inputs v, v' in 5 buckets, every J of size d and every output b in {0,1}^d: the largest
    probability ratio is exactly e^(round epsilon) (e^eps without output perturbation)."""
    k, eps = 5, 1.2
    params = DBitFlipParams(DBITFLIP if d < k else BINFLIP, eps, M, k, d, gamma)
    pe, qe = _bit_frequencies_match(params)
    pe, qe = gamma + (1 - 2 * gamma) * pe, gamma + (1 - 2 * gamma) * qe
    worst = 0.0
    for J in itertools.combinations(range(k), d):
        for b in itertools.product((0, 1), repeat=d):
            probs = []
            for v in range(k):
                p = 1.0
                for j, bit in zip(J, b):
                    pj = pe if j == v else qe
                    p *= pj if bit else 1 - pj
                probs.append(p)
            worst = max(worst, max(probs) / min(probs))
    per_bit = eps / 2 if gamma == 0 else epsilon_prime(eps / 2, gamma)
    expected = min(d, 2) * per_bit  # d = 1: a single bit differs, so eps/2 (the paper states eps)
    assert math.log(worst) == pytest.approx(expected, rel=1e-12)
    assert params.round_epsilon == pytest.approx(expected)


def test_kflip_is_eps_ldp_exactly_and_kernel_matches() -> None:
    k, eps, n = 6, 0.9, 300_000
    params = KFlipParams(KFLIP, eps, M, k)
    p, q = kflip_pq(eps, k)
    assert p + (k - 1) * q == pytest.approx(1.0)
    assert math.log(p / q) == pytest.approx(eps)  # the worst ratio over inputs and outputs
    y = KFlipDevices(params, 2, np.arange(n)).report(1, np.full(n, 2 * M / k + 0.1))["y"]  # bucket 2
    freq = np.bincount(y, minlength=k) / n
    expect = np.where(np.arange(k) == 2, p, q)
    assert np.all(np.abs(freq - expect) < Z * np.sqrt(expect * (1 - expect) / n))


def test_laplace_noise_has_the_laplace_distribution() -> None:
    """P[|noise| > t] = exp(-t/scale): checked at several t (eps-LDP of the Laplace mechanism follows from
    the density ratio exp(|x - x'|/scale) <= e^eps for x, x' in [0, m])."""
    n = 400_000
    params = LaplaceParams(LAPLACE, 2.0, M)
    noise = LaplaceDevices(params, 5, np.arange(n)).report(1, np.zeros(n))["y"]
    for t in (0.5, 2.0, 8.0):
        expect = math.exp(-t / params.scale)
        assert abs(np.mean(np.abs(noise) > t) - expect) < Z * math.sqrt(expect * (1 - expect) / n)
    assert abs(np.mean(noise > 0) - 0.5) < Z * math.sqrt(0.25 / n)


# ------------------------------------------------------------------------------------------- memoization
def test_dbitflippm_reveals_at_most_d_plus_1_distinct_reports() -> None:
    """Values jump over every bucket each round for 60 rounds: a device still sends at most d + 1 distinct
    reports (with gamma = 0), reveals are counted exactly, and the ledger charges distinct reports x eps."""
    d, n, rounds, eps = 2, 2000, 60, 0.8
    params = DBitFlipParams(DBITFLIPPM, eps, M, K, d)
    dev = DBitFlipDevices(params, seed=4, device_ids=np.arange(n))
    ledger = Ledger(n)
    rng = np.random.default_rng(9)
    seen: list[set[bytes]] = [set() for _ in range(n)]
    inputs = np.zeros((rounds, n), dtype=np.int64)
    for r in range(1, rounds + 1):
        x = rng.uniform(0, M, n)
        batch, charges = dev.respond(CollectionRequest(r, DBITFLIPPM, 1.0), r, x, float(r))
        for c in charges:
            ledger.record(c)
        b = batch.columns["b"]
        for i in range(n):
            seen[i].add(b[i].tobytes())
        J = batch.columns["j"]
        bk = bucket_of(x, K, M)
        inputs[r - 1] = np.where(J[:, 0] == bk, 1, np.where(J[:, 1] == bk, 2, 0))
    distinct = np.array([len(s) for s in seen])
    assert distinct.max() <= d + 1
    revealed = np.array([np.unique(inputs[:, i]).size for i in range(n)])
    np.testing.assert_array_equal(dev.reveals.counts(), revealed)
    assert np.all(distinct <= revealed)  # two memo inputs may by chance share a bit pattern
    np.testing.assert_allclose(ledger.spend, revealed * eps)
    assert revealed.max() == d + 1


def test_dbitflip_fresh_reports_change_and_memoized_ones_do_not() -> None:
    n = 3000
    x = _values(n)
    for name, same in ((DBITFLIPPM, True), (DBITFLIP, False)):
        dev = DBitFlipDevices(DBitFlipParams(name, 1.0, M, K, 2), seed=1, device_ids=np.arange(n))
        a, _ = dev.report_bits(1, x)
        b, _ = dev.report_bits(2, x)
        assert np.array_equal(a, b) == same


def test_j_is_d_distinct_buckets_uniformly() -> None:
    n, k, d = 200_000, 10, 3
    dev = DBitFlipDevices(DBitFlipParams(DBITFLIP, 1.0, M, k, d), seed=8, device_ids=np.arange(n))
    assert np.all(np.diff(dev.J, axis=1) > 0)
    freq = np.bincount(dev.J.ravel(), minlength=k) / n
    assert np.all(np.abs(freq - d / k) < Z * math.sqrt(d / k * (1 - d / k) / n))


def test_collector_refuses_a_j_with_repeated_buckets() -> None:
    params = DBitFlipParams(DBITFLIP, 1.0, M, K, 2)
    col = DBitFlipCollector(params, 10)
    col.request(1, 1.0)
    from protocols.base import ProtocolError
    from protocols.messages import ReportBatch
    bad = ReportBatch(1, DBITFLIP, np.arange(2, dtype=np.uint32),
                      {"b": wire.bits(np.zeros((2, 2))), "j": np.array([[1, 1], [0, 3]], np.uint8)})
    with pytest.raises(ProtocolError, match="distinct buckets"):
        col.receive(wire.decode(wire.encode(bad)))
