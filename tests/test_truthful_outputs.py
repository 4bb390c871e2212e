"""Outputs that say exactly what they contain: counts that add up, per-report guarantees that are not 0, no
table of an older run beside a newer summary, errors that name the misspelled key."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from scenarios import cli, jsonout, output, runner, schema


def _run(*overrides: str) -> dict:
    return output.summary(runner.run(schema.load("quickstart", ["population.devices=500", *overrides])))


def test_reports_sent_is_delivered_plus_lost() -> None:
    s = _run("network.loss=0.2")
    r = s["reports"]
    assert r["lost"] > 0
    assert r["sent"] == r["delivered"] + r["lost"] == 500 * 14
    assert r["accepted"] == r["delivered"]


@pytest.mark.parametrize("name, gamma", [("1bitmean", 0.0), ("1bitrrpm", 0.0), ("1bitmean", 0.1), ("1bitrrpm", 0.1)])
def test_round_epsilon_is_the_per_report_guarantee(name: str, gamma: float) -> None:
    s = _run(f"protocol.name={name!r}", f"protocol.gamma={gamma}")
    sc = schema.load("quickstart", [f"protocol.name={name!r}", f"protocol.gamma={gamma}"])
    assert s["round_epsilon_max"] == pytest.approx(sc.protocol.round_epsilon) and s["round_epsilon_max"] > 0
    assert s["privacy"]["round_epsilon"] == s["round_epsilon_max"]
    if gamma:
        assert s["round_epsilon_max"] < sc.protocol.epsilon  # eps' of Theorem 6


def test_force_removes_every_file_of_the_previous_run(tmp_path) -> None:
    out = tmp_path / "run"
    args = ["run", "quickstart", "--out", str(out), "--quiet", "--set", "population.devices=300"]
    assert cli.main(args) == 0
    old = {p.name for p in out.iterdir()}
    assert any(name.startswith("ledger") for name in old)
    (out / "notes.txt").write_text("mine")
    assert cli.main([*args, "--force", "--no-ledger-rows"]) == 0
    new = {p.name for p in out.iterdir()}
    assert not any(name.startswith("ledger") for name in new), "an old ledger must not sit beside a new summary"
    assert "notes.txt" in new, "files that are not run outputs are left alone"
    assert json.loads((out / "summary.json").read_text())["devices"] == 300


@pytest.mark.parametrize("table, key, missing", [("protocol", "epsilonn", "epsilon"), ("population", "devicess", "devices")])
def test_a_misspelled_required_key_is_named_with_a_suggestion(table: str, key: str, missing: str) -> None:
    _, data = schema.read("quickstart")
    data[table][key] = data[table].pop(missing)
    with pytest.raises(schema.ScenarioError, match=rf"^{table}\.{key}: unknown key \(did you mean {missing}\?\)"):
        schema.parse(data)


def test_a_short_required_key_lengthened_is_named_with_a_suggestion() -> None:
    """``sdev`` for ``sd``: too far apart for the similarity ratio, it was reported as "counter.sd: required"."""
    _, data = schema.read("quickstart")
    counter = data["population"]["groups"][0]["counter"]
    counter["sdev"] = counter.pop("sd")
    with pytest.raises(schema.ScenarioError,
                       match=r"^population\.groups\[0\]\.counter\.sdev: unknown key \(did you mean sd\?\)"):
        schema.parse(data)


def test_a_misspelled_optional_key_is_named_with_a_suggestion() -> None:
    with pytest.raises(schema.ScenarioError, match=r"protocol\.gama: unknown key \(did you mean gamma\?\)"):
        schema.load("quickstart", ["protocol.gama=0.1"])


@pytest.mark.parametrize("overrides", [["population.devices=20"], ["network.loss=0.99"],
                                       ["network.loss=0.9999", "population.devices=50"]])
def test_tops_rounds_without_holdout_or_reports_have_no_estimate_and_do_not_crash(overrides) -> None:
    """ToPS with an empty round-1 holdout (20 devices, or almost every report lost) chooses theta = max_value,
    which depends on no data; a round with no report has no estimate (NaN), never a made-up 0."""
    sc = schema.load("tops_pos", ["rounds=3", *overrides])
    result = runner.run(sc)
    s = output.summary(result)
    col = result.collector.protocol
    for rec in result.rounds:
        assert (rec.reports == 0) <= (rec.estimate != rec.estimate)  # no reports -> NaN
    if col.fallback:
        assert col.tops.threshold == sc.protocol.max_value
    assert s["privacy"]["within_guarantee"]


@pytest.mark.parametrize("name", ["quickstart", "usage_histogram", "apps_multi", "thresh_stable", "topl_pos",
                                  "tops_pos"])
def test_every_protocol_survives_a_run_where_almost_nothing_arrives(name: str) -> None:
    sc = schema.load(name, ["population.devices=30", "network.loss=0.995"])
    s = output.summary(runner.run(sc))
    assert s["reports"]["sent"] == s["reports"]["delivered"] + s["reports"]["lost"]
    assert s["privacy"]["within_guarantee"]


def _strict(constant: str) -> None:
    raise ValueError(f"summary.json holds {constant}, which strict JSON readers reject")


def test_summary_json_is_strict_json_and_names_each_figure_that_is_not_finite(tmp_path, capsys) -> None:
    """THRESH's derived vote noise a is infinite at 100 devices (its denominator is negative): summary.json
    and ``--json`` write null there (RFC 8259 has no Infinity) and ``non_finite`` says that it was inf."""
    out = tmp_path / "run"
    args = ["run", "thresh_stable", "--out", str(out), "--quiet", "--json", "--set", "population.devices=100",
            "--set", "rounds=28"]
    assert cli.main(args) == 0
    for text in (capsys.readouterr().out, (out / "summary.json").read_text()):
        s = json.loads(text, parse_constant=_strict)
        assert s["parameters"]["derived"]["a"] is None
        assert s["non_finite"]["values"] == {"parameters.derived.a": "inf"}


def test_strict_documents_name_each_null_that_stands_for_a_non_finite_figure() -> None:
    """compare.json, audit.json and privacy_audit.json go through jsonout.document: a dict says where its nulls
    were not finite, a list of rows says it row by row, and the text is strict JSON (no NaN, no Infinity)."""
    record = {"a": 1.0, "b": {"c": math.nan, "d": [0.5, -math.inf]}, "e": None}
    doc = json.loads(jsonout.write_document(record), parse_constant=_strict)
    assert doc["b"] == {"c": None, "d": [0.5, None]} and doc["e"] is None
    assert doc["non_finite"]["values"] == {"b.c": "nan", "b.d[1]": "-inf"}
    rows = json.loads(jsonout.write_document([{"x": math.inf}, {"x": 2.0}]), parse_constant=_strict)
    assert rows == [{"x": None, "non_finite": {"values": {"x": "inf"}, "meaning": jsonout.MEANING}}, {"x": 2.0}]
    assert "non_finite" not in jsonout.document({"x": 1.0})


def test_another_protocols_key_left_by_a_protocol_switch_says_how_to_switch() -> None:
    """app_usage_31d is a 1bitrrpm scenario: --set protocol.name=dbitflippm leaves its granularity behind,
    which is no misspelling; the error says which keys dbitflippm reads and how to replace the table whole,
    and the table set whole runs."""
    switch = ["protocol.name=dbitflippm", "protocol.buckets=24", "protocol.bits=1", "population.devices=500"]
    with pytest.raises(schema.ScenarioError, match=r"^protocol\.granularity: unknown key for dbitflippm \(it reads "
                                                   r"bits, buckets, epsilon, gamma, max_value, name\); to switch .*"
                                                   r"--set 'protocol = \{name = \"dbitflippm\""):
        schema.load("app_usage_31d", switch)
    whole = schema.load("app_usage_31d", ['protocol={name="dbitflippm", epsilon=1, max_value=86400, buckets=24, '
                                          'bits=1}', "population.devices=500"])
    assert whole.protocol.name == "dbitflippm" and whole.protocol.buckets == 24


def test_1bitmean_ignores_a_granularity_out_loud_and_does_not_state_it() -> None:
    """README's `ldpsim run app_usage_31d --set protocol.name=1bitmean`: 1BitMean does not round, so the
    scenario's granularity is named in a warning and summary.json's parameters say None, not 3600."""
    sc = schema.load("app_usage_31d", ["protocol.name=1bitmean", "population.devices=300", "rounds=2"])
    assert sc.protocol.granularity is None
    assert any(w.startswith("protocol: granularity is not used by 1bitmean") for w in sc.warnings)
    params = output.summary(runner.run(sc))["parameters"]
    assert params["granularity"] is None and "warnings" not in params
    assert not schema.load("app_usage_31d", ["population.devices=300"]).warnings  # 1bitrrpm rounds by it


@pytest.mark.parametrize("protocol", ["1bitrrpm", "dbitflippm"])
def test_with_churn_the_truth_is_that_of_the_devices_present(protocol: str) -> None:
    """The light group (70%) joins in round 3: in rounds 1-2 only the heavy users report, so the estimate is
    of their mean and the truth must be too (it was the whole population's, a bias of ~1.5x the mean that the
    error figures blamed on the protocol). The truth equals the mean of the present devices' true values, and
    every round's estimate is within 4 theoretical sd of it; with nobody present the truth is NaN, not the
    absent population's figure."""
    table = ("protocol={name=\"1bitrrpm\", epsilon=1, max_value=86400, granularity=3600}" if protocol == "1bitrrpm"
             else "protocol={name=\"dbitflippm\", epsilon=1, max_value=86400, buckets=8, bits=2}")
    sc = schema.load("quickstart", [table, "population.devices=20000", "rounds=4", "population.groups.0.joins=3",
                                    "analysis.attacks=true", "network.loss=0"])
    result = runner.run(sc)
    assert result.true_values is not None
    for r in result.rounds:
        present = result.true_values[:, r.round - 1]
        present = present[~np.isnan(present)]
        if protocol == "1bitrrpm":
            assert present.size == (6000 if r.round < 3 else 20000) and r.truth == pytest.approx(present.mean())
        else:
            np.testing.assert_allclose(r.truth, np.histogram(np.minimum(present, 86400 - 1e-9), bins=8,
                                                            range=(0, 86400))[0] / present.size)
        assert np.all(np.abs(np.asarray(r.estimate) - r.truth) <= 4 * np.asarray(r.sd_theory)), r
    nobody = runner.run(schema.load("quickstart", [table, "population.devices=500", "rounds=3",
                                                   "population.groups.0.joins=3", "population.groups.1.joins=3"]))
    assert all(np.all(np.isnan(np.asarray(r.truth))) for r in nobody.rounds[:2])
    assert not np.any(np.isnan(np.asarray(nobody.rounds[2].truth)))


def test_a_run_directory_given_as_a_scenario_points_at_its_scenario_json(tmp_path) -> None:
    """`ldpsim run RUN_DIR` said "no such file (nor a shipped scenario of that name)", wrong for a directory."""
    run = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--set", "population.devices=200", "--set", "rounds=1", "--out", str(run),
                     "--quiet"]) == 0
    with pytest.raises(schema.ScenarioError, match=r"a directory, not a scenario file; a run directory's scenario is "
                                                   r".*run/scenario\.json$"):
        schema.load(str(run))
    with pytest.raises(schema.ScenarioError, match=r"a directory, not a scenario file$"):
        schema.load(str(tmp_path))
    assert schema.load(str(run / "scenario.json")).devices == 200
