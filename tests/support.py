"""Scenario builders shared by several test modules (tests/conftest.py also offers them as fixtures).

A test module imports what it needs at collection time (parametrize ids) from here, never from another test
module: a test module imported by another would be imported twice and its tests' setup run twice.
"""

from __future__ import annotations

import functools
from typing import Any

from protocols.baselines import KFlipDevices, KFlipParams
from protocols.guard import Guarantee
from protocols.onebit import OneBitParams
from scenarios import schema

__all__ = ["PROTOCOL_TABLES", "live_scenarios", "protocol_scenario"]


def protocol_scenario(protocol: str, **overrides: object) -> schema.Scenario:
    """A small two-group scenario with a change at round 4, loss and latency jitter that split batches and
    make some reports late; ``overrides`` are dotted keys with TOML values (as ``--set``)."""
    data = {
        "name": "determinism", "seed": 7, "rounds": 6,
        "population": {"devices": 1200, "groups": [
            {"name": "a", "share": 0.6, "counter": {"dist": "normal", "mean": 30, "sd": 10},
             "jitter": {"dist": "normal", "sd": 4}},
            {"name": "b", "share": 0.4, "counter": {"dist": "uniform", "low": 40, "high": 100}},
        ]},
        "changes": [{"round": 4, "group": "b", "fraction": 0.5, "counter": {"dist": "constant", "value": 5}}],
        "protocol": {"name": protocol, "epsilon": 1.0, "max_value": 100, "gamma": 0.1,
                     **({"granularity": 10} if protocol == "1bitrrpm" else {})},
        # loss and latency jitter so that fates split batches; some reports arrive after the deadline
        "network": {"loss": 0.05, "latency": 0.1, "jitter": 1.0, "deadline": 3.0},
        "simulation": {"cohort_size": 10_000, "round_seconds": 100},
    }
    for key, value in overrides.items():
        data = schema.apply_overrides(data, [f"{key}={value}"])
    return schema.parse(data)


#: [protocol] tables of the histogram and baseline protocols, for :func:`protocol_scenario`'s world
PROTOCOL_TABLES = {
    "dbitflippm-d1": {"name": "dbitflippm", "epsilon": 1.0, "max_value": 100, "buckets": 8, "bits": 1},
    "dbitflip-d3": {"name": "dbitflip", "epsilon": 1.0, "max_value": 100, "buckets": 8, "bits": 3, "gamma": 0.1},
    "binflip": {"name": "binflip", "epsilon": 1.0, "max_value": 100, "buckets": 6},
    "kflip": {"name": "kflip", "epsilon": 1.0, "max_value": 100, "buckets": 8},
    "laplace": {"name": "laplace", "epsilon": 1.0, "max_value": 100},
}


@functools.cache
def live_scenarios() -> dict[str, schema.Scenario]:
    """One small lossless scenario (400 devices, cohorts of 100) for every protocol, by name: what the live
    runtime is checked against the simulator with (tests/test_live.py, tests/test_hostile.py). Built once."""
    base = {"simulation.cohort_size": 100, "network.loss": 0, "network.jitter": 0, "population.devices": 400}
    out = {p: protocol_scenario(p, **base) for p in ("1bitrrpm", "1bitmean")}
    for name, table in PROTOCOL_TABLES.items():
        out[name] = schema.parse({**protocol_scenario("1bitmean", **base).raw, "protocol": table})
    out["thresh"] = schema.load("thresh_stable", ["population.devices=400", "rounds=28", "simulation.cohort_size=100"])
    out["topl"] = schema.load("topl_pos", ["population.devices=400", "rounds=6", "protocol.rethreshold_every=3",
                                           "simulation.cohort_size=100"])
    out["tops"] = schema.load("tops_pos", ["population.devices=400", "rounds=6", "simulation.cohort_size=100"])
    out["1bitmulti"] = schema.load("apps_multi", ["population.devices=400", "rounds=3", "simulation.cohort_size=100"])
    return out


class UnderstatedKFlip(KFlipParams):
    """k-ary randomized response that claims half the guarantee its devices spend (a broken protocol for the
    tests: ``ldpsim run`` must say so and exit 1). Named in a scenario as ``tests.support:UnderstatedKFlip``."""

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("understated", table, ctx)  # the short name messages carry

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epsilon / 2, f"R x eps / 2 = {horizon} x {self.epsilon:g} / 2 (understated)")


class ShareOneBit(OneBitParams):
    """1BitMean under a plugin's own words for what it estimates (``estimate_label``): its error lines and sweep
    axes must name that, not "mean counter" in the scenario's unit. ``tests.support:ShareOneBit``."""

    estimate_label = "share of the day in use"

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("1bitmean", table, ctx)


class PlainKFlip:
    """k-ary randomized response behind a parameter class that is not a dataclass (the README asks for none):
    it delegates to the shipped KFlipParams. Named in a scenario as ``tests.support:PlainKFlip``."""

    kind = "histogram"
    report_family = None

    def __init__(self, inner: KFlipParams) -> None:
        self._inner = inner
        self.name, self.epsilon, self.max_value, self.buckets = "plainkflip", inner.epsilon, inner.max_value, inner.buckets

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return cls(KFlipParams.from_table("kflip", table, ctx))

    @property
    def round_epsilon(self) -> float:
        return self._inner.round_epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return self._inner.guarantee(horizon)

    def make_devices(self, seed, ids, limits=None):  # type: ignore[no-untyped-def]
        return self._inner.make_devices(seed, ids, limits)

    def make_collector(self, n_devices: int):  # type: ignore[no-untyped-def]
        return self._inner.make_collector(n_devices)

    def truth(self, values):  # type: ignore[no-untyped-def]
        return self._inner.truth(values)

    def estimate_sd(self, values, reports):  # type: ignore[no-untyped-def]
        return self._inner.estimate_sd(values, reports)


class MislabelledKFlip(KFlipParams):
    """k-ary randomized response declaring the one-bit report family, whose report column (``bit``) it does not
    have: the attack metrics must say so rather than fail the run. ``tests.support:MislabelledKFlip``."""

    report_family = "onebit"

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("mislabelled", table, ctx)


class NoKindKFlip(PlainKFlip):
    """PlainKFlip without ``kind`` (it is required): a one-line error at load. ``tests.support:NoKindKFlip``."""

    @property  # type: ignore[override]
    def kind(self) -> str:
        raise AttributeError("kind")


class NoEstimateKFlip(KFlipParams):
    """k-ary randomized response whose collector side has no ``estimate``: a one-line error when a round closes.
    ``tests.support:NoEstimateKFlip``."""

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("noestimate", table, ctx)

    def make_collector(self, n_devices: int):  # type: ignore[no-untyped-def]
        from protocols.collecting import ReportCollector

        collector = super().make_collector(n_devices)
        collector.estimate = functools.partial(ReportCollector.estimate, collector)  # the base class's: none
        return collector


class Uint16KFlip(KFlipParams):
    """k-ary randomized response whose collector declares a uint16 report column, a dtype the wire does not
    carry: a one-line error, not a traceback from the encoder. ``tests.support:Uint16KFlip``."""

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("uint16kflip", table, ctx)

    def make_collector(self, n_devices: int):  # type: ignore[no-untyped-def]
        import numpy as np

        from protocols.collecting import Column

        collector = super().make_collector(n_devices)
        collector.columns = (Column("y", np.uint16, high=self.buckets - 1),)
        return collector


class _CastKFlipDevices(KFlipDevices):
    """KFlip's device side sending its report column as ``cast`` instead of what its collector declares."""

    cast: Any = None

    def report(self, round_, values):  # type: ignore[no-untyped-def]
        return {"y": super().report(round_, values)["y"].astype(self.cast)}


class _CastKFlip(KFlipParams):
    cast: Any = None

    def make_devices(self, seed, device_ids, limits=None):  # type: ignore[no-untyped-def]
        devices = _CastKFlipDevices(self, seed, device_ids, limits)
        devices.cast = self.cast
        return devices


class Uint16DevicesKFlip(_CastKFlip):
    """k-ary randomized response whose device side sends its column as uint16, a dtype the wire does not carry
    (its collector declares u1): a one-line error naming the column, not the encoder's ValueError.
    ``tests.support:Uint16DevicesKFlip``."""

    cast = "uint16"

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("uint16deviceskflip", table, ctx)


class Float32DevicesKFlip(_CastKFlip):
    """k-ary randomized response whose device side sends its column as float32 while its collector declares
    u1: the wire carries it and the collector rejects every batch, which the run must say.
    ``tests.support:Float32DevicesKFlip``."""

    cast = "float32"

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("float32deviceskflip", table, ctx)


class _RaisingKFlipDevices(KFlipDevices):
    """KFlip's device side failing in round 3, as a plugin's own code might."""

    def report(self, round_, values):  # type: ignore[no-untyped-def]
        if round_ == 3:
            raise RuntimeError("plugin device side failed on purpose")
        return super().report(round_, values)


class RaisingDevicesKFlip(KFlipParams):
    """k-ary randomized response whose device side raises in round 3: the command's one line names this file,
    the function and the round, not a traceback through ldpsim. ``tests.support:RaisingDevicesKFlip``."""

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("raisingdeviceskflip", table, ctx)

    def make_devices(self, seed, device_ids, limits=None):  # type: ignore[no-untyped-def]
        return _RaisingKFlipDevices(self, seed, device_ids, limits)


class RaisingEstimateKFlip(KFlipParams):
    """k-ary randomized response whose collector's estimate raises. ``tests.support:RaisingEstimateKFlip``."""

    @classmethod
    def from_table(cls, name, table, ctx):  # type: ignore[no-untyped-def]
        return super().from_table("raisingestimatekflip", table, ctx)

    def make_collector(self, n_devices: int):  # type: ignore[no-untyped-def]
        collector = super().make_collector(n_devices)

        def estimate(columns):  # type: ignore[no-untyped-def]
            raise ZeroDivisionError("plugin estimate failed on purpose")

        collector.estimate = estimate
        return collector
