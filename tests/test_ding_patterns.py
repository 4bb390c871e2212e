"""The behavior-pattern study (Ding, Kulkarni, Yekhanin 2017, figure 3; scenarios/studies/ding_patterns.py).

Populations whose patterns are known by construction (constant devices, a weekly switch, a value that differs
every day), the alpha-point rounding rule behind a pattern's width, agreement with a full run's attack
metrics, the shipped scenario, resuming, and one-line errors.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from scenarios import attacks, runner, schema
from scenarios.schema import ScenarioError

ROOT = Path(__file__).resolve().parents[1]
M = 86_400.0
T = 31


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scenarios" / "studies" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dp = _module("ding_patterns")
plot = _module("plot_ding_patterns")


def scenario(groups: list[dict[str, Any]], s: float = 3600.0, devices: int = 2000, seed: int = 5,
             protocol: dict[str, Any] | None = None) -> schema.Scenario:
    return schema.parse({
        "name": "patterns", "seed": seed, "rounds": T,
        "population": {"devices": devices, "groups": groups},
        "protocol": protocol or {"name": "1bitrrpm", "epsilon": 1.0, "max_value": M, "granularity": s},
    })


def counts(fig: dict[str, Any]) -> dict[int, int]:
    """support -> devices with that support."""
    return {s: s * c for s, c in fig["support_counts"]}


# ----------------------------------------------------------------------------------------------- by construction
@pytest.mark.parametrize("s", [M, 3600.0, 60.0])
def test_constant_devices_share_one_pattern_whatever_their_levels(s: float) -> None:
    """A device whose value never changes has one rounded value all month: the width-1 pattern. Definition 2
    forgets the values, so every constant device of an app is in that one pattern, whatever its level."""
    sc = scenario([
        {"name": "a/zero", "share": 0.25, "counter": {"dist": "constant", "value": 0}},
        {"name": "a/spread", "share": 0.35, "counter": {"dist": "uniform", "low": 0, "high": M}},
        {"name": "b/spread", "share": 0.4, "counter": {"dist": "normal", "mean": 7200, "sd": 3000,
                                                       "truncate": True}},
    ], s=s)
    apps = dp.patterns_of(sc)["apps"]
    assert list(apps) == ["a", "b"]
    assert apps["a"]["devices"] == 1200 and apps["b"]["devices"] == 800
    for fig in apps.values():
        assert fig["patterns"] == 1
        assert fig["support_counts"] == [[fig["devices"], 1]]
        assert fig["width_counts"] == [[1, fig["devices"]]]
        assert fig["top"] == [{"support": fig["devices"], "width": 1, "word": "A" * T}]
        assert fig["alone_by_round"] == [0.0] * T


def test_a_weekly_switch_is_one_pattern_of_width_two() -> None:
    """Office users at 11 h on weekdays and 0 at weekends round to two grid values (s = 1 h: 0 and 11 or
    12 h) that switch on the same days, so all of them share one width-2 pattern; the unused share the
    width-1 pattern. Exactly two patterns, with the groups' sizes as supports."""
    sc = scenario([
        {"name": "app/unused", "share": 0.3, "counter": {"dist": "constant", "value": 0}},
        {"name": "app/office", "share": 0.7, "counter": {"dist": "uniform", "low": 39_600, "high": 43_200},
         "behavior": "weekly", "params": {"weekday": 1.0, "weekend": 0.0, "first_weekday": "mon"}},
    ])
    fig = dp.patterns_of(sc)["apps"]["app"]
    assert fig["patterns"] == 2
    assert counts(fig) == {1400: 1400, 600: 600}
    assert fig["top"] == [{"support": 1400, "width": 2, "word": ("AAAAABB" * 5)[:T]},
                          {"support": 600, "width": 1, "word": "A" * T}]
    row = dp.app_row("app", fig)
    assert row["share_alone"] == 0 and row["largest_share"] == 0.7 and row["second_share"] == 0.3
    assert row["share_support_ge_1000"] == 0.7 and row["mean_width"] == pytest.approx(1.7)


def test_a_value_that_differs_every_day_is_one_pattern_of_full_width() -> None:
    """A device whose value grows by more than s every day has a new grid value every day: width 31. All such
    devices share that one pattern, which is why the finest s leaves the most irregular devices not alone."""
    sc = scenario([{"name": "grower", "share": 1.0, "counter": {"dist": "uniform", "low": 10_000, "high": 20_000},
                    "behavior": "trend", "params": {"rate": 0.1, "kind": "linear"}}], s=900.0, devices=500)
    fig = dp.patterns_of(sc)["apps"]["all"]
    assert fig["support_counts"] == [[500, 1]]
    assert fig["top"] == [{"support": 500, "width": T, "word": dp.LETTERS[:T]}]


def test_width_follows_the_alpha_point_rule_and_coarser_s_does_not_nest_finer_patterns() -> None:
    """Devices alternate between 3,000 s (weekdays) and 4,000 s (weekends). With alpha = u s, the grid index of
    x is floor(x/s + u), so a device has width 2 exactly when floor(3000/s + u) != floor(4000/s + u). The grids
    of s and 2 s do not nest: some devices have width 1 at s = 1 h and 2 at 2 h, others the reverse. So a
    coarser s need not merge patterns, and the share of devices in large patterns is not monotone in s by
    construction (docs/ding_patterns.md)."""
    groups = [{"name": "w", "share": 1.0, "counter": {"dist": "constant", "value": 3000},
               "behavior": "weekly", "params": {"weekday": 1.0, "weekend": 4 / 3}}]
    truth = dp.true_values(scenario(groups, devices=4000))
    assert set(np.unique(np.round(truth)).tolist()) == {3000.0, 4000.0}
    widths = {}
    for s in (3600.0, 7200.0):
        sc = scenario(groups, s=s, devices=4000)
        inputs = attacks.memo_inputs(sc.protocol, sc.seed, truth, np.arange(1, T + 1))
        widths[s] = attacks.pattern_width(attacks.first_occurrence(inputs))
        u = sc.protocol.make_devices(sc.seed, np.arange(4000)).alpha / s
        predicted = np.where(np.floor(3000 / s + u) != np.floor(4000 / s + u), 2, 1)
        assert np.array_equal(widths[s], predicted)
        assert abs(np.mean(widths[s] == 2) - 1000 / s) < 0.03  # P(a cut falls between the two values)
    assert np.any((widths[3600.0] == 1) & (widths[7200.0] == 2))
    assert np.any((widths[3600.0] == 2) & (widths[7200.0] == 1))


def test_width_one_share_agrees_with_the_alpha_point_closed_form() -> None:
    """Given its values, a device keeps one grid value all month with probability max(0, 1 - R/s) over its
    alpha, R the spread of its values. Over 20,000 jittering devices the measured share of width 1 is within
    4 standard errors of the mean of that, at a step where it is neither 0 nor 1."""
    sc = scenario([
        {"name": "a/light", "share": 0.5, "counter": {"dist": "normal", "mean": 900, "sd": 300, "truncate": True},
         "jitter": {"dist": "normal", "sd": 60}},
        {"name": "a/heavy", "share": 0.5, "counter": {"dist": "normal", "mean": 3600, "sd": 1200,
                                                      "truncate": True}, "jitter": {"dist": "normal", "sd": 300}},
    ], s=3600.0, devices=20_000)
    truth = dp.true_values(sc)
    p = dp.width_one_expected(truth, 3600.0)
    spread = truth.max(axis=1) - truth.min(axis=1)
    np.testing.assert_allclose(p, np.maximum(0.0, 1.0 - spread / 3600.0))
    fig = dp.patterns_of(sc, truth)["apps"]["a"]
    measured = dict(map(tuple, fig["width_counts"]))[1] / 20_000
    assert fig["width_one_expected"] == pytest.approx(p.mean())
    se = math.sqrt(np.sum(p * (1 - p))) / 20_000
    assert 0.3 < p.mean() < 0.9 and abs(measured - p.mean()) < 4 * se
    assert dp.app_row("a", fig)["width_one_share"] == measured


# ----------------------------------------------------------------------------------------------- as a run does
def test_supports_equal_those_of_a_full_runs_attack_metrics() -> None:
    """The study computes the true values from the world, without a run; a full run of app_usage_31d (with
    loss, a late-joining group and scripted changes) keeps them for its attack metrics. Both give the same
    values, absences included, and the same pattern supports, count and lone share."""
    sc = schema.load("app_usage_31d", ["population.devices=1500", "population.groups.1.joins=4",
                                       "analysis.attacks=true", "protocol.granularity=1800"])
    result = runner.run(sc)
    truth = dp.true_values(sc)
    assert np.array_equal(np.isnan(truth), np.isnan(result.true_values))
    assert np.isnan(truth).any()
    np.testing.assert_array_equal(np.nan_to_num(truth), np.nan_to_num(result.true_values))
    report = attacks.analyze(result)
    theirs = {int(x): int(d) for metric, _, x, _, d, _ in report.rows if metric == "pattern_support"}
    fig = dp.patterns_of(sc)["apps"]["all"]
    assert counts(fig) == theirs
    assert fig["patterns"] == report.summary["patterns"]["patterns"]
    assert fig["alone_by_round"][-1] == report.summary["patterns"]["share_alone"]
    assert 1 < fig["patterns"] < 1500  # not degenerate


# ----------------------------------------------------------------------------------------------- the shipped study
def test_shipped_scenario_has_three_apps_of_equal_size() -> None:
    sc = schema.load("app_usage_3apps_31d")
    assert sc.rounds == 31 and sc.protocol.name == "1bitrrpm" and sc.protocol.max_value == M
    ids = dp.app_ids(sc)
    assert list(ids) == ["chat", "browser", "game"]
    assert [len(v) for v in ids.values()] == [300_000] * 3
    assert np.array_equal(np.sort(np.concatenate(list(ids.values()))), np.arange(sc.devices))
    for app in ids:  # every app has installed-but-unused counters, and most counters are steady or unused
        assert any(g.name == f"{app}/unused" and g.counter.kind == "constant" and g.counter.value == 0
                   for g in sc.groups)
    for s in (86400, 21600, 3600, 900, 300, 60):  # the study's grid steps validate
        assert schema.load("app_usage_3apps_31d", [f"protocol.granularity={s}"]).protocol.granularity == s


def test_shipped_scenario_blends_less_as_s_gets_finer_down_to_15_minutes() -> None:
    """The study's headline at a hundredth of its size: in every app the largest pattern is the width-1 one,
    and its share and the share of devices in patterns of support >= 10 fall as s goes from m to 1 h to 15 min
    (a property of this population, not of the construction: see the test above)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for s in (86400, 3600, 900):
        sc = schema.load("app_usage_3apps_31d", ["population.devices=30000", f"protocol.granularity={s}"])
        for app, fig in dp.patterns_of(sc)["apps"].items():
            rows.setdefault(app, []).append(dp.app_row(app, fig))
    for app, by_s in rows.items():
        assert [r["largest_width"] for r in by_s] == [1, 1, 1]
        largest = [r["largest_share"] for r in by_s]
        ge10 = [r["share_support_ge_10"] for r in by_s]
        assert largest[0] > largest[1] > largest[2] and ge10[0] > ge10[1] > ge10[2], app
        assert largest[0] > 0.9 and by_s[0]["share_alone"] < 0.05


def test_study_writes_tables_figures_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study"
    args = [str(ROOT / "scenarios" / "app_usage_3apps_31d.toml"), "--grid", "protocol.granularity=86400,3600",
            "--set", "population.devices=3000", "--out", str(out), "--quiet"]
    assert dp.main(args) == 0
    lines = (out / "runs.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    for name in ("sweep.json", "results.csv", "supports.csv", "fig_supports.png", "fig_share_at_least_k.png",
                 "summary_table.md"):
        assert (out / name).stat().st_size > 0, name
    results = list(csv.DictReader(open(out / "results.csv", encoding="utf-8")))
    assert [(r["protocol.granularity"], r["app"]) for r in results] == [
        (s, a) for s in ("86400", "3600") for a in ("chat", "browser", "game")]
    supports = list(csv.DictReader(open(out / "supports.csv", encoding="utf-8")))
    for r in results:  # the support counts add up to the app's devices and patterns
        mine = [x for x in supports if x["protocol.granularity"] == r["protocol.granularity"] and x["app"] == r["app"]]
        assert sum(int(x["devices"]) for x in mine) == int(r["app_devices"]) == 1000
        assert sum(int(x["patterns"]) for x in mine) == int(r["patterns"])
        assert float(r["share_support_ge_2"]) == pytest.approx(1 - float(r["share_alone"]))
    capsys.readouterr()
    assert dp.main(args) == 0  # resumed: nothing to compute
    assert "0 computed now, 2 already done" in capsys.readouterr().err
    assert (out / "runs.jsonl").read_text(encoding="utf-8").splitlines() == lines
    other = [a if a != "protocol.granularity=86400,3600" else "protocol.granularity=900" for a in args]
    assert dp.main(other) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds a different study (grid" in err
    assert dp.main([*other, "--force", "--no-plots"]) == 0
    assert len((out / "runs.jsonl").read_text(encoding="utf-8").splitlines()) == 1
    assert json.loads((out / "sweep.json").read_text(encoding="utf-8"))["grid"] == {"protocol.granularity": [900]}


# ----------------------------------------------------------------------------------------------- errors, helpers
def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dp.main(["app_usage_3apps_31d", "--grid", "protocol.epsilon=1,2", "--set", "protocol.name=1bitmean",
                    "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "1bitmean does not memoize its reports" in err
    assert not (tmp_path / "x" / "sweep.json").exists()
    sc = scenario([{"name": "a/x", "share": 0.5, "counter": {"dist": "constant", "value": 0}},
                   {"name": "y", "share": 0.5, "counter": {"dist": "constant", "value": 0}}])
    with pytest.raises(ScenarioError, match=r"population.groups\[1\].name: 'y' names no app"):
        dp.app_ids(sc)


def test_dbitflippm_patterns_are_read_too() -> None:
    """The study takes any memoized protocol the attack metrics read: dBitFlipPM's memo input is the position
    of the value's bucket in J (or none), so a constant population is again one pattern."""
    sc = scenario([{"name": "c", "share": 1.0, "counter": {"dist": "uniform", "low": 0, "high": M}}],
                  protocol={"name": "dbitflippm", "epsilon": 1.0, "max_value": M, "buckets": 8, "bits": 2})
    summary = dp.patterns_of(sc)
    assert summary["granularity"] is None and summary["apps"]["all"]["support_counts"] == [[2000, 1]]


def test_plot_helpers() -> None:
    ranks, values = plot.staircase([(1, 4), (5, 1), (2, 3)])
    assert ranks.tolist() == [1, 1, 2, 4, 5, 8] and values.tolist() == [5, 5, 2, 2, 1, 1]
    k, at_least = plot.share_curve([(1, 4), (5, 1), (2, 3)])  # 15 devices: 4 alone, 6 in pairs, 5 together
    assert k.tolist() == [1, 2, 5] and np.allclose(at_least, [1, 11 / 15, 5 / 15])
    assert dp.share_at_least([[5, 1], [2, 3], [1, 4]], 3) == pytest.approx(5 / 15)
    assert math.isnan(dp.share_at_least([], 2))
    assert [plot.duration(v, M) for v in (M, 21600, 900, 45)] == ["24 h = m", "6 h", "15 min", "45 s"]
