"""1BitMean / 1BitRRPM: privacy, unbiasedness and variance against the closed forms (Ding et al. 2017).

Every statistical tolerance is stated from theory: means over K independent repetitions are within
Z standard errors (SE = sd/sqrt(K), sd from the closed-form variance); sample variances are within
Z sqrt(2/(K - 1)) relative error (the sampling sd of a variance estimate for near-normal estimates).
Z = 4.5 gives a false-failure rate below 1e-5 per check.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols import keyed
from protocols.ledger import FRESH_REPORT, MEMO_REVEAL, ROUND_GUARANTEE, Ledger
from protocols.memo import alpha_round
from protocols.messages import CollectionRequest
from protocols.onebit import (MEMOIZED, NAIVE, OneBitCollector, OneBitDevices, OneBitParams, epsilon_prime,
                              estimate_mean, hoeffding_radius, mean_variance, p_one)

Z = 4.5
M = 100.0


def _values(n: int, seed: int = 0) -> np.ndarray:
    # Values away from m/2: at the midpoint P[b = 1] = 1/2 for every eps, which would hide a wrong eps.
    return np.random.default_rng(seed).uniform(0.0, 0.35 * M, n)


def _estimates(params: OneBitParams, x: np.ndarray, reps: int, rounds: int = 1,
               est_eps: float | None = None) -> np.ndarray:
    """One estimate per repetition (independent seeds), for the last of ``rounds`` rounds."""
    ids = np.arange(x.size)
    out = np.empty(reps)
    for k in range(reps):
        dev = OneBitDevices(params, seed=1000 + k, device_ids=ids)
        for r in range(1, rounds + 1):
            bits, _ = dev.report_bits(r, x)
        out[k] = estimate_mean(bits, est_eps or params.epsilon, params.max_value, params.gamma)
    return out


CASES = [
    OneBitParams(NAIVE, 1.0, M),
    OneBitParams(NAIVE, 0.5, M, gamma=0.1),
    OneBitParams(MEMOIZED, 1.0, M, granularity=10.0),
    OneBitParams(MEMOIZED, 2.0, M, granularity=25.0, gamma=0.2),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"{p.name}-eps{p.epsilon}-g{p.gamma}")
def test_estimator_unbiased_and_variance_matches_closed_form(params: OneBitParams) -> None:
    n, reps = 800, 1500
    x = _values(n)
    est = _estimates(params, x, reps, rounds=3)
    var = mean_variance(x, params.epsilon, M, params.gamma)
    se = math.sqrt(var / reps)
    assert abs(est.mean() - x.mean()) < Z * se
    rel = est.var(ddof=1) / var - 1.0
    assert abs(rel) < Z * math.sqrt(2.0 / (reps - 1))


def test_unbiasedness_test_detects_a_wrong_epsilon() -> None:
    """The tolerance above is tight enough to catch an estimator that assumes eps 10% off."""
    params, n, reps = CASES[0], 800, 1500
    x = _values(n)
    est = _estimates(params, x, reps, est_eps=1.1)
    se = math.sqrt(mean_variance(x, 1.1, M) / reps)
    assert abs(est.mean() - x.mean()) > Z * se


def test_one_bit_mechanism_is_eps_ldp_exactly() -> None:
    """max over inputs and outputs of P[b | x] / P[b | x'] is e^eps, attained at x = 0 vs x = m."""
    for eps in (0.1, 1.0, 3.0):
        x = np.linspace(0, M, 101)
        p1 = p_one(x, eps, M)
        worst = max(p1.max() / p1.min(), (1 - p1).max() / (1 - p1).min())
        assert worst == pytest.approx(math.exp(eps), rel=1e-12)


@pytest.mark.parametrize("eps,gamma", [(1.0, 0.1), (2.0, 0.3), (0.5, 0.05)])
def test_output_perturbation_epsilon_prime_by_brute_force(eps: float, gamma: float) -> None:
    """Theorem 6: the flipped bit's worst probability ratio over inputs equals eps' and eps' < eps."""
    x = np.linspace(0, M, 201)
    q1 = gamma + (1 - 2 * gamma) * p_one(x, eps, M)
    worst = math.log(max(q1.max() / q1.min(), (1 - q1).max() / (1 - q1).min()))
    assert worst == pytest.approx(epsilon_prime(eps, gamma), rel=1e-12)
    assert epsilon_prime(eps, gamma) < eps
    assert epsilon_prime(eps, 0.0) == pytest.approx(eps)


def test_alpha_rounding_is_unbiased() -> None:
    s, n = 10.0, 400_000
    ids = np.arange(n)
    alpha = keyed.uniform(keyed.stream_key(3, keyed.Purpose.ALPHA), ids) * s
    for x0 in (0.0, 3.3, 17.5, 99.99, 100.0):
        g = alpha_round(np.full(n, x0), alpha, s)
        frac = x0 / s - math.floor(x0 / s)
        assert set(np.unique(g)) <= {math.floor(x0 / s), math.floor(x0 / s) + 1}
        se = s * math.sqrt(frac * (1 - frac) / n) + 1e-12
        assert abs((g * s).mean() - x0) <= Z * se


def test_memoized_bit_of_a_grid_value_has_the_one_bit_probability() -> None:
    """Across devices, the memo bit of grid value g is Bernoulli(p_one(g))."""
    params = OneBitParams(MEMOIZED, 1.0, M, granularity=20.0)
    n = 200_000
    dev = OneBitDevices(params, seed=5, device_ids=np.arange(n))
    for g in range(params.grid_size):
        x = np.full(n, g * 20.0)
        # Pick alpha-free values: exact grid values round to themselves for every alpha.
        bits, grid = dev.report_bits(1, x)
        assert np.all(grid == g)
        p = p_one(g * 20.0, 1.0, M)
        assert abs(bits.mean() - p) < Z * math.sqrt(p * (1 - p) / n)


def test_device_inside_its_grid_cell_sends_identical_bits_every_round() -> None:
    """gamma = 0: values that move only inside a device's rounding cell [k s - alpha, (k+1) s - alpha)
    round to the same grid value, so the memoized bit is the same every round."""
    params = OneBitParams(MEMOIZED, 1.0, M, granularity=10.0)
    n, rounds = 5000, 20
    dev = OneBitDevices(params, seed=9, device_ids=np.arange(n))
    rng = np.random.default_rng(1)
    k = rng.integers(1, 9, n)
    lo = k * 10.0 - dev.alpha
    sent = []
    for r in range(1, rounds + 1):
        x = lo + rng.uniform(0, 1, n) * (10.0 - 1e-9)  # anywhere inside the cell, differently each round
        bits, grid = dev.report_bits(r, x)
        assert np.all(grid == k)
        sent.append(bits)
    assert np.all(np.stack(sent) == sent[0])
    # and naive 1BitMean does not: fresh randomness changes bits between rounds
    naive = OneBitDevices(OneBitParams(NAIVE, 1.0, M), seed=9, device_ids=np.arange(n))
    b1, _ = naive.report_bits(1, lo + 5)
    b2, _ = naive.report_bits(2, lo + 5)
    assert np.mean(b1 != b2) > 0.3


def _run_rounds(params: OneBitParams, xs: list[np.ndarray]) -> tuple[Ledger, OneBitDevices]:
    n = xs[0].size
    ledger = Ledger(n)
    dev = OneBitDevices(params, seed=11, device_ids=np.arange(n))
    for r, x in enumerate(xs, start=1):
        batch, charges = dev.respond(CollectionRequest(r, params.name, 1.0), r, x, float(r))
        assert batch is not None and len(batch) == n
        for c in charges:
            ledger.record(c)
        ledger.close_round(r, float(r))
    return ledger, dev


def test_ledger_spend_is_pattern_width_times_eps() -> None:
    """Theorem 4 accounting: spend = (number of distinct grid values revealed) x eps, recomputed here
    independently from the values and alpha."""
    params = OneBitParams(MEMOIZED, 0.7, M, granularity=5.0, gamma=0.1)
    n, rounds = 3000, 12
    rng = np.random.default_rng(4)
    level = rng.uniform(0, M, n)
    xs = [np.clip(level + rng.normal(0, 6, n), 0, M) for _ in range(rounds)]
    ledger, dev = _run_rounds(params, xs)
    grids = np.stack([alpha_round(x, dev.alpha, 5.0) for x in xs])
    width = np.array([np.unique(grids[:, i]).size for i in range(n)])
    assert width.max() > 2  # the case is not trivial
    np.testing.assert_allclose(ledger.spend, width * 0.7, rtol=0, atol=1e-9)
    np.testing.assert_array_equal(dev.reveals.counts(), width)
    # the per-round guarantee of output perturbation is recorded, not added to the spend
    np.testing.assert_allclose(ledger.round_epsilon, epsilon_prime(0.7, 0.1))
    reasons = {c[2] for c in ledger.device_charges(0)}
    assert reasons == {MEMO_REVEAL, ROUND_GUARANTEE}


@pytest.mark.parametrize("gamma", [0.0, 0.25])
def test_naive_spend_is_rounds_times_round_epsilon(gamma: float) -> None:
    params = OneBitParams(NAIVE, 0.9, M, gamma=gamma)
    n, rounds = 500, 7
    ledger, _ = _run_rounds(params, [_values(n, s) for s in range(rounds)])
    expected = rounds * (epsilon_prime(0.9, gamma) if gamma else 0.9)
    np.testing.assert_allclose(ledger.spend, expected)
    assert all(c[2] == FRESH_REPORT for c in ledger.device_charges(3))
    assert [h["max"] for h in ledger.history] == pytest.approx([expected * r / rounds for r in range(1, 8)])


def test_device_refuses_repeats_other_rounds_and_other_protocols() -> None:
    """Privacy is enforced on the device: a replayed or mislabeled request gets no report and no charge."""
    params = OneBitParams(NAIVE, 1.0, M)
    dev = OneBitDevices(params, seed=1, device_ids=np.arange(10))
    x = _values(10)
    batch, charges = dev.respond(CollectionRequest(1, NAIVE, 1.0), 1, x, 0.0)
    assert batch is not None and charges
    for req, day in [(CollectionRequest(1, NAIVE, 1.0), 1),  # replay
                     (CollectionRequest(3, NAIVE, 1.0), 2),  # a round that is not today
                     (CollectionRequest(2, MEMOIZED, 1.0), 2)]:  # another protocol
        assert dev.respond(req, day, x, 0.5) == (None, [])


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_a_cohort_takes_strictly_increasing_ids_of_either_integer_type_only(dtype) -> None:
    """A cohort's device ids are strictly increasing (signed ids as the runtime passes them, or the device
    side's own uint64, taken without a copy); a repeat or a step back is local misuse, whatever the type."""
    from protocols.base import MisuseError

    params = OneBitParams(MEMOIZED, 1.0, M, granularity=10.0)
    ids = np.arange(5, 1000, 7, dtype=dtype)
    dev = OneBitDevices(params, seed=1, device_ids=ids)
    assert np.array_equal(dev.device_ids, ids) and (dtype is np.int64 or np.shares_memory(dev.device_ids, ids))
    for bad in ([3, 1, 2], [1, 1], [0, 2, 4, 4, 6], [9, 10, 11, 10]):
        with pytest.raises(MisuseError, match="strictly increasing"):
            OneBitDevices(params, seed=1, device_ids=np.array(bad, dtype=dtype))
    assert OneBitDevices(params, seed=1, device_ids=np.array([4], dtype=dtype)).device_ids.tolist() == [4]


def test_collector_estimate_matches_estimator_and_hoeffding() -> None:
    """The collector's estimate from a batch equals estimate_mean; over repetitions the error exceeds the
    Hoeffding radius at delta = 0.05 in at most a binomially plausible share of runs."""
    params = OneBitParams(NAIVE, 1.0, M)
    n, reps, delta = 2000, 300, 0.05
    x = _values(n)
    radius = hoeffding_radius(n, 1.0, M, delta)
    misses = 0
    for k in range(reps):
        dev = OneBitDevices(params, seed=k, device_ids=np.arange(n))
        batch, _ = dev.respond(CollectionRequest(1, NAIVE, 1.0), 1, x, 0.0)
        col = OneBitCollector(params, n)
        col.request(1, 1.0)
        col.receive(batch)
        res = col.close_round()
        assert res.estimate == pytest.approx(estimate_mean(batch.columns["bit"], 1.0, M))
        misses += abs(res.estimate - x.mean()) > radius
    assert misses <= reps * delta + Z * math.sqrt(reps * delta * (1 - delta))


@pytest.mark.parametrize("gamma", [0.0, 0.1])
def test_close_round_estimate_from_the_stored_column_is_that_of_the_reports(gamma: float) -> None:
    """OneBitCollector estimates from its stored column (rows without a report hold 0) without selecting the
    reports first: bit for bit estimate_mean of the reports that arrived, whichever devices sent them; a
    subclass with an estimate of its own is handed the reports, as before."""
    params = OneBitParams(MEMOIZED, 1.0, M, M / 24, gamma)
    n = 5000
    dev = OneBitDevices(params, seed=3, device_ids=np.arange(n))
    rng = np.random.default_rng(5)
    for rnd, share in enumerate((1.0, 0.9, 0.01), start=1):
        here = rng.random(n) < share
        batch, _ = dev.respond(CollectionRequest(rnd, MEMOIZED, 1.0), rnd, _values(n, rnd), 0.0, here)

        class Selecting(OneBitCollector):
            def estimate(self, reports: dict[str, np.ndarray]) -> float:
                return estimate_mean(reports["bit"][:, 0], params.epsilon, params.max_value, params.gamma)

        results = []
        for cls in (OneBitCollector, Selecting):
            col = cls(params, n)
            col.request(rnd, 1.0)
            col.receive(batch)
            results.append(col.close_round().estimate)
        expect = estimate_mean(batch.columns["bit"], params.epsilon, params.max_value, params.gamma)
        assert results == [expect, expect]


def test_every_device_answering_reads_one_shared_read_only_range() -> None:
    """With every device present the device side takes its rows as the cohort's read-only 0..n-1 (views of
    arrays every cohort shares) instead of searching an all-True mask; the batch and charges are those of the
    same devices passed as an explicit mask."""
    params = OneBitParams(MEMOIZED, 1.0, M, M / 24, 0.1)
    a, b = (OneBitDevices(params, seed=3, device_ids=np.arange(100, 1100)) for _ in range(2))
    mask, rows = a.everyone()
    assert not mask.flags.writeable and not rows.flags.writeable and rows.tolist() == list(range(1000))
    assert OneBitDevices(params, seed=3, device_ids=np.arange(7)).everyone()[1].base is rows.base
    for rnd in (1, 2, 3):
        x = _values(1000, rnd)
        got, charges = a.respond(CollectionRequest(rnd, MEMOIZED, 1.0), rnd, x, 0.0)
        want, want_charges = b.respond(CollectionRequest(rnd, MEMOIZED, 1.0), rnd, x, 0.0, np.ones(1000, bool))
        assert got is not None and want is not None
        np.testing.assert_array_equal(got.devices, want.devices)
        np.testing.assert_array_equal(got.columns["bit"], want.columns["bit"])
        assert [(c.reason, c.amount, c.devices.tolist()) for c in charges] == \
            [(c.reason, c.amount, c.devices.tolist()) for c in want_charges]
