"""Attack metrics in runs (scenarios/attacks.py, docs/attacks.md): the averaging attack's error falls like
1/sqrt(T) with fresh randomness and stops falling with memoization; change detection is near certain for
1BitRRPM without output perturbation and weakens as gamma grows; behavior patterns (Definition 2) agree with a
brute-force count; ``[analysis] attacks`` is parsed strictly and is off by default above the size limit; the run
directory holds attacks.csv, attacks.png and summary.json's ``attacks``.

Every statistical tolerance is 4 standard deviations of the quantity checked, the standard deviation taken from
theory: the binomial fourth moment for averages of fresh bits, the bound Var[e^2] <= B^2 E[e^2] for errors
bounded by B, and Var[AUC] <= AUC (1 - AUC)/min(positives, negatives). Seeds are fixed.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from protocols.dbitflip import bucket_of
from protocols.memo import alpha_round
from protocols.onebit import p_one
from scenarios import attacks, output, runner, schema
from scenarios.schema import ATTACKS_AUTO_LIMIT, ScenarioError

M, EPS = 86_400.0, 1.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scenario(protocol: dict, groups: list[dict], rounds: int, devices: int, seed: int = 3,
             changes: list[dict] | None = None, **extra: dict) -> schema.Scenario:
    return schema.parse({"name": "attacks", "seed": seed, "rounds": rounds,
                         "population": {"devices": devices, "groups": groups}, "changes": changes or [],
                         "protocol": {"epsilon": EPS, **protocol}, **extra})


def constant_levels(jitter: float = 0.0, low: float = 10_000, high: float = 76_400) -> list[dict]:
    group = {"name": "all", "share": 1.0, "counter": {"dist": "uniform", "low": low, "high": high}}
    if jitter:
        group["jitter"] = {"dist": "normal", "sd": jitter}
    return [group]


def averaging(sc: schema.Scenario) -> tuple[runner.RunResult, dict]:
    result = runner.run(sc)
    return result, attacks.analyze(result).plot["averaging"]


def binomial_rmse(scale: float, q: np.ndarray, t: int) -> tuple[float, float]:
    """RMSE of scale x (mean of t Bernoulli(q) draws - q) over independent units, and the standard deviation of
    its empirical value: E e^2 = C^2 v/t and E e^4 = C^4 v (1 + 3 (t - 2) v)/t^3 with v = q (1 - q) (the
    binomial fourth central moment), so Var[mean e^2] = sum (E e^4 - (E e^2)^2)/N^2 and sd[RMSE] = sd[MSE]/(2 RMSE)."""
    v = q * (1 - q)
    e2 = scale**2 * v / t
    e4 = scale**4 * v * (1 + 3 * (t - 2) * v) / t**3
    mse = float(e2.mean())
    return math.sqrt(mse), math.sqrt(float((e4 - e2**2).sum())) / q.size / (2 * math.sqrt(mse))


# ----------------------------------------------------------------------------------------------- averaging
@pytest.mark.parametrize("name", ["1bitmean", "dbitflip"])
def test_averaging_rmse_falls_like_one_over_sqrt_t_with_fresh_reports(name: str) -> None:
    """Constant values, every report delivered: a device's estimate after t rounds is an average of t fresh
    bits, so its RMSE is C sqrt(mean q (1 - q))/sqrt(t) and RMSE(4)/RMSE(64) = 4."""
    n, T = 4000, 64
    if name == "1bitmean":
        sc = scenario({"name": name, "max_value": M}, constant_levels(), T, n)
    else:
        sc = scenario({"name": name, "max_value": 16.0, "buckets": 16, "bits": 2},
                      constant_levels(low=0.0, high=16.0), T, n)
    result, av = averaging(sc)
    x = result.true_values[:, 0]
    if name == "1bitmean":
        q, scale = p_one(x, EPS, M), M * (math.e + 1) / (math.e - 1)
    else:  # each (device, position): bit at E/(E + 1) when J_p is the value's bucket, else 1/(E + 1)
        e = math.exp(EPS / 2)
        J = result.world  # noqa: F841 (J comes from the device side: the same keyed draws)
        devices = sc.protocol.make_devices(sc.seed, np.arange(n))
        own = devices.J == bucket_of(x, 16, 16.0)[:, None]
        q, scale = np.where(own, e / (e + 1), 1 / (e + 1)).ravel(), (e + 1) / (e - 1)
    rmse = {}
    for t in (4, 64):
        expected, sd = binomial_rmse(scale, q, t)
        assert av["theory"][t - 1] == pytest.approx(expected, rel=1e-9)  # the module's closed form
        assert abs(av["rmse"][t - 1] - expected) <= 4 * sd, (t, av["rmse"][t - 1], expected, sd)
        rmse[t] = (av["rmse"][t - 1], sd / expected)
    ratio = rmse[4][0] / rmse[64][0]
    assert abs(math.log(ratio / 4.0)) <= 4 * (rmse[4][1] + rmse[64][1]), ratio
    assert av["auc"][T - 1] > av["auc"][0]  # more rounds tell heavy from light users better


def test_averaging_stops_improving_for_1bitrrpm() -> None:
    """1BitRRPM, gamma = 0, values jittering by half a grid step: a device keeps resending the memoized bits of
    the two or three grid values it visits, so its estimate stops improving. Expected RMSE from the memo
    structure, computed here from the devices' own alpha-point rounding: Var = C^2/t^2 sum_g N_g^2 p_g (1 - p_g)
    plus the rounding bias (mean rounded value - mean value)^2. Errors are bounded by B = m e^eps/(e^eps - 1),
    so sd[RMSE] <= B/(2 sqrt(n))."""
    n, T, s = 4000, 64, 3600.0
    sc = scenario({"name": "1bitrrpm", "max_value": M, "granularity": s}, constant_levels(jitter=s / 2), T, n)
    result, av = averaging(sc)
    x = result.true_values
    alpha = sc.protocol.make_devices(sc.seed, np.arange(n)).alpha
    grid = np.stack([alpha_round(x[:, t], alpha, s) for t in range(T)], axis=1) * s
    scale = M * (math.e + 1) / (math.e - 1)
    tolerance = 4 * M * math.e / (math.e - 1) / (2 * math.sqrt(n))
    expected = {}
    for t in (4, 64):
        mse = np.empty(n)
        for i in range(n):
            values, counts = np.unique(grid[i, :t], return_counts=True)
            p = p_one(values, EPS, M)
            mse[i] = scale**2 * np.sum(counts**2 * p * (1 - p)) / t**2 + (grid[i, :t].mean() - x[i, :t].mean())**2
        expected[t] = math.sqrt(mse.mean())
        assert av["theory"][t - 1] == pytest.approx(expected[t], rel=1e-9)
        assert abs(av["rmse"][t - 1] - expected[t]) <= tolerance, (t, av["rmse"][t - 1], expected[t])
    fresh = math.sqrt(4 / 64)
    assert expected[64] / expected[4] > 3 * fresh  # theory: the error stops falling (0.9 here, 0.25 if fresh)
    assert av["rmse"][63] / av["rmse"][3] > 3 * fresh
    assert av["auc"][T - 1] < 0.7  # heavy and light users stay hard to tell apart


def test_dbitflippm_estimate_never_improves_for_a_device_that_stays_in_its_bucket() -> None:
    """dBitFlipPM with constant values: every round resends the same memoized report, so each device's
    estimate, and the RMSE, are the same after 1 round and after 32."""
    sc = scenario({"name": "dbitflippm", "max_value": 16.0, "buckets": 16, "bits": 2},
                  constant_levels(low=0.0, high=16.0), 32, 2000)
    _, av = averaging(sc)
    assert av["rmse"][31] == pytest.approx(av["rmse"][0], rel=1e-12)
    assert av["theory"][31] == pytest.approx(av["theory"][0], rel=1e-12)


# ----------------------------------------------------------------------------------------------- change detection
def change_scenario(gamma: float) -> schema.Scenario:
    """Half the devices keep one constant value; the other half move at round 13 to a new level with a jitter of
    more than two grid steps, so after the change they visit several grid values."""
    level = {"dist": "uniform", "low": 20_000, "high": 60_000}
    return scenario({"name": "1bitrrpm", "max_value": M, "granularity": 3600.0, "gamma": gamma},
                    [{"name": "stable", "share": 0.5, "counter": level},
                     {"name": "movers", "share": 0.5, "counter": level}], 24, 3000, seed=5,
                    changes=[{"round": 13, "group": "movers", "counter": {"dist": "normal", "mean": 40_000,
                                                                          "sd": 10_000},
                              "jitter": {"dist": "normal", "sd": 8000}}])


def auc_sd(value: float, summary: dict) -> float:
    return math.sqrt(value * (1 - value) / min(summary["changed"], summary["unchanged"]))


def test_change_detection_is_near_certain_for_1bitrrpm_without_output_perturbation() -> None:
    """gamma = 0: a device is flagged exactly when its bits are not constant. A mover is missed only when the
    memoized bits of all the grid values it visited are equal, with probability prod p_g + prod (1 - p_g);
    a stable device never changes its bit. The scores are 0 or infinite, so AUC = 1/2 + (TPR - FPR)/2."""
    sc = change_scenario(0.0)
    result = runner.run(sc)
    cd = attacks.analyze(result).summary["change_detection"]
    x = result.true_values
    alpha = sc.protocol.make_devices(sc.seed, np.arange(sc.devices)).alpha
    grid = np.stack([alpha_round(x[:, t], alpha, 3600.0) for t in range(x.shape[1])], axis=1)
    movers = np.arange(sc.devices // 2, sc.devices)
    caught = np.empty(movers.size)
    for k, i in enumerate(movers):
        p = p_one(np.unique(grid[i]) * 3600.0, EPS, M)
        caught[k] = 1 - np.prod(p) - np.prod(1 - p)
    assert (cd["changed"], cd["unchanged"]) == (1500, 1500)
    assert cd["fpr"] == 0.0
    assert abs(cd["tpr"] - caught.mean()) <= 4 * math.sqrt(np.sum(caught * (1 - caught))) / movers.size
    assert cd["auc"] == pytest.approx(0.5 + (cd["tpr"] - cd["fpr"]) / 2, abs=1e-12)
    assert cd["auc"] > 0.95
    loc = cd["location_error"]
    assert loc["detected"] == round(cd["tpr"] * 1500) and loc["mean"] == loc["mean_abs"] >= 0  # never early
    assert cd["location_privacy"]["log_ratio_per_round_of_shift"] is None  # Theorem 5 gives no bound at gamma 0


def test_change_detection_weakens_as_gamma_grows() -> None:
    """Output perturbation makes a change a statistical question: AUC falls from near 1 (gamma = 0) as gamma
    grows to 0.1 and 1/3. The stable devices are the detector's null model (one memoized bit, flipped with
    gamma), so their false-alarm rate stays at the rule's 5%."""
    cds = {g: attacks.analyze(runner.run(change_scenario(g))).summary["change_detection"] for g in (0.0, 0.1, 1 / 3)}
    aucs = [cds[g]["auc"] for g in (0.0, 0.1, 1 / 3)]
    for hi, lo, g_hi, g_lo in zip(aucs, aucs[1:], (0.0, 0.1), (0.1, 1 / 3)):
        assert hi - lo > 4 * math.hypot(auc_sd(hi, cds[g_hi]), auc_sd(lo, cds[g_lo])), aucs
    for g in (0.1, 1 / 3):
        fa = attacks.FALSE_ALARM
        assert cds[g]["fpr"] <= fa + 4 * math.sqrt(fa * (1 - fa) / cds[g]["unchanged"]), cds[g]
        assert cds[g]["location_privacy"]["log_ratio_per_round_of_shift"] == pytest.approx(math.log((1 - g) / g))
    assert cds[0.1]["tpr"] > cds[1 / 3]["tpr"]


def test_change_statistic_on_hand_made_sequences() -> None:
    bits = np.array([[0, 0, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.uint8)
    present = np.ones(bits.shape, dtype=bool)
    present[3, 2] = False
    score, tau = attacks.change_statistic(bits[:, :, None], present, memoized=True, gamma=0.0)
    assert score.tolist() == [math.inf, 0.0, math.inf, 0.0] and tau[[0, 2]].tolist() == [3, 2]
    score, tau = attacks.change_statistic(bits[:, :, None], present, memoized=True, gamma=0.1)
    assert score[1] == score[3] == 0.0 and tau[2] == 2
    assert score[2] > score[0] > 0  # a clean switch is stronger evidence than scattered ones


def _bernoulli_best(k: int, m: int, low: float) -> float:
    """max over p in [low, 1 - low] of k ln p + (m - k) ln(1 - p), from the definition (0 ln 0 = 0)."""
    if m == 0:
        return 0.0
    p = min(max(k / m, low), 1.0 - low)
    return (k * math.log(p) if k else 0.0) + ((m - k) * math.log(1.0 - p) if m - k else 0.0)


def _brute_change(bits: np.ndarray, present: np.ndarray, memoized: bool, gamma: float) -> tuple[float, list]:
    """One device's generalized log-likelihood ratio and each split's value, position by position from the
    definitions in change_statistic's docstring (no tables, no vectors)."""
    T, d = bits.shape

    def first(k: int, m: int) -> float:
        if memoized:  # one memoized bit, each round's copy flipped with gamma
            return m * math.log(1 - gamma) - min(k, m - k) * math.log((1 - gamma) / gamma)
        return _bernoulli_best(k, m, 0.0)

    def segment(rounds: range, fit: Any) -> float:
        total = 0.0
        for p in range(d):
            k = sum(int(bits[t, p]) for t in rounds if present[t])
            m = sum(1 for t in rounds if present[t])
            total += fit(k, m)
        return total

    base = segment(range(T), first)
    second = lambda k, m: _bernoulli_best(k, m, gamma if memoized else 0.0)  # noqa: E731
    splits = [segment(range(t), first) + segment(range(t, T), second) for t in range(1, T)]
    return max([0.0] + [v - base for v in splits]), [v - base for v in splits]


@pytest.mark.parametrize("memoized, gamma", [(True, 0.1), (True, 0.3), (False, 0.0)])
def test_change_statistic_matches_the_definition_over_several_positions(memoized: bool, gamma: float) -> None:
    """The vectorized statistic (tabulated log-likelihoods, positions summed, rounds missing) against a direct
    evaluation of its definition for every device and split: the score, and the split it names scores it."""
    rng = np.random.default_rng(5)
    n, T, d = 40, 7, 5
    bits = (rng.random((n, T, d)) < rng.random((n, 1, d))).astype(np.uint8)
    bits[: n // 2, T // 2:] ^= 1  # half the devices switch every bit half way
    present = rng.random((n, T)) < 0.8
    score, tau = attacks.change_statistic(bits, present, memoized, gamma)
    for i in range(n):
        want, splits = _brute_change(bits[i], present[i], memoized, gamma)
        assert score[i] == pytest.approx(want, rel=1e-9, abs=1e-9), i
        if tau[i] >= 0:
            assert splits[tau[i] - 1] == pytest.approx(want, rel=1e-9, abs=1e-9), i
        else:
            assert want == pytest.approx(0.0, abs=1e-9), i
    assert (score[: n // 2] > 0).mean() > 0.5  # (not a vacuous comparison: most switchers score)


# ----------------------------------------------------------------------------------------------- patterns
def test_first_occurrence_forgets_values_and_keeps_which_rounds_share_one() -> None:
    inputs = np.array([[5, 5, 7, 5, -1, 7], [3, 3, 9, 3, -1, 9], [1, 2, 3, 4, 5, 6], [4, 4, 4, 4, 4, 4]])
    canon = attacks.first_occurrence(inputs)
    assert canon.tolist() == [[0, 0, 2, 0, -1, 2], [0, 0, 2, 0, -1, 2], [0, 1, 2, 3, 4, 5], [0] * 6]
    assert attacks.pattern_width(canon).tolist() == [2, 2, 6, 1]
    assert attacks.pattern_support(canon).support.tolist() == [2, 2, 1, 1]


def test_pattern_support_matches_a_brute_force_count() -> None:
    """A tiny 1BitRRPM run: each device's grid values by its own alpha-point rounding, relabelled by first
    appearance (Definition 2), counted with a dict; the width also equals the ledger's spend / eps (Theorem 4)."""
    s, T, n = 14_400.0, 6, 60
    sc = scenario({"name": "1bitrrpm", "max_value": M, "granularity": s}, constant_levels(jitter=6000), T, n,
                  seed=11)
    result = runner.run(sc)
    report = attacks.analyze(result)
    alpha = sc.protocol.make_devices(sc.seed, np.arange(n)).alpha
    grid = [[int(g) for g in alpha_round(result.true_values[i], alpha[i], s)] for i in range(n)]

    def pattern(seq: list[int]) -> tuple[int, ...]:
        names: dict[int, int] = {}
        return tuple(names.setdefault(g, len(names)) for g in seq)

    patterns = [pattern(g) for g in grid]
    support = Counter(patterns)
    widths = [len(set(g)) for g in grid]
    canon = attacks.first_occurrence(np.array(grid))
    pats = attacks.pattern_support(canon)
    assert pats.support.tolist() == [support[p] for p in patterns]
    assert attacks.pattern_width(canon).tolist() == widths
    for t in range(1, T + 1):
        prefix = Counter(p[:t] for p in patterns)
        assert pats.alone[t - 1] == sum(1 for p in patterns if prefix[p[:t]] == 1) / n
        assert pats.count[t - 1] == len(prefix)
    summary = report.summary["patterns"]
    assert summary["share_alone"] == sum(1 for p in patterns if support[p] == 1) / n
    assert summary["patterns"] == len(support) and summary["width"]["max"] == max(widths)
    np.testing.assert_allclose(result.ledger.spend, np.array(widths) * EPS)
    assert 1 < len(support) < n  # the case is not degenerate


# ----------------------------------------------------------------------------------------------- schema
def test_attacks_are_on_by_default_up_to_the_size_limit_and_off_above() -> None:
    raw = schema.read("quickstart")[1]
    rounds = raw["rounds"]
    at_limit = ATTACKS_AUTO_LIMIT // rounds
    assert schema.load("quickstart", [f"population.devices={at_limit}"]).attacks
    above = schema.load("quickstart", [f"population.devices={at_limit + 1}"])
    assert not above.attacks and "set analysis.attacks = true" in above.attacks_why
    assert above.as_run["analysis"] == {"attacks": False}  # scenario.json records the resolved setting
    assert schema.load("quickstart", [f"population.devices={at_limit + 1}", "analysis.attacks=true"]).attacks
    assert not schema.load("quickstart", ["analysis.attacks=false"]).attacks
    assert "analysis" not in raw and schema.load("quickstart").raw == raw  # the input itself is kept as given
    # a report of d numbers counts d times: BinFlip over 65,536 buckets is off from 153 device-rounds
    wide = ["protocol.name='binflip'", "protocol.buckets=65536", "protocol.bits=65536", "rounds=2"]
    on = ATTACKS_AUTO_LIMIT // (2 * 65536)
    assert schema.load("usage_histogram", [*wide, f"population.devices={on}"]).attacks
    off = schema.load("usage_histogram", [*wide, f"population.devices={on + 1}"])
    assert not off.attacks and "x report width 65,536" in off.attacks_why


@pytest.mark.parametrize("override, message", [
    ("analysis.attacks=1", r"^analysis\.attacks: must be a boolean, got 1"),
    ("analysis.attacks='yes'", r"^analysis\.attacks: must be a boolean"),
    ("analysis.atacks=true", r"^analysis\.atacks: unknown key \(did you mean attacks\?\)"),
    ("analysis=3", r"^analysis: must be a table"),
])
def test_analysis_table_is_strict(override: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        schema.load("quickstart", [override])


# ----------------------------------------------------------------------------------------------- run directory
def test_run_directory_has_attacks_csv_png_and_summary(tmp_path: Path) -> None:
    sc = schema.load("quickstart", ["population.devices=600"])
    s = output.write_run_dir(runner.run(sc), tmp_path / "on")
    out = tmp_path / "on"
    a = s["attacks"]
    assert a["enabled"] and a["why"].startswith("default")
    assert a["averaging"]["applies"] and a["change_detection"]["applies"] and a["patterns"]["applies"]
    assert 0 < a["averaging"]["rmse_final"] < a["averaging"]["rmse_round_1"]
    assert 0 <= a["patterns"]["share_alone"] <= 1 and a["change_detection"]["changed"] > 0
    assert json.loads((out / "summary.json").read_text())["attacks"] == a
    assert json.loads((out / "scenario.json").read_text())["analysis"] == {"attacks": True}
    assert (out / "attacks.png").read_bytes()[:8] == PNG_MAGIC
    with open(out / "attacks.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(attacks.CSV_HEADER) and len(rows) == s["files"]["attacks.csv"]["rows"]
    metrics = {r["metric"] for r in rows}
    assert {"averaging_rmse", "averaging_auc_heavy_light", "change_auc", "change_tpr", "change_fpr",
            "change_location_error", "pattern_width", "pattern_support", "pattern_alone"} <= metrics
    assert all(r["theory"] == "" for r in rows if r["metric"] != "averaging_rmse")  # unknown: empty, not 0
    assert [int(r["round"]) for r in rows if r["metric"] == "averaging_rmse"] == list(range(1, 15))

    off = output.write_run_dir(runner.run(schema.load("quickstart", ["population.devices=600",
                                                                        "analysis.attacks=false"])), out)
    assert off["attacks"] == {"enabled": False, "why": "analysis.attacks = false"}
    assert not (out / "attacks.csv").exists() and not (out / "attacks.png").exists()
    assert off["files"]["attacks.csv"] == {"written": False, "why": "analysis.attacks = false"}


def test_a_protocol_the_attacks_do_not_read_says_why() -> None:
    s = output.summary(runner.run(schema.load("apps_multi", ["population.devices=300", "rounds=3"])))
    assert "attacks" not in s  # summary() alone (sweeps) computes no attacks
    report = attacks.analyze(runner.run(schema.load("apps_multi", ["population.devices=300", "rounds=3"])))
    for key in ("averaging", "change_detection", "patterns"):
        assert report.summary[key]["applies"] is False and "1bitmulti" in report.summary[key]["why"]
    assert report.rows == []
