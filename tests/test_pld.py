"""(eps, delta) accounting beside pure eps (issue 11, part 3): the per-round mechanism descriptions
(protocols/round_mechanism.py and each params class's ``round_mechanism``) and the PLD accountant
(scenarios/accounting.py).

What is checked:
- every description's pure eps is the ledger's round_epsilon, round by round (a description with the wrong eps
  fails here), and the non-fresh protocols say why they do not compose;
- each description against the real device side: the empirical output law of many device ids against the
  described P and Q, within 5 binomial standard deviations, and the same check rejects a description at 1.3 eps;
- the accountant against exact results: k-fold randomized response has a closed-form delta(eps) (the binomial
  privacy loss), which the lattice grid must reproduce; with delta -> 0 it never falls below the exact pure
  bound T x eps (attained by the all-ones output), and it never exceeds basic composition by more than the
  discretization allows; for many rounds it is well below T x eps and below the advanced composition bounds
  (Kairouz-Oh-Viswanath, Dwork-Rothblum-Vadhan);
- the run directory: summary.json's privacy.eps_delta and eps_delta.csv.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from protocols import config, numeric
from protocols.baselines import KFlipDevices, KFlipParams, LaplaceDevices, LaplaceParams, laplace_grid
from protocols.dbitflip import DBitFlipDevices, DBitFlipParams
from protocols.epochrr import EpochRRParams
from protocols.multicounter import MultiDevices, MultiParams, joint_epsilon, joint_report_pair
from protocols.onebit import OneBitDevices, OneBitParams, epsilon_prime
from protocols.round_mechanism import (DiscretePair, LaplacePair, NoRoundMechanism, _grid, lower_envelope,
                                       pair_from_curve, randomized_response, rr_power, upper_envelope)
from protocols.topl import ToplParams, hm_pair, sw_pair
from scenarios import accounting, output, runner, schema



def test_dp_accounting_is_installed() -> None:
    """The accountant's tests need dp-accounting, which the test extra installs (never skipped)."""
    assert accounting.dependency_problem() is None, accounting.dependency_problem()

M = 100.0
FRESH = {
    "1bitmean": OneBitParams("1bitmean", 1.0, M),
    "1bitmean-gamma": OneBitParams("1bitmean", 1.0, M, gamma=0.2),
    "dbitflip-d2": DBitFlipParams("dbitflip", 1.0, M, 6, 2),
    "dbitflip-d1": DBitFlipParams("dbitflip", 0.7, M, 6, 1),
    "dbitflip-gamma": DBitFlipParams("dbitflip", 1.5, M, 6, 3, gamma=0.1),
    "binflip": DBitFlipParams("binflip", 1.0, M, 4, 4),
    "kflip": KFlipParams("kflip", 1.0, M, 5),
    "kflip-2": KFlipParams("kflip", 0.5, M, 2),
    "laplace": LaplaceParams("laplace", 1.0, M),
    "1bitmulti-1": MultiParams("1bitmulti", 1.0, M, 1),
    "1bitmulti-2": MultiParams("1bitmulti", 1.0, M, 2),
    "1bitmulti-3": MultiParams("1bitmulti", 1.0, M, 3),
    "1bitmulti-8": MultiParams("1bitmulti", 0.5, M, 8),
    "epochrr": EpochRRParams("epochrr", 2.0, 4, 12),
    "topl": ToplParams("topl", 1.0, 1.0, M, 0.05, 10, 40, 1000),
    "topl-two-eps": ToplParams("topl", 1.0, 1.7, M, 0.05, 10, 40, 1000),
    "topl-small-eps": ToplParams("topl", 0.5, 0.3, M, 0.05, 0, 40, 1000),
}


# ------------------------------------------------------------------------------------------- descriptions
@pytest.mark.parametrize("name", sorted(FRESH))
def test_description_pure_eps_is_the_ledgers_round_epsilon(name: str) -> None:
    """Each round's pair has pure eps = what the ledger charges that round, so T rounds sum to the guarantee.
    A description built with a wrong eps (or a ledger charging a wrong one) fails here."""
    params = FRESH[name]
    horizon = 23
    total = 0.0
    for r in range(1, horizon + 1):
        mech = params.round_mechanism(r)
        assert isinstance(mech, (DiscretePair, LaplacePair))
        total += mech.max_loss
        charged = params.guarantee(r).value - (params.guarantee(r - 1).value if r > 1 else 0.0)  # round r's charge
        assert mech.max_loss == pytest.approx(charged, rel=1e-9)
        assert mech.max_loss <= params.round_epsilon * (1 + 1e-9)
    assert total == pytest.approx(params.guarantee(horizon).value, rel=1e-9)


def test_descriptions_that_are_attained_say_so() -> None:
    assert FRESH["1bitmean"].round_mechanism().attained
    assert FRESH["dbitflip-d2"].round_mechanism().attained
    assert FRESH["kflip"].round_mechanism().attained
    assert FRESH["1bitmulti-2"].round_mechanism().attained
    assert not FRESH["1bitmulti-3"].round_mechanism().attained  # an envelope of two bounds
    assert not FRESH["laplace"].round_mechanism().attained  # the clamp makes the real pair slightly better


@pytest.mark.parametrize("scenario, name", [("quickstart", "1bitrrpm"), ("usage_histogram", "dbitflippm"),
                                            ("thresh_stable", "thresh"), ("tops_pos", "tops")])
def test_non_fresh_protocols_say_why(scenario: str, name: str) -> None:
    sc = schema.load(scenario)
    assert sc.protocol.name == name
    mech = sc.protocol.round_mechanism()
    assert isinstance(mech, NoRoundMechanism) and len(mech.why) > 20
    entry, table = accounting.summary_entry(sc.protocol, sc.collections)
    assert entry == {"applies": False, "why": mech.why} and table is None


# ------------------------------------------------------------------------------------------- device checks
def _zmax(counts: np.ndarray, probs: np.ndarray) -> float:
    """Largest |empirical - described| over the outputs, in binomial standard deviations."""
    n = counts.sum()
    probs = np.asarray(probs, dtype=np.float64)
    sd = np.sqrt(np.maximum(probs * (1 - probs), 1e-12) / n)
    return float(np.max(np.abs(counts / n - probs) / sd))


def _check(counts_p: np.ndarray, counts_q: np.ndarray, described: DiscretePair, wrong: DiscretePair) -> None:
    """The device's counts fit the description (z < 5) and reject the same mechanism declared at 1.3 eps."""
    assert _zmax(counts_p, described.p) < 5 and _zmax(counts_q, described.q) < 5
    assert max(_zmax(counts_p, wrong.p), _zmax(counts_q, wrong.q)) > 8


N = 200_000
IDS = np.arange(N, dtype=np.uint64)


@pytest.mark.parametrize("gamma", [0.0, 0.2])
def test_onebitmean_description_matches_the_device(gamma: float) -> None:
    params = OneBitParams("1bitmean", 1.0, M, gamma=gamma)
    dev = OneBitDevices(params, 11, IDS)
    counts = []
    for x in (M, 0.0):
        bits, _ = dev.report_bits(3, np.full(N, x))
        ones = int(bits.sum())
        counts.append(np.array([ones, N - ones]))  # outputs ("1", "0")
    wrong = OneBitParams("1bitmean", 1.3, M, gamma=gamma).round_mechanism()
    _check(counts[0], counts[1], params.round_mechanism(), wrong)


@pytest.mark.parametrize("k, d, gamma", [(4, 2, 0.0), (5, 3, 0.0), (4, 4, 0.0), (5, 3, 0.15), (6, 1, 0.0)])
def test_dbitflip_description_matches_the_device(k: int, d: int, gamma: float) -> None:
    """Brute force over many device ids of the real device side: each device's J (fixed for life) holds its own
    b and b' (the worst J, on which the description conditions); count the bits at b and b' under x in b and
    under x' in b'. With d = 1 the single bit is counted, x in J against x' outside."""
    name = "binflip" if d == k else "dbitflip"
    params = DBitFlipParams(name, 1.0, M, k, d, gamma)
    dev = DBitFlipDevices(params, 5, IDS)
    J = dev.J
    width = M / k
    counts = []
    if d == 1:
        inside = (J[:, 0] + 0.5) * width
        outside = ((J[:, 0] + 1) % k + 0.5) * width
        for values in (inside, outside):
            bits, _ = dev.report_bits(2, values)
            ones = int(bits[:, 0].sum())
            counts.append(np.array([ones, N - ones]))
    else:
        x, x2 = (J[:, 0] + 0.5) * width, (J[:, d - 1] + 0.5) * width  # b = J_0, b' = J_{d-1}
        for values in (x, x2):
            bits, _ = dev.report_bits(2, values)
            a, b = bits[:, 0].astype(int), bits[:, d - 1].astype(int)
            code = (1 - a) * 2 + (1 - b)  # outputs "1|1", "1|0", "0|1", "0|0"
            counts.append(np.bincount(code, minlength=4))
    wrong = DBitFlipParams(name, 1.3, M, k, d, gamma).round_mechanism()
    _check(counts[0], counts[1], params.round_mechanism(), wrong)


def test_kflip_description_matches_the_device() -> None:
    params = KFlipParams("kflip", 1.0, M, 5)
    dev = KFlipDevices(params, 3, IDS)
    b, b2 = 1, 3
    counts = []
    for bucket in (b, b2):
        y = dev.report(4, np.full(N, (bucket + 0.5) * M / 5))["y"].astype(int)
        counts.append(np.array([np.sum(y == b), np.sum(y == b2), np.sum((y != b) & (y != b2))]))
    _check(counts[0], counts[1], params.round_mechanism(), KFlipParams("kflip", 1.3, M, 5).round_mechanism())


def test_laplace_description_matches_the_device() -> None:
    """The grid Laplace report n = k + Z (steps of m/1024): for x = 0 (k = 0) and x' = m (k = 1024), the tail
    P[Z >= z] = alpha^z/(1 + alpha) of the described two-sided geometric, alpha = e^(-parameter)."""
    params = LaplaceParams("laplace", 1.0, M)
    mech = params.round_mechanism()
    parameter, steps = mech.discrete
    step, alpha, _ = laplace_grid(params.epsilon, params.max_value)
    assert steps == 1024 and parameter == pytest.approx(params.epsilon / 1024)
    assert math.exp(-parameter) == pytest.approx(alpha) and mech.step == pytest.approx(step)
    assert mech.max_loss == pytest.approx(params.epsilon)
    dev = LaplaceDevices(params, 9, IDS)

    def tails(a: float) -> np.ndarray:
        z = np.array([256, 1024, 2048])
        return a**z / (1 + a)

    for x, k in ((0.0, 0), (M, 1024)):
        n = np.rint(dev.report(6, np.full(N, x))["y"] / step).astype(np.int64) - k
        counts = np.array([np.sum(n >= z) for z in (256, 1024, 2048)])
        mirror = np.array([np.sum(n <= -z) for z in (256, 1024, 2048)])
        for c in (counts, mirror):
            sd = np.sqrt(tails(alpha) * (1 - tails(alpha)) / N)
            assert np.max(np.abs(c / N - tails(alpha)) / sd) < 5
            assert np.max(np.abs(c / N - tails(math.exp(-1.3 * parameter))) / sd) > 8


def test_multicounter_two_counters_description_matches_the_device() -> None:
    """c = 2: x = (m, 0) against x' = (0, m); the sufficient statistic is how many bits point to x."""
    params = MultiParams("1bitmulti", 1.0, M, 2)
    dev = MultiDevices(params, 4, IDS)
    counts = []
    for x in ((M, 0.0), (0.0, M)):
        b = np.asarray(dev.report(2, np.tile(np.array(x), (N, 1)))["b"]).astype(int)
        agree = b[:, 0] + (1 - b[:, 1])  # bits that point to x = (m, 0): b_1 = 1, b_2 = 0
        counts.append(np.bincount(agree, minlength=3))
    wrong = MultiParams("1bitmulti", 1.3, M, 2).round_mechanism()
    _check(counts[0], counts[1], params.round_mechanism(), wrong)


def _multi_law(u: np.ndarray, eps: float) -> np.ndarray:
    """P[bits | x = u m] for every bit vector (itertools.product order): c independent 1BitMean bits."""
    e = math.exp(eps)
    p1 = 1 / (e + 1) + u * (e - 1) / (e + 1)
    outs = np.array(list(itertools.product([0, 1], repeat=u.size)))
    return np.prod(np.where(outs == 1, p1, 1 - p1), axis=1)


def test_multicounter_law_matches_the_device() -> None:
    """The product law used below, against the device at an interior input (the budget split over two apps)."""
    params = MultiParams("1bitmulti", 1.0, M, 3)
    u = np.array([0.5, 0.5, 0.0])
    b = np.asarray(MultiDevices(params, 8, IDS).report(5, np.tile(u * M, (N, 1)))["b"]).astype(int)
    counts = np.bincount(b[:, 0] * 4 + b[:, 1] * 2 + b[:, 2], minlength=8)
    assert _zmax(counts, _multi_law(u, 1.0)) < 5


@pytest.mark.parametrize("c, eps", [(3, 1.0), (4, 0.5), (3, 2.0)])
def test_multicounter_envelope_dominates_every_feasible_pair(c: int, eps: float) -> None:
    """The envelope's H_alpha is at least H_alpha(M(x) || M(x')) for every pair of feasible inputs on a grid
    that holds the extreme points, the even splits and the interior, at every alpha; and no single one of
    those pairs dominates the others (why the description is an envelope)."""
    mech = MultiParams("1bitmulti", eps, M, c).round_mechanism()
    steps = 6
    grid = [np.array(v) / steps for v in itertools.product(range(steps + 1), repeat=c) if sum(v) <= steps]
    laws = np.array([_multi_law(u, eps) for u in grid])
    alphas = np.exp(np.linspace(-joint_epsilon(eps, c) - 0.2, joint_epsilon(eps, c) + 0.2, 81))
    h_env = mech.hockey_stick(alphas)
    worst = np.zeros_like(alphas)
    which = np.zeros(alphas.size, dtype=np.int64)
    for i, law in enumerate(laws):
        h = np.maximum(law[None, None, :] - alphas[:, None, None] * laws[None, :, :], 0).sum(axis=2)  # (alpha, j)
        best = h.max(axis=1)
        which = np.where(best > worst, i * len(laws) + h.argmax(axis=1), which)
        worst = np.maximum(worst, best)
    assert np.all(worst <= h_env + 1e-12)
    assert len(set(which[worst > 1e-9].tolist())) > 1
    assert mech.max_loss == pytest.approx(joint_epsilon(eps, c), rel=1e-9)


def test_hm_and_sw_descriptions_match_their_samplers() -> None:
    rng = np.random.default_rng(1)
    eps = 1.0
    c_sr, c_pm = numeric.sr_c(eps), numeric.pm_c(eps)
    counts = []
    for t in (1.0, -1.0):
        y = numeric.hm_randomize(np.full(N, t), eps, *rng.random((3, N)))
        atom_hi, atom_lo = y == c_sr, y == -c_sr
        pm = ~(atom_hi | atom_lo)
        counts.append(np.array([np.sum(pm & (y >= 1)), np.sum(pm & (y > -1) & (y < 1)), np.sum(pm & (y <= -1)),
                                atom_hi.sum(), atom_lo.sum()]))
    assert c_pm > c_sr
    _check(counts[0], counts[1], hm_pair(eps), hm_pair(1.3 * eps))
    b = numeric.sw_b(eps)
    counts = []
    for v in (1.0, 0.0):
        y = numeric.sw_randomize(np.full(N, v), eps, *rng.random((2, N)))
        near1, near0 = np.abs(y - 1) <= b, np.abs(y) <= b
        counts.append(np.array([np.sum(near1 & ~near0), np.sum(near0 & ~near1), np.sum(~(near0 ^ near1))]))
    _check(counts[0], counts[1], sw_pair(eps), sw_pair(1.3 * eps))


def test_epochrr_description_is_1bitmean_at_eps_over_t() -> None:
    params = FRESH["epochrr"]
    mech = params.round_mechanism()
    from protocols.onebit import p_one

    assert mech.p[0] == pytest.approx(p_one(1.0, params.epoch_epsilon, 1.0))
    assert mech.q[0] == pytest.approx(p_one(0.0, params.epoch_epsilon, 1.0))


def test_output_perturbation_matches_theorem_6() -> None:
    mech = OneBitParams("1bitmean", 1.0, M, gamma=0.2).round_mechanism()
    assert mech.max_loss == pytest.approx(epsilon_prime(1.0, 0.2))
    e = math.e
    assert mech.p[0] == pytest.approx(0.2 + 0.6 * e / (e + 1))


# ------------------------------------------------------------------------------------------- envelopes
def test_pair_from_curve_reproduces_a_pair() -> None:
    for pair in (randomized_response(0.7, "x", "d"), rr_power(0.4, 5, "x", "d"), hm_pair(1.2), sw_pair(0.9)):
        p, q = pair.arrays()
        ok = (p > 0) & (q > 0)
        alphas = _grid(p[ok] / q[ok])  # 0, then the likelihood ratios (ties up to rounding merged)
        values = pair.hockey_stick(alphas)
        values[-1] = 0.0
        rebuilt = pair_from_curve(alphas, values, "x", "d")
        grid = np.exp(np.linspace(-4, 4, 401))
        np.testing.assert_allclose(rebuilt.hockey_stick(grid), pair.hockey_stick(grid), atol=1e-12)


def test_envelopes_bound_the_right_way() -> None:
    grid = np.exp(np.linspace(-5, 5, 1001))
    a, b = randomized_response(2.24, "x", "d"), rr_power(1.0, 3, "x", "d")
    low = lower_envelope(a, b, "x", "d")
    assert np.all(low.hockey_stick(grid) <= np.minimum(a.hockey_stick(grid), b.hockey_stick(grid)) + 1e-12)
    assert low.max_loss == pytest.approx(2.24) and low.symmetric
    # c = 2: the product is below randomized response at 2 eps, so the envelope is the product itself
    two = lower_envelope(randomized_response(2.0, "x", "d"), rr_power(1.0, 2, "x", "d"), "x", "d")
    np.testing.assert_allclose(two.hockey_stick(grid), rr_power(1.0, 2, "x", "d").hockey_stick(grid), atol=1e-12)
    high = upper_envelope(hm_pair(1.0), sw_pair(1.7), "x", "d")
    assert np.all(high.hockey_stick(grid) >= np.maximum(hm_pair(1.0).hockey_stick(grid),
                                                        sw_pair(1.7).hockey_stick(grid)) - 1e-12)
    assert high.max_loss == pytest.approx(1.7)


@pytest.mark.parametrize("eps, threshold_eps", [(5.0, 1.0), (8.0, 8.0), (10.0, 10.0), (10.0, 1.0), (1.0, 10.0)])
def test_the_topl_threshold_round_envelope_holds_across_the_epsilon_range(eps: float, threshold_eps: float) -> None:
    """At eps = 10 the envelope's segments near alpha = 0 are 1e-5 long, and rounding moved their slopes by
    1e-11: the convexity check must allow rounding over short segments (it refused at eps = 10 before), and
    the slope at 0, -1 exactly, must not leave an infinite-loss output of rounding noise. The result still
    dominates both pairs up to rounding, and the accountant's grid stays small."""
    hm, sw = hm_pair(eps), sw_pair(threshold_eps)
    high = upper_envelope(hm, sw, "x", "d")
    grid = np.exp(np.linspace(-25, 25, 2001))
    rounding = 1e-12 + 1e-15 * grid  # H_alpha = sum (P - alpha Q)+ carries alpha x Q's rounding
    assert np.all(high.hockey_stick(grid) >= np.maximum(hm.hockey_stick(grid), sw.hockey_stick(grid)) - rounding)
    assert high.max_loss == pytest.approx(max(eps, threshold_eps), rel=1e-6)
    d = accounting.choose_discretization([high, hm])
    assert max(eps, threshold_eps) / d.interval <= accounting.MAX_LATTICE_STEPS


def test_a_lattice_of_tiny_units_is_not_taken_for_exact() -> None:
    """Losses of 1e-6 and 10 are multiples of 1e-6 within the lattice tolerance (1e-9 of 1e7), but a grid of
    1e7 points a round (2e7 after two rounds, dense) is not what "exact" should cost: the fine grid instead."""
    d = accounting.choose_discretization([randomized_response(1e-6, "x", "d"), randomized_response(10.0, "x", "d")])
    assert not d.exact and 10.0 / d.interval <= accounting.MAX_LATTICE_STEPS


# ------------------------------------------------------------------------------------------- the accountant
def _rr_delta(eps: float, eps0: float, count: int) -> float:
    """Exact delta(eps) of ``count``-fold randomized response at eps0: the privacy loss is (count - 2i) eps0
    with probability C(count, i) h^(count - i) (1 - h)^i, h = e^eps0/(e^eps0 + 1)."""
    h = 1 / (1 + math.exp(-eps0))
    total = 0.0
    for i in range(count + 1):
        loss = (count - 2 * i) * eps0
        if loss <= eps:
            break
        logp = (math.lgamma(count + 1) - math.lgamma(i + 1) - math.lgamma(count - i + 1)
                + (count - i) * math.log(h) + i * math.log1p(-h))
        total += math.exp(logp) * -math.expm1(eps - loss)
    return total


def _rr_epsilon(delta: float, eps0: float, count: int) -> float:
    lo, hi = 0.0, count * eps0
    if _rr_delta(0.0, eps0, count) <= delta:
        return 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _rr_delta(mid, eps0, count) > delta else (lo, mid)
    return hi


@pytest.mark.parametrize("eps", [0.3, 1.0])
def test_accountant_equals_exact_randomized_response_composition(eps: float) -> None:
    """1BitMean is randomized response: its T-round eps(delta) has a closed form (binomial privacy loss), and
    on the lattice grid the accountant reproduces it after every round. dBitFlip (d >= 2) is randomized
    response at eps/2 on two bits a round: 2T-fold."""
    exact_tables = [accounting.account(p, 60, truncation=0.0)
                    for p in (OneBitParams("1bitmean", eps, M), DBitFlipParams("dbitflip", eps, M, 8, 3))]
    default_tables = [accounting.account(p, 60)
                      for p in (OneBitParams("1bitmean", eps, M), DBitFlipParams("dbitflip", eps, M, 8, 3))]
    for t in (1, 2, 5, 31, 60):
        for i, delta in enumerate(accounting.DELTAS):
            for tables, (eps0, count) in zip(zip(exact_tables, default_tables), ((eps, t), (eps / 2, 2 * t))):
                exact = _rr_epsilon(delta, eps0, count)
                assert tables[0].discretization.exact
                assert tables[0].epsilon[i][t - 1] == pytest.approx(exact, abs=1e-7)
                # dp-accounting's default tail truncation (1e-15 a composition) moves mass to an infinite
                # loss: pessimistic, and small
                assert exact - 1e-9 <= tables[1].epsilon[i][t - 1] <= exact + 1e-5
                assert _rr_delta(tables[1].epsilon[i][t - 1], eps0, count) <= delta * (1 + 1e-6)


def _pure_tolerance(table: accounting.EpsDeltaTable, t: int) -> float:
    """How far above the exact figure rounding may put the accountant after t rounds: t intervals on a fine
    grid (each round's losses rounded up by less than one interval), t x ROUND_SLACK intervals on a lattice."""
    grid = table.discretization
    per_round = accounting.ROUND_SLACK if grid.exact else 1.0
    return t * per_round * grid.interval + 1e-9 * table.basic[t - 1]


@pytest.mark.parametrize("name", ["1bitmean", "1bitmean-gamma", "dbitflip-d2", "dbitflip-d1", "kflip", "binflip",
                                  "1bitmulti-2", "epochrr", "topl", "topl-two-eps"])
def test_delta_to_zero_is_never_below_the_exact_pure_bound(name: str) -> None:
    """Without tail truncation and with delta = 1e-300, eps is the composed pair's largest loss: for attained
    pairs exactly the basic composition T x eps_round (the output that favours x in every round attains it),
    never below it, and above it by no more than the grid allows."""
    params = FRESH[name]
    table = accounting.account(params, 20, deltas=(1e-300,), truncation=0.0)
    if not name.startswith("topl"):  # there a threshold round's pair is an envelope; its pure eps is attained
        assert all(accounting.round_mechanisms(params, 20)[t].attained for t in range(20))
    for t in range(1, 21):
        eps = table.epsilon[0][t - 1]
        assert eps >= table.basic[t - 1] * (1 - 1e-12)
        assert eps <= table.basic[t - 1] + _pure_tolerance(table, t)


@pytest.mark.parametrize("name", sorted(FRESH))
def test_never_above_basic_composition(name: str) -> None:
    """After every round, for both deltas, eps(delta) <= t x eps_round up to the discretization's allowance."""
    table = accounting.account(FRESH[name], 40)
    for t in range(1, table.rounds + 1):
        for i in range(len(table.deltas)):
            assert table.epsilon[i][t - 1] <= table.basic[t - 1] + _pure_tolerance(table, t)
        assert table.epsilon[1][t - 1] >= table.epsilon[0][t - 1]  # smaller delta, larger eps


def _kov(eps: float, k: int, delta: float) -> float:
    """Kairouz, Oh, Viswanath (ICML 2015): k-fold composition of eps-DP mechanisms is (eps_k, delta)-DP with
    eps_k = min(k eps, k eps (e^eps - 1)/(e^eps + 1) + eps sqrt(2k ln(e + sqrt(k eps^2)/delta)),
                k eps (e^eps - 1)/(e^eps + 1) + eps sqrt(2k ln(1/delta)))."""
    head = k * eps * math.expm1(eps) / (math.exp(eps) + 1)
    return min(k * eps, head + eps * math.sqrt(2 * k * math.log(math.e + math.sqrt(k * eps**2) / delta)),
               head + eps * math.sqrt(2 * k * math.log(1 / delta)))


def _drv(eps: float, k: int, delta: float) -> float:
    """Dwork, Rothblum, Vadhan (FOCS 2010; Dwork and Roth 2014, Theorem 3.20): sqrt(2k ln(1/delta)) eps +
    k eps (e^eps - 1)."""
    return math.sqrt(2 * k * math.log(1 / delta)) * eps + k * eps * math.expm1(eps)


@pytest.mark.parametrize("eps, rounds, share", [(1.0, 365, 0.75), (0.1, 365, 0.40), (0.3, 400, 0.45)])
def test_many_rounds_are_well_below_basic_composition_and_advanced_bounds(eps: float, rounds: int,
                                                                          share: float) -> None:
    """Advanced-composition-like growth: eps(1e-6) grows like sqrt(T), well below T x eps, and below the
    closed-form advanced composition bounds, which are valid upper bounds for any eps-DP rounds."""
    table = accounting.account(OneBitParams("1bitmean", eps, M), rounds)
    for i, delta in enumerate(table.deltas):
        got = table.epsilon[i][-1]
        assert got < share * rounds * eps
        assert got <= _kov(eps, rounds, delta) + 1e-9
        assert got <= _drv(eps, rounds, delta) + 1e-9
    # the sqrt(T) part: from 100 to 400 rounds the excess over the mean loss grows about twice, not 4 times
    mean = eps * math.expm1(eps) / (math.exp(eps) + 1)
    long = accounting.account(OneBitParams("1bitmean", eps, M), 400)
    excess = [long.epsilon[0][t - 1] - t * mean for t in (100, 400)]
    assert 1.5 < excess[1] / excess[0] < 2.5


def test_laplace_single_round_has_the_closed_form() -> None:
    """One continuous Laplace round at eps: delta(e) = 1 - e^((e - eps)/2), so eps(delta) = eps + 2 ln(1 - delta);
    the discrete (grid) Laplace is within a step of it. The accountant is above it and within an interval."""
    for mech in (LaplacePair(2.0, 2.0, "x", "d"), LaplaceParams("laplace", 1.0, M).round_mechanism()):
        table = accounting._compose((mech,), (1e-6, 1e-3), accounting.TAIL_TRUNCATION, None)
        for i, delta in enumerate((1e-6, 1e-3)):
            exact = 1.0 + 2 * math.log1p(-delta)
            assert exact - 2e-3 <= table[0][i][0] <= exact + table[1].interval + 2e-3


@pytest.mark.parametrize("name", ["1bitmean", "kflip", "laplace", "1bitmulti-3", "topl-two-eps"])
def test_fast_epsilon_for_delta_is_the_librarys(name: str) -> None:
    """The accountant reads eps(delta) with numpy; dp-accounting's own get_epsilon_for_delta gives the same."""
    params = FRESH[name]
    mechanisms = accounting.round_mechanisms(params, 120)
    grid = accounting.choose_discretization(mechanisms)
    acc = None
    for t, mech in enumerate(mechanisms, start=1):
        one = accounting.round_pld(mech, grid.interval)
        acc = one if acc is None else acc.compose(one)
        if t in (1, 2, 7, 40, 120):
            for delta in (0.5, 1e-3, 1e-6, 1e-9, 1e-300):
                ours, theirs = accounting.epsilon_for_delta(acc, delta), acc.get_epsilon_for_delta(delta)
                assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-9), (t, delta)


def test_results_are_cached_per_run() -> None:
    params = OneBitParams("1bitmean", 0.8, M)
    first = accounting.account(params, 50)
    second = accounting.account(params, 50)
    assert first.epsilon is second.epsilon


# ------------------------------------------------------------------------------------------- run outputs
def _run(tmp_path: Path, name: str, sets: list[str]) -> tuple[dict, Path]:
    sc = schema.load(name, ["population.devices=300", *sets])
    out = tmp_path / "run"
    output.write_run_dir(runner.run(sc), out)
    return json.loads((out / "summary.json").read_text()), out


def test_summary_and_table_in_a_run(tmp_path: Path) -> None:
    s, out = _run(tmp_path, "quickstart", ["protocol.name=1bitmean", "rounds=6"])
    entry = s["privacy"]["eps_delta"]
    assert entry["applies"] is True and entry["rounds"] == 6 and entry["table"] == accounting.CSV
    assert set(entry["deltas"]) == {"1e-06", "1e-09"}
    for d in entry["deltas"].values():
        assert d["basic"] == pytest.approx(s["privacy"]["guarantee"])
        assert d["epsilon"] <= d["basic"]
    assert entry["discretization"]["exact"] is True and entry["attained"] is True
    lines = (out / accounting.CSV).read_text().splitlines()
    assert lines[0] == "round,basic_eps,eps_at_delta_1e-06,eps_at_delta_1e-09" and len(lines) == 7
    last = [float(v) for v in lines[-1].split(",")]
    assert last[1] == pytest.approx(s["privacy"]["guarantee"]) and last[2] == pytest.approx(
        entry["deltas"]["1e-06"]["epsilon"])
    assert s["files"][accounting.CSV] == {"written": True, "rows": 6}


def test_summary_of_a_memoized_run_says_why(tmp_path: Path) -> None:
    s, out = _run(tmp_path, "quickstart", ["rounds=3"])
    entry = s["privacy"]["eps_delta"]
    assert entry["applies"] is False and "memoized" in entry["why"]
    assert s["files"][accounting.CSV]["written"] is False and not (out / accounting.CSV).exists()


def test_missing_dp_accounting_is_said_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accounting, "dependency_problem", lambda: "dp-accounting is not installed (test)")
    s, out = _run(tmp_path, "quickstart", ["protocol.name=1bitmean", "rounds=2"])
    assert s["privacy"]["eps_delta"] == {"applies": False, "why": "dp-accounting is not installed (test)"}
    assert s["files"][accounting.CSV] == {"written": False, "why": "dp-accounting is not installed (test)"}
    with pytest.raises(ImportError):
        accounting.account(OneBitParams("1bitmean", 1.0, M), 3)


def test_long_runs_skip_the_accountant_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(accounting, "MAX_ROUNDS", 10)
    monkeypatch.setattr(accounting, "MAX_FINE_ROUNDS", 5)
    entry, table = accounting.summary_entry(FRESH["1bitmean"], 11)
    assert entry["applies"] is False and "more than 10" in entry["why"] and table is None
    entry, _ = accounting.summary_entry(FRESH["1bitmulti-3"], 6)
    assert entry["applies"] is False and "more than 5" in entry["why"]
    assert accounting.summary_entry(FRESH["1bitmean"], 10)[0]["applies"] is True


def test_a_pair_the_accountant_cannot_take_is_said_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accountant runs after the simulation: a pair it refuses must not lose the finished run."""
    def refuse(*args: object) -> None:
        raise ValueError("envelopes need pairs without infinite privacy loss")

    monkeypatch.setattr(accounting, "account", refuse)
    entry, table = accounting.summary_entry(FRESH["1bitmean"], 3)
    assert entry == {"applies": False, "why": "the accountant could not describe these rounds: envelopes need pairs "
                                              "without infinite privacy loss"} and table is None


@pytest.mark.parametrize("counters", [2, 3, 8, 64])
def test_1bitmulti_reports_within_the_epsilon_range_have_finite_accounting(counters: int) -> None:
    """1bitmulti's report is eps_joint(c)-LDP (Theorem 7), far above eps for many counters (eps 3, c = 64:
    19.7), and the accountant's pairs broke there; a scenario may not ask for eps_joint above 10, and every
    eps it accepts gives a pair of finite loss."""
    for eps in (1e-6, 0.1, 1.0, 2.0, 3.0, 5.0, 10.0):
        table = {"name": "1bitmulti", "epsilon": eps, "max_value": 1.0, "counters": counters}
        ctx = config.Context(rounds=3, devices=10)
        if joint_epsilon(eps, counters) > 10:
            with pytest.raises(config.ConfigError, match=r"^protocol\.epsilon: .* eps_joint = .* above 10"):
                MultiParams.from_table("1bitmulti", config.Table(table, "protocol"), ctx)
            continue
        params = MultiParams.from_table("1bitmulti", config.Table(dict(table), "protocol"), ctx)
        assert math.isfinite(joint_report_pair(eps, counters).max_loss)
        assert accounting.summary_entry(params, 2)[0]["applies"] is True


def test_round_mechanism_module_is_sans_io() -> None:
    import protocols.round_mechanism as mod

    src = open(mod.__file__).read()
    for banned in ("simpy", "asyncio", "np.random", "import random", "from agents", "from collector",
                   "from scenarios", "dp_accounting", "open("):
        assert banned not in src, banned


def test_eps_delta_is_never_above_the_pure_composition() -> None:
    """Pure eps composed holds with delta = 0, so no eps(delta) may exceed it: for 1BitMean the pessimistic
    rounding used to put eps(1e-9) after 2 rounds at 2.0000000001 against basic composition's 2. Every round of
    randomized response, at delta = 1e-9 (where the PLD is nearly the pure bound) stays at or below t x eps."""
    for eps in (0.5, 1.0, 2.0):
        table = accounting.account(OneBitParams("1bitmean", eps, M), 40)
        for t in range(40):
            assert table.basic[t] == pytest.approx((t + 1) * eps)
            for i in range(len(table.deltas)):
                assert table.epsilon[i][t] <= table.basic[t], (eps, t, table.deltas[i])
