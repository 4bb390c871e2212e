"""Scripted behaviors (agents/behavior.py): weekly seasonality, changes at a simulated time, condition
triggers, trends and keyed bursts shape the world's values exactly as specified; values stay a pure function of
(seed, device, round), the same for every cohort split and in both runtimes; TOML and Python give the same run;
scenario.json repeats it; and bad behaviors are one-line errors naming the key."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agents.behavior import Behavior, Day, Weekly, compose, first_round_at
from agents.world import Dist, Group, World
from collector.server import LiveSettings
from scenarios import cli, live, output, runner, schema

FAST = LiveSettings(stage_timeout=2.0, read_timeout=0.3, startup_timeout=10.0)
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------- a user's own behaviors
def weekend_dip(day: Day, ids: np.ndarray, value: np.ndarray, *, weekend: float = 0.5,
                first: int = 0) -> np.ndarray:
    """A user's weekday behavior: weekend values times ``weekend``."""
    return value * weekend if day.weekday(first) >= 5 else value


def wrong_shape(day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
    return value[:1]


def raises(day: Day, ids: np.ndarray, value: np.ndarray, *, k: float = 1.0) -> np.ndarray:
    return value * (1.0 / (k - 1.0))  # k = 1: ZeroDivisionError


USER_MODULE = """
import numpy as np


def weekday_hours(day, ids, value, *, weekend=0.5, first=0):
    '''Weekend dip with a keyed per-device, per-round wobble of 10%.'''
    wobble = 1.0 + 0.1 * day.keys.normal(ids, "wobble", day.round)
    return value * wobble * (weekend if day.weekday(first) >= 5 else 1.0)
"""


def _group(behavior: Any = None, params: Any = None, name: str = "u", share: float = 1.0,
           counter: dict | None = None, **more: Any) -> dict[str, Any]:
    g: dict[str, Any] = {"name": name, "share": share,
                         "counter": counter or {"dist": "normal", "mean": 3600, "sd": 900},
                         "jitter": {"dist": "normal", "sd": 300}, **more}
    if behavior is not None:
        g["behavior"] = behavior
    if params is not None:
        g["params"] = params
    return g


def _data(groups: list[dict[str, Any]], rounds: int = 14, devices: int = 1000, **top: Any) -> dict[str, Any]:
    return {"name": "behaviors", "seed": 11, "rounds": rounds, "population": {"devices": devices, "groups": groups},
            "protocol": {"name": "1bitrrpm", "epsilon": 1.0, "max_value": 86400, "granularity": 3600},
            "network": {"loss": 0.0}, "simulation": {"cohort_size": 250}, **top}


def _world(behavior: Behavior, n: int = 1000, counter: Dist | None = None, max_value: float = 1e9,
           seed: int = 5) -> World:
    return World(seed, n, [Group("u", 1.0, counter or Dist("constant", value=1000.0), behavior=behavior)], [],
                 max_value)


def _run_values(world: World, rounds: int) -> np.ndarray:
    """(rounds, n): every round's values."""
    out = []
    for r in range(1, rounds + 1):
        world.advance_to(r)
        out.append(world.values(np.arange(world.n))[0].copy())
    return np.array(out)


def _digests(sc: schema.Scenario) -> dict[str, str]:
    return output.summary(runner.run(sc))["digests"]


# --------------------------------------------------------------------------------- what the behaviors do
def test_weekday_multiplier_shows_in_the_per_round_truth() -> None:
    """Constant usage of 3600 s, weekends at a quarter, round 1 a Wednesday: the truth of every round is 3600
    on weekdays and 900 on Saturdays and Sundays (rounds 4, 5, 11, 12), built-in and user function alike."""
    const = {"dist": "constant", "value": 3600}
    for behavior, params in (("weekly", {"weekend": 0.25, "first_weekday": "wed"}),
                             (weekend_dip, {"weekend": 0.25, "first": 2})):
        sc = schema.parse(_data([{"name": "u", "share": 1.0, "counter": const, "behavior": behavior,
                                  "params": params}]))
        truth = [r.truth for r in runner.run(sc).rounds]
        assert truth == [900.0 if r in (4, 5, 11, 12) else 3600.0 for r in range(1, 15)]
    factors = [1, 2, 3, 4, 5, 6, 7]
    v = _run_values(_world(compose("weekly", {"factors": factors, "first_weekday": 6})), 8)
    assert v[:, 0].tolist() == [1000.0 * factors[(6 + d) % 7] for d in range(8)]


@pytest.mark.parametrize("round_seconds, at_time, expected", [
    (86400, 0, 1), (86400, 3.5 * 86400, 5), (86400, 4 * 86400, 5), (86400, 4 * 86400 + 1, 6),
    (3600, 7200, 3), (3600, 7199.5, 3), (3600, 7200.001, 4), (0.1, 0.3, 4),
])
def test_change_at_a_simulated_time_lands_in_the_first_round_starting_then(round_seconds: float, at_time: float,
                                                                            expected: int) -> None:
    """Round r starts at (r - 1) x round_seconds and its values are read then: a change at time t shows from
    the first round that starts at or after t."""
    assert first_round_at(at_time, round_seconds) == expected
    v = _run_values(_world(compose("step", {"at_time": at_time, "factor": 2.0}, round_seconds)), expected + 2)
    assert (v[:expected - 1] == 1000.0).all() and (v[expected - 1:] == 2000.0).all()


def test_change_at_a_time_in_a_scenario_file() -> None:
    """From TOML, with hourly rounds: a step behavior and a [[changes]] entry at the same time (2.5 h) both land
    in round 4 (it starts at 3 h); a keyed fraction of the group is hit and stays the same devices."""
    rs = {"round_seconds": 3600.0}
    data = _data([_group("step", {"at_time": 9000, "factor": 3.0, "fraction": 0.4}, counter={
        "dist": "constant", "value": 100}, jitter={"dist": "none"})], rounds=6,
        changes=[{"at_time": 9000, "group": "u", "jitter": {"dist": "normal", "sd": 1}}],
        simulation={"cohort_size": 250, **rs}, network={"loss": 0.0, "deadline": 600})
    sc = schema.parse(data)
    assert sc.changes[0].round == 4 and sc.groups[0].behavior.round_seconds == 3600.0
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    v = _run_values(world, 6)
    assert (v[:3] == 100.0).all()
    hit = np.abs(v[3] - 300.0) < 10
    assert (np.abs(v[3:][:, hit] - 300) < 10).all() and (np.abs(v[3:][:, ~hit] - 100) < 10).all()
    assert abs(hit.mean() - 0.4) < 4.5 * math.sqrt(0.4 * 0.6 / sc.devices)
    with pytest.raises(schema.ScenarioError, match=r"^changes\[0\]\.at_time: give round or at_time, not both$"):
        schema.parse({**data, "changes": [{"at_time": 9000, "round": 2, "group": "u", "jitter": {"dist": "none"}}]})


def test_trigger_on_a_devices_own_value() -> None:
    """Levels uniform on [0, 1000] growing by a quarter a day; once a device's value passes 1000 in a round, it
    is 0 from the next round on, and stays 0."""
    world = _world(compose(["trend", "trigger"], [{"rate": 0.25}, {"above": 1000.0, "factor": 0.0}]),
                   counter=Dist("uniform", low=0.0, high=1000.0))
    levels = world.levels.copy()
    v = _run_values(world, 10)
    grown = levels[None, :] * (1.0 + 0.25 * np.arange(10))[:, None]
    crossed = np.where((grown > 1000).any(axis=0), (grown > 1000).argmax(axis=0), 99)  # 0-based round
    expect = np.where(np.arange(10)[:, None] > crossed[None, :], 0.0, grown)
    np.testing.assert_array_equal(v, expect)
    assert 0 < (crossed < 99).mean() < 1


def test_trigger_on_the_population_mean() -> None:
    """Group a grows 10% a day; group b doubles from the round after the population mean first passes 1250."""
    bh = compose("trigger", {"on": "mean", "above": 1250.0, "factor": 2.0})
    world = World(3, 2000, [Group("a", 0.5, Dist("constant", value=1000.0), behavior=compose("trend", {"rate": 0.1})),
                            Group("b", 0.5, Dist("constant", value=1000.0), behavior=bh)], [], 1e9)
    v = _run_values(world, 12)
    means = v.mean(axis=1)
    first = int(np.argmax(means > 1250))  # 0-based round of the first crossing
    assert 2 <= first <= 9
    assert (v[:first + 1, 1000:] == 1000.0).all() and (v[first + 1:, 1000:] == 2000.0).all()


def test_trend_linear_and_exponential_per_day() -> None:
    """linear: 1 + rate x days since the start round; exponential: (1 + rate)^days, days of 86,400 s (half-day
    rounds: half a day per round)."""
    v = _run_values(_world(compose("trend", {"rate": 0.1, "round": 3})), 8)[:, 0]
    np.testing.assert_allclose(v, [1000, 1000] + [1000 * (1 + 0.1 * t) for t in range(6)], rtol=1e-12)
    v = _run_values(_world(compose("trend", {"rate": 0.05, "kind": "exponential"}, 43200.0)), 8)[:, 0]
    np.testing.assert_allclose(v, [1000 * 1.05 ** (t / 2) for t in range(8)], rtol=1e-12)
    v = _run_values(_world(compose("trend", {"rate": -0.4})), 5)[:, 0]  # a decline, clipped at 0
    np.testing.assert_allclose(v, [1000, 600, 200, 0, 0], atol=1e-9)


def test_burst_rates_within_binomial_tolerance() -> None:
    """p = 0.05, duration 3: the share of devices in a burst is p in round 1, 1 - (1 - p)^2 in round 2 and
    1 - (1 - p)^3 after, each within 5 binomial sd; a burst lasts exactly its duration when no other starts."""
    n, p = 200_000, 0.05
    v = _run_values(_world(compose("burst", {"p": p, "factor": 2.0, "duration": 3}), n=n, counter=Dist(
        "constant", value=1.0)), 6)
    on = v == 2.0
    assert ((v == 1.0) | on).all()
    for r in range(6):
        q = 1 - (1 - p) ** min(r + 1, 3)
        assert abs(on[r].mean() - q) < 5 * math.sqrt(q * (1 - q) / n), r
    # devices that start a burst in round 2 and none in rounds 3 and 4 (not on in round 1, nor in round 5)
    lone = ~on[0] & on[1] & ~on[4]
    assert lone.sum() > 1000 and on[1:4, lone].all()


def test_clipping_of_behavior_values_is_counted() -> None:
    """Values a behavior pushes out of [0, max_value] are clipped and counted with the rest."""
    world = World(2, 1000, [Group("up", 0.3, Dist("constant", value=1000.0),
                                  behavior=compose("step", {"round": 2, "factor": 100.0})),
                            Group("down", 0.3, Dist("constant", value=1000.0),
                                  behavior=compose("step", {"round": 3, "add": -5000.0})),
                            Group("plain", 0.4, Dist("normal", mean=10.0, sd=100.0))], [], 86400.0)
    ids = np.arange(1000)
    plain = []
    for r in (1, 2, 3):
        world.advance_to(r)
        v, clipped = world.values(ids)
        plain.append(int((v[600:] == 0).sum()))
        assert clipped == plain[-1] + (300 if r >= 2 else 0) + (300 if r >= 3 else 0)
        assert v.min() >= 0 and v.max() <= 86400
    assert (v[:300] == 86400).all() and (v[300:600] == 0).all() and min(plain) > 0


# --------------------------------------------------------------------------------- purity and the runtimes
def test_values_are_a_pure_function_of_seed_id_and_round() -> None:
    """Each built-in gives a device the same value whatever other devices are asked with it; the seed matters;
    a world that jumps days equals one that steps through them; two worlds keep separate trigger state."""
    specs = [("weekly", {"weekend": 0.5}), ("trend", {"rate": 0.02}), ("burst", {"p": 0.1, "factor": 3.0,
             "duration": 2}), ("step", {"round": 3, "factor": 2.0, "fraction": 0.5})]
    ids = np.arange(5000, dtype=np.int64)
    sub = np.sort(np.random.default_rng(0).choice(ids, 300, replace=False))
    base = np.random.default_rng(1).uniform(100, 1000, ids.size)
    for spec, params in specs:
        for day in (1, 4, 6):
            full = compose(spec, params).bind(9, 0, 1e9).apply(day, ids, base.copy())
            part = compose(spec, params).bind(9, 0, 1e9).apply(day, sub, base[sub].copy())
            np.testing.assert_array_equal(full[sub], part)
        other = compose(spec, params).bind(10, 0, 1e9).apply(6, ids, base.copy())
        if spec in ("burst", "step"):
            assert not np.array_equal(other, compose(spec, params).bind(9, 0, 1e9).apply(6, ids, base.copy()))
    trig = compose(["burst", "trigger"], [{"p": 0.1, "factor": 5.0}, {"above": 4000.0, "factor": 0.5}])
    a, b = _world(trig, counter=Dist("uniform", low=0, high=1000)), _world(trig, counter=Dist("uniform", low=0,
                                                                                                 high=1000))
    stepped = _run_values(a, 7)
    b.advance_to(7)
    np.testing.assert_array_equal(b.values(np.arange(b.n))[0], stepped[-1])
    assert (stepped[-1] != _run_values(_world(compose("burst", {"p": 0.1, "factor": 5.0}),
                                              counter=Dist("uniform", low=0, high=1000)), 7)[-1]).any()


def test_digests_do_not_depend_on_the_cohort_split() -> None:
    sets = ["population.devices=200", "rounds=8", "network.loss=0.05"]
    digests = [_digests(schema.load("weekday_usage", sets + [f"simulation.cohort_size={c}"])) for c in (1, 7, 200)]
    assert digests[0] == digests[1] == digests[2]


def test_toml_and_python_give_identical_runs_and_scenario_json_repeats_them(tmp_path: Path) -> None:
    """The same behaviors named in a TOML file and passed as Python objects: equal digests, equal scenario.json;
    and the run directory's scenario.json, parsed again, repeats the run."""
    name = f"{weekend_dip.__module__}:weekend_dip"
    toml = tmp_path / "b.toml"
    toml.write_text(textwrap.dedent(f"""
        name = "behaviors"
        seed = 11
        rounds = 10
        [population]
        devices = 600
        [[population.groups]]
        name = "u"
        share = 0.5
        counter = {{ dist = "normal", mean = 3600, sd = 900 }}
        behavior = ["{name}", "burst"]
        params = [{{ weekend = 0.3 }}, {{ p = 0.1, factor = 2.0, duration = 2 }}]
        [[population.groups]]
        name = "v"
        share = 0.5
        counter = {{ dist = "normal", mean = 7200, sd = 900 }}
        behavior = "weekly"
        [population.groups.params]
        weekend = 2.0
        [protocol]
        name = "1bitmean"
        epsilon = 1.0
        max_value = 86400
    """), encoding="utf-8")
    from_toml = schema.load(str(toml))
    from agents.behavior import Burst

    data = json.loads(json.dumps(from_toml.raw))
    data["population"]["groups"][0]["behavior"] = [weekend_dip, Burst]
    data["population"]["groups"][1]["behavior"] = Weekly
    from_python = schema.parse(data)
    assert from_python.as_run == from_toml.as_run
    assert from_toml.as_run["population"]["groups"][0]["behavior"] == [name, "burst"]
    digests = _digests(from_toml)
    assert _digests(from_python) == digests
    result = runner.run(from_python)
    output.write_run_dir(result, tmp_path / "run")
    again = schema.parse(json.loads((tmp_path / "run" / "scenario.json").read_text()))
    assert _digests(again) == digests
    # a parameter changed with --set changes the run
    assert _digests(schema.load(str(toml), ["population.groups.1.params.weekend=1.5"])) != digests


def test_a_weekday_behavior_runs_identically_in_both_runtimes() -> None:
    """The shipped weekday scenario: the live runtime over loopback gives the simulated run's digests."""
    sc = schema.load("weekday_usage", ["population.devices=600", "rounds=9", "network.loss=0",
                                       "simulation.cohort_size=100"])
    sim = output.summary(runner.run(sc))
    got = output.summary(asyncio.run(live.run_embedded(sc, connections=3, settings=FAST)))
    assert got["digests"] == sim["digests"]
    assert got["reports"]["accepted"] == sim["reports"]["accepted"] > 0


def test_ldpsim_live_with_a_users_behavior_module_equals_the_simulator(tmp_path: Path, monkeypatch) -> None:
    """`ldpsim live` in its own process imports a user's module by name (PYTHONPATH) and gives the transcript
    digest of the simulated run of the same scenario file."""
    (tmp_path / "ldpsim_user_behaviors.py").write_text(USER_MODULE, encoding="utf-8")
    text = (schema.SHIPPED / "weekday_usage.toml").read_text(encoding="utf-8")
    old = 'behavior = "weekly"                  # a built-in; or "module:function" for your own\n' \
          'params = { weekday = 1.0, weekend = 0.2, first_weekday = "mon" }'
    assert old in text
    scenario = tmp_path / "user.toml"
    scenario.write_text(text.replace(old, 'behavior = "ldpsim_user_behaviors:weekday_hours"\n'
                                          'params = { weekend = 0.2 }'), encoding="utf-8")
    sets = ["population.devices=500", "rounds=8", "network.loss=0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    p = subprocess.run([sys.executable, "-m", "scenarios.cli", "live", str(scenario), "--out", str(tmp_path / "live"),
                        "--connections", "2", *[a for s in sets for a in ("--set", s)]],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads((tmp_path / "live" / "summary.json").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    sc = schema.load(str(scenario), sets)
    assert sc.groups[0].behavior.steps[0].name == "ldpsim_user_behaviors:weekday_hours"
    assert got["digests"] == _digests(sc)
    written = json.loads((tmp_path / "live" / "scenario.json").read_text())
    assert written["population"]["groups"][0]["behavior"] == "ldpsim_user_behaviors:weekday_hours"
    assert written["population"]["groups"][0]["params"] == {"weekend": 0.2}


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("change, message", [
    ({"behavior": "no_such_module_xyz:f"}, r"^population\.groups\[0\]\.behavior: module 'no_such_module_xyz' is "
                                           r"not importable .*PYTHONPATH$"),
    ({"behavior": "json:no_such_function"}, r"^population\.groups\[0\]\.behavior: module 'json' has no attribute"),
    ({"behavior": "json:dumps"}, r"^population\.groups\[0\]\.behavior: dumps must take \(day, ids, value\)"),
    ({"behavior": "weeklyy"}, r"^population\.groups\[0\]\.behavior: unknown behavior 'weeklyy': a built-in"),
    ({"behavior": "weekly", "params": {"weekends": 0.5}},
     r"^population\.groups\[0\]\.params\.weekends: unknown parameter of weekly"),
    ({"behavior": "weekly", "params": {"weekend": "low"}},
     r"^population\.groups\[0\]\.params\.weekend: must be a finite number, got 'low'$"),
    ({"behavior": "burst", "params": {"p": 1.5, "factor": 2}},
     r"^population\.groups\[0\]\.params\.p: must be a probability in \[0, 1\], got 1\.5$"),
    ({"behavior": ["weekly", "burst"], "params": [{}, {"p": 0.1}]},
     r"^population\.groups\[0\]\.params\[1\]\.factor: required parameter of burst$"),
    ({"behavior": ["weekly", "burst"], "params": [{}]},
     r"^population\.groups\[0\]\.params: 2 behaviors need an array of 2 tables"),
    ({"behavior": ["weekly", 3]}, r"^population\.groups\[0\]\.behavior: must be a name"),
    ({"params": {"weekend": 0.5}}, r"^population\.groups\[0\]\.params: parameters of a behavior, but the group has"),
    ({"behavior": "step", "params": {"round": 2, "at_time": 5.0}},
     r"^population\.groups\[0\]\.params\.at_time: give round or at_time, not both$"),
    ({"behavior": lambda day, ids, value: value}, r"^population\.groups\[0\]\.behavior: .*no importable name"),
    ({"behavior": weekend_dip, "params": {"weekend": object()}},
     r"^population\.groups\[0\]\.params\.weekend: must be a TOML value"),
    # a user's behavior, by the types it declares (a string where it takes a number ran with no effect)
    ({"behavior": weekend_dip, "params": {"weekend": "0.2"}},
     r"^population\.groups\[0\]\.params\.weekend: must be a number \(as .*weekend_dip declares it\), got '0\.2'$"),
    ({"behavior": weekend_dip, "params": {"first": 2.5}},
     r"^population\.groups\[0\]\.params\.first: must be an integer \(as .*weekend_dip declares it\), got 2\.5$"),
    ({"behavior": weekend_dip, "params": {"weekend": True}},
     r"^population\.groups\[0\]\.params\.weekend: must be a number .* got True$"),
    ({"behavior": wrong_shape}, r"^population\.groups\[0\]\.behavior: behavior .*wrong_shape returned shape \(1,\) "
                                r"for 3 devices in round 1 \(a trial call on 3 devices\)$"),
    ({"behavior": raises}, r"^population\.groups\[0\]\.behavior: behavior .*raises failed in round 1: "
                           r"ZeroDivisionError: float division by zero \(a trial call"),
    ({"behavior": "weekly", "counter": {"dist": "bernoulli", "p": 0.5}},
     r"^population\.groups\[0\]\.behavior: behaviors shape counter values; this group's counter is bernoulli"),
])
def test_bad_behaviors_are_one_line_errors_naming_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(schema.ScenarioError) as ei:
        schema.parse(_data([{**_group(), **change}]))
    assert "\n" not in str(ei.value)
    assert __import__("re").search(message, str(ei.value)), str(ei.value)


def test_the_cli_reports_an_unimportable_module_in_one_line(tmp_path: Path, capsys) -> None:
    code = cli.main(["run", "weekday_usage", "--out", str(tmp_path / "out"), "--quiet",
                     "--set", 'population.groups.0.behavior="my_missing_module:weekday"'])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("ldpsim: error: population.groups[0].behavior: module 'my_missing_module' is not "
                          "importable")
    assert not (tmp_path / "out").exists()


def test_a_behavior_failing_mid_run_is_a_one_line_error(tmp_path, monkeypatch, capsys) -> None:
    """A user's behavior that passes the load-time trial call but raises in round 3: exit status 2 and one line
    naming the behavior and the round, not a traceback."""
    from scenarios.cli import main

    (tmp_path / "explodes_late.py").write_text(
        "def explode(day, ids, value, at=3):\n"
        "    if day.round >= at:\n"
        "        raise RuntimeError('boom')\n"
        "    return value\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["run", "quickstart", "--set", "population.devices=300", "--set",
                 'population.groups.0.behavior="explodes_late:explode"', "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("ldpsim: error: population.groups[0].behavior: behavior explodes_late")
    assert "round 3" in err[-1] and "boom" in err[-1]
    assert not any("Traceback" in line for line in err)


def unkeyed_noise(day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
    """A behavior drawing from numpy's global generator: not a function of (seed, device, round)."""
    return value * np.random.default_rng().uniform(0.5, 1.5, ids.size)


def test_a_behavior_with_unkeyed_randomness_is_refused_at_load() -> None:
    """Two runs of a behavior that draws from an unkeyed generator differ (different transcript digests), which
    only an audit with --allow-code caught, as report mismatches with no hint of the cause. Two trial calls on
    the same input at load tell it, in one line naming day.keys."""
    _, data = schema.read("quickstart")
    data["population"]["groups"][0]["behavior"] = unkeyed_noise
    with pytest.raises(schema.ScenarioError, match=r"^population\.groups\[0\]\.behavior: two trial calls on the same "
                                                   r"devices, round and values returned different values: .*day\.keys"):
        schema.parse(data)


# ------------------------------------------------------------------------------- changes a behavior makes
def test_a_step_records_the_devices_it_changes_in_its_first_round() -> None:
    """A step adding 100 for a keyed 30% from round 4: the world records exactly the devices whose values it
    moved (against the same world without the step), in round 4 and no other; x 1 + 0 records nothing."""
    world = _world(compose("step", {"round": 4, "add": 100.0, "fraction": 0.3}))
    plain = _world(compose("weekly", {"weekday": 1.0}))
    moved = _run_values(world, 6)[3] != _run_values(plain, 6)[3]
    assert world.behavior_fired == [(4, "u", "step", int(moved.sum()))] and 0.2 < moved.mean() < 0.4
    np.testing.assert_array_equal(world.behavior_changed, np.where(moved, 4, 0))
    idle = _world(compose("step", {"round": 4, "factor": 1.0}))
    _run_values(idle, 6)
    assert idle.behavior_fired == [] and idle.behavior_changed is None
    # a step in round 2 lifts everyone past a trigger's level, which fires in round 3: both are listed, and each
    # device's first change stays round 2
    twice = _world(compose(["step", "trigger"], [{"round": 2, "add": 100.0}, {"above": 1050.0, "factor": 0.0}]))
    _run_values(twice, 4)
    assert twice.behavior_fired == [(2, "u", "step", 1000), (3, "u", "trigger", 1000)]
    assert (twice.behavior_changed == 2).all()


def test_a_trigger_records_each_device_in_the_round_after_it_crossed() -> None:
    """Levels uniform on [0, 1000] growing by a quarter a day, set to 0 once past 1000: each device is recorded
    in the round after its value first passed 1000 (from the closed form), once; on the population mean, every
    device of the group in the round after the mean passed."""
    world = _world(compose(["trend", "trigger"], [{"rate": 0.25}, {"above": 1000.0, "factor": 0.0}]),
                   counter=Dist("uniform", low=0.0, high=1000.0))
    levels = world.levels.copy()
    _run_values(world, 10)
    grown = levels[None, :] * (1.0 + 0.25 * np.arange(10))[:, None]
    crossed = np.where((grown > 1000).any(axis=0), (grown > 1000).argmax(axis=0) + 1, 0)  # 1-based round
    expect = np.where((crossed > 0) & (crossed < 10), crossed + 1, 0)
    np.testing.assert_array_equal(world.behavior_changed, expect)
    assert [(r, n) for r, _, _, n in world.behavior_fired] == [
        (r, int((expect == r).sum())) for r in range(1, 11) if (expect == r).any()]
    bh = compose("trigger", {"on": "mean", "above": 1250.0, "factor": 2.0})
    mean = World(3, 2000, [Group("a", 0.5, Dist("constant", value=1000.0), behavior=compose("trend", {"rate": 0.1})),
                           Group("b", 0.5, Dist("constant", value=1000.0), behavior=bh)], [], 1e9)
    first = int(np.argmax(_run_values(mean, 12).mean(axis=1) > 1250)) + 1  # 1-based round of the crossing
    assert mean.behavior_fired == [(first + 1, "b", "trigger", 1000)]


def test_a_behavior_s_change_shows_in_the_event_log_picture_and_attack_metrics(tmp_path: Path, monkeypatch) -> None:
    """A step doubling a keyed 30% of a group from round 6: events.jsonl logs it once (behavior_fired, with the
    count the world recorded), estimates.png gets a dotted line at round 6, and the attack metrics count those
    devices as changed (they had counted none and blamed jitter)."""
    from scenarios import plots

    lines: list[list[int]] = []
    real = plots.estimates_plot
    monkeypatch.setattr(plots, "estimates_plot", lambda path, rounds, truth, est, sd, title, change_rounds, *a, **k:
                        (lines.append(list(change_rounds)), real(path, rounds, truth, est, sd, title, change_rounds,
                                                                  *a, **k))[1])
    import io

    data = _data([_group("step", {"round": 6, "factor": 2.0, "fraction": 0.3})], rounds=10, devices=2000)
    log = io.StringIO()
    result = runner.run(schema.parse(data), events=log)
    output.write_run_dir(result, tmp_path)
    events = [json.loads(line) for line in log.getvalue().splitlines()]
    fired = [e for e in events if e["event"] == "behavior_fired"]
    hit = int((result.world.behavior_changed == 6).sum())
    assert [(e["round"], e["group"], e["behavior"], e["devices"]) for e in fired] == [(6, "u", "step", hit)]
    assert 400 < hit < 800 and lines == [[6]]
    changes = json.loads((tmp_path / "summary.json").read_text())["attacks"]["change_detection"]
    assert changes["changed"] == hit
    # which devices it reached is in the run directory: spend.parquet's first_change_round (null: never changed)
    import pyarrow.parquet as pq

    column = pq.read_table(tmp_path / "spend.parquet")["first_change_round"].to_numpy(zero_copy_only=False)
    np.testing.assert_array_equal(np.nan_to_num(column, nan=0), result.world.behavior_changed)
    assert np.isnan(column).sum() == 2000 - hit
    rows = (tmp_path / "spend.csv").read_text().splitlines()
    assert rows[0].endswith(",first_change_round")
    assert [r.rsplit(",", 1)[1] for r in rows[1:]] == [str(c) if c else "" for c in result.world.behavior_changed]


def test_a_step_after_the_last_round_is_warned_about_like_a_scripted_change() -> None:
    """A step whose round (or at_time) comes after the last round never happens: the scenario says so in a
    warning naming the key, as it does for a [[changes]] entry; a step in the last round is not warned about."""
    late = schema.parse(_data([_group("step", {"round": 30, "factor": 2.0})], rounds=14))
    assert late.warnings == ["population.groups[0].params.round: 30 is after the last round (14); it will not happen"]
    timed = schema.parse(_data([_group(["weekly", "step"], [{"weekend": 0.5}, {"at_time": 3e6, "factor": 2.0}])]))
    assert timed.warnings == ["population.groups[0].params[1].at_time: 3e+06 s is round 36, after the last round "
                              "(14); it will not happen"]
    assert schema.parse(_data([_group("step", {"round": 14, "factor": 2.0})], rounds=14)).warnings == []
