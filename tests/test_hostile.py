"""Every protocol against every hostile collector behavior: devices never crash, never spend past the
protocol's declared guarantee or their budget, and ignore (and count) whatever they must not answer."""

from __future__ import annotations

import asyncio
import functools
import math

import numpy as np
import pytest

from collector.server import LiveSettings
from protocols.guard import MAX_ROUND, Guard, Limits
from protocols.messages import CollectionRequest, Threshold
from scenarios import live, output, runner, schema
from tests.support import live_scenarios

HOSTILE = [b for b in schema.BEHAVIORS if b not in ("honest", "always_update")]
SCENARIOS = live_scenarios()
FAST = LiveSettings(stage_timeout=2.0, read_timeout=0.3, startup_timeout=10.0)


def _with(sc: schema.Scenario, *overrides: str) -> schema.Scenario:
    return schema.parse(schema.apply_overrides(sc.raw, list(overrides)))


def _summary(sc: schema.Scenario) -> dict:
    return output.summary(runner.run(sc))


@functools.cache
def _honest(name: str) -> dict:
    return _summary(SCENARIOS[name])


@pytest.mark.parametrize("behavior", HOSTILE)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_hostile_collector_cannot_push_devices_past_the_guarantee(name: str, behavior: str) -> None:
    """The run survives; max spend <= guarantee; the devices ignored the hostile messages; and since every
    one of them was refused, the ledger is the honest run's to the bit."""
    s = _summary(_with(SCENARIOS[name], f"collector.behavior={behavior}"))
    pv, honest = s["privacy"], _honest(name)["privacy"]
    assert pv["max_spend"] <= pv["guarantee"] * (1 + 1e-9), pv
    assert pv["within_guarantee"] is True
    assert pv["ignored_messages"] > 0, "the hostile messages must reach the devices and be refused"
    assert honest["ignored_messages"] == 0
    assert s["digests"]["ledger"] == _honest(name)["digests"]["ledger"]
    assert pv["max_spend"] == pytest.approx(honest["max_spend"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_budget_caps_every_device_whatever_the_collector_does(name: str) -> None:
    """A budget below the guarantee: no device exceeds it, under an honest and a replaying collector,
    and the refusals are counted."""
    honest = _honest(name)["privacy"]
    budget = honest["max_spend"] / 2
    for behavior in ("honest", "replay", "beyond_horizon"):
        s = _summary(_with(SCENARIOS[name], f"privacy.budget={budget!r}", f"collector.behavior={behavior}"))
        pv = s["privacy"]
        assert pv["budget"] == budget
        assert pv["max_spend"] <= budget * (1 + 1e-9), (behavior, pv)
        assert pv["within_budget"] is True
        assert pv["refusals"] > 0, "half the honest spend cannot be reached without refusing reports"


def test_guard_admits_rounds_once_in_order_inside_the_horizon() -> None:
    g = Guard(np.arange(3), Limits(horizon=5))
    assert not g.admit(0) and not g.admit(6) and not g.admit(MAX_ROUND)
    assert g.admit(2) and not g.admit(2) and not g.admit(1)
    assert not g.admit(3, current=4) and g.admit(4, current=4)
    assert g.ignored == 6


def test_guard_budget_refuses_and_charges_only_through_the_guard() -> None:
    g = Guard(np.arange(4), Limits(budget=1.0))
    g.charge(1, 0.0, "fresh_report", 0.6, np.array([0, 1]))
    ok = g.affordable(np.array([0.5, 0.4, 0.5, 0.0]))
    assert ok.tolist() == [False, True, True, True]
    assert g.refusals == 1
    assert g.spent.tolist() == [0.6, 0.6, 0.0, 0.0]
    with pytest.raises(ValueError):
        Limits(budget=0.0)
    with pytest.raises(ValueError):
        Limits(horizon=0)


def test_topl_devices_ignore_absurd_thresholds_and_reused_versions() -> None:
    sc = SCENARIOS["topl"]
    p = sc.protocol
    dev = p.make_devices(sc.seed, np.arange(50), sc.limits)
    values = np.full(50, p.max_value / 3)
    dev.respond(CollectionRequest(1, p.name, 1.0), 1, values, 0.0)
    batch, charges = dev.respond(Threshold(1, p.name, p.max_value / 2, 1, 1.0), 1, values, 0.0)
    assert batch is not None and len(batch) > 0
    before = dev.guard.ignored
    for theta, version in ((0.0, 5), (-1.0, 5), (1e-300, 5), (1e308, 5), (math.nan, 5), (p.max_value / 4, 1)):
        assert dev.respond(Threshold(1, p.name, theta, version, 1.0), 1, values, 0.0) == (None, [])
    # five refused by the cohort as a whole; the reused version by each device that holds it (all 50)
    assert dev.guard.ignored == before + 5 and dev.guard.ignored_rows == 50
    assert dev.guard.device_messages_ignored == (before + 5) * 50 + 50
    assert np.all(dev.theta[dev.version > 0] == p.max_value / 2)


def test_scenario_checks_behavior_and_budget() -> None:
    base = SCENARIOS["1bitmean"]
    for bad, field in (("collector.behavior=evil", "collector.behavior"), ("privacy.budget=0", "privacy.budget"),
                       ("privacy.budgett=1", "privacy.budgett"),
                       ("collector.behavior=always_update", "collector.behavior")):
        with pytest.raises(schema.ScenarioError, match=field):
            _with(base, bad)


@pytest.mark.asyncio
@pytest.mark.parametrize("behavior", ["far_future", "replay", "bad_threshold", "beyond_horizon"])
async def test_live_device_clients_refuse_hostile_collectors(behavior: str) -> None:
    """Over TCP: the server acts the behavior, the device clients refuse; the far-future request is refused at
    once instead of walked to day by day; the ledger equals the honest simulated run's."""
    for name in ("1bitmean", "topl"):
        sc = _with(SCENARIOS[name], f"collector.behavior={behavior}")
        result = await asyncio.wait_for(live.run_embedded(sc, connections=2, settings=FAST), 60)
        s = output.summary(result)
        assert s["privacy"]["ignored_messages"] > 0
        assert s["privacy"]["max_spend"] <= s["privacy"]["guarantee"] * (1 + 1e-9)
        assert s["digests"]["ledger"] == _honest(name)["digests"]["ledger"], name


def test_ignored_messages_do_not_depend_on_the_cohort_split() -> None:
    """privacy.ignored_messages counts a refused message once per device that refused it: a replaying collector
    gives the same figure with one cohort, ten and one per device (it counted cohorts, 27 to 54,000)."""
    from scenarios import output, runner, schema

    figures = set()
    for cohort in (200, 20, 1):
        sc = schema.load("quickstart", ["population.devices=200", "rounds=4", 'collector.behavior="replay"',
                                        f"simulation.cohort_size={cohort}"])
        figures.add(output.privacy_summary(runner.run(sc))["ignored_messages"])
    (count,) = figures
    assert count > 0 and count % 200 == 0  # every device refused every replayed message


def test_topl_threshold_refusals_do_not_depend_on_the_cohort_split() -> None:
    """A replayed ToPL threshold is refused by the devices that already hold its version and taken by those
    whose first copy was lost: counted per refusing device, the figure is the same with one cohort, seven
    and one per device (it counted a cohort whole only when none of its devices took it: 5,058 devices'
    refusals with one per device, 5,000 with one cohort, in a run of 200 devices)."""
    figures = set()
    for cohort in (200, 29, 1):
        sc = schema.load("topl_pos", ["population.devices=200", "rounds=6", 'collector.behavior="replay"',
                                      "network.downlink_loss=0.3", f"simulation.cohort_size={cohort}"])
        figures.add(output.privacy_summary(runner.run(sc))["ignored_messages"])
    (count,) = figures
    assert count > 0 and count % 200 != 0  # some devices took the replayed copy, and did not refuse it


def test_guard_counts_a_refusal_by_some_devices_per_device() -> None:
    g = Guard(np.arange(4))
    g.ignore()
    g.ignore(3)
    assert (g.ignored, g.ignored_rows, g.device_messages_ignored) == (1, 3, 7)
    restored = Guard(np.arange(4))
    restored.restore(g.snapshot())
    assert restored.device_messages_ignored == 7
