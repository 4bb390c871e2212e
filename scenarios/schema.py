"""Scenario files (TOML): loading, ``--set`` overrides, and strict validation with errors that name the field.

A scenario says what happens (docs/design.md section 7): the population's groups and counter models, scripted
behavior changes, the protocol and its parameters, network conditions and the seed. Unknown keys, wrong
types and inconsistent values are errors; nothing is silently ignored.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.world import Change, Dist, Group, split_shares
from collector.network import NetworkParams
from protocols.base import ProtocolParams
from protocols.guard import Limits
from protocols.baselines import KFLIP, LAPLACE, KFlipParams, LaplaceParams
from protocols.dbitflip import BINFLIP, DBITFLIP, DBITFLIPPM, DBitFlipParams
from protocols.epochrr import EPOCHRR, EpochRRParams
from protocols.multicounter import MULTI, MultiParams
from protocols.onebit import MEMOIZED, NAIVE, OneBitParams
from protocols.thresh import THRESH, ThreshParams
from protocols.topl import METHODS as TOPL_METHODS
from protocols.topl import TOPL, ToplParams
from protocols.tops_protocol import TOPS, TopsParams

SHIPPED = Path(__file__).resolve().parent
#: collector behaviors a scenario can ask for: the honest collector, and adversaries for audits (the devices'
#: guarantees must hold against each). ``always_update`` is THRESH's; the others apply to every protocol.
BEHAVIORS = ("honest", "always_update", "beyond_horizon", "replay", "far_future", "bad_threshold")
PROTOCOLS = (NAIVE, MEMOIZED, DBITFLIP, DBITFLIPPM, BINFLIP, KFLIP, LAPLACE, MULTI, THRESH, EPOCHRR, TOPL, TOPS)


class ScenarioError(ValueError):
    """A scenario that cannot run; the message starts with the offending field."""


@dataclass(frozen=True)
class Simulation:
    cohort_size: int = 10_000
    round_seconds: float = 86_400.0


#: [analysis] attacks: on by default when devices x rounds is at most this (e.g. 100,000 devices x 100 rounds,
#: or 200,000 x 50); off above it, where an explicit ``attacks = true`` still turns them on. The attacks keep
#: every device's true value per round (8 bytes a device-round) and decode the transcript (scenarios/attacks.py).
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

    @property
    def collections(self) -> int:
        """Collection rounds of the run: rounds, or epochs for protocols that collect once per epoch."""
        return self.rounds // int(getattr(self.protocol, "epoch_length", 1))

    @property
    def as_run(self) -> dict[str, Any]:
        """The scenario as run, for scenario.json: the validated input with ``[analysis] attacks`` resolved (the
        size rule's answer when the input left it out), so the file runs again exactly as this run did."""
        return {**self.raw, "analysis": {**self.raw.get("analysis", {}), "attacks": self.attacks}}

    @property
    def limits(self) -> Limits:
        """What every device enforces: the horizon (last collection round) and the budget."""
        return Limits(horizon=self.collections, budget=self.budget)


# ----------------------------------------------------------------------------------------------- helpers
class _Table:
    """Reads one TOML table, remembering which keys were used so the rest can be reported as unknown."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ScenarioError(f"{where or 'scenario'}: must be a table")
        self.data, self.where, self.used = data, where, set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ..., check=None, what: str = "") -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                self._unknown_near(key)
                raise ScenarioError(f"{self.path(key)}: required")
            return default
        v = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
            names = " or ".join(k.__name__.replace("str", "string").replace("float", "number") for k in kinds)
            raise ScenarioError(f"{self.path(key)}: must be a {names}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ScenarioError(f"{self.path(key)}: must be finite, got {v}")
        if check is not None and not check(v):
            raise ScenarioError(f"{self.path(key)}: must be {what}, got {v!r}")
        return v

    def table(self, key: str, default: Any = ...) -> "_Table":
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise ScenarioError(f"{self.path(key)}: required table")
            return _Table({}, self.path(key))
        return _Table(self.data[key], self.path(key))

    def _unknown_near(self, key: str) -> None:
        """A required key is missing: a misspelled key given instead is the real error, so name it."""
        close = difflib.get_close_matches(key, sorted(set(self.data) - self.used), n=1, cutoff=0.75)
        if close:
            raise ScenarioError(f"{self.path(close[0])}: unknown key (did you mean {key}?)")

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            close = difflib.get_close_matches(extra[0], sorted(self.used), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ScenarioError(f"{self.path(extra[0])}: unknown key{hint}")


def _dist(t: _Table) -> Dist:
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


def load_data(spec: str, field_name: str) -> np.ndarray:
    """An empirical data set: one non-negative number per line, optionally gzip-compressed. Relative paths
    are looked up beside the scenario file, then in the shipped scenarios/data/."""
    candidates = [Path(spec)] if Path(spec).is_absolute() else [
        *(b / spec for b in BASE_DIR[-1:]), Path(spec), DATA_DIR / spec, DATA_DIR / Path(spec).name]
    path = next((c.resolve() for c in candidates if c.is_file()), None)
    if path is None:
        raise ScenarioError(f"{field_name}: no data file {spec!r} (looked beside the scenario and in {DATA_DIR})")
    if path not in _DATA_CACHE:
        try:
            data = np.loadtxt(path, dtype=np.float64, ndmin=1)
        except (ValueError, OSError) as exc:
            raise ScenarioError(f"{field_name}: {spec!r} is not one number per line: {exc}"[:300]) from None
        if data.size == 0 or not np.all(np.isfinite(data)) or data.min() < 0:
            raise ScenarioError(f"{field_name}: {spec!r} must hold finite non-negative numbers, one per line")
        data.setflags(write=False)
        _DATA_CACHE[path] = data
    return _DATA_CACHE[path]


def _jitter(t: _Table) -> float:
    kind = t.get("dist", str, check=lambda v: v in ("normal", "none"), what='"normal" or "none"')
    sd = t.get("sd", float, check=lambda v: v >= 0, what=">= 0") if kind == "normal" else 0.0
    t.done()
    return sd


def _positive(v: float) -> bool:
    return v > 0


def _thresh(pt: _Table, name: str, epsilon: float, ctx: dict) -> ThreshParams:
    """THRESH's table. Infeasible derived constants are an error naming them, unless a, b or tau_scale are
    given explicitly (or allow_infeasible = true): then the problems become warnings."""
    rounds = ctx["rounds"]
    length = pt.get("epoch_length", int, check=lambda v: 1 <= v <= rounds and rounds % v == 0,
                    what=f"a divisor of rounds ({rounds})")
    positive = dict(check=_positive, what="> 0")
    overrides = {k: pt.get(k, float, None, **positive) for k in ("a", "b")}
    tau_scale = pt.get("tau_scale", float, None, **positive)
    params = ThreshParams(
        name, epsilon, pt.get("delta", float, 0.1, check=lambda v: 0 < v < 1, what="a number in (0, 1)"),
        length, rounds // length, ctx["devices"], ctx["groups"], ctx["smallest_group"], overrides["a"],
        overrides["b"], 1.0 if tau_scale is None else tau_scale,
        pt.get("cap_rule", str, "paper", check=lambda v: v in ("paper", "strict"), what='"paper" or "strict"'),
        ctx["behavior"])
    allow = pt.get("allow_infeasible", bool, False)
    problems = params.problems()
    explicit = allow or tau_scale is not None or any(v is not None for v in overrides.values())
    if problems and not explicit:
        raise ScenarioError("protocol: THRESH's derived constants are infeasible for this population:\n  - "
                            + "\n  - ".join(problems)
                            + "\nSet protocol.a, protocol.b and/or protocol.tau_scale (or allow_infeasible = true)"
                            " to run anyway.")
    params.warnings.extend(problems)
    return params


def _holdout(pt: _Table, devices: int) -> float:
    """``holdout``: a share of devices in (0, 1), or a number of devices (converted to a share)."""
    hold = pt.get("holdout", float, check=lambda v: 0 < v < devices,
                  what=f"a share in (0, 1) or a number of devices below {devices}")
    return hold if hold < 1 else hold / devices


def _protocol(pt: _Table, ctx: dict) -> ProtocolParams:
    """The [protocol] table: common keys, then each family's own."""
    name = pt.get("name", str, check=lambda v: v in PROTOCOLS, what=f"one of {list(PROTOCOLS)}")
    epsilon = pt.get("epsilon", float, check=lambda v: 0 < v <= 50, what="a number in (0, 50]")
    if name == THRESH:
        params = _thresh(pt, name, epsilon, ctx)
        pt.done()
        return params
    if name == TOPL:
        max_value = pt.get("max_value", float, check=_positive, what="> 0")
        share = _holdout(pt, ctx["devices"])
        rounds = ctx["rounds"]
        on_demand = pt.get("rethreshold_at", list, [], check=lambda v: all(
            isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= rounds for r in v),
            what=f"an array of rounds in [1, {rounds}]")
        params = ToplParams(
            name, epsilon,
            pt.get("threshold_epsilon", float, epsilon, check=lambda v: 0 < v <= 50, what="a number in (0, 50]"),
            max_value, share,
            pt.get("rethreshold_every", int, 0, check=lambda v: v >= 0, what="an integer >= 0 (0: never)"),
            ctx["rounds"], ctx["devices"],
            pt.get("method", str, "sw-w", check=lambda v: v in TOPL_METHODS, what=f"one of {list(TOPL_METHODS)}"),
            pt.get("bins", int, 1024, check=lambda v: 16 <= v <= 4096, what="an integer in [16, 4096]"),
            tuple(sorted(set(on_demand))))
        pt.done()
        return params
    if name == TOPS:
        max_value = pt.get("max_value", float, check=_positive, what="> 0")
        params = TopsParams(name, epsilon,
                            pt.get("threshold_epsilon", float, epsilon, check=lambda v: 0 < v <= 50,
                                   what="a number in (0, 50]"),
                            max_value, _holdout(pt, ctx["devices"]), ctx["rounds"], ctx["devices"], ctx["seed"])
        pt.done()
        return params
    if name == EPOCHRR:
        rounds = ctx["rounds"]
        length = pt.get("epoch_length", int, check=lambda v: 1 <= v <= rounds and rounds % v == 0,
                        what=f"a divisor of rounds ({rounds})")
        pt.done()
        return EpochRRParams(name, epsilon, length, rounds // length)
    max_value = pt.get("max_value", float, check=_positive, what="> 0")
    gamma_ok = dict(check=lambda v: 0 <= v < 0.5, what="a number in [0, 0.5)")
    if name in (NAIVE, MEMOIZED):
        gran = pt.get("granularity", float, None if name == NAIVE else ..., check=_positive, what="> 0")
        if gran is not None:
            k = max_value / gran
            if gran > max_value or abs(k - round(k)) > 1e-9 * k:
                raise ScenarioError(f"protocol.granularity: {gran:g} must divide protocol.max_value {max_value:g}")
        params: ProtocolParams = OneBitParams(name, epsilon, max_value, gran, pt.get("gamma", float, 0.0, **gamma_ok))
    elif name == LAPLACE:
        params = LaplaceParams(name, epsilon, max_value)
    elif name == MULTI:
        params = MultiParams(name, epsilon, max_value,
                             pt.get("counters", int, check=lambda v: 1 <= v <= 64, what="an integer in [1, 64]"))
    else:
        k = pt.get("buckets", int, check=lambda v: 2 <= v <= 65_536, what="an integer in [2, 65536]")
        if name == KFLIP:
            params = KFlipParams(name, epsilon, max_value, k)
        else:
            default_d = k if name == BINFLIP else ...
            d = pt.get("bits", int, default_d, check=lambda v: 1 <= v <= k, what=f"an integer in [1, buckets = {k}]")
            if name == BINFLIP and d != k:
                raise ScenarioError(f"protocol.bits: binflip sends all {k} buckets, got {d}")
            params = DBitFlipParams(name, epsilon, max_value, k, d, pt.get("gamma", float, 0.0, **gamma_ok))
    pt.done()
    return params


# ----------------------------------------------------------------------------------------------- loading
def parse(data: dict[str, Any]) -> Scenario:
    """Validate a scenario given as a dict (parsed TOML)."""
    top = _Table(data, "")
    name = top.get("name", str, check=lambda v: 0 < len(v) <= 100, what="a non-empty name")
    description = top.get("description", str, "")
    seed = top.get("seed", int, 0, check=lambda v: 0 <= v < 2**63, what="an integer in [0, 2^63)")
    rounds = top.get("rounds", int, check=lambda v: 1 <= v <= 100_000, what="an integer in [1, 100000]")

    pop = top.table("population")
    devices = pop.get("devices", int, check=lambda v: 1 <= v <= 2**32 - 1, what="an integer in [1, 2^32)")
    raw_groups = pop.get("groups", list, check=lambda v: len(v) >= 1, what="a non-empty array of tables")
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
            isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 and math.isfinite(w) for w in v),
            what="an array of 1 to 64 positive weights")
        joins = t.get("joins", int, 1, check=lambda v: v >= 1, what="a round >= 1")
        leaves = t.get("leaves", int, None, check=lambda v: v > joins, what=f"a round after joins ({joins})")
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
    for i, c in enumerate(top.get("changes", list, [])):
        t = _Table(c, f"changes[{i}]")
        rnd = t.get("round", int, check=lambda v: 1 <= v <= 100_000, what="a round >= 1")
        if rnd > rounds:
            warnings.append(f"changes[{i}].round: {rnd} is after the last round ({rounds}); it will not happen")
        group = t.get("group", str, check=lambda v: v in names, what=f"one of the groups {names}")
        counter = _dist(t.table("counter")) if "counter" in c else None
        jitter = _jitter(t.table("jitter")) if "jitter" in c else None
        t.used.update(("counter", "jitter"))
        fraction = t.get("fraction", float, 1.0, check=lambda v: 0 < v <= 1, what="a number in (0, 1]")
        if counter is None and jitter is None:
            raise ScenarioError(f"changes[{i}]: needs a counter or a jitter to change")
        t.done()
        changes.append(Change(rnd, group, counter, jitter, fraction))

    ct = top.table("collector", default=None)
    behavior = ct.get("behavior", str, "honest", check=lambda v: v in BEHAVIORS, what=f"one of {list(BEHAVIORS)}")
    ct.done()
    pv = top.table("privacy", default=None)
    budget = pv.get("budget", float, None, check=_positive, what="a total epsilon > 0")
    pv.done()
    sizes = np.diff(split_shares(devices, [g.share for g in groups]))
    protocol = _protocol(top.table("protocol"), {"rounds": rounds, "devices": devices, "groups": len(groups),
                                                 "seed": seed,
                                                 "smallest_group": int(sizes.min()),
                                                 "behavior": "always_update" if behavior == "always_update"
                                                 else "honest"})
    if behavior == "always_update" and protocol.name != THRESH:
        raise ScenarioError(f"collector.behavior: {behavior!r} is only defined for {THRESH}")
    if protocol.name in (THRESH, EPOCHRR):
        for i, g in enumerate(groups):
            if g.counter.kind != "bernoulli":
                raise ScenarioError(f"population.groups[{i}].counter: {THRESH} collects bits: use "
                                    f'{{ dist = "bernoulli", p = ... }}')
        for i, c in enumerate(changes):
            if c.counter is not None and c.counter.kind != "bernoulli" or c.jitter_sd:
                raise ScenarioError(f"changes[{i}]: {THRESH} collects bits: a change sets a bernoulli counter")
    for i, g in enumerate(groups):
        if protocol.name == MULTI and (g.apps is None or len(g.apps) != protocol.counters):
            raise ScenarioError(f"population.groups[{i}].apps: {MULTI} needs {protocol.counters} app weights "
                                f"(protocol.counters) in every group")
        if protocol.name != MULTI and g.apps is not None:
            raise ScenarioError(f"population.groups[{i}].apps: only the {MULTI} protocol collects several counters")
    st = top.table("simulation", default=None)
    sim = Simulation(
        cohort_size=st.get("cohort_size", int, 10_000, check=lambda v: v >= 1, what="an integer >= 1"),
        round_seconds=st.get("round_seconds", float, 86_400.0, check=_positive, what="> 0"),
    )
    st.done()
    nt = top.table("network", default=None)
    net = NetworkParams(
        latency=nt.get("latency", float, 0.05, check=lambda v: v >= 0, what=">= 0"),
        jitter=nt.get("jitter", float, 0.0, check=lambda v: v >= 0, what=">= 0"),
        loss=nt.get("loss", float, 0.0, check=lambda v: 0 <= v < 1, what="a number in [0, 1)"),
        deadline=nt.get("deadline", float, 3600.0, check=_positive, what="> 0"),
        downlink_loss=nt.get("downlink_loss", float, 0.0, check=lambda v: 0 <= v < 1, what="a number in [0, 1)"),
    )
    nt.done()
    if net.latency >= net.deadline:
        raise ScenarioError(f"network.latency: {net.latency:g} s leaves no time before the deadline "
                            f"({net.deadline:g} s)")
    if net.deadline >= sim.round_seconds:
        raise ScenarioError(f"network.deadline: {net.deadline:g} s must be shorter than "
                            f"simulation.round_seconds ({sim.round_seconds:g} s)")
    at = top.table("analysis", default=None)
    attacks = at.get("attacks", bool, None)
    at.done()
    size = devices * rounds
    if attacks is None:
        attacks = size <= ATTACKS_AUTO_LIMIT
        attacks_why = (f"default: devices x rounds = {size:,} {'<=' if attacks else '>'} {ATTACKS_AUTO_LIMIT:,}"
                       + ("" if attacks else " (set analysis.attacks = true to compute them)"))
    else:
        attacks_why = f"analysis.attacks = {str(attacks).lower()}"
    top.done()
    warnings += [f"protocol: {w}" for w in getattr(protocol, "warnings", [])]
    return Scenario(name, seed, rounds, devices, groups, changes, protocol, net, sim, description, data, warnings,
                    budget, behavior, attacks, attacks_why)


def _parse_value(text: str) -> Any:
    """A ``--set`` value: any TOML value (``3``, ``0.5``, ``true``, ``"x"``, ``[1, 2]``), else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``KEY=VALUE`` overrides with dotted keys (``simulation.cohort_size=1``,
    ``population.groups.0.share=0.5``) to a copy of ``data``."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--set {item!r}: expected KEY=VALUE")
        parts = key.strip().split(".")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            where = ".".join(parts[:depth + 1])
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ScenarioError(f"--set {key}: {where} is not an index of the array")
                node = node[int(part)]
            elif isinstance(node, dict):
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ScenarioError(f"--set {key}: {where} is not a table")
        last = parts[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
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
    for candidate in (SHIPPED / spec, SHIPPED / f"{spec}.toml"):
        if candidate.is_file():
            return candidate
    raise ScenarioError(f"scenario {spec!r}: no such file (nor a shipped scenario of that name)")


def read(spec: str) -> tuple[Path, dict[str, Any]]:
    """The path and parsed TOML of a scenario file or shipped name (not yet validated)."""
    path = resolve_path(spec)
    try:
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from None


def load(spec: str, overrides: list[str] | None = None) -> Scenario:
    """Load, override and validate a scenario file."""
    path, data = read(spec)
    BASE_DIR.append(path.parent)
    try:
        return parse(apply_overrides(data, overrides or []))
    finally:
        BASE_DIR.pop()
