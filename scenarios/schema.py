"""Scenario files (TOML): loading, ``--set`` overrides, and strict validation with errors that name the field.

A scenario says what happens (docs/design.md section 7): the population's groups and counter models, scripted
behavior changes, the protocol and its parameters, network conditions and the seed. Unknown keys, wrong
types and inconsistent values are errors; nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import gzip
import io
import json
import math
import re
import tomllib
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from agents import behavior as behaviors
from agents.world import Change, Dist, Group, split_shares
from collector.network import NetworkParams
from protocols import wire
from protocols.base import KINDS, ProtocolParams
from protocols.guard import Limits
from protocols import registry
from protocols.config import ConfigError, Context, Table

SHIPPED = Path(__file__).resolve().parent
#: collector behaviors a scenario can ask for: the honest collector, and adversaries for audits (the devices'
#: guarantees must hold against each). Those in PROTOCOL_BEHAVIORS are implemented by a protocol's collector
#: side and allowed only where its parameter class lists them in ``collector_behaviors``; the others apply to
#: every protocol.
BEHAVIORS = ("honest", "always_update", "beyond_horizon", "replay", "far_future", "bad_threshold")
PROTOCOL_BEHAVIORS = ("always_update",)
PROTOCOLS = registry.builtin_names()


class ScenarioError(ConfigError):
    """A scenario that cannot run; the message starts with the offending field."""


@dataclass(frozen=True)
class Simulation:
    cohort_size: int = 10_000
    round_seconds: float = 86_400.0
    workers: int = 0  # worker processes answering for the cohorts (scenarios/parallel.py); 0: auto
    threads: int = 0  # threads answering for the cohorts in a run's own process (agents/shard.py); 0: auto


#: [analysis] attacks: on by default when devices x rounds x report width (the numbers in one device's report:
#: dBitFlip's d bits, 1 for most) is at most this (e.g. 100,000 devices x 100 rounds of one number, or 200,000 x
#: 50); off above it, where an explicit ``attacks = true`` still turns them on. The attacks keep every device's
#: true value per round (8 bytes a device-round) and decode the transcript into arrays of that many numbers
#: (BinFlip over 65,536 buckets: 2,000 devices x 2 rounds took 46 s and 11 GB) (scenarios/attacks.py).
ATTACKS_AUTO_LIMIT = 10_000_000


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    rounds: int
    devices: int
    groups: list[Group]
    changes: list[Change]
    protocol: ProtocolParams
    network: NetworkParams
    simulation: Simulation
    description: str = ""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the validated input, for the run directory
    warnings: list[str] = field(default_factory=list)  # valid but probably not what was meant
    budget: float | None = None  # [privacy] budget: total epsilon per device, enforced by the devices
    behavior: str = "honest"  # [collector] behavior
    attacks: bool = False  # [analysis] attacks: attack metrics in the run directory (scenarios/attacks.py)
    attacks_why: str = ""  # why they are on or off (explicit, or the size rule)
    unit: str | None = None  # [population] unit: what the counters count ("seconds"), for labels; None: unsaid

    @property
    def collections(self) -> int:
        """Collection rounds of the run: rounds, or epochs for protocols that collect once per epoch."""
        return self.rounds // int(getattr(self.protocol, "epoch_length", 1))

    @property
    def as_run(self) -> dict[str, Any]:
        """The scenario as run, for scenario.json: the validated input with ``[analysis] attacks`` resolved (the
        size rule's answer when the input left it out), so the file runs again exactly as this run did."""
        run = {**self.raw, "analysis": {**self.raw.get("analysis", {}), "attacks": self.attacks}}
        if any(g.behavior is not None for g in self.groups):  # behaviors by name ("module:qualname"), params
            run["population"] = {**run["population"], "groups": [
                {**rg, **dict(zip(("behavior", "params"), g.behavior.record()))} if g.behavior is not None else rg
                for rg, g in zip(run["population"]["groups"], self.groups)]}
        return run

    @property
    def limits(self) -> Limits:
        """What every device enforces: the horizon (last collection round) and the budget."""
        return Limits(horizon=self.collections, budget=self.budget)


# ----------------------------------------------------------------------------------------------- helpers
class _Table(Table):
    """A scenario table (protocols.config.Table) whose errors are ScenarioErrors."""

    def __init__(self, data: Any, where: str, error: type[ConfigError] | None = None) -> None:
        super().__init__(data, where, error or ScenarioError)


def _dist(t: Table) -> Dist:
    kind = t.get("dist", str, check=lambda v: v in ("constant", "uniform", "normal", "bernoulli", "data"),
                 what='"constant", "uniform", "normal", "bernoulli" or "data"')
    if kind == "data":
        path = t.get("path", str)
        d = Dist("data", data=load_data(path, t.path("path")), path=path)
    elif kind == "constant":
        d = Dist("constant", value=t.get("value", float))
    elif kind == "bernoulli":
        d = Dist("bernoulli", value=t.get("p", float, check=lambda v: 0 <= v <= 1, what="a probability in [0, 1]"))
    elif kind == "uniform":
        low, high = t.get("low", float), t.get("high", float)
        if high < low:
            raise ScenarioError(f"{t.path('high')}: must be >= low ({low}), got {high}")
        d = Dist("uniform", low=low, high=high)
    else:
        d = Dist("normal", mean=t.get("mean", float), sd=t.get("sd", float, check=lambda v: v >= 0, what=">= 0"),
                 truncate=t.get("truncate", bool, False))
    t.done()
    return d


DATA_DIR = SHIPPED / "data"
_DATA_CACHE: dict[Path, np.ndarray] = {}
BASE_DIR: list[Path] = []  # the directory of the scenario being parsed (for relative data paths)


#: the most text a data file may hold once decompressed (the shipped ones: 1-5 MB)
MAX_DATA_BYTES = 256 << 20


def load_data(spec: str, field_name: str) -> np.ndarray:
    """An empirical data set: one non-negative number per line, optionally gzip-compressed. Relative paths
    are looked up beside the scenario file, then in the shipped scenarios/data/."""
    candidates = [Path(spec)] if Path(spec).is_absolute() else [
        *(b / spec for b in BASE_DIR[-1:]), Path(spec), DATA_DIR / spec, DATA_DIR / Path(spec).name]
    path = next((c.resolve() for c in candidates if c.is_file()), None)
    if path is None:
        folder = next((c for c in candidates if c.is_dir()), None)
        if folder is not None:
            raise ScenarioError(f"{field_name}: {spec!r} is a directory, not a data file ({folder})")
        raise ScenarioError(f"{field_name}: no data file {spec!r} (looked beside the scenario and in {DATA_DIR})")
    if path not in _DATA_CACHE:
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
                raw = f.read(MAX_DATA_BYTES + 1)  # a 6 MB .gz of one 1.5 GB line filled the memory
            if len(raw) > MAX_DATA_BYTES:
                raise ScenarioError(f"{field_name}: {spec!r} holds more than {MAX_DATA_BYTES:,} bytes of text")
            with warnings.catch_warnings():  # an empty file: numpy's warning would come before our one line
                warnings.simplefilter("ignore", UserWarning)
                data = np.loadtxt(io.BytesIO(raw), dtype=np.float64, ndmin=2)  # (lines, numbers a line)
        except ScenarioError:  # a ValueError, but already the one line
            raise
        except (ValueError, OSError, EOFError, zlib.error) as exc:  # EOFError, zlib.error: a damaged .gz
            # the line number, not numpy's message: that quotes the file's text (a path to /proc/self/environ
            # in a scenario from elsewhere would print the environment)
            row = re.search(r"at row (\d+)", str(exc))
            if row:
                why = f" (line {int(row.group(1)) + 1})"
            elif isinstance(exc, ValueError):
                why = f" ({type(exc).__name__})"
            else:  # a damaged .gz or an unreadable file: its message quotes no content
                why = f": {exc}"[:200]
            raise ScenarioError(f"{field_name}: {spec!r} is not one number per line{why}") from None
        if data.shape[1] > 1:
            raise ScenarioError(f"{field_name}: {spec!r} must hold one number per line, not {data.shape[1]} columns")
        data = data.ravel()
        if data.size == 0:
            raise ScenarioError(f"{field_name}: {spec!r} is empty: a data set needs one number per line")
        if not np.all(np.isfinite(data)) or data.min() < 0:
            raise ScenarioError(f"{field_name}: {spec!r} must hold finite non-negative numbers, one per line")
        data.setflags(write=False)
        _DATA_CACHE[path] = data
    return _DATA_CACHE[path]


def _jitter(t: Table) -> float:
    kind = t.get("dist", str, check=lambda v: v in ("normal", "none"), what='"normal" or "none"')
    sd = t.get("sd", float, check=lambda v: v >= 0, what=">= 0") if kind == "normal" else 0.0
    t.done()
    return sd


def _positive(v: float) -> bool:
    return v > 0


def _protocol(pt: Table, ctx: Context) -> ProtocolParams:
    """The [protocol] table: ``name`` picks the registered protocol (protocols/registry.py), whose parameter
    class parses and checks the rest of the table itself."""
    name = pt.get("name", str, check=lambda v: len(v) > 0, what="a protocol name")
    try:
        entry = registry.lookup(name)
    except registry.RegistryError as exc:
        raise ScenarioError(str(exc)) from None
    try:
        params = entry.params.from_table(name, pt, ctx)
    except ScenarioError:
        raise
    except ValueError as exc:  # the parameter class's own consistency checks
        raise ScenarioError(f"protocol: {exc}") from None
    wire_name = getattr(params, "name", None)
    if not isinstance(wire_name, str) or not wire.valid_name(wire_name):
        # every message carries it: a name the wire refuses left a run in which no device ever reported
        raise ScenarioError(f"protocol.name: {name!r} made a parameter object named {wire_name!r}, which messages "
                            f"cannot carry (a lowercase letter or digit, then up to 63 of a-z 0-9 _ -): a "
                            f"module:Class protocol's from_table must return its short name, not the class path")
    for attr in ("epsilon", "max_value", "kind", "round_epsilon"):  # what every runtime reads of it
        if not hasattr(params, attr):
            raise ScenarioError(f"protocol.name: {name!r} made a parameter object without {attr!r} (README: Writing "
                                f"a protocol lists what a parameter class describes)")
    if params.kind not in KINDS:
        raise ScenarioError(f"protocol.name: {name!r} made a parameter object of kind {params.kind!r}, not one of "
                            f"{', '.join(KINDS)}")
    unread = sorted(set(pt.data) - pt.used)
    if unread and not difflib.get_close_matches(unread[0], sorted(pt.used), n=1, cutoff=0.75):
        # not a misspelling (done() names those): most often another protocol's key left by --set protocol.name
        raise ScenarioError(f"protocol.{unread[0]}: unknown key for {name} (it reads {', '.join(sorted(pt.used))}); "
                            f"to switch a scenario's protocol from the command line, set the table whole: "
                            f"--set 'protocol = {{name = \"{name}\", epsilon = 1, ...}}'")
    pt.done()
    return params


def _group_behaviors(groups: list[Group], raw_groups: list[Any], changes: list[Change], seed: int,
                     round_seconds: float, max_value: float, warnings: list[str], rounds: int) -> list[Group]:
    """Each group's ``behavior`` (a built-in name, ``"module:function"``, a Python function or class, or an
    array of them) and ``params`` (a table, or an array of tables aligned with the behaviors), resolved,
    checked, and tried once on a few devices of round 1, so that a broken behavior fails here with one line
    naming the key rather than in the middle of a run (agents/behavior.py); a ``step`` after the last of
    ``rounds`` is warned about, like a [[changes]] entry."""
    out = []
    for i, (g, rg) in enumerate(zip(groups, raw_groups)):
        where = f"population.groups[{i}]"
        if "behavior" not in rg:
            if "params" in rg:
                raise ScenarioError(f"{where}.params: parameters of a behavior, but the group has no behavior")
            out.append(g)
            continue
        spec, params = rg["behavior"], rg.get("params")
        if not (isinstance(spec, str) or callable(spec) or isinstance(spec, (list, tuple)) and spec
                and all(isinstance(x, str) or callable(x) for x in spec)):
            raise ScenarioError(f'{where}.behavior: must be a name ("weekly", "module:function"), a function, or '
                                f"an array of them, got {spec!r}")
        try:
            bh = behaviors.compose(spec, params, round_seconds)
        except behaviors.BehaviorError as exc:
            key = exc.key
            if isinstance(spec, (list, tuple)) and key.startswith("["):
                # "[k].name" -> params[k].name; "[k]" -> behavior[k]
                k, _, rest = key.partition("]")
                key = f"params{k}].{rest.lstrip('.')}" if rest.lstrip(".") else f"behavior{k}]"
            elif key and key != "params":
                key = f"params.{key}"
            raise ScenarioError(f"{where}.{key or 'behavior'}: {exc.message}") from None
        if g.counter.kind == "bernoulli" or any(c.group == g.name and c.counter is not None
                                                and c.counter.kind == "bernoulli" for c in changes):
            raise ScenarioError(f"{where}.behavior: behaviors shape counter values; this group's counter is "
                                "bernoulli (private bits)")
        ids = np.arange(3, dtype=np.int64)
        base = np.array([0.25, 0.5, 0.75]) * max_value
        try:  # one trial round on a few devices, with a fresh copy, twice: the same answer, or it is not repeatable
            first, again = (bh.bind(seed, i, max_value).apply(1, ids, base.copy()) for _ in range(2))
        except behaviors.BehaviorError as exc:
            raise ScenarioError(f"{where}.behavior: {exc.message} (a trial call on {ids.size} devices)") from None
        if not np.array_equal(first, again):
            raise ScenarioError(f"{where}.behavior: two trial calls on the same devices, round and values returned "
                                f"different values: a behavior draws its randomness from day.keys (keyed by seed, "
                                f"device and round), never from an unkeyed generator, so that a run can be repeated "
                                f"and audited")
        for position, step in enumerate(bh.steps):
            late = _step_after_last(step, round_seconds, rounds)
            if late:
                warnings.append(f"{where}.params" + (f"[{position}]" if len(bh.steps) > 1 else "") + f".{late}")
        names = [s.name for s in bh.steps]
        if any(n.startswith("__main__:") for n in names):
            warnings.append(f"{where}.behavior: {', '.join(n for n in names if n.startswith('__main__:'))} lives "
                            "in __main__: scenario.json can repeat the run only from the same script")
        out.append(dataclasses.replace(g, behavior=bh))
    return out


def _step_after_last(step: behaviors.Step, round_seconds: float, rounds: int) -> str | None:
    """The warning's words (from the parameter's name on) when ``step`` is a built-in ``step`` whose change
    comes after the last of ``rounds``; else None."""
    if step.target is not behaviors.StepChange:
        return None
    at_time = step.params.get("at_time")
    first = cast(behaviors.StepChange, step.start()).first_round(round_seconds)
    if first <= rounds:
        return None
    when = f"at_time: {float(at_time):g} s is round {first}," if at_time is not None else f"round: {first} is"
    return f"{when} after the last round ({rounds}); it will not happen"


# ----------------------------------------------------------------------------------------------- loading
def parse(data: dict[str, Any]) -> Scenario:
    """Validate a scenario given as a dict (parsed TOML)."""
    huge = _first_huge_integer(data)
    if huge:
        raise ScenarioError(f"{huge}: an integer beyond 64 bits (at most {MAX_INTEGER:,})")
    top = _Table(data, "")
    # the name becomes part of default output paths (runs/<name>-<timestamp>): no separators, no "..", no
    # control characters, not hidden
    name = top.get("name", str, check=lambda v: 0 < len(v) <= 100 and v.isprintable() and "/" not in v
                   and "\\" not in v and not v.startswith(".") and ".." not in v,
                   what="a name of 1-100 printable characters without '/', '\\', '..' or a leading '.'")
    description = top.get("description", str, "")
    seed = top.get("seed", int, 0, check=lambda v: 0 <= v < 2**63, what="an integer in [0, 2^63)")
    rounds = top.get("rounds", int, check=lambda v: 1 <= v <= 100_000, what="an integer in [1, 100000]")

    pop = top.table("population")
    devices = pop.get("devices", int, check=lambda v: 1 <= v <= 2**32 - 1, what="an integer in [1, 2^32)")
    raw_groups = pop.get("groups", list, check=lambda v: len(v) >= 1, what="a non-empty array of tables")
    unit = pop.get("unit", str, None, check=lambda v: 0 < len(v) <= 40 and v.isprintable() and v.strip() == v,
                   what="a unit of 1-40 printable characters, e.g. \"seconds\"")
    pop.done()
    groups = []
    for i, g in enumerate(raw_groups):
        t = _Table(g, f"population.groups[{i}]")
        gname = t.get("name", str, check=lambda v: len(v) > 0, what="a non-empty name")
        share = t.get("share", float, check=lambda v: 0 < v <= 1, what="a number in (0, 1]")
        counter = _dist(t.table("counter"))
        jitter = _jitter(t.table("jitter")) if "jitter" in g else 0.0
        t.used.add("jitter")
        apps = t.get("apps", list, None, check=lambda v: 1 <= len(v) <= 64 and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and 0 < w <= 1e15 for w in v),
            what="an array of 1 to 64 positive weights of at most 1e15")
        joins = t.get("joins", int, 1, check=lambda v: v >= 1, what="a round >= 1")
        leaves = t.get("leaves", int, None, check=lambda v: v > joins, what=f"a round after joins ({joins})")
        t.used.update(("behavior", "params"))  # checked with the simulation's round length (_group_behaviors)
        t.done()
        groups.append(Group(gname, share, counter, jitter, tuple(float(w) for w in apps) if apps else None,
                            joins, leaves))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise ScenarioError("population.groups: group names must be distinct")
    total = sum(g.share for g in groups)
    if abs(total - 1.0) > 1e-9:
        raise ScenarioError(f"population.groups: shares must sum to 1, they sum to {total:g}")

    changes, warnings = [], []
    change_times: dict[int, float] = {}
    for i, c in enumerate(top.get("changes", list, [])):
        t = _Table(c, f"changes[{i}]")
        at_time = t.get("at_time", float, None, check=lambda v: 0 <= v <= 1e15, what="a simulated time >= 0 (s)")
        if at_time is not None and "round" in c:
            raise ScenarioError(f"changes[{i}].at_time: give round or at_time, not both")
        rnd = t.get("round", int, 0 if at_time is not None else ..., check=lambda v: 1 <= v <= 100_000,
                    what="a round >= 1")
        if at_time is not None:
            change_times[i] = at_time  # its round once simulation.round_seconds is known
        if rnd > rounds:
            warnings.append(f"changes[{i}].round: {rnd} is after the last round ({rounds}); it will not happen")
        group = t.get("group", str, check=lambda v: v in names, what=f"one of the groups {names}")
        new_counter = _dist(t.table("counter")) if "counter" in c else None
        new_jitter = _jitter(t.table("jitter")) if "jitter" in c else None
        t.used.update(("counter", "jitter"))
        fraction = t.get("fraction", float, 1.0, check=lambda v: 0 < v <= 1, what="a number in (0, 1]")
        if new_counter is None and new_jitter is None:
            raise ScenarioError(f"changes[{i}]: needs a counter or a jitter to change")
        t.done()
        changes.append(Change(rnd, group, new_counter, new_jitter, fraction))

    ct = top.table("collector", default=None)
    behavior = ct.get("behavior", str, "honest", check=lambda v: v in BEHAVIORS, what=f"one of {list(BEHAVIORS)}")
    ct.done()
    pv = top.table("privacy", default=None)
    budget = pv.get("budget", float, None, check=_positive, what="a total epsilon > 0")
    pv.done()
    sizes = np.diff(split_shares(devices, [g.share for g in groups]))
    protocol = _protocol(top.table("protocol"), Context(rounds, devices, len(groups), int(sizes.min()), seed,
                                                        behavior))
    if behavior in PROTOCOL_BEHAVIORS and behavior not in getattr(protocol, "collector_behaviors", ()):
        raise ScenarioError(f"collector.behavior: {behavior!r} is not implemented by protocol {protocol.name!r}")
    if getattr(protocol, "collects_bits", False):
        for i, g in enumerate(groups):
            if g.counter.kind != "bernoulli":
                raise ScenarioError(f"population.groups[{i}].counter: {protocol.name} collects bits: use "
                                    f'{{ dist = "bernoulli", p = ... }}')
        for i, c in enumerate(changes):
            if c.counter is not None and c.counter.kind != "bernoulli" or c.jitter_sd:
                raise ScenarioError(f"changes[{i}]: {protocol.name} collects bits: a change sets a bernoulli "
                                    f"counter")
    counters = getattr(protocol, "counters", None)
    for i, g in enumerate(groups):
        if counters is not None and (g.apps is None or len(g.apps) != counters):
            raise ScenarioError(f"population.groups[{i}].apps: {protocol.name} needs {counters} app weights "
                                f"(protocol.counters) in every group")
        if counters is None and g.apps is not None:
            raise ScenarioError(f"population.groups[{i}].apps: protocol {protocol.name} collects one counter; "
                                f"apps are for protocols with several (protocol.counters)")
    st = top.table("simulation", default=None)
    sim = Simulation(
        cohort_size=st.get("cohort_size", int, 10_000, check=lambda v: v >= 1, what="an integer >= 1"),
        round_seconds=st.get("round_seconds", float, 86_400.0, check=lambda v: v >= 1e-3 and v * rounds <= 1e15,
                             what=f"at least 1e-3 s, with rounds ({rounds}) x round_seconds at most 1e15 s"),
        workers=st.get("workers", int, 0, check=lambda v: 0 <= v <= 1024,
                       what="an integer in [0, 1024] (0: one per core for large runs on 4+ cores)"),
        threads=st.get("threads", int, 0, check=lambda v: 0 <= v <= 1024,
                       what="an integer in [0, 1024] (0: one per core when the run is in one process)"),
    )
    st.done()
    width = int(getattr(protocol, "report_elements", 1))
    if sim.cohort_size * width > wire.MAX_ELEMENTS:  # a cohort's reports travel as one message; results do not
        # depend on the cohort size, so a smaller one changes nothing but the number of messages
        fits = max(1, wire.MAX_ELEMENTS // width)
        warnings.append(f"simulation.cohort_size: {sim.cohort_size:,} devices x {width:,} values a report exceed "
                        f"the wire limit of {wire.MAX_ELEMENTS:,} values a message: cohorts of {fits:,} instead")
        sim = dataclasses.replace(sim, cohort_size=fits)
    for i, at_time in change_times.items():  # a change at a simulated time: from the first round starting then
        rnd = behaviors.first_round_at(at_time, sim.round_seconds)
        changes[i] = dataclasses.replace(changes[i], round=rnd)
        if rnd > rounds:
            warnings.append(f"changes[{i}].at_time: {at_time:g} s is round {rnd}, after the last round ({rounds}); "
                            "it will not happen")
    groups = _group_behaviors(groups, raw_groups, changes, seed, sim.round_seconds, protocol.max_value, warnings,
                              rounds)
    nt = top.table("network", default=None)
    net = NetworkParams(
        latency=nt.get("latency", float, 0.05, check=lambda v: v >= 0, what=">= 0"),
        jitter=nt.get("jitter", float, 0.0, check=lambda v: v >= 0, what=">= 0"),
        loss=nt.get("loss", float, 0.0, check=lambda v: 0 <= v < 1, what="a number in [0, 1)"),
        deadline=nt.get("deadline", float, 3600.0, check=_positive, what="> 0"),
        downlink_loss=nt.get("downlink_loss", float, 0.0, check=lambda v: 0 <= v < 1, what="a number in [0, 1)"),
    )
    nt.done()
    if 2 * net.latency >= net.deadline:  # the request reaches a device after the latency, its report as long again
        raise ScenarioError(f"network.latency: {net.latency:g} s each way (the request, then the report) leaves no "
                            f"time before the deadline ({net.deadline:g} s)")
    if net.deadline >= sim.round_seconds:
        raise ScenarioError(f"network.deadline: {net.deadline:g} s must be shorter than "
                            f"simulation.round_seconds ({sim.round_seconds:g} s)")
    at = top.table("analysis", default=None)
    attacks = at.get("attacks", bool, None)
    at.done()
    width = max(1, int(getattr(protocol, "report_elements", 1)))
    size = devices * rounds * width
    if attacks is None:
        attacks = size <= ATTACKS_AUTO_LIMIT
        shape = "devices x rounds" + (f" x report width {width:,}" if width > 1 else "")
        attacks_why = (f"default: {shape} = {size:,} {'<=' if attacks else '>'} {ATTACKS_AUTO_LIMIT:,}"
                       + ("" if attacks else " (set analysis.attacks = true to compute them)"))
    else:
        attacks_why = f"analysis.attacks = {str(attacks).lower()}"
    top.done()
    warnings += [f"protocol: {w}" for w in getattr(protocol, "warnings", [])]
    return Scenario(name, seed, rounds, devices, groups, changes, protocol, net, sim, description, data, warnings,
                    budget, behavior, attacks, attacks_why, unit)


def _parse_value(text: str) -> Any:
    """A ``--set`` value: any TOML value (``3``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    except ValueError:  # an integer of more than 4,300 digits (Python's limit on int parsing)
        raise ScenarioError(f"--set value {text[:40]}...: a number of thousands of digits") from None


#: the largest integer a scenario may hold: every count, round, seed and weight fits in 64 bits
MAX_INTEGER = 2**63 - 1


def _first_huge_integer(data: Any, where: str = "") -> str | None:
    """The path of the first integer beyond 64 bits in parsed TOML/JSON (None if there is none): every check
    converts numbers to floats, and 10**400 does not convert."""
    if isinstance(data, int) and not isinstance(data, bool):
        return where or "scenario" if abs(data) > MAX_INTEGER else None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        found = _first_huge_integer(v, f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``KEY=VALUE`` overrides with dotted keys (``simulation.cohort_size=1``,
    ``population.groups.0.share=0.5``, or ``population.groups[0].share=0.5`` as error messages write it) to a
    copy of ``data``."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--set {item!r}: expected KEY=VALUE")
        key = re.sub(r"\[(\d+)\]", r".\1", key.strip())
        parts = key.split(".")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[:depth + 1])
            if isinstance(node, list):
                if not part.isdecimal() or int(part) >= len(node):
                    raise ScenarioError(f"--set {key}: {where} is not an index of the array")
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ScenarioError(f"--set {key}: {where} is not a table")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdecimal() or int(last) >= len(node):
                raise ScenarioError(f"--set {key}: {last} is not an index of the array")
            node[int(last)] = _parse_value(text)
        else:
            node[last] = _parse_value(text)
    return out


def resolve_path(spec: str) -> Path:
    """A scenario path, or the name of a shipped scenario (``quickstart`` -> scenarios/quickstart.toml)."""
    p = Path(spec)
    if p.is_file():
        return p
    if p.is_dir():
        inside = p / "scenario.json"
        hint = f"; a run directory's scenario is {inside}" if inside.is_file() else ""
        raise ScenarioError(f"scenario {spec!r}: a directory, not a scenario file{hint}")
    for candidate in (SHIPPED / spec, SHIPPED / f"{spec}.toml"):
        if candidate.is_file():
            return candidate
    import difflib

    close = difflib.get_close_matches(spec, sorted(q.stem for q in SHIPPED.glob("*.toml")), n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ScenarioError(f"scenario {spec!r}: no such file (nor a shipped scenario of that name){hint}")


def read(spec: str) -> tuple[Path, dict[str, Any]]:
    """The path and parsed contents of a scenario file or shipped name (not yet validated): TOML, or the JSON
    of a run directory's scenario.json (a ``.json`` file), which runs again as that run did."""
    path = resolve_path(spec)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() != ".json":
            return path, tomllib.loads(text)
        data = json.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path}: not valid JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from None
    except ValueError:  # an integer of more than 4,300 digits (Python's limit on int parsing)
        raise ScenarioError(f"{path}: holds a number of thousands of digits") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a JSON object, not {type(data).__name__}")
    return path, data


def load(spec: str, overrides: list[str] | None = None) -> Scenario:
    """Load, override and validate a scenario file."""
    path, data = read(spec)
    BASE_DIR.append(path.parent)
    try:
        return parse(apply_overrides(data, overrides or []))
    finally:
        BASE_DIR.pop()
