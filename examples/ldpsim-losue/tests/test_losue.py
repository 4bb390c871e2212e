"""Tests of the L-OSUE plugin: the conformance kit, the estimator against theory, a cross-check against
multi-freq-ldpy's L-OSUE, and the registration.

Run from the repository root, installed (``pip install -e examples/ldpsim-losue``) or not (the folder is put on
sys.path and scenarios name the protocol ``ldpsim_losue:LosueParams``):

    pytest examples/ldpsim-losue/tests

tests/test_plugin_example.py runs these same tests in the project's own suite.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

HERE = Path(__file__).resolve().parents[1]  # examples/ldpsim-losue
try:
    import ldpsim_losue  # noqa: F401
except ImportError:  # not installed: run from the source folder
    sys.path.insert(0, str(HERE))

from protocols import registry
from scenarios import conformance as testing  # noqa: E402
from protocols.messages import CollectionRequest  # noqa: E402
from scenarios.metrics import clip_renormalize as _clip_one  # noqa: E402

from ldpsim_losue.losue import (LOSUE, LosueParams, estimate_frequencies, losue_probabilities,  # noqa: E402
                                losue_variance, report_probabilities)


def clip_renormalize(est: np.ndarray) -> np.ndarray:
    """Each row clipped at 0 and renormalized (the peer's post-processing of MI estimates)."""
    return np.array([_clip_one(e) for e in np.atleast_2d(est)])


def entry_point_installed() -> bool:
    """Whether an installed distribution declares the ``losue`` entry point (the ldpsim_losue.egg-info that a
    build leaves in this source folder, visible once the folder is on sys.path, does not count)."""
    for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP):
        if ep.name == LOSUE and ep.dist is not None:
            if Path(str(ep.dist.locate_file(""))).resolve() != HERE.resolve():
                return True
    return False


#: the [protocol] name scenarios use: the entry point when the package is installed, else module:Class
#: (LDPSIM_LOSUE_NAME, or tests/test_plugin_example.py, may set it)
NAME = os.environ.get("LDPSIM_LOSUE_NAME") or (LOSUE if entry_point_installed() else "ldpsim_losue:LosueParams")
TABLE = {"epsilon": 2.0, "eps_1": 1.0, "max_value": 1.0, "buckets": 6}

Z = 4.5  # standard errors a fixed-seed statistical check may be off by
ALPHA = 0.001  # KS test level


# ------------------------------------------------------------------------------------------------ the kit
@pytest.fixture(scope="module")
def scenario():
    return testing.scenario_for({"name": NAME, **TABLE}, devices=240, rounds=6)


@pytest.mark.parametrize("check", sorted(testing.CHECKS))
def test_losue_conforms(scenario, check: str) -> None:
    """Every property of the conformance kit: cohort split, live equals simulated, wire, hostile collectors,
    ``ldpsim audit`` clean (the plugin's reference model), privacy audit not above the claims (exact test)."""
    if check == "privacy_audit":
        rows = testing.check_privacy_audit(scenario, trials=1500)
        assert all(r.statistic == "exact likelihood ratio" for r in rows)
    else:
        testing.CHECKS[check](scenario)


def test_scenario_parses_and_names_bad_keys() -> None:
    from scenarios.schema import ScenarioError

    sc = testing.scenario_for({"name": NAME, **TABLE}, devices=20, rounds=2)
    assert sc.protocol.name == LOSUE and sc.protocol.eps_1 == 1.0
    with pytest.raises(ScenarioError, match="eps_1"):
        testing.scenario_for({"name": NAME, **TABLE, "eps_1": 2.0}, devices=20, rounds=2)
    with pytest.raises(ScenarioError, match="buckets"):
        testing.scenario_for({"name": NAME, **TABLE, "buckets": 1}, devices=20, rounds=2)
    with pytest.raises(ScenarioError, match="bukets"):
        testing.scenario_for({"name": NAME, **TABLE, "bukets": 4}, devices=20, rounds=2)


# ------------------------------------------------------------------------------------------------ formulas
def test_one_report_is_oue_at_eps_1() -> None:
    """Chaining OUE(eps_perm) and SUE(p2): a report's bit is 1 w.p. 1/2 at the device's bucket and
    1/(e^eps_1 + 1) elsewhere, so one report is exactly eps_1-LDP (two bits differ)."""
    for eps_perm, eps_1 in ((2.0, 1.0), (1.0, 0.5), (5.0, 0.1), (0.3, 0.29)):
        p1, q1, p2, q2 = losue_probabilities(eps_perm, eps_1)
        ps, qs = report_probabilities(eps_perm, eps_1)
        assert 0.5 < p2 < 1 and q2 == pytest.approx(1 - p2)
        assert ps == pytest.approx(0.5) and qs == pytest.approx(1 / (math.exp(eps_1) + 1))
        assert math.log(ps * (1 - qs) / ((1 - ps) * qs)) == pytest.approx(eps_1)
        assert (ps - qs) == pytest.approx((p1 - q1) * (p2 - q2))


def test_worst_case_bound_dominates_exact_enumeration() -> None:
    """For a small case (k = 3, 3 rounds) enumerate every pair of input sequences and every transcript of the
    exact likelihood: the largest log-ratio stays below worst_case_bound, and within a pattern below the
    ledger's width x eps_perm."""
    import itertools

    params = LosueParams(LOSUE, 1.5, 0.6, 3.0, 3)
    k, T = 3, 3
    seqs = [np.array(s, dtype=np.float64) + 0.5 for s in itertools.product(range(k), repeat=T)]
    ys = np.array(list(itertools.product((0, 1), repeat=T * k)), dtype=np.uint8).reshape(-1, T, k)
    reports = [{"b": ys[:, t, :]} for t in range(T)]
    present = np.ones((ys.shape[0], T), dtype=bool)
    ll = np.stack([params.log_likelihood(s, reports, present) for s in seqs])  # (sequences, transcripts)
    assert np.allclose(np.exp(ll).sum(axis=1), 1.0)  # a likelihood: sums to 1 over transcripts

    def pattern(s):
        names: dict[float, int] = {}
        return tuple(names.setdefault(float(v), len(names)) for v in s)

    worst, within = 0.0, 0.0
    for a in range(len(seqs)):
        gap = (ll[a][None, :] - ll).max()
        worst = max(worst, gap)
        same = [b for b in range(len(seqs)) if pattern(seqs[b]) == pattern(seqs[a])]
        width = len(set(pattern(seqs[a])))
        within = max(within, (ll[a][None, :] - ll[same]).max() / (width * params.epsilon))
    assert worst <= params.worst_case_bound(T) + 1e-9
    assert within <= 1 + 1e-9


# ------------------------------------------------------------------------------------------------ estimator
K, N, R = 6, 3_000, 200


def _values(which: int) -> np.ndarray:
    """Fixed inputs: a skewed histogram (bucket midpoints on [0, K]); ``which`` 1 moves the mass."""
    w = 0.6 ** np.arange(K) if which == 0 else np.array([0.05, 0.1, 0.1, 0.15, 0.2, 0.4])
    counts = np.floor(w / w.sum() * N).astype(np.int64)
    counts[0] += N - counts.sum()
    return np.random.default_rng(which).permutation(np.repeat(np.arange(K), counts)) + 0.5


def _round_estimates(params: LosueParams, values: list[np.ndarray]) -> np.ndarray:
    """(R, rounds, K) raw estimates from the real device side and collector, R seeds, all N devices."""
    out = np.empty((R, len(values), K))
    for r in range(R):
        dev, col = params.make_devices(1000 + r, np.arange(N)), params.make_collector(N)
        for t, x in enumerate(values, start=1):
            batch, _ = dev.respond(col.request(t, 1e9), t, x, 0.0)
            col.receive(batch)
            out[r, t - 1] = col.close_round().estimate
    return out


def test_estimator_is_unbiased_with_the_closed_form_variance() -> None:
    """Rounds 1-3 with values A, B, A (round 3 repeats round 1's memoized vectors): per round and bucket the
    mean of R raw estimates is within Z standard errors of the truth, and their variance within
    Z sqrt(2/(R - 1)) relative of the exact fixed-input variance."""
    params = LosueParams(LOSUE, 2.0, 1.0, float(K), K)
    values = [_values(0), _values(1), _values(0)]
    est = _round_estimates(params, values)
    for t, x in enumerate(values):
        h = params.truth(x)
        var = losue_variance(h, N, params.epsilon, params.eps_1)
        z = (est[:, t].mean(axis=0) - h) / np.sqrt(var / R)
        assert np.all(np.abs(z) < Z), (t, z)
        rel = est[:, t].var(axis=0, ddof=1) / var - 1
        assert np.all(np.abs(rel) < Z * math.sqrt(2 / (R - 1))), (t, rel)
        assert np.allclose(params.estimate_sd(x, N) ** 2, var)


# ------------------------------------------------------------------------------------------------ the peer
@numba.njit
def _seed_numba(seed):
    # the peer draws with np.random inside numba, whose generator is seeded from jitted code only
    np.random.seed(seed)


def _ks_ok(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    from scipy.stats import ks_2samp

    stat = ks_2samp(a, b).statistic
    return stat < math.sqrt(-math.log(ALPHA / 2) / 2) * math.sqrt((a.size + b.size) / (a.size * b.size)), stat


def test_cross_check_against_multi_freq_ldpy() -> None:
    """multi-freq-ldpy 0.2.5's L-OSUE (L_OSUE_Client once per device, L_OSUE_Aggregator_MI) against ours on the
    same N inputs, R repetitions each: (1) on the peer's own reports, its aggregator equals our estimator
    clipped at 0 and renormalized (the same formula); (2) the error distributions of the two pipelines agree
    (per repetition the max-bucket error and the errors of the heaviest and lightest bucket: two-sample KS at
    ALPHA and means within Z standard errors); (3) the same comparison rejects our estimator assuming an eps_1
    10% off (negative control)."""
    from multi_freq_ldpy.long_freq_est.L_OSUE import L_OSUE_Aggregator_MI, L_OSUE_Client

    eps_perm, eps_1 = 2.0, 1.0
    params = LosueParams(LOSUE, eps_perm, eps_1, float(K), K)
    x = _values(0)
    h = params.truth(x)
    ints = [int(v) for v in x]
    reps = 100
    ours = clip_renormalize(_round_estimates(params, [x])[:reps, 0])
    peer = np.empty((reps, K))
    _seed_numba(7)
    for r in range(reps):
        reports = np.array([L_OSUE_Client(v, K, eps_perm, eps_1) for v in ints])
        peer[r] = L_OSUE_Aggregator_MI(reports, eps_perm, eps_1)
        if r < 3:  # (1) the same estimator on the same reports
            mine = clip_renormalize(estimate_frequencies(reports.astype(np.uint8), eps_perm, eps_1)[None, :])[0]
            assert np.allclose(peer[r], mine, atol=1e-12)

    def stats(est: np.ndarray) -> dict[str, np.ndarray]:
        err = est - h
        return {"max": np.abs(err).max(axis=1), "heavy": err[:, 0], "light": err[:, K - 1]}

    def agree(a: np.ndarray, b: np.ndarray) -> bool:
        se = math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        return _ks_ok(a, b)[0] and abs(a.mean() - b.mean()) < Z * se

    s_ours, s_peer = stats(ours), stats(peer)
    for name in s_ours:
        assert agree(s_ours[name], s_peer[name]), (name, _ks_ok(s_ours[name], s_peer[name]))
    # (3) negative control: our reports, an estimator assuming eps_1 10% too high
    wrong = np.empty((reps, K))
    for r in range(reps):
        dev = params.make_devices(1000 + r, np.arange(N))
        batch, _ = dev.respond(CollectionRequest(round=1, protocol=LOSUE, deadline=1e9), 1, x, 0.0)
        wrong[r] = estimate_frequencies(np.asarray(batch.columns["b"]), eps_perm, 1.1 * eps_1)
    s_wrong = stats(clip_renormalize(wrong))
    assert not all(agree(s_wrong[n], s_peer[n]) for n in s_wrong)


# ------------------------------------------------------------------------------------------------ registration
def test_ldpsim_protocols_lists_losue() -> None:
    """Installed, the entry point registers ``losue``: the registry finds it and ``ldpsim protocols`` lists it."""
    assert entry_point_installed(), "ldpsim-losue is not installed: pip install -e examples/ldpsim-losue"
    entry = registry.lookup(LOSUE)
    assert entry.params is LosueParams and entry.source == "plugin: ldpsim-losue"
    out = subprocess.run([sys.executable, "-m", "scenarios.cli", "protocols", "--json"], capture_output=True,
                         text=True, check=True)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows[LOSUE]["class"] == "ldpsim_losue.losue:LosueParams"
    assert rows[LOSUE]["summary"].startswith("L-OSUE")


def test_module_class_name_runs_without_installing() -> None:
    """``[protocol] name = "ldpsim_losue:LosueParams"`` resolves to the same class, and the run's protocol is
    ``losue`` on the wire."""
    entry = registry.lookup("ldpsim_losue:LosueParams")
    assert entry.params is LosueParams and entry.source == "module:Class"
    sc = testing.scenario_for({"name": "ldpsim_losue:LosueParams", **TABLE}, devices=40, rounds=2)
    assert sc.protocol.name == LOSUE
