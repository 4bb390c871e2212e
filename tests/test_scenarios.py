"""Scenario files: loading the shipped scenarios, strict validation with errors that name the field,
``--set`` overrides, and the world model (group split, scripted changes, clipping, jitter)."""

from __future__ import annotations

import copy
import math
import tomllib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.world import Change, Dist, Group, World, split_shares
from protocols import keyed
from protocols.keyed import Purpose, stream_key
from scenarios import schema
from scenarios.schema import ScenarioError, apply_overrides, load, parse

SHIPPED = sorted(schema.SHIPPED.glob("*.toml"))


def quickstart_dict() -> dict:
    return tomllib.loads((schema.SHIPPED / "quickstart.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ shipped scenarios
def test_there_are_shipped_scenarios():
    names = {p.name for p in SHIPPED}
    assert {"quickstart.toml", "app_usage_31d.toml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_scenario_loads_by_path(path):
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    sc = load(str(path))
    assert sc.name == raw["name"]
    assert sc.rounds == raw["rounds"]
    assert sc.devices == raw["population"]["devices"]
    assert [g.name for g in sc.groups] == [g["name"] for g in raw["population"]["groups"]]
    assert math.isclose(sum(g.share for g in sc.groups), 1.0)
    assert len(sc.changes) == len(raw.get("changes", []))
    assert sc.protocol.name == raw["protocol"]["name"]
    assert sc.protocol.epsilon == raw["protocol"]["epsilon"]
    assert sc.raw == raw  # the validated input, kept for the run directory


def test_quickstart_loads_by_shipped_name():
    sc = load("quickstart")
    assert sc.name == "quickstart"
    assert sc.seed == 42 and sc.rounds == 14 and sc.devices == 20_000
    assert [(g.name, g.share) for g in sc.groups] == [("light", 0.7), ("heavy", 0.3)]
    light = sc.groups[0]
    assert light.counter == Dist("normal", mean=1800.0, sd=600.0) and light.jitter_sd == 300.0
    assert sc.groups[1].counter == Dist("uniform", low=7200.0, high=21600.0)
    assert sc.changes == [Change(8, "light", Dist("normal", mean=3600.0, sd=600.0), None, 1.0)]
    p = sc.protocol
    assert (p.name, p.epsilon, p.max_value, p.granularity, p.gamma) == ("1bitrrpm", 1.0, 86400.0, 3600.0, 0.1)
    assert sc.network.latency == 0.05 and sc.network.loss == 0.01 and sc.network.deadline == 3600.0
    assert sc.simulation.cohort_size == 5000 and sc.simulation.round_seconds == 86_400.0
    # the same file, by name with the extension
    assert load("quickstart.toml") == sc


def test_load_applies_overrides():
    sc = load("quickstart", ["seed=7", "population.devices=300", "simulation.cohort_size=1"])
    assert (sc.seed, sc.devices, sc.simulation.cohort_size) == (7, 300, 1)


def test_load_unknown_scenario_names_it():
    with pytest.raises(ScenarioError) as ei:
        load("no-such-scenario-xyz")
    assert "no-such-scenario-xyz" in str(ei.value)


def test_load_invalid_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("name = \n", encoding="utf-8")
    with pytest.raises(ScenarioError) as ei:
        load(str(p))
    assert str(ei.value).startswith(str(p))
    assert "not valid TOML" in str(ei.value)


# ------------------------------------------------------------------------------------- bad scenarios
def _set(path: tuple, value):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return mutate


def _del(path: tuple):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return mutate


def _shares(*shares):
    def mutate(d):
        for g, s in zip(d["population"]["groups"], shares):
            g["share"] = s
    return mutate


def _no_change_payload(d):
    del d["changes"][0]["counter"]


def _duplicate_names(d):
    d["population"]["groups"][1]["name"] = "light"


G0, G1 = ("population", "groups", 0), ("population", "groups", 1)

BAD = [
    # (id, mutation, field path the message must start with)
    ("unknown-top-level-key", _set(("colour",), "blue"), "colour"),
    ("unknown-protocol-key", _set(("protocol", "delta"), 1e-6), "protocol.delta"),
    ("unknown-group-key", _set(G0 + ("weight",), 2), "population.groups[0].weight"),
    ("unknown-counter-key", _set(G0 + ("counter", "low"), 3), "population.groups[0].counter.low"),
    ("unknown-network-key", _set(("network", "bandwidth"), 10), "network.bandwidth"),
    ("unknown-change-key", _set(("changes", 0, "when"), 3), "changes[0].when"),
    ("epsilon-string", _set(("protocol", "epsilon"), "1.0"), "protocol.epsilon"),
    ("rounds-float", _set(("rounds",), 14.5), "rounds"),
    ("rounds-integral-float", _set(("rounds",), 14.0), "rounds"),
    ("devices-bool", _set(("population", "devices"), True), "population.devices"),
    ("seed-string", _set(("seed",), "42"), "seed"),
    ("groups-not-array", _set(("population", "groups"), {"name": "x"}), "population.groups"),
    ("group-not-table", _set(G0, 0.7), "population.groups[0]"),
    ("shares-sum-0.9", _shares(0.6, 0.3), "population.groups"),
    ("shares-sum-1.1", _shares(0.8, 0.3), "population.groups"),
    ("share-zero", _shares(0.0, 1.0), "population.groups[0].share"),
    ("share-above-1", _shares(1.2, 0.3), "population.groups[0].share"),
    ("duplicate-group-names", _duplicate_names, "population.groups"),
    ("granularity-not-dividing", _set(("protocol", "granularity"), 7000), "protocol.granularity"),
    ("granularity-above-max", _set(("protocol", "granularity"), 172800), "protocol.granularity"),
    ("granularity-missing-rrpm", _del(("protocol", "granularity")), "protocol.granularity"),
    ("gamma-0.5", _set(("protocol", "gamma"), 0.5), "protocol.gamma"),
    ("gamma-0.7", _set(("protocol", "gamma"), 0.7), "protocol.gamma"),
    ("epsilon-zero", _set(("protocol", "epsilon"), 0), "protocol.epsilon"),
    ("epsilon-negative", _set(("protocol", "epsilon"), -1.0), "protocol.epsilon"),
    ("epsilon-inf", _set(("protocol", "epsilon"), math.inf), "protocol.epsilon"),
    # where double precision stops computing the formulas (protocols/config.py EPSILON_RANGE, MAX_VALUE_RANGE)
    ("epsilon-below-1e-6", _set(("protocol", "epsilon"), 1e-7), "protocol.epsilon"),
    ("epsilon-above-10", _set(("protocol", "epsilon"), 10.5), "protocol.epsilon"),
    ("max-value-above-1e15", _set(("protocol", "max_value"), 2e15), "protocol.max_value"),
    ("max-value-below-1e-9", _set(("protocol", "max_value"), 1e-10), "protocol.max_value"),
    ("granularity-2^32-steps", _set(("protocol", "granularity"), 86400 / 2**32), "protocol.granularity"),
    ("protocol-unknown", _set(("protocol", "name"), "rappor"), "protocol.name"),
    ("dist-unknown", _set(G0 + ("counter", "dist"), "poisson"), "population.groups[0].counter.dist"),
    ("uniform-high-below-low", _set(G1 + ("counter", "high"), 100), "population.groups[1].counter.high"),
    ("counter-sd-negative", _set(G0 + ("counter", "sd"), -1), "population.groups[0].counter.sd"),
    ("jitter-sd-negative", _set(G0 + ("jitter", "sd"), -5), "population.groups[0].jitter.sd"),
    ("jitter-dist-unknown", _set(G0 + ("jitter", "dist"), "uniform"), "population.groups[0].jitter.dist"),
    ("change-round-zero", _set(("changes", 0, "round"), 0), "changes[0].round"),
    ("change-round-negative", _set(("changes", 0, "round"), -3), "changes[0].round"),
    ("change-round-too-large", _set(("changes", 0, "round"), 100_001), "changes[0].round"),
    ("change-round-float", _set(("changes", 0, "round"), 8.5), "changes[0].round"),
    ("change-group-unknown", _set(("changes", 0, "group"), "medium"), "changes[0].group"),
    ("change-without-payload", _no_change_payload, "changes[0]"),
    ("change-fraction-zero", _set(("changes", 0, "fraction"), 0), "changes[0].fraction"),
    ("deadline-equals-round", _set(("network", "deadline"), 86_400), "network.deadline"),
    ("deadline-above-round", _set(("network", "deadline"), 100_000), "network.deadline"),
    ("latency-equals-deadline", _set(("network", "latency"), 3600), "network.latency"),
    ("latency-above-deadline", _set(("network", "latency"), 5000), "network.latency"),
    # the request reaches a device after the latency and its report takes as long again: all late
    ("latency-half-deadline", _set(("network", "latency"), 1800), "network.latency"),
    ("round-seconds-1e-300", _set(("simulation", "round_seconds"), 1e-300), "simulation.round_seconds"),
    ("simulated-time-past-1e15", _set(("simulation", "round_seconds"), 1e14), "simulation.round_seconds"),
    # integers that no check can convert to a float, wherever they are
    ("epsilon-10^400", _set(("protocol", "epsilon"), 10**400), "protocol.epsilon"),
    ("seed-2^64", _set(("seed",), 2**64), "seed"),
    ("jitter-sd-huge", _set(G0 + ("jitter", "sd"), -10**30), "population.groups[0].jitter.sd"),
    ("granularity-subnormal", _set(("protocol", "granularity"), 1e-320), "protocol.granularity"),  # m / g overflows
    ("loss-one", _set(("network", "loss"), 1.0), "network.loss"),
    ("loss-negative", _set(("network", "loss"), -0.1), "network.loss"),
    ("cohort-size-zero", _set(("simulation", "cohort_size"), 0), "simulation.cohort_size"),
    ("round-seconds-zero", _set(("simulation", "round_seconds"), 0), "simulation.round_seconds"),
    ("missing-name", _del(("name",)), "name"),
    ("empty-name", _set(("name",), ""), "name"),
    ("missing-rounds", _del(("rounds",)), "rounds"),
    ("missing-population", _del(("population",)), "population"),
    ("missing-protocol", _del(("protocol",)), "protocol"),
    ("missing-devices", _del(("population", "devices")), "population.devices"),
    ("missing-epsilon", _del(("protocol", "epsilon")), "protocol.epsilon"),
    ("population-not-table", _set(("population",), 5), "population"),
]


def test_quickstart_dict_is_valid():
    """The base every bad case mutates must itself be valid, or the table below proves nothing."""
    parse(quickstart_dict())


@pytest.mark.parametrize("mutate, field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_scenario_names_the_field(mutate, field):
    data = quickstart_dict()
    mutate(data)
    with pytest.raises(ScenarioError) as ei:
        parse(data)
    msg = str(ei.value)
    assert msg.startswith(field + ":"), msg


def test_granularity_is_optional_for_naive():
    data = quickstart_dict()
    data["protocol"]["name"] = "1bitmean"
    del data["protocol"]["granularity"]
    sc = parse(data)
    assert sc.protocol.name == "1bitmean" and sc.protocol.granularity is None


def test_change_with_jitter_only_is_valid():
    data = quickstart_dict()
    del data["changes"][0]["counter"]
    data["changes"][0]["jitter"] = {"dist": "none"}
    data["changes"][0]["fraction"] = 0.5
    sc = parse(data)
    assert sc.changes == [Change(8, "light", None, 0.0, 0.5)]


def test_integers_are_accepted_as_numbers():
    data = quickstart_dict()
    data["protocol"]["epsilon"] = 2
    data["network"]["loss"] = 0
    sc = parse(data)
    assert sc.protocol.epsilon == 2.0 and isinstance(sc.protocol.epsilon, float)
    assert sc.network.loss == 0.0


# ---------------------------------------------------------------------------------------- overrides
def test_overrides_dotted_keys():
    data = quickstart_dict()
    out = apply_overrides(data, ["protocol.epsilon=2.5", "simulation.cohort_size=1", "seed=7"])
    assert out["protocol"]["epsilon"] == 2.5
    assert out["simulation"]["cohort_size"] == 1
    assert out["seed"] == 7


def test_overrides_create_missing_tables():
    data = quickstart_dict()
    del data["simulation"]
    out = apply_overrides(data, ["simulation.round_seconds=7200"])
    assert out["simulation"] == {"round_seconds": 7200}


def test_overrides_list_index():
    data = quickstart_dict()
    out = apply_overrides(data, ["population.groups.0.share=0.5", "population.groups.1.share=0.5"])
    assert [g["share"] for g in out["population"]["groups"]] == [0.5, 0.5]
    assert out["population"]["groups"][0]["name"] == "light"  # the rest of the table is kept
    out = apply_overrides(data, ["changes.0.round=3"])
    assert out["changes"][0]["round"] == 3
    assert parse(out).changes[0].round == 3


def test_overrides_replace_list_element():
    out = apply_overrides({"a": [1, 2, 3]}, ["a.1=20"])
    assert out == {"a": [1, 20, 3]}


@pytest.mark.parametrize("text, expected", [
    ("3", 3),
    ("-4", -4),
    ("0.5", 0.5),
    ("1e3", 1000.0),
    ("true", True),
    ("false", False),
    ('"hello"', "hello"),
    ('"3"', "3"),
    ("'7'", "7"),
    ("1bitmean", "1bitmean"),  # bare string: not valid TOML
    ("hello world", "hello world"),
    ("[1, 2]", [1, 2]),
    ("", ""),
])
def test_override_value_parsing(text, expected):
    out = apply_overrides({}, [f"x={text}"])
    assert out["x"] == expected
    assert type(out["x"]) is type(expected)


def test_override_value_may_contain_equals():
    assert apply_overrides({}, ["x=a=b"]) == {"x": "a=b"}


def test_override_with_bare_protocol_name_validates():
    sc = parse(apply_overrides(quickstart_dict(), ["protocol.name=1bitmean"]))
    assert sc.protocol.name == "1bitmean"


@pytest.mark.parametrize("item", ["seed", "=3", " =3", ""])
def test_override_bad_form(item):
    with pytest.raises(ScenarioError) as ei:
        apply_overrides(quickstart_dict(), [item])
    assert str(ei.value).startswith("--set")
    assert "KEY=VALUE" in str(ei.value)


@pytest.mark.parametrize("item, where", [
    ("population.groups.2.share=0.5", "population.groups.2"),  # out of range
    ("population.groups.x.share=0.5", "population.groups.x"),  # not a number
    ("population.groups.-1.share=0.5", "population.groups.-1"),  # negative
    ("population.groups.5=1", "5"),  # last part out of range
    ("population.groups.first=1", "first"),
])
def test_override_bad_index(item, where):
    with pytest.raises(ScenarioError) as ei:
        apply_overrides(quickstart_dict(), [item])
    msg = str(ei.value)
    assert msg.startswith("--set " + item.partition("=")[0] + ":"), msg
    assert where in msg and "index" in msg


@pytest.mark.parametrize("item", ["name.x=1", "rounds.per_day=2", "population.devices.x=2"])
def test_override_through_scalar(item):
    with pytest.raises(ScenarioError) as ei:
        apply_overrides(quickstart_dict(), [item])
    assert str(ei.value).startswith("--set " + item.partition("=")[0] + ":")
    assert "not a table" in str(ei.value)


def test_overrides_leave_input_unchanged():
    data = quickstart_dict()
    before = copy.deepcopy(data)
    out = apply_overrides(data, ["population.groups.0.share=0.5", "protocol.epsilon=3", "network.extra.x=1",
                                 "changes.0.counter.mean=10"])
    assert data == before
    assert out != before
    assert out["population"]["groups"] is not data["population"]["groups"]


def test_override_errors_then_validation():
    with pytest.raises(ScenarioError) as ei:
        load("quickstart", ["protocol.epsilon=-1"])
    assert str(ei.value).startswith("protocol.epsilon:")
    with pytest.raises(ScenarioError) as ei:
        load("quickstart", ["changes.0.group=nobody"])
    assert str(ei.value).startswith("changes[0].group:")


def test_change_after_the_last_round_is_a_warning():
    """A change scheduled after the last round is valid (it just never happens) but is reported."""
    sc = load("quickstart", ["rounds=5"])
    assert sc.rounds == 5 and sc.changes[0].round == 8
    assert len(sc.warnings) == 1 and sc.warnings[0].startswith("changes[0].round:")
    assert load("quickstart").warnings == []
    assert load("quickstart", ["rounds=8"]).warnings == []  # the last round itself is in range


# -------------------------------------------------------------------------------------------- world
share_vectors = st.lists(st.floats(min_value=1e-6, max_value=1.0), min_size=1, max_size=8).map(
    lambda xs: [x / sum(xs) for x in xs])


@settings(max_examples=300, deadline=None)
@given(n=st.one_of(st.integers(0, 50), st.integers(0, 2**32 - 1)), shares=share_vectors)
def test_split_shares_exact(n, shares):
    b = split_shares(n, shares)
    assert b.shape == (len(shares) + 1,)
    assert b[0] == 0 and b[-1] == n
    sizes = np.diff(b)
    assert sizes.sum() == n
    assert (sizes >= 0).all()
    # largest remainder: each size is the floor of its exact share or one more, and the extra devices go
    # to the largest remainders
    raw = np.asarray(shares, dtype=np.float64) * n
    extra = sizes - np.floor(raw).astype(np.int64)
    assert set(extra.tolist()) <= {0, 1}
    rem = raw - np.floor(raw)
    if extra.any() and not extra.all():
        assert rem[extra == 1].min() >= rem[extra == 0].max()


def test_split_shares_examples():
    assert split_shares(10, [0.7, 0.3]).tolist() == [0, 7, 10]
    assert split_shares(10, [1 / 3] * 3).tolist() == [0, 4, 7, 10]  # ties: the first in order gets the extra
    assert split_shares(5, [0.5, 0.5]).tolist() == [0, 3, 5]
    assert split_shares(0, [0.5, 0.5]).tolist() == [0, 0, 0]


def _world(n=10_000, changes=(), max_value=1e9, seed=3, groups=None):
    groups = groups or [Group("a", 0.6, Dist("constant", value=100.0)),
                        Group("b", 0.4, Dist("constant", value=200.0))]
    return World(seed, n, groups, list(changes), max_value)


def test_world_groups_are_contiguous_blocks():
    w = _world(n=1000)
    assert w.group_ids("a").tolist() == list(range(600))
    assert w.group_ids("b").tolist() == list(range(600, 1000))
    assert w.group_of(np.array([0, 599, 600, 999])).tolist() == [0, 0, 1, 1]


def test_change_applies_from_its_round_not_before():
    ch = Change(3, "a", Dist("constant", value=500.0))
    w = _world(changes=[ch])
    a, b = w.group_ids("a"), w.group_ids("b")
    for day in (1, 2):
        assert w.advance_to(day) == []
        v, _ = w.values(np.arange(w.n))
        assert (v[a] == 100.0).all() and (v[b] == 200.0).all(), day
    assert w.advance_to(3) == [ch]
    v, _ = w.values(np.arange(w.n))
    assert (v[a] == 500.0).all() and (v[b] == 200.0).all()
    for day in (4, 7):
        assert w.advance_to(day) == []  # applied once
        v, _ = w.values(np.arange(w.n))
        assert (v[a] == 500.0).all() and (v[b] == 200.0).all()


def test_change_applies_when_its_round_is_skipped():
    ch = Change(3, "b", Dist("constant", value=50.0))
    w = _world(changes=[ch])
    w.advance_to(1)
    assert w.advance_to(5) == [ch]
    v, _ = w.values(np.arange(w.n))
    assert (v[w.group_ids("b")] == 50.0).all() and (v[w.group_ids("a")] == 100.0).all()


def test_world_values_require_the_current_round():
    w = _world()
    w.advance_to(2)
    with pytest.raises(ValueError):
        w.values(np.arange(10), day=1)
    with pytest.raises(ValueError):
        w.advance_to(1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_change_fraction_hits_a_share_of_the_group(seed):
    n, frac = 40_000, 0.25
    ch = Change(2, "a", Dist("constant", value=999.0), fraction=frac)
    w = _world(n=n, changes=[ch], seed=seed)
    a, b = w.group_ids("a"), w.group_ids("b")
    w.advance_to(2)
    v, _ = w.values(np.arange(n))
    hit = v[a] == 999.0
    assert ((v[a] == 999.0) | (v[a] == 100.0)).all()
    assert (v[b] == 200.0).all()  # the other group is untouched
    m = a.size
    se = math.sqrt(m * frac * (1 - frac))
    assert abs(hit.sum() - frac * m) <= 4 * se, (hit.sum(), frac * m, se)
    # spread over the group, not a block of it
    half = m // 2
    assert abs(hit[:half].sum() - frac * half) <= 4 * math.sqrt(half * frac * (1 - frac))


def test_change_jitter_only_keeps_levels():
    ch = Change(2, "a", None, jitter_sd=50.0)
    groups = [Group("a", 0.5, Dist("normal", mean=1000.0, sd=10.0)), Group("b", 0.5, Dist("constant", value=1.0))]
    w = _world(n=2000, changes=[ch], groups=groups)
    levels = w.levels.copy()
    w.advance_to(1)
    v1 = w.values(np.arange(w.n))[0].copy()
    np.testing.assert_array_equal(v1, levels)  # no jitter yet
    w.advance_to(2)
    np.testing.assert_array_equal(w.levels, levels)
    a = w.group_ids("a")
    assert (w.sds[a] == 50.0).all() and (w.sds[w.group_ids("b")] == 0.0).all()
    v2 = w.values(np.arange(w.n))[0]
    assert np.std(v2[a] - levels[a]) == pytest.approx(50.0, rel=0.15)


@pytest.mark.parametrize("jitter", [0.0, 40.0])
def test_values_clipped_and_counted(jitter):
    m, n, seed = 100.0, 20_000, 11
    groups = [Group("low", 0.5, Dist("normal", mean=10.0, sd=30.0), jitter),
              Group("high", 0.5, Dist("uniform", low=50.0, high=150.0), jitter)]
    w = _world(n=n, groups=groups, max_value=m, seed=seed)
    w.advance_to(4)
    ids = np.arange(n)
    v, clipped = w.values(ids)
    assert v.min() >= 0.0 and v.max() <= m
    # recompute the unclipped values from the same keyed stream and count directly
    noise = keyed.normal(stream_key(seed, Purpose.JITTER, 4), ids)
    raw = w.levels + w.sds * noise
    direct = int(((raw < 0) | (raw > m)).sum())
    assert clipped == direct
    assert 1000 < direct < n - 1000  # both ends clip a fair number (the test means something)
    assert ((raw < 0) == (v == 0.0))[raw != 0].all()
    assert ((raw > m) == (v == m))[raw != m].all()
    np.testing.assert_allclose(v, np.clip(raw, 0.0, m), rtol=0, atol=1e-9)
    # a subset is served from the same day's values, with the population's clip count
    sub = np.array([5, 17, 12_345])
    vs, c2 = w.values(sub)
    np.testing.assert_array_equal(vs, v[sub])
    assert c2 == clipped


def test_jitter_zero_gives_the_level_exactly():
    groups = [Group("a", 0.5, Dist("normal", mean=5000.0, sd=300.0), 0.0),
              Group("b", 0.5, Dist("uniform", low=10.0, high=20.0), 0.0)]
    w = _world(n=5000, groups=groups)
    assert len(np.unique(w.levels)) > 4000  # levels vary between devices
    for day in (1, 2, 9):
        w.advance_to(day)
        v, clipped = w.values(np.arange(w.n))
        np.testing.assert_array_equal(v, w.levels)
        assert clipped == 0


def test_jitter_varies_between_rounds():
    groups = [Group("a", 1.0, Dist("constant", value=5000.0), 100.0)]
    w = _world(n=5000, groups=groups)
    w.advance_to(1)
    v1 = w.values(np.arange(w.n))[0].copy()
    w.advance_to(2)
    v2 = w.values(np.arange(w.n))[0]
    assert not np.array_equal(v1, v2)
    assert np.std(v1 - 5000.0) == pytest.approx(100.0, rel=0.1)


@pytest.mark.parametrize("apps", [None, (2.0, 1.0, 1.0)])
def test_a_span_sized_world_holds_and_computes_exactly_its_span_of_the_whole_world(apps):
    """A shard's world (``span``) holds hi - lo devices and gives them the values, clipping, churn and app splits
    the whole world gives them, across changes that hit a keyed fraction of a group and a data set counter."""
    pos = np.array([1.0, 2.0, 3.0, 50.0, 400.0])
    groups = [Group("a", 0.5, Dist("normal", mean=100.0, sd=40.0), jitter_sd=30.0, apps=apps, joins=2),
              Group("b", 0.3, Dist("data", data=pos), apps=apps, leaves=4),
              Group("c", 0.2, Dist("uniform", low=0.0, high=300.0), jitter_sd=80.0, apps=apps)]
    changes = [Change(2, "a", Dist("constant", value=250.0), fraction=0.3),
               Change(3, "c", Dist("data", data=pos), jitter_sd=5.0)]
    whole = World(9, 3000, groups, changes, 260.0)
    spans = [(0, 1000), (1000, 2400), (2400, 3000), (1400, 1401), (700, 700)]
    parts = [World(9, 3000, groups, changes, 260.0, span=s) for s in spans]
    for day in range(1, 6):
        whole.advance_to(day)
        v, clipped = whole.values(np.arange(3000))
        assert clipped > 0
        counts = []
        for (lo, hi), part in zip(spans, parts):
            assert part.levels.size == hi - lo and part.sds.size == hi - lo
            part.advance_to(day)
            ids = np.arange(lo, hi)
            got, k = part.values(ids)
            counts.append(k)
            np.testing.assert_array_equal(got, v[lo:hi])
            np.testing.assert_array_equal(part.values(ids[::-1])[0], v[lo:hi][::-1])  # any ids, not only a slice
            np.testing.assert_array_equal(part.present(ids), whole.present(ids))
        assert sum(counts[:3]) == clipped  # the spans that partition the population: their clipping adds up
    with pytest.raises(ValueError, match="outside the population"):
        World(9, 3000, groups, changes, 260.0, span=(10, 3001))


def test_levels_drawn_in_chunks_are_the_levels_drawn_at_once(monkeypatch):
    """A world draws its levels a chunk of devices at a time (bounded temporaries at 100M devices): keyed draws
    make every chunking give the same levels, in a span world too."""
    import agents.world as world_module

    groups = [Group("a", 0.55, Dist("normal", mean=100.0, sd=40.0, truncate=True)),
              Group("b", 0.45, Dist("uniform", low=0.0, high=300.0), jitter_sd=3.0)]
    whole = World(5, 1000, groups, [], 260.0).levels.copy()
    monkeypatch.setattr(world_module, "_CHUNK", 7)
    np.testing.assert_array_equal(World(5, 1000, groups, [], 260.0).levels, whole)
    np.testing.assert_array_equal(World(5, 1000, groups, [], 260.0, span=(503, 777)).levels, whole[503:777])


def test_a_span_world_refuses_devices_it_does_not_hold():
    """A shard's world answers for its own span only: ids of another shard's devices are an error, not the values
    of whichever devices sit at those positions."""
    groups = [Group("a", 1.0, Dist("uniform", low=0.0, high=300.0), leaves=5)]
    part = World(4, 1000, groups, [], 260.0, span=(100, 200))
    part.advance_to(1)
    assert part.values(np.arange(100, 200))[0].size == 100 and part.totals(150, 200)[0].size == 50
    for bad in (np.arange(50, 53), np.arange(190, 210), np.array([150, 99])):
        with pytest.raises(IndexError, match=r"outside this world's span \[100, 200\)"):
            part.values(bad)
        with pytest.raises(IndexError, match="outside this world's span"):
            part.present(bad)
    with pytest.raises(IndexError, match="outside this world's span"):
        part.totals(150, 250)


@pytest.mark.parametrize("name, content, says", [
    ("cut.txt.gz", "gzip-truncated", "Compressed file ended"),
    ("bad.txt.gz", b"\x1f\x8b\x08\x00garbagegarbage", "is not one number per line"),
    ("two.txt", b"1 2\n3 4\n", "must hold one number per line, not 2 columns"),
    ("one-line.txt", b"1 2\n", "must hold one number per line, not 2 columns"),
    ("empty.txt", b"# nothing\n\n", "is empty: a data set needs one number per line"),
    ("folder", None, "is a directory, not a data file"),
    ("neg.txt", b"1\n-2\n", "must hold finite non-negative numbers"),
])
def test_a_bad_data_file_is_one_line_naming_it(tmp_path, recwarn, name, content, says):
    """A data set that is damaged (a cut or corrupt .gz), has two numbers a line (which used to pass and crash
    the run's kernel), or is empty is a ScenarioError naming the field and file, with no warning before it."""
    import gzip

    path = tmp_path / name
    numbers = "".join(f"{i}\n" for i in range(1, 1001)).encode()
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(gzip.compress(numbers)[:200] if content == "gzip-truncated" else content)
    counter = f'population.groups.0.counter={{dist="data", path="{path}"}}'
    with pytest.raises(ScenarioError, match=r"^population\.groups\[0\]\.counter\.path: ") as exc:
        load("quickstart", [counter])
    assert says in str(exc.value) and "\n" not in str(exc.value)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_set_takes_a_key_as_error_messages_write_it() -> None:
    """An error names `population.groups[0].counter.sd`; --set accepts that spelling as well as the dotted one."""
    from scenarios import schema as sch

    with pytest.raises(sch.ScenarioError, match=r"population\.groups\[0\]\.counter\.sd: must be >= 0"):
        sch.load("quickstart", ["population.groups.0.counter.sd=-1"])
    a = sch.load("quickstart", ["population.groups[0].counter.sd=123"])
    b = sch.load("quickstart", ["population.groups.0.counter.sd=123"])
    assert a.raw == b.raw and a.raw["population"]["groups"][0]["counter"]["sd"] == 123


@pytest.mark.parametrize("name, sets, error", [
    ("thresh_stable", ["protocol.epsilon=1001"], r"^protocol\.epsilon: must be a number in \[1e-06, 1000\]"),
    ("thresh_stable", ["protocol.a=11"], r"^protocol\.a: must be a number in \[1e-06, 10\]"),
    ("thresh_stable", ["protocol.b=1e-7"], r"^protocol\.b: must be a number in \[1e-06, 10\]"),
    ("tops_pos", ["protocol.max_value=1e15"], r"^protocol\.threshold_step: 1 \(the default\) gives 1,000,000,000,000,001 candidates"),
    ("topl_pos", ["protocol.threshold_epsilon=12"], r"^protocol\.threshold_epsilon: must be a number in \[1e-06, 10\]"),
])
def test_a_parameter_beyond_what_doubles_compute_is_one_line_naming_it(name, sets, error):
    """Totals (THRESH and its baselines divide them) may reach 1000, but every mechanism's own epsilon stays
    in [1e-6, 10]; ToPS's default candidate step cannot cover a max_value of 1e15."""
    load(name)  # valid as shipped
    with pytest.raises(ScenarioError, match=error):
        load(name, sets)


def test_each_epochs_share_of_a_total_epsilon_is_in_range():
    """epochrr spends its total evenly over the epochs: 1e-5 over 364 epochs is 2.7e-8 an epoch, below 1e-6."""
    data = {**load("thresh_stable").raw, "protocol": {"name": "epochrr", "epsilon": 1e-5, "epoch_length": 1}}
    with pytest.raises(ScenarioError, match=r"^protocol\.epsilon: 1e-05 over 364 epochs is 2\.75e-08 an epoch, outside \[1e-06, 10\]$"):
        parse(data)
    parse({**data, "protocol": {"name": "epochrr", "epsilon": 1e-3, "epoch_length": 1}})  # 2.7e-6 an epoch: fine


def test_numbers_of_thousands_of_digits_are_one_line(tmp_path):
    """TOML and JSON read integers of any size, but Python refuses to parse one of more than 4,300 digits with
    a ValueError of its own (neither decode error): in a file or a --set value it is one line."""
    huge = "9" * 5000
    for name, text in (("s.toml", f"name = 'x'\nseed = {huge}\n"), ("s.json", f'{{"name": "x", "seed": {huge}}}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ScenarioError, match=r"holds a number of thousands of digits$"):
            load(str(tmp_path / name))
    with pytest.raises(ScenarioError, match=r"^--set value 9{40}\.\.\.: a number of thousands of digits$"):
        load("quickstart", [f"seed={huge}"])


def test_app_weights_are_bounded():
    """Weights of 1e308 overflowed their sum, and the light group's counters became 0 with only a warning."""
    with pytest.raises(ScenarioError, match=r"^population\.groups\[0\]\.apps: must be an array of 1 to 64 "
                                            r"positive weights of at most 1e15"):
        load("apps_multi", ["population.groups.0.apps=[1e308, 1e308, 1e308]"])


def test_cohorts_whose_reports_pass_the_wire_limit_are_made_smaller():
    """BinFlip over 65,536 buckets sends 65,536 bits a device: a cohort of 600 was one message of 39M values,
    past the wire's 2^25, and the run died mid-round. The cohort size does not change results, so the run
    uses cohorts that fit, and says so."""
    sets = ["protocol.name='binflip'", "protocol.buckets=65536", "protocol.bits=65536", "protocol.max_value=65536"]
    sc = load("usage_histogram", sets)
    assert sc.simulation.cohort_size == 512
    assert any(w.startswith("simulation.cohort_size: 20,000 devices x 65,536 values") for w in sc.warnings)
    assert load("usage_histogram").simulation.cohort_size == 20_000  # 24 buckets, 2 bits: as given


def test_a_data_file_is_read_up_to_its_size_limit(tmp_path, monkeypatch):
    """A 6 MB .gz of one 1.5 GB line filled the memory: the text is read up to MAX_DATA_BYTES, then refused."""
    import gzip

    from scenarios import schema as sch

    monkeypatch.setattr(sch, "MAX_DATA_BYTES", 1000)
    monkeypatch.setattr(sch, "_DATA_CACHE", {})
    with gzip.open(tmp_path / "big.txt.gz", "wt") as f:
        f.write("7" * 1001)
    with pytest.raises(ScenarioError, match=r"^x: '.*big\.txt\.gz' holds more than 1,000 bytes of text$"):
        sch.load_data(str(tmp_path / "big.txt.gz"), "x")
    (tmp_path / "ok.txt").write_text("1\n2\n" * 250)  # exactly 1000 bytes
    assert sch.load_data(str(tmp_path / "ok.txt"), "x").size == 500
