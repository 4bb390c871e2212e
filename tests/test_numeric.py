"""Numeric mechanisms (protocols/numeric.py): SR, PM, HM, Square Wave and EM/EMS/SW-W.

- Privacy: the largest density ratio over a grid of inputs and outputs equals e^eps (to 1e-9; the grids contain
  the inputs and outputs where it is attained) and never exceeds it, for densities checked to integrate to 1.
- Randomizers against densities: 400k keyed draws binned, each bin's count against its exact binomial law
  (bin masses integrated exactly, the densities being piecewise constant); every |z| < Z = 4.5 (a false alarm
  rate below 7e-6 per bin). Each such test also shows that a 10% wrong eps is rejected by the same check.
- Means within Z standard errors; sample variances within Z sd(s^2), sd(s^2)^2 = (mu4 - sigma^4 (n-3)/(n-1))/n
  with the exact fourth central moment integrated from the density (independently of the module's formulas).
- EM: exact products against a dense numpy reference, a non-decreasing likelihood, and recovery of a known density
  from 200k SW reports within a Wasserstein bound (justified at the test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols import keyed
from protocols import numeric as nu
from protocols.keyed import Purpose, stream_key

Z = 4.5
N_HIST = 400_000
N_MOMENT = 200_000


def _u(n: int, seed: int, *context: int) -> np.ndarray:
    """Keyed uniforms, one per simulated device, as the project draws them."""
    return keyed.uniform(stream_key(seed, Purpose.REPORT, *context), np.arange(n))


# ------------------------------------------------------------------------------ exact piecewise integration
def _pieces(breaks: list[float], density, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(left ends, right ends, density values) of the constant pieces of a piecewise-constant density."""
    pts = np.unique(np.clip(np.asarray(breaks, dtype=float), lo, hi))
    a, b = pts[:-1], pts[1:]
    keep = b > a
    a, b = a[keep], b[keep]
    return a, b, density(0.5 * (a + b))


def _bin_mass(edges: np.ndarray, breaks: list[float], density) -> np.ndarray:
    """Exact mass of each bin [edges[k], edges[k+1]) for a density constant between ``breaks``."""
    pts = np.unique(np.concatenate([edges, np.clip(breaks, edges[0], edges[-1])]))
    mid = 0.5 * (pts[:-1] + pts[1:])
    mass = density(mid) * np.diff(pts)
    return np.bincount(np.searchsorted(edges, mid) - 1, weights=mass, minlength=edges.size - 1)


def _central_moment(a: np.ndarray, b: np.ndarray, d: np.ndarray, mean: float, k: int) -> float:
    return float(np.sum(d * ((b - mean) ** (k + 1) - (a - mean) ** (k + 1)) / (k + 1)))


def _pm_pieces(t: float, eps: float):
    c = nu.pm_c(eps)
    left, right = nu.pm_interval(t, eps)
    return _pieces([-c, float(left), float(right), c], lambda y: nu.pm_density(y, t, eps), -c, c)


def _sw_pieces(v: float, eps: float):
    b = nu.sw_b(eps)
    return _pieces([-b, v - b, v + b, 1 + b], lambda y: nu.sw_density(y, v, eps), -b, 1 + b)


def _max_abs_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """Largest per-category binomial z-score; a count where the law puts no mass is an infinite z."""
    n = counts.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (counts - n * probs) / np.sqrt(n * probs * (1 - probs))
    z = np.where(probs > 0, z, np.where(counts > 0, np.inf, 0.0))
    return float(np.max(np.abs(z)))


# ============================================================================================ closed forms
def test_constants_match_the_papers() -> None:
    """SW at eps = 1 as stated in Li et al. (b = 0.2561, p = 1.1363, q = 0.4180); PM and SR constants."""
    assert nu.sw_b(1.0) == pytest.approx(0.2561, abs=5e-5)
    p, q = nu.sw_pq(1.0)
    assert (p, q) == (pytest.approx(1.1363, abs=5e-5), pytest.approx(0.4180, abs=5e-5))
    for eps in (0.2, 1.0, 3.0):
        p, q = nu.sw_pq(eps)
        assert p / q == pytest.approx(math.exp(eps), rel=1e-12)
        assert 2 * nu.sw_b(eps) * p + q == pytest.approx(1.0, rel=1e-12)  # total mass
        assert nu.sr_c(eps) == pytest.approx(1 / math.tanh(eps / 2), rel=1e-12)
        assert nu.pm_c(eps) == pytest.approx(1 / math.tanh(eps / 4), rel=1e-12)
    assert nu.hm_alpha(0.61) == 0.0 and nu.hm_alpha(0.62) == pytest.approx(1 - math.exp(-0.31))
    x = np.array([0.0, 3.0, 10.0])
    assert np.allclose(nu.to_unit(x, 10.0), [-1.0, -0.4, 1.0])
    assert np.allclose(nu.from_unit(nu.to_unit(x, 10.0), 10.0), x)
    assert nu.unit_variance_scale(10.0) == 25.0


def test_inputs_outside_the_domain_are_rejected() -> None:
    with pytest.raises(ValueError):
        nu.pm_randomize(np.array([1.01]), 1.0, [0.5], [0.5])
    with pytest.raises(ValueError):
        nu.sw_randomize(np.array([-0.01]), 1.0, [0.5], [0.5])
    with pytest.raises(ValueError):
        nu.sr_randomize(np.array([0.0]), 0.0, [0.5])


# ===================================================================================================== eps-LDP
EPS_LDP = [0.1, 0.5, 0.61, 1.0, 2.0, 5.0]
T_GRID = np.linspace(-1.0, 1.0, 201)


def _assert_ratio(ratio: float, eps: float) -> None:
    assert ratio <= math.exp(eps) * (1 + 1e-9), "a density ratio exceeds e^eps"
    assert ratio == pytest.approx(math.exp(eps), rel=1e-9), "the worst ratio is not attained at e^eps"


@pytest.mark.parametrize("eps", EPS_LDP)
def test_sr_is_eps_ldp(eps: float) -> None:
    pmf = nu.sr_pmf(T_GRID, eps)  # (t, output)
    assert np.allclose(pmf.sum(axis=1), 1.0) and pmf.min() > 0
    _assert_ratio(float((pmf.max(axis=0) / pmf.min(axis=0)).max()), eps)


@pytest.mark.parametrize("eps", EPS_LDP)
def test_pm_is_eps_ldp(eps: float) -> None:
    c = nu.pm_c(eps)
    for t in (-1.0, -0.3, 0.0, 0.8, 1.0):
        a, b, d = _pm_pieces(t, eps)
        assert np.sum(d * (b - a)) == pytest.approx(1.0, rel=1e-12)
    y = np.linspace(-c, c, 4001)
    dens = nu.pm_density(y[None, :], T_GRID[:, None], eps)
    assert dens.min() > 0
    _assert_ratio(float((dens.max(axis=0) / dens.min(axis=0)).max()), eps)
    assert np.all(nu.pm_density(np.array([-c - 1e-9, c + 1e-9]), 0.0, eps) == 0)


@pytest.mark.parametrize("eps", EPS_LDP)
def test_hm_mixture_is_eps_ldp(eps: float) -> None:
    """HM's law is a continuous part (alpha PM) plus two atoms ((1 - alpha) SR). Against Lebesgue plus counting
    measure its density is the PM part off the atoms and the atom mass on them; both ratios are at most e^eps."""
    c = nu.pm_c(eps)
    y = np.linspace(-c, c, 4001)
    cont, atoms = nu.hm_density(y[None, :], T_GRID[:, None], eps)
    alpha = nu.hm_alpha(eps)
    assert alpha + atoms[:, 0, :].sum(axis=-1) == pytest.approx(np.ones(T_GRID.size), rel=1e-12)
    atom_pmf = atoms[:, 0, :]
    ratios = [float((atom_pmf.max(axis=0) / atom_pmf.min(axis=0)).max())]
    if alpha > 0:
        assert cont.min() > 0
        ratios.append(float((cont.max(axis=0) / cont.min(axis=0)).max()))
    else:
        assert eps <= nu.EPS_STAR and np.all(cont == 0)
    _assert_ratio(max(ratios), eps)


@pytest.mark.parametrize("eps", EPS_LDP)
def test_sw_is_eps_ldp(eps: float) -> None:
    b = nu.sw_b(eps)
    v_grid = np.linspace(0.0, 1.0, 201)
    for v in (0.0, 0.31, 1.0):
        a, e, d = _sw_pieces(v, eps)
        assert np.sum(d * (e - a)) == pytest.approx(1.0, rel=1e-12)
    y = np.linspace(-b, 1 + b, 4001)
    dens = nu.sw_density(y[None, :], v_grid[:, None], eps)
    assert dens.min() > 0
    _assert_ratio(float((dens.max(axis=0) / dens.min(axis=0)).max()), eps)


# ======================================================================================= randomizer vs density
RAND_CASES = [(0.5, -1.0), (0.5, 0.7), (1.0, 0.0), (1.0, 1.0), (2.0, -0.6), (4.0, 0.9)]


@pytest.mark.parametrize(("eps", "t"), RAND_CASES)
def test_sr_randomizer_matches_its_law(eps: float, t: float) -> None:
    y = nu.sr_randomize(np.full(N_HIST, t), eps, _u(N_HIST, 1, 1))
    c = nu.sr_c(eps)
    assert set(np.unique(y)) <= {-c, c}
    counts = np.array([(y < 0).sum(), (y > 0).sum()])
    assert _max_abs_z(counts, nu.sr_pmf(t, eps)) < Z
    if t != 0.0:  # at t = 0 P[+C] = 1/2 for every eps
        assert _max_abs_z(counts, nu.sr_pmf(t, 1.1 * eps)) > Z


@pytest.mark.parametrize(("eps", "t"), RAND_CASES)
def test_pm_randomizer_matches_its_density(eps: float, t: float) -> None:
    y = nu.pm_randomize(np.full(N_HIST, t), eps, _u(N_HIST, 2, 1), _u(N_HIST, 2, 2))
    c = nu.pm_c(eps)
    wide = nu.pm_c(eps / 1.1)  # bins also cover the wrong eps's support
    edges = np.linspace(-wide, wide, 61)
    counts = np.histogram(y, bins=edges)[0]
    assert counts.sum() == N_HIST and np.abs(y).max() <= c

    def probs(e: float) -> np.ndarray:
        left, right = nu.pm_interval(t, e)
        ce = nu.pm_c(e)
        return _bin_mass(edges, [-ce, float(left), float(right), ce], lambda z: nu.pm_density(z, t, e))

    assert probs(eps).sum() == pytest.approx(1.0, rel=1e-12)
    assert _max_abs_z(counts, probs(eps)) < Z
    assert _max_abs_z(counts, probs(1.1 * eps)) > Z


@pytest.mark.parametrize(("eps", "t"), [(0.5, 0.9), (1.0, -0.7), (3.0, 0.2)])
def test_hm_randomizer_matches_its_mixture(eps: float, t: float) -> None:
    y = nu.hm_randomize(np.full(N_HIST, t), eps, _u(N_HIST, 3, 1), _u(N_HIST, 3, 2), _u(N_HIST, 3, 3))
    c_sr = nu.sr_c(eps)
    minus, plus = y == -c_sr, y == c_sr
    cont = y[~(minus | plus)]
    wide = nu.pm_c(eps / 1.1)
    edges = np.linspace(-wide, wide, 41)
    counts = np.concatenate([[minus.sum(), plus.sum()], np.histogram(cont, bins=edges)[0]])
    assert counts.sum() == N_HIST

    def probs(e: float) -> np.ndarray:
        alpha = nu.hm_alpha(e)
        left, right = nu.pm_interval(t, e)
        ce = nu.pm_c(e)
        pm = _bin_mass(edges, [-ce, float(left), float(right), ce], lambda z: nu.pm_density(z, t, e))
        return np.concatenate([(1 - alpha) * nu.sr_pmf(t, e), alpha * pm])

    assert probs(eps).sum() == pytest.approx(1.0, rel=1e-12)
    assert _max_abs_z(counts, probs(eps)) < Z
    assert _max_abs_z(counts, probs(1.1 * eps)) > Z
    if eps <= nu.EPS_STAR:
        assert cont.size == 0


@pytest.mark.parametrize(("eps", "v"), [(0.5, 0.0), (1.0, 0.37), (1.0, 1.0), (2.0, 0.8), (4.0, 0.05)])
def test_sw_randomizer_matches_its_density(eps: float, v: float) -> None:
    y = nu.sw_randomize(np.full(N_HIST, v), eps, _u(N_HIST, 4, 1), _u(N_HIST, 4, 2))
    b = nu.sw_b(eps)
    assert y.min() >= -b and y.max() <= 1 + b
    wide = max(b, nu.sw_b(1.1 * eps))
    edges = np.linspace(-wide, 1 + wide, 61)
    counts = np.histogram(y, bins=edges)[0]

    def probs(e: float) -> np.ndarray:
        be = nu.sw_b(e)
        return _bin_mass(edges, [-be, v - be, v + be, 1 + be], lambda z: nu.sw_density(z, v, e))

    assert probs(eps).sum() == pytest.approx(1.0, rel=1e-12)
    assert _max_abs_z(counts, probs(eps)) < Z
    assert _max_abs_z(counts, probs(1.1 * eps)) > Z


# ============================================================================== unbiasedness and variances
MOMENT_EPS = [0.3, 0.61, 1.0, 2.0, 4.0]
MOMENT_T = [-1.0, -0.5, 0.0, 0.3, 1.0]


def _exact_moments(mech: str, t: float, eps: float) -> tuple[float, float, float]:
    """(mean, variance, fourth central moment) from the output law alone."""
    c = nu.sr_c(eps)
    p_plus = 0.5 + t * (math.exp(eps) - 1) / (2 * (math.exp(eps) + 1))
    sr = [p_plus * c + (1 - p_plus) * -c]
    sr += [p_plus * (c - t) ** k + (1 - p_plus) * (c + t) ** k for k in (2, 4)]
    a, b, d = _pm_pieces(t, eps)
    pm = [_central_moment(a, b, d, 0.0, 1) + 0.0, _central_moment(a, b, d, t, 2), _central_moment(a, b, d, t, 4)]
    if mech == "sr":
        return tuple(sr)  # type: ignore[return-value]
    if mech == "pm":
        return tuple(pm)  # type: ignore[return-value]
    alpha = nu.hm_alpha(eps)  # both parts have mean t, so central moments mix linearly
    return tuple(alpha * x + (1 - alpha) * s for x, s in zip(pm, sr))  # type: ignore[return-value]


def _draw(mech: str, t: float, eps: float, seed: int) -> np.ndarray:
    ts = np.full(N_MOMENT, t)
    if mech == "sr":
        return nu.sr_randomize(ts, eps, _u(N_MOMENT, seed, 1))
    if mech == "pm":
        return nu.pm_randomize(ts, eps, _u(N_MOMENT, seed, 1), _u(N_MOMENT, seed, 2))
    return nu.hm_randomize(ts, eps, _u(N_MOMENT, seed, 1), _u(N_MOMENT, seed, 2), _u(N_MOMENT, seed, 3))


VARIANCE = {"sr": nu.sr_variance, "pm": nu.pm_variance, "hm": nu.hm_variance}


@pytest.mark.parametrize("mech", ["sr", "pm", "hm"])
@pytest.mark.parametrize("eps", MOMENT_EPS)
def test_unbiased_with_closed_form_variance(mech: str, eps: float) -> None:
    for k, t in enumerate(MOMENT_T):
        mean, var, mu4 = _exact_moments(mech, t, eps)
        # the closed forms against the law itself (exact)
        assert mean == pytest.approx(t, abs=1e-12)
        assert float(VARIANCE[mech](t, eps)) == pytest.approx(var, rel=1e-12)
        # the draws against the closed forms
        y = _draw(mech, t, eps, seed=100 * k + int(eps * 10))
        n = y.size
        se = math.sqrt(var / n)
        assert abs(y.mean() - t) < Z * se
        sd_s2 = math.sqrt((mu4 - var**2 * (n - 3) / (n - 1)) / n)
        assert abs(y.var(ddof=1) - var) < Z * sd_s2
        assert Z * sd_s2 < 0.1 * var  # power: a variance formula 10% off would fail this check


def test_hm_worst_case_variance_is_the_max_over_inputs() -> None:
    """Wang et al. ICDE 2019 Eq. 8 / CCS 2021 Eq. 22 against max_t (alpha Var_PM(t) + (1 - alpha) Var_SR(t)),
    computed from the mechanisms' own variances on a grid of t that contains 0 and +-1."""
    t = np.linspace(-1.0, 1.0, 2001)
    for eps in np.concatenate([np.linspace(0.05, 0.61, 15), np.linspace(0.62, 8.0, 60)]):
        e2, e = math.exp(eps / 2), math.exp(eps)
        var_pm = t**2 / (e2 - 1) + (e2 + 3) / (3 * (e2 - 1) ** 2)
        var_sr = ((e + 1) / (e - 1)) ** 2 - t**2
        alpha = 1 - math.exp(-eps / 2) if eps > 0.61 else 0.0
        actual = alpha * var_pm + (1 - alpha) * var_sr
        assert nu.hm_worst_variance(eps) == pytest.approx(actual.max(), rel=1e-12)
        assert np.allclose(nu.hm_variance(t, eps), actual, rtol=1e-12)
        if eps > 0.61:  # the t^2 terms cancel: HM's variance is the same at every input
            assert actual.max() - actual.min() < 1e-12 * actual.max()
            assert nu.hm_worst_variance(eps) < min(var_pm.max(), var_sr.max())  # HM beats PM and SR worst cases


# ======================================================================================== transition matrix
def test_sw_transition_matrix_exact_masses() -> None:
    eps, d_in, d_out = 1.0, 8, 32
    b = nu.sw_b(eps)
    edges = np.linspace(-b, 1 + b, d_out + 1)
    for model in ("uniform", "center"):
        m = nu.sw_transition_matrix(eps, d_in, d_out, input_model=model)
        assert m.shape == (d_out, d_in) and m.min() > 0
        assert np.allclose(m.sum(axis=0), 1.0, rtol=0, atol=1e-12)
    # centre model: the exact mass of each output bin for the input at the bin centre
    m_c = nu.sw_transition_matrix(eps, d_in, d_out, input_model="center")
    for i in range(d_in):
        v = (i + 0.5) / d_in
        mass = _bin_mass(edges, [-b, v - b, v + b, 1 + b], lambda z: nu.sw_density(z, v, eps))
        assert np.allclose(m_c[:, i], mass, rtol=1e-10, atol=1e-14)
    # uniform model: the average over the input bin (midpoint rule on 4096 sub-inputs, error O(1e-8))
    m_u = nu.sw_transition_matrix(eps, d_in, d_out, input_model="uniform")
    fine = nu.sw_transition_matrix(eps, d_in * 4096, d_out, input_model="center")
    assert np.allclose(m_u, fine.reshape(d_out, d_in, 4096).mean(axis=2), rtol=0, atol=1e-8)
    assert np.abs(m_u - m_c).max() > 1e-4  # the two models do differ at the window edges
    # cells that no window [v - b, v + b] of the input bin reaches hold exactly q |bin| (EM relies on the band)
    a = np.linspace(0.0, 1.0, d_in + 1)
    out_of_reach = (edges[1:, None] <= a[None, :-1] - b) | (edges[:-1, None] >= a[None, 1:] + b)
    assert out_of_reach.any() and np.all(m_u[out_of_reach] == m_u.min())
    assert m_u.min() == pytest.approx(nu.sw_pq(eps)[1] * (1 + 2 * b) / d_out, rel=1e-12)
    # splitting an input bin averages its columns exactly
    halves = nu.sw_transition_matrix(eps, 2 * d_in, d_out)
    assert np.allclose(m_u, halves.reshape(d_out, d_in, 2).mean(axis=2), rtol=1e-12, atol=1e-15)


def test_sw_transition_matrix_matches_the_randomizer() -> None:
    """Inputs uniform within input bin i of 8: the output histogram follows column i of M (uniform model)."""
    eps, d_in, d_out = 1.0, 8, 32
    m = nu.sw_transition_matrix(eps, d_in, d_out)
    for i in (0, 3, 7):
        v = (i + _u(N_HIST, 5, i, 0)) / d_in
        y = nu.sw_randomize(v, eps, _u(N_HIST, 5, i, 1), _u(N_HIST, 5, i, 2))
        counts = nu.sw_histogram(y, eps, d_out)
        assert counts.sum() == N_HIST
        assert _max_abs_z(counts, m[:, i]) < Z
        assert _max_abs_z(counts, m[:, (i + 1) % d_in]) > Z  # a neighbouring column is rejected


# ======================================================================================================== EM
def _em_reference(h: np.ndarray, m: np.ndarray, smoothing: bool, iters: int) -> np.ndarray:
    """Li et al.'s EM/EMS in dense numpy (their smoothing matrix: [1, 2, 1]/4, rows renormalized at the edges)."""
    d = m.shape[1]
    s = np.zeros((d, d))
    for i in range(d):
        for j, w in ((i - 1, 1.0), (i, 2.0), (i + 1, 1.0)):
            if 0 <= j < d:
                s[i, j] = w
    s /= s.sum(axis=1, keepdims=True)
    theta = np.full(d, 1.0 / d)
    for _ in range(iters):
        theta = theta * (m.T @ (h / (m @ theta)))
        theta /= theta.sum()
        if smoothing:
            theta = s @ theta
            theta /= theta.sum()
    return theta


@pytest.mark.parametrize("smoothing", [False, True])
def test_em_matches_dense_reference(smoothing: bool) -> None:
    rng = np.random.default_rng(7)
    dense = rng.random((48, 40)) + 0.05  # no band structure
    dense /= dense.sum(axis=0)
    sw = nu.sw_transition_matrix(1.5, 40, 48)
    for m in (dense, sw):
        h = rng.integers(0, 500, size=48).astype(float)
        h[5] = 0.0  # an empty output bin
        theta, it = nu.em_estimate(h, m, smoothing=smoothing, max_iter=60, tol=-np.inf)
        assert it == 60 and theta.sum() == pytest.approx(1.0)
        assert np.allclose(theta, _em_reference(h, m, smoothing, 60), rtol=1e-9, atol=1e-15)


def test_em_likelihood_never_decreases_and_stops_at_tol() -> None:
    eps = 1.0
    m = nu.sw_transition_matrix(eps, 64, 64)
    v = _u(20_000, 6, 0) ** 2
    h = nu.sw_histogram(nu.sw_randomize(v, eps, _u(20_000, 6, 1), _u(20_000, 6, 2)), eps, 64)
    lls = [float(h @ np.log(m @ nu.em_estimate(h, m, max_iter=k, tol=-np.inf)[0])) for k in range(1, 40)]
    assert np.all(np.diff(lls) >= -1e-9)
    theta, it = nu.em_estimate(h, m, tol=1e-3)
    assert 1 < it < 10_000
    before = float(h @ np.log(m @ nu.em_estimate(h, m, max_iter=it - 1, tol=-np.inf)[0]))
    assert 0 <= float(h @ np.log(m @ theta)) - before < 1e-3  # stopped at the first gain below tol


def _mixture_cdf(x: np.ndarray) -> np.ndarray:
    """70% Beta(1, 4) (skewed to 0, like usage data) + 30% uniform on [0.5, 0.7]."""
    x = np.clip(x, 0.0, 1.0)
    return 0.7 * (1 - (1 - x) ** 4) + 0.3 * np.clip((x - 0.5) / 0.2, 0.0, 1.0)


def _mixture_sample(n: int, seed: int) -> np.ndarray:
    pick, u = _u(n, seed, 10), _u(n, seed, 11)
    return np.where(pick < 0.7, 1 - (1 - u) ** 0.25, 0.5 + 0.2 * u)


def _w1(a: np.ndarray, b: np.ndarray) -> float:
    """Wasserstein-1 distance between two histograms on equal bins of [0, 1] (value units)."""
    return float(np.abs(np.cumsum(a - b)).sum() / a.size)


def test_em_recovers_a_known_density_from_sw_reports() -> None:
    """200k SW reports at eps = 2, 1024 x 1024 bins (ToPL's setting).

    Bound: W1 < 0.012 (1.2% of the domain). Justification, from seeds 1-4 of this setup: EM lands at 0.0040-0.0045
    (3x below the bound); (a) the same reports decoded as if eps were 25% higher land at 0.024-0.025 (20% lower:
    0.032), twice the bound, and the test checks that this misspecification fails it; (b) more data must help:
    4x fewer reports (50k) give 0.0059-0.0067, and the test checks W1 grows; (c) the inputs' own histogram is
    within 1/sqrt(n) of the truth (checks the sampler). EMS is at least as close (0.0018-0.0026) and far
    smoother (total variation below a tenth of EM's).
    """
    eps, d = 2.0, 1024
    truth = np.diff(_mixture_cdf(np.linspace(0.0, 1.0, d + 1)))
    m = nu.sw_transition_matrix(eps, d, d)

    def run(n: int, seed: int, decode_eps: float = eps, smoothing: bool = False) -> np.ndarray:
        v = _mixture_sample(n, seed)
        assert _w1(np.histogram(v, bins=d, range=(0, 1))[0] / n, truth) < 1 / math.sqrt(n)  # the sampler
        y = nu.sw_randomize(v, eps, _u(n, seed, 12), _u(n, seed, 13))
        mat = m if decode_eps == eps else nu.sw_transition_matrix(decode_eps, d, d)
        theta, it = nu.em_estimate(nu.sw_histogram(y, decode_eps, d), mat, smoothing=smoothing)
        assert theta.sum() == pytest.approx(1.0) and theta.min() >= 0
        return theta

    em = run(200_000, 1)
    assert _w1(em, truth) < 0.012
    assert _w1(run(50_000, 1), truth) > _w1(em, truth)
    assert _w1(run(200_000, 1, decode_eps=1.25 * eps), truth) > 0.012
    ems = run(200_000, 1, smoothing=True)
    assert _w1(ems, truth) <= _w1(em, truth)
    tv = lambda x: float(np.abs(np.diff(x)).sum())  # noqa: E731
    assert tv(ems) <= 0.1 * tv(em)


# ======================================================================================================= SW-W
def test_sw_w_prune_zeros_the_tail_and_conserves_mass() -> None:
    theta = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0,  # leading zeros are not the tail
                      0.3, 0.2, 0.00005, 0.1,  # 0.00005 is below 1e-4 of the total (1.0) and is zeroed
                      0.0, 0.0, 0.0, 0.0, 0.2,  # a run of only 4 zeros: kept going
                      0.1, 0.0, 0.0, 0.0, 0.0, 0.0,  # the first run of 5
                      0.04995, 0.05])  # the tail, removed
    total = theta.sum()
    out = nu.sw_w_prune(theta)
    assert out.sum() == pytest.approx(total, rel=1e-12)
    kept = np.array([6, 7, 9, 14, 15])
    assert np.all(out[np.setdiff1d(np.arange(theta.size), kept)] == 0.0)
    removed = 0.00005 + 0.04995 + 0.05
    assert np.allclose(out[kept], theta[kept] + removed / kept.size, rtol=1e-12)
    # a run of exactly 5 is enough; a run of 4 is not
    assert nu.sw_w_prune(np.array([0.5, 0, 0, 0, 0, 0.5]))[5] > 0
    assert nu.sw_w_prune(np.array([0.5, 0, 0, 0, 0, 0, 0.5]))[6] == 0
    # the floor is relative to the total
    scaled = nu.sw_w_prune(1000.0 * np.array([0.5, 0.49989, 0.00011]))
    assert scaled[2] > 0 and scaled.sum() == pytest.approx(1000.0)
    scaled = nu.sw_w_prune(1000.0 * np.array([0.5, 0.49982, 0.00009, 0.00009]))
    assert np.all(scaled[2:] == 0) and scaled.sum() == pytest.approx(1000.0)


def test_sw_w_prune_on_em_output() -> None:
    """On plain EM from SW reports (skewed data): everything after the first run of 5 bins under 1e-4 is zero,
    mass is conserved and each kept bin gains the same amount."""
    eps, d, n = 2.0, 1024, 100_000
    v = 1 - (1 - _u(n, 8, 0)) ** 0.125  # Beta(1, 8): mass near 0, a long thin tail
    m = nu.sw_transition_matrix(eps, d, d)
    theta, _ = nu.em_estimate(nu.sw_histogram(nu.sw_randomize(v, eps, _u(n, 8, 1), _u(n, 8, 2)), eps, d), m)
    out = nu.sw_w_prune(theta)
    assert out.sum() == pytest.approx(1.0, rel=1e-12)
    small = theta < 1e-4
    first = int(np.flatnonzero(~small)[0])
    runs = [i for i in range(first, d - 4) if small[i:i + 5].all()]
    assert runs, "expected a run of 5 negligible bins"
    cut = runs[0]
    assert np.all(out[cut:] == 0) and cut < d
    kept = out > 0
    assert np.array_equal(kept[:cut], ~small[:cut])
    gain = out[kept] - theta[kept]
    assert np.allclose(gain, gain[0], rtol=1e-9) and gain[0] > 0
