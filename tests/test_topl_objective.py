"""ToPL's threshold objective: the "paper" and "authors" weightings, and the exact truncation bias for integer
data (protocols/topl.py: range_mse, truncation_bias, support_points, choose_threshold; docs/topl_figures.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from protocols import config, numeric
from protocols.topl import (OBJECTIVES, TOPL, ToplParams, choose_threshold, range_mse, support_points,
                            truncation_bias)
from scenarios import output, runner, schema

# a small integer pmf on 0..19 (bins = max_value = 20: bin k = [k, k + 1) holds the integer k)
PMF = {0: 0.30, 1: 0.25, 2: 0.15, 3: 0.10, 5: 0.08, 8: 0.06, 13: 0.04, 19: 0.02}
D = 20


def _density() -> np.ndarray:
    f = np.zeros(D)
    for k, p in PMF.items():
        f[k] = p
    return f


def _hand_bias(theta: float) -> float:
    return sum(p * max(k - theta, 0) for k, p in PMF.items())


def test_exact_integer_bias_is_the_hand_computed_sum() -> None:
    """B(theta) = sum_x f(x) max(x - theta, 0) over the integer support, e.g. at theta = 4:
    0.08 x 1 + 0.06 x 4 + 0.04 x 9 + 0.02 x 15 = 0.98."""
    support = support_points(D, float(D), integer=True)
    np.testing.assert_array_equal(support, np.arange(D))
    thetas = np.arange(0, D + 1, dtype=float)
    got = truncation_bias(thetas, _density(), support)
    np.testing.assert_allclose(got, [_hand_bias(t) for t in thetas], rtol=0, atol=1e-12)
    assert got[4] == pytest.approx(0.98, abs=1e-12)
    assert got[D] == 0.0


def test_bin_centres_overstate_the_bias_by_half_the_tail_mass_at_integer_theta() -> None:
    """Bin k's centre is k + 1/2: every bin k >= theta adds 1/2 (the bin of theta itself, whose true excess is 0,
    included), so centre - exact = 1/2 P(X >= theta) at every integer theta, exactly."""
    f = _density()
    thetas = np.arange(1, D + 1, dtype=float)
    centre = truncation_bias(thetas, f, support_points(D, float(D)))
    exact = truncation_bias(thetas, f, support_points(D, float(D), integer=True))
    tail = np.array([sum(p for k, p in PMF.items() if k >= t) for t in thetas])
    np.testing.assert_allclose(centre - exact, 0.5 * tail, rtol=0, atol=1e-12)
    assert (centre - exact)[2] == pytest.approx(0.5 * 0.30)  # theta = 3: P(X >= 3) = 0.30, not P(X > 3) = 0.20


def test_authors_weighting_is_four_times_the_variance_and_a_quarter_of_the_squared_bias() -> None:
    """Per candidate: paper = (R/3) V + (R^2/6) B^2 and authors = 4 (R/3) V + (R^2/24) B^2, with
    V = theta^2/4 V*_HM(eps)/r and B the truncation bias, each term computed here by hand."""
    f, support = _density(), support_points(D, float(D), integer=True)
    thetas = np.arange(0, D + 1, dtype=float)
    eps, rounds, reports = 0.8, 64, 300
    var = thetas**2 / 4 * numeric.hm_worst_variance(eps) / reports
    b2 = np.array([_hand_bias(t) for t in thetas]) ** 2
    paper = range_mse(thetas, f, support, eps, rounds, reports)
    authors = range_mse(thetas, f, support, eps, rounds, reports, objective="authors")
    np.testing.assert_allclose(paper, rounds / 3 * var + rounds**2 / 6 * b2, rtol=1e-12)
    np.testing.assert_allclose(authors, 4 * rounds / 3 * var + rounds**2 / 6 * b2 / 4, rtol=1e-12)
    # the pure terms: theta = 0 has no variance (authors = paper / 4), theta = 19 no bias (authors = 4 paper)
    assert authors[0] == pytest.approx(paper[0] / 4, rel=1e-12)
    assert authors[19] == pytest.approx(4 * paper[19], rel=1e-12)
    np.testing.assert_array_equal(range_mse(thetas, f, support, eps, rounds, reports, objective="paper"), paper)


def test_more_weight_on_variance_never_raises_the_chosen_threshold() -> None:
    """The authors' objective is the paper's with squared bias weighed 16 times less (then scaled by 4), and
    the variance grows with theta while the bias shrinks: its minimizer is never above the paper's. On random
    heavy-tailed integer pmfs (fixed seed) it is <= every time and strictly lower in most."""
    rng = np.random.default_rng(14)
    lower = 0
    for _ in range(200):
        d = int(rng.integers(16, 200))
        f = rng.pareto(rng.uniform(0.8, 3.0), size=d) * rng.random(d)
        f = np.sort(f)[::-1] + 1e-12  # decreasing: most mass in the low bins, a long tail
        for integer in (False, True):
            args = (f, float(d), float(rng.uniform(0.3, 3.0)), int(rng.integers(2, 500)), int(rng.integers(1, 10**5)))
            paper = choose_threshold(*args, objective="paper", integer=integer)
            authors = choose_threshold(*args, objective="authors", integer=integer)
            assert authors <= paper
            lower += authors < paper
    assert lower >= 350  # measured: 398 of 400


def test_exact_bias_never_raises_the_chosen_threshold_on_integer_data() -> None:
    """Centres overstate the bias, so the objective with exact integer bias never prefers a larger theta:
    the overstatement 1/2 P(X >= theta) falls with theta. Checked on the small pmf across R x r."""
    f = _density()
    for rounds in (2, 8, 64, 512):
        for reports in (1, 30, 1000, 10**5):
            centre = choose_threshold(f, float(D), 1.0, rounds, reports)
            exact = choose_threshold(f, float(D), 1.0, rounds, reports, integer=True)
            assert exact <= centre


def _table(**kw) -> ToplParams:
    data = {"name": "topl", "epsilon": 1.0, "max_value": 20, "holdout": 0.1, **kw}
    return ToplParams.from_table("topl", config.Table(data, "protocol"), config.Context(rounds=10, devices=100))


def test_options_parse_and_default_to_the_paper_and_bin_centres() -> None:
    p = _table()
    assert (p.objective, p.integer) == ("paper", False)
    p = _table(objective="authors", integer=True, bins=20)
    assert (p.objective, p.integer, p.bins) == ("authors", True, 20)
    assert OBJECTIVES == ("paper", "authors")


@pytest.mark.parametrize("kw, match", [
    ({"objective": "author"}, r"^protocol\.objective: must be one of \['paper', 'authors'\], got 'author'$"),
    ({"objective": 1}, r"^protocol\.objective: must be a string, got 1$"),
    ({"integer": "yes", "bins": 20}, r"^protocol\.integer: must be a boolean, got 'yes'$"),
    ({"integer": True}, r"^protocol\.integer: true needs unit-width bins .*got bins = 1024, max_value = 20$"),
    ({"integer": True, "bins": 40}, r"^protocol\.integer: true needs unit-width bins .*got bins = 40, max_value = 20$"),
])
def test_bad_options_raise_one_line_errors_naming_the_key(kw: dict, match: str) -> None:
    with pytest.raises(config.ConfigError, match=match) as err:
        _table(**kw)
    assert "\n" not in str(err.value)


def test_bad_options_are_refused_outside_a_table_too() -> None:
    base: dict[str, Any] = dict(name=TOPL, epsilon=1.0, threshold_epsilon=1.0, max_value=20.0, holdout=0.1,
                                rethreshold_every=0, rounds=10, devices=100)
    with pytest.raises(ValueError, match="protocol.objective must be one of"):
        ToplParams(**base, objective="Paper")
    with pytest.raises(ValueError, match="protocol.integer = true needs unit-width bins"):
        ToplParams(**base, integer=True)  # bins 1024
    with pytest.raises(ValueError, match="objective must be one of"):
        range_mse(np.ones(2), np.ones(3), np.ones(3), 1.0, 10, 10, objective="both")
    with pytest.raises(ValueError, match="integer = true needs unit-width bins"):
        support_points(16, 20.0, integer=True)


def test_a_run_uses_the_options_for_its_thresholds() -> None:
    """The POS scenario with the oracle method, unit-width integer bins and the authors' weighting: the
    threshold broadcast in round 1 is the one choose_threshold gives with those options on the round's true
    values (the run's oracle_theta), and it differs from the default options' choice."""
    sets = ["population.devices=4000", "rounds=6", "protocol.rethreshold_every=0", "protocol.method=oracle",
            "protocol.max_value=166", "protocol.bins=166", "simulation.cohort_size=4000"]
    runs = {}
    for extra in ([], ["protocol.objective=authors", "protocol.integer=true"]):
        sc = schema.load("topl_pos", sets + extra)
        s = output.summary(runner.run(sc))
        runs[bool(extra)] = s["threshold"][0]
        assert s["threshold"][0]["theta"] == s["threshold"][0]["oracle_theta"]
        assert s["parameters"]["objective"] == ("authors" if extra else "paper")
    assert runs[True]["theta"] < runs[False]["theta"]


@pytest.mark.parametrize("name", ["dns", "webview2", "pos", "retail"])
def test_the_figure_8_studies_are_valid_sweeps_over_both_weightings(name: str) -> None:
    """Every point of each shipped figure-8 study parses (sweep.plan validates them all): two domains (unit
    integer bins, the authors' 1,024 bins), the paper's threshold-epsilon grid 0.2..2.0, three methods, both
    weightings; the data file is shipped in scenarios/data."""
    from scenarios import sweep

    sw = sweep.plan(str(schema.SHIPPED / "studies" / f"topl_fig8_{name}.toml"), [])
    assert len(sw.points) == 2 * 10 * 3 * 2
    assert sw.grid["protocol.objective"] == ["paper", "authors"]
    assert sw.grid["protocol.threshold_epsilon"] == pytest.approx([0.2 * k for k in range(1, 11)])
    domains = sw.grid["protocol "]
    assert domains[0]["integer"] is True and domains[0]["bins"] == domains[0]["max_value"]
    assert "integer" not in domains[1] and domains[1]["bins"] == 1024
    sc = schema.parse(sw.base)
    assert isinstance(sc.protocol, ToplParams)
    assert sc.rounds * sc.devices == 2**20 and round(sc.protocol.holdout * sc.devices) == 65536
