"""Worst-case transcript loss of memoized protocols (protocols.worst_case) against brute-force enumeration.

The brute force knows nothing of blocks, imbalances or the min-spend argument: it enumerates every input
sequence over the grid (or every memo-input sequence for dBitFlipPM), every output, and sums over every
memo-bit assignment and every flip, straight from the mechanism's definition (Ding et al. 2017, section 3).
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from protocols.dbitflip import DBitFlipParams
from protocols.onebit import epsilon_prime
from protocols.worst_case import (WorstCase, dbitflippm_worst_case, memo_bit_worst_case, one_report_loss,
                                  within_pattern_bound)


# ------------------------------------------------------------------------------------------- brute force
def _outputs(width: int) -> np.ndarray:
    return np.array(list(itertools.product((0, 1), repeat=width)), dtype=np.int8)


def _transcript_probs(prior: np.ndarray, sent: np.ndarray, outs: np.ndarray, gamma: float) -> np.ndarray:
    """P(o) for every o: sum over memo assignments (rows of ``sent``, the bits sent before flipping, with
    probabilities ``prior``) of prod over sent bits of (1 - gamma if o matches else gamma)."""
    match = outs[None, :, :] == sent[:, None, :]
    return prior @ np.prod(np.where(match, 1.0 - gamma, gamma), axis=2)


def _max_log_ratio(probs: np.ndarray) -> float:
    """max over outputs (columns) and pairs of inputs (rows) of ln P(o|g)/P(o|g'); inf if some P is 0."""
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    return float((logp.max(axis=0) - logp.min(axis=0)).max())


def brute_memo_bit(eps: float, gamma: float, rounds: int, grid: int) -> float:
    """1BitRRPM: one memo bit per grid value, Bern(p(g)) with p(g) = 1/(e^eps+1) + (g/m)(e^eps-1)/(e^eps+1)."""
    e = math.exp(eps)
    p = [1 / (e + 1) + (j / (grid - 1)) * (e - 1) / (e + 1) for j in range(grid)]
    outs = _outputs(rounds)
    rows = []
    for g in itertools.product(range(grid), repeat=rounds):
        vals = sorted(set(g))
        bits = _outputs(len(vals))  # every memo assignment of the visited grid values
        prior = np.prod([[p[v] if b else 1 - p[v] for v, b in zip(vals, row)] for row in bits], axis=1)
        sent = bits[:, [vals.index(x) for x in g]]
        rows.append(_transcript_probs(prior, sent, outs, gamma))
    return _max_log_ratio(np.array(rows))


def brute_dbitflippm(eps: float, gamma: float, rounds: int, d: int, k: int) -> float:
    """dBitFlipPM: memo input s in {0..d} ({1..d} when d = k); bit p of input s is Bern(E/(E+1)) if p = s - 1
    else Bern(1/(E+1)), E = e^(eps/2), independent over (s, p); every sent bit flipped with prob gamma."""
    e = math.exp(eps / 2)
    inputs = list(range(d + 1)) if d < k else list(range(1, d + 1))
    pairs = [(s, p) for s in inputs for p in range(d)]
    pone = np.array([e / (e + 1) if p == s - 1 else 1 / (e + 1) for s, p in pairs])
    memo = _outputs(len(pairs))
    prior = np.prod(np.where(memo == 1, pone, 1 - pone), axis=1)
    outs = _outputs(d * rounds)
    rows = []
    for seq in itertools.product(inputs, repeat=rounds):
        cols = [pairs.index((s, p)) for s in seq for p in range(d)]
        rows.append(_transcript_probs(prior, memo[:, cols], outs, gamma))
    return _max_log_ratio(np.array(rows))


def block_dp_memo_bit(eps: float, gamma: float, rounds: int, grid: int) -> float:
    """Reference for longer runs: for each count of ones n1 in o, give every grid value j a block of a_j ones
    and b_j zeros (none: unused) with factor p_j (1-gamma)^a gamma^b + (1 - p_j) gamma^a (1-gamma)^b, and take
    the max and min of the product by a plain DP over grid values (no convexity, no structural claim)."""
    e = math.exp(eps)
    p = [1 / (e + 1) + (j / (grid - 1)) * (e - 1) / (e + 1) for j in range(grid)]
    best = 0.0
    for n1 in range(rounds + 1):
        n0 = rounds - n1
        a, b = np.meshgrid(np.arange(n1 + 1), np.arange(n0 + 1), indexing="ij")
        hi = np.full((n1 + 1, n0 + 1), -np.inf)
        hi[0, 0] = 0.0
        lo = np.where(hi == 0.0, 0.0, np.inf)
        for pj in p:
            cost = np.log(pj * (1 - gamma) ** a * gamma**b + (1 - pj) * gamma**a * (1 - gamma) ** b)
            new_hi, new_lo = hi.copy(), lo.copy()
            for i in range(n1 + 1):
                for k in range(n0 + 1):
                    if i or k:
                        new_hi[i:, k:] = np.maximum(new_hi[i:, k:], hi[: n1 + 1 - i, : n0 + 1 - k] + cost[i, k])
                        new_lo[i:, k:] = np.minimum(new_lo[i:, k:], lo[: n1 + 1 - i, : n0 + 1 - k] + cost[i, k])
            hi, lo = new_hi, new_lo
        best = max(best, hi[n1, n0] - lo[n1, n0])
    return best


# ------------------------------------------------------------------------------------------- 1BitRRPM
CASES = [(1.0, 0.1), (0.5, 0.3), (2.0, 0.05), (1.0, 1 / 3)]


@pytest.mark.parametrize("rounds,grid", [(2, 2), (2, 5), (3, 3), (3, 5), (4, 2), (4, 4), (5, 3), (6, 2)])
@pytest.mark.parametrize("eps,gamma", CASES)
def test_exact_grid_value_equals_brute_force(eps, gamma, rounds, grid):
    brute = brute_memo_bit(eps, gamma, rounds, grid)
    wc = memo_bit_worst_case(eps, gamma, rounds, grid_size=grid)
    assert wc.exact and wc.value == pytest.approx(brute, abs=1e-9)
    relaxed = memo_bit_worst_case(eps, gamma, rounds)
    assert relaxed.value >= brute - 1e-12  # the continuous relaxation bounds every grid


@pytest.mark.parametrize("eps,gamma,rounds,grid", [(1.0, 1 / 3, 12, 7), (0.5, 0.3, 10, 9), (1.0, 0.1, 11, 6),
                                                    (2.0, 0.2, 9, 10)])
def test_exact_grid_value_equals_block_dp(eps, gamma, rounds, grid):
    """Longer runs than the brute force reaches: the block DP (validated against it below) agrees."""
    assert memo_bit_worst_case(eps, gamma, rounds, grid_size=grid).value == pytest.approx(
        block_dp_memo_bit(eps, gamma, rounds, grid), abs=1e-9)


def test_block_dp_equals_brute_force():
    for eps, gamma, rounds, grid in [(1.0, 1 / 3, 4, 4), (0.5, 0.3, 5, 3), (2.0, 0.2, 3, 5)]:
        assert block_dp_memo_bit(eps, gamma, rounds, grid) == pytest.approx(
            brute_memo_bit(eps, gamma, rounds, grid), abs=1e-9)


def test_relaxation_is_the_fine_grid_limit():
    eps, gamma = 1.0, 0.1
    relaxed = memo_bit_worst_case(eps, gamma, 2)
    assert not relaxed.exact  # at T = 2 two values near p_lo beat the grid's single p_lo
    coarse, mid, fine = (brute_memo_bit(eps, gamma, 2, g) for g in (2, 21, 41))
    assert coarse < mid < fine < relaxed.value  # 1.651 < 1.733 < 1.761 < 1.790
    # the gap closes like 1/s: the second-smallest p is p_lo + (p_hi - p_lo)/(|G| - 1)
    assert (relaxed.value - fine) / (relaxed.value - mid) == pytest.approx(20 / 40, rel=0.05)
    assert memo_bit_worst_case(eps, gamma, 2, grid_size=41).value == pytest.approx(fine, abs=1e-9)
    assert memo_bit_worst_case(eps, gamma, 2, grid_size=10**6 + 1).value == pytest.approx(relaxed.value, abs=1e-5)
    for rounds in (2, 5, 31):
        values = [memo_bit_worst_case(eps, 1 / 3, rounds, grid_size=g).value for g in (2, 11, 101, 10**6 + 1)]
        assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
        relaxed = memo_bit_worst_case(eps, 1 / 3, rounds).value
        assert values[-1] == pytest.approx(relaxed, abs=1e-3)  # the gap is about T^2/|G|


@pytest.mark.parametrize("eps,gamma", CASES + [(0.5, 0.05), (2.0, 1 / 3)])
def test_relaxation_closed_form(eps, gamma):
    """Continuous grid: ones in one block at q, zeros in one at 1 - q (numerator); single-round blocks at the
    extreme p (denominator): all T rounds when H(1 - q, 1) < 0, else |n1 - n0| of them plus balanced pairs."""
    lam, q = 0.5 * math.log((1 - gamma) / gamma), 1 / (1 + math.exp(-eps))

    def h(p, s):
        return math.log(p * math.exp(lam * s) + (1 - p) * math.exp(-lam * s))

    h1 = h(1 - q, 1)
    assert (h1 < 0) == ((1 - gamma) / gamma < math.exp(2 * eps))
    for rounds in (2, 3, 7, 31, 100):
        spend = [h(q, n1) + h(q, rounds - n1) - (rounds * h1 if h1 < 0 else abs(2 * n1 - rounds) * h1)
                 for n1 in range(rounds + 1)]
        assert memo_bit_worst_case(eps, gamma, rounds).value == pytest.approx(max(spend), rel=1e-12)


def test_relaxation_flagged_exact_only_when_two_grid_values_reach_it():
    for eps, gamma in CASES:
        for rounds in (2, 3, 4, 7, 31):
            wc = memo_bit_worst_case(eps, gamma, rounds)
            two = memo_bit_worst_case(eps, gamma, rounds, grid_size=2).value
            assert wc.exact == (abs(wc.value - two) <= 1e-9 * wc.value)
            if wc.exact and rounds <= 4:
                assert wc.value == pytest.approx(brute_memo_bit(eps, gamma, rounds, 3), abs=1e-9)


@pytest.mark.parametrize("eps,gamma", CASES + [(3.0, 0.01), (0.2, 0.45)])
def test_one_round_is_theorem_6(eps, gamma):
    g, e = gamma, math.exp(eps)
    expected = math.log(((1 - 2 * g) * e / (e + 1) + g) / ((1 - 2 * g) / (e + 1) + g))
    assert one_report_loss(eps, gamma) == pytest.approx(expected, rel=1e-12)
    assert epsilon_prime(eps, gamma) == pytest.approx(expected, rel=1e-12)
    for grid in (None, 2, 11):
        wc = memo_bit_worst_case(eps, gamma, 1, grid_size=grid)
        assert wc.exact and wc.value == pytest.approx(expected, rel=1e-12)
    assert memo_bit_worst_case(eps, gamma, 1, grid_size=3).value == pytest.approx(
        brute_memo_bit(eps, gamma, 1, 3), abs=1e-12)
    assert memo_bit_worst_case(eps, 0.0, 1).value == pytest.approx(eps, rel=1e-12)


def test_no_output_perturbation_is_unbounded():
    for rounds in (2, 3, 365):
        for grid in (None, 2, 25):
            wc = memo_bit_worst_case(1.0, 0.0, rounds, grid_size=grid)
            assert wc == WorstCase(math.inf, True, wc.method)
        assert dbitflippm_worst_case(1.0, 0.0, rounds, 2, 8).value == math.inf
    assert brute_memo_bit(1.0, 0.0, 2, 2) == math.inf  # a constant device never sends (0, 1)
    assert memo_bit_worst_case(1.0, 0.0, 0).value == 0.0


def test_grows_with_rounds_and_shrinks_as_gamma_goes_to_half():
    for grid in (None, 2, 25):
        by_rounds = [memo_bit_worst_case(1.0, 0.1, t, grid_size=grid).value for t in (1, 2, 3, 7, 31, 365)]
        assert all(a < b for a, b in zip(by_rounds, by_rounds[1:]))
        gammas = (0.01, 0.05, 0.1, 0.3, 0.45, 0.499)
        by_gamma = [memo_bit_worst_case(1.0, g, 31, grid_size=grid).value for g in gammas]
        assert all(a > b for a, b in zip(by_gamma, by_gamma[1:]))
        assert by_gamma[-1] < 0.1
    # with output perturbation the loss exceeds the within-pattern charge of any single grid value
    assert memo_bit_worst_case(1.0, 0.1, 4, grid_size=2).value > within_pattern_bound(1.0, 4, 2)


def test_issue_figures():
    """Issue 9 quotes 3.01 (T = 4) and 4.59 (T = 6) at eps = 1, gamma = 0.1. The maximum over every output and
    pair of devices is larger on every grid: 3.777 at T = 4 for every grid of up to 65 values (a constant
    device against one holding all ones in one grid value and all zeros in another, on an output with two
    ones and two zeros), rising to 3.884 as s -> 0; 5.966 at T = 6 (5.983 as s -> 0). The quoted figures are
    ratios of particular pairs of devices, not the worst case."""
    for grid in (2, 3, 4):
        assert brute_memo_bit(1.0, 0.1, 4, grid) == pytest.approx(3.776989, abs=1e-6)
    assert brute_memo_bit(1.0, 0.1, 6, 2) == pytest.approx(5.966159, abs=1e-6)
    assert memo_bit_worst_case(1.0, 0.1, 4, grid_size=65).value == pytest.approx(3.776989, abs=1e-6)
    assert memo_bit_worst_case(1.0, 0.1, 4, grid_size=66).value > 3.776989 + 1e-6
    assert memo_bit_worst_case(1.0, 0.1, 4).value == pytest.approx(3.884139, abs=1e-6)
    assert memo_bit_worst_case(1.0, 0.1, 6, grid_size=4).value == pytest.approx(5.966159, abs=1e-6)
    assert memo_bit_worst_case(1.0, 0.1, 6).value == pytest.approx(5.982756, abs=1e-6)


def test_long_runs_are_fast_and_finite():
    start = time.perf_counter()
    for gamma in (0.001, 0.1, 1 / 3):
        for grid in (None, 2, 101, 10**6 + 1):
            wc = memo_bit_worst_case(2.0, gamma, 365, grid_size=grid)
            assert math.isfinite(wc.value) and wc.value > 0
    assert time.perf_counter() - start < 5.0
    # large T: the balanced output against a constant device gives ln((1 - gamma)/gamma)/2 per round
    lam = 0.5 * math.log(0.9 / 0.1)
    assert memo_bit_worst_case(1.0, 0.1, 365).value / 365 == pytest.approx(lam, rel=0.01)


# ------------------------------------------------------------------------------------------- dBitFlipPM
@pytest.mark.parametrize("rounds,d,k", [(1, 1, 2), (1, 2, 3), (1, 3, 4), (2, 1, 2), (3, 1, 4), (2, 2, 3),
                                        (2, 2, 2), (3, 2, 3), (2, 3, 4)])
@pytest.mark.parametrize("eps,gamma", [(1.0, 0.1), (2.0, 0.2)])
def test_dbitflippm_against_brute_force(eps, gamma, rounds, d, k):
    brute = brute_dbitflippm(eps, gamma, rounds, d, k)
    wc = dbitflippm_worst_case(eps, gamma, rounds, d, k)
    assert wc.exact == (d == 1 or rounds == 1)
    if wc.exact:
        assert wc.value == pytest.approx(brute, abs=1e-9)
    else:
        assert wc.value >= brute - 1e-12
    if rounds == 1:
        assert wc.value == pytest.approx(DBitFlipParams("dbitflippm", eps, 1.0, k, d, gamma).round_epsilon)


def test_dbitflippm_one_bit_is_two_value_memo_bit():
    for rounds in (2, 7, 365):
        assert dbitflippm_worst_case(1.0, 0.1, rounds, 1, 16).value == pytest.approx(
            memo_bit_worst_case(0.5, 0.1, rounds, grid_size=2).value, rel=1e-12)
    assert dbitflippm_worst_case(1.0, 0.0, 1, 4, 16).value == pytest.approx(1.0)  # two bits at eps/2


# ------------------------------------------------------------------------------------------- misc
def test_within_pattern_bound():
    assert within_pattern_bound(1.0, 4, 25) == 4.0
    assert within_pattern_bound(0.5, 365, 3) == 1.5
    assert within_pattern_bound(2.0, 0, 3) == 0.0


@pytest.mark.parametrize("call", [
    lambda: memo_bit_worst_case(0.0, 0.1, 3), lambda: memo_bit_worst_case(1.0, 0.5, 3),
    lambda: memo_bit_worst_case(1.0, -0.1, 3), lambda: memo_bit_worst_case(1.0, 0.1, -1),
    lambda: memo_bit_worst_case(1.0, 0.1, 2.5), lambda: memo_bit_worst_case(1.0, 0.1, 3, grid_size=1),
    lambda: dbitflippm_worst_case(1.0, 0.1, 3, 0, 4), lambda: dbitflippm_worst_case(1.0, 0.1, 3, 5, 4),
    lambda: within_pattern_bound(1.0, 3, 0)])
def test_rejects_bad_arguments(call):
    with pytest.raises(ValueError):
        call()
