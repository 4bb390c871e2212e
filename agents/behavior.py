"""Behaviors: a population group's values as a scripted, keyed function of the day (docs/behaviors.md).

A group's counter model (agents/world.py: a level per device plus per-round jitter, or a data set) gives each
device a *base value* every round. A behavior shapes it: it is a function

    f(day: Day, ids: np.ndarray, value: np.ndarray, **params) -> np.ndarray

called once per round with the ids of all the group's devices (int64, increasing), their base values
(float64, aligned with the ids) and the round as a :class:`Day`; it returns the new values, aligned with the
ids. Its randomness comes from ``day.keys`` (:class:`Keys`): keyed draws, a pure function of (seed, group,
position in the group's list of behaviors, context, device), never a stateful generator. So a device's values
stay a pure function of (seed, device, round): the same for every cohort split and in both runtimes, since
every process that holds the world computes it for the whole population, every round, in order.

A group may list several behaviors; each gets the previous one's output. After the last, values are clipped
to [0, max_value] and the clipping is counted, as for every value (docs/algorithms.md, "Notation and
conventions").

Event hooks: a behavior may be a class instead of a function. The world makes one instance per world with the
parameters (``Class(**params)``), calls it like a function (without parameters), and, if it has one, calls
``observe(day, ids, values)`` after each round with the group's final (clipped) values: the place to keep
state, e.g. which devices have crossed a level. ``Day.mean`` is the previous round's mean over the whole
population, for conditions on the population. A class may also say when it changes devices for good
(``changed(day, ids)``: which of the group's devices its change reaches first in that round, a boolean mask
aligned with the ids, or None): the world records it, the run's event log shows it (``behavior_fired``), the
estimates picture marks the round and the attack metrics count those devices as changed. ``step`` and
``trigger`` do.

Built-in behaviors (:data:`BUILTINS`), by name in a scenario: ``weekly`` (a multiplier by day of week),
``trend`` (linear or exponential growth per day), ``burst`` (keyed bursts: a device's value multiplied for a
few rounds, each round with probability p), ``step`` (a change at a simulated time or round, for a keyed
fraction of the group), ``trigger`` (a change once a device's own value, or the population mean, crosses a
level). A user's own behavior is named ``"module:function"`` (or ``"module:Class"``) and imported by name.

In a scenario (scenarios/schema.py)::

    [[population.groups]]
    name = "office"
    share = 1.0
    counter = { dist = "normal", mean = 3600, sd = 600 }
    behavior = ["weekly", "mypackage.usage:holiday_dip"]   # or one name
    params = [{ weekend = 0.3 }, { day_of_run = 25 }]       # or one table

From Python: pass the function (or class) itself as ``behavior`` to ``schema.parse``, or build a group with
``Group(..., behavior=compose(my_function, {"k": 2}))`` for :class:`agents.world.World`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, cast, runtime_checkable

import numpy as np

from protocols import keyed
from protocols.keyed import Purpose, stream_key

__all__ = [
    "BUILTINS", "PURPOSE", "Behavior", "BehaviorError", "BehaviorFunction", "Bound", "Burst", "Changing", "Day",
    "Keys", "Stateful", "Step", "StepChange", "Trend", "Trigger", "Weekly", "compose", "first_round_at", "name_of",
    "resolve",
]

#: the stream purpose of behaviors' keyed draws: protocols.keyed.Purpose.BEHAVIOR (1000, apart from the protocols'
#: tags, which count up from 1)
PURPOSE = int(Purpose.BEHAVIOR)
SECONDS_PER_DAY = 86_400.0
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class BehaviorError(ValueError):
    """A behavior that cannot be used; ``key`` names the parameter at fault ("" for the behavior itself)."""

    def __init__(self, key: str, message: str | None = None) -> None:
        if message is None:  # rebuilt from its text alone (SimPy re-raises a process's error as type(e)(*e.args))
            key, message = "", key
        super().__init__(f"{key}: {message}" if key else message)
        self.key, self.message = key, message


# ----------------------------------------------------------------------------------------- keys and days
def _part(c: int | str) -> int:
    """A context part as an integer: strings by CRC-32 of their UTF-8 bytes, stable across processes (unlike
    Python's ``hash``), offset past 2^32 so that they never equal a small integer."""
    if isinstance(c, str):
        return (1 << 32) + zlib.crc32(c.encode("utf-8"))
    return int(c)


@dataclass(frozen=True)
class Keys:
    """Keyed randomness of one behavior: every draw is a pure function of (seed, path, context, device).

    ``path`` is (group index, position of the behavior in the group's list); ``context`` names the draw: a
    string tag and/or integers such as the round (``keys.uniform(ids, "start", day.round)``).
    """

    seed: int
    path: tuple[int, ...] = ()

    def key(self, *context: int | str) -> int:
        """The 64-bit stream key of the draw named by ``context``."""
        return stream_key(self.seed, PURPOSE, *self.path, *(_part(c) for c in context))

    def uniform(self, ids: np.ndarray, *context: int | str) -> np.ndarray:
        """Uniforms in [0, 1), one per device id."""
        return keyed.uniform(self.key(*context), ids)

    def normal(self, ids: np.ndarray, *context: int | str) -> np.ndarray:
        """Standard normals, one per device id."""
        return keyed.normal(self.key(*context), ids)

    def child(self, *context: int | str) -> Keys:
        """Keys of a part of this behavior (e.g. a behavior it delegates to), apart from this one's."""
        return Keys(self.seed, (*self.path, *(_part(c) for c in context)))


def first_round_at(at_time: float, round_seconds: float) -> int:
    """The first round that starts at or after ``at_time`` (s): round r starts at (r - 1) x round_seconds,
    and a round's values are read at its start, so a change at a moment inside a round shows from the next."""
    r = max(1, math.ceil(at_time / round_seconds) + 1)
    while r > 1 and (r - 2) * round_seconds >= at_time:  # floating-point guard: the same test as Day.reached
        r -= 1
    while (r - 1) * round_seconds < at_time:
        r += 1
    return r


@dataclass(frozen=True)
class Day:
    """The round a behavior is asked about.

    ``round``: 1-based; ``time``: its simulated start, (round - 1) x round_seconds; ``calendar_day``: whole
    days of 86,400 s since the start of the run (0-based; equal to round - 1 for daily rounds); ``mean``: the
    previous round's mean value over the whole population (NaN in round 1); ``keys``: this behavior's keyed
    randomness; ``max_value``: the protocol's m (values are clipped to [0, m] after the behaviors).
    """

    round: int
    round_seconds: float
    max_value: float
    keys: Keys
    mean: float = math.nan

    @property
    def time(self) -> float:
        return (self.round - 1) * self.round_seconds

    @property
    def calendar_day(self) -> int:
        return int(self.time // SECONDS_PER_DAY)

    def weekday(self, first: int = 0) -> int:
        """Day of week, 0 = Monday ... 6 = Sunday, when round 1 falls on weekday ``first``."""
        return (first + self.calendar_day) % 7

    def reached(self, at_time: float) -> bool:
        """Whether this round starts at or after ``at_time`` (see :func:`first_round_at`)."""
        return self.time >= at_time


@runtime_checkable
class BehaviorFunction(Protocol):
    """A behavior as a function: the group's values on ``day`` from their base values; pure and keyed."""

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray, /, **params: Any) -> np.ndarray: ...


@runtime_checkable
class Stateful(Protocol):
    """A behavior instance with the event hook: told every round's final values, in round order."""

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray, /) -> np.ndarray: ...

    def observe(self, day: Day, ids: np.ndarray, values: np.ndarray, /) -> None: ...


@runtime_checkable
class Changing(Protocol):
    """A behavior instance that says which devices its change reaches first on ``day`` (a boolean mask aligned
    with ``ids``; None: none), called after the behavior shaped that day's values."""

    def changed(self, day: Day, ids: np.ndarray, /) -> np.ndarray | None: ...


# ----------------------------------------------------------------------------------------- parameters
def _number(key: str, v: Any, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
            what: str = "") -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BehaviorError(key, f"must be a finite number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise BehaviorError(key, f"must be {what}, got {v!r}")
    return float(v)


def _integer(key: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BehaviorError(key, f"must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


def _moment(round_: Any, at_time: Any) -> tuple[int | None, float | None]:
    """``round`` or ``at_time`` (s), not both; neither: (None, None)."""
    if round_ is not None and at_time is not None:
        raise BehaviorError("at_time", "give round or at_time, not both")
    r = _integer("round", round_, 1, 10**9) if round_ is not None else None
    t = _number("at_time", at_time, 0, what=">= 0") if at_time is not None else None
    return r, t


def _started(day: Day, round_: int | None, at_time: float | None) -> bool:
    if round_ is not None:
        return day.round >= round_
    if at_time is not None:
        return day.reached(at_time)
    return True


def _start_time(day: Day, round_: int | None, at_time: float | None) -> float:
    if round_ is not None:
        return (round_ - 1) * day.round_seconds
    return at_time if at_time is not None else 0.0


def _fraction_ids(day: Day, ids: np.ndarray, fraction: float) -> np.ndarray | None:
    """Which devices a keyed ``fraction`` of the group holds (None: all of them): fixed for the whole run."""
    return None if fraction >= 1.0 else day.keys.uniform(ids, "fraction") < fraction


# ----------------------------------------------------------------------------------------- built-ins
class Weekly:
    """Seasonality by day of week: a device's value times the factor of the round's weekday.

    ``weekday`` and ``weekend`` are the factors of Monday-Friday and Saturday-Sunday, or ``factors`` gives
    all seven (Monday first); ``first_weekday`` is the weekday of round 1 (0-6 or "mon" ... "sun"; default
    Monday). With rounds shorter than a day, a round takes the weekday of the calendar day it starts in.
    """

    name: ClassVar[str] = "weekly"

    def __init__(self, *, weekday: float | None = None, weekend: float | None = None,
                 factors: Sequence[float] | None = None, first_weekday: int | str = 0) -> None:
        if factors is not None:
            if weekday is not None or weekend is not None:
                raise BehaviorError("factors", "give factors (all seven days) or weekday/weekend, not both")
            if not isinstance(factors, (list, tuple)) or len(factors) != 7:
                raise BehaviorError("factors", f"must be an array of 7 factors (Monday first), got {factors!r}")
            self.factors = tuple(_number(f"factors[{i}]", f, 0, what=">= 0") for i, f in enumerate(factors))
        else:
            wd = _number("weekday", 1.0 if weekday is None else weekday, 0, what=">= 0")
            we = _number("weekend", 1.0 if weekend is None else weekend, 0, what=">= 0")
            self.factors = (wd,) * 5 + (we,) * 2
        if isinstance(first_weekday, str):
            if first_weekday.lower()[:3] not in WEEKDAYS:
                raise BehaviorError("first_weekday", f'must be 0-6 or one of {list(WEEKDAYS)}, got {first_weekday!r}')
            self.first = WEEKDAYS.index(first_weekday.lower()[:3])
        else:
            self.first = _integer("first_weekday", first_weekday, 0, 6)

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
        f = self.factors[day.weekday(self.first)]
        return value if f == 1.0 else value * f


class Trend:
    """Growth per day from a moment on (``round`` or ``at_time`` in s; default the start): ``linear``
    multiplies by 1 + rate x t, ``exponential`` by (1 + rate)^t, with t the days (86,400 s, fractional for
    shorter rounds) since the moment. A negative rate is a decline; values below 0 are clipped and counted."""

    name: ClassVar[str] = "trend"

    def __init__(self, *, rate: float, kind: str = "linear", round: int | None = None,
                 at_time: float | None = None) -> None:
        self.rate = _number("rate", rate, -1, what="a number >= -1 (a rate per day)")
        if kind not in ("linear", "exponential"):
            raise BehaviorError("kind", f'must be "linear" or "exponential", got {kind!r}')
        self.kind = kind
        self.round, self.at_time = _moment(round, at_time)

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
        t = max(0.0, (day.time - _start_time(day, self.round, self.at_time)) / SECONDS_PER_DAY)
        f = 1.0 + self.rate * t if self.kind == "linear" else (1.0 + self.rate) ** t
        return value if f == 1.0 else value * f


class Burst:
    """Keyed bursts: each round, each device starts a burst with probability ``p``; during a burst (the
    round it starts and the ``duration`` - 1 rounds after it) its value is multiplied by ``factor``. Whether
    device i is in a burst on round r is a pure function of (seed, i, r): it started one in one of rounds
    r - duration + 1 ... r, so the share of devices in a burst is 1 - (1 - p)^duration from round
    ``duration`` on. Overlapping bursts multiply once."""

    name: ClassVar[str] = "burst"

    def __init__(self, *, p: float, factor: float, duration: int = 1) -> None:
        self.p = _number("p", p, 0, 1, what="a probability in [0, 1]")
        self.factor = _number("factor", factor, 0, what=">= 0")
        self.duration = _integer("duration", duration, 1, 365)

    def in_burst(self, day: Day, ids: np.ndarray) -> np.ndarray:
        """Which devices are in a burst on ``day``."""
        on = np.zeros(ids.shape[0], dtype=np.bool_)
        for start in range(max(1, day.round - self.duration + 1), day.round + 1):
            on |= day.keys.uniform(ids, "start", start) < self.p
        return on

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
        if self.p == 0.0:
            return value
        return np.where(self.in_burst(day, ids), value * self.factor, value)


class StepChange:
    """A change at a moment: from ``round``, or from the first round that starts at or after ``at_time`` (s
    since the start of the run), the value of a keyed ``fraction`` of the group becomes value x ``factor`` +
    ``add``. Built-in name ``step``."""

    name: ClassVar[str] = "step"

    def __init__(self, *, factor: float = 1.0, add: float = 0.0, round: int | None = None,
                 at_time: float | None = None, fraction: float = 1.0) -> None:
        self.round, self.at_time = _moment(round, at_time)
        if self.round is None and self.at_time is None:
            raise BehaviorError("round", "required: the round or the simulated time (at_time, s) of the change")
        self.factor = _number("factor", factor, 0, what=">= 0")
        self.add = _number("add", add)
        self.fraction = _number("fraction", fraction, 0, 1, lo_open=True, what="a number in (0, 1]")

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
        if not _started(day, self.round, self.at_time):
            return value
        changed = value * self.factor + self.add
        hit = _fraction_ids(day, ids, self.fraction)
        return changed if hit is None else np.where(hit, changed, value)

    def first_round(self, round_seconds: float) -> int:
        """The round the step starts in: ``round``, or the first that starts at or after ``at_time``."""
        return self.round if self.round is not None else first_round_at(cast(float, self.at_time), round_seconds)

    def changed(self, day: Day, ids: np.ndarray) -> np.ndarray | None:
        """The devices the step reaches, in its first round (none for x 1 + 0, which changes nothing)."""
        if day.round != self.first_round(day.round_seconds) or (self.factor == 1.0 and self.add == 0.0):
            return None
        hit = _fraction_ids(day, ids, self.fraction)
        return np.ones(ids.shape, np.bool_) if hit is None else hit


class Trigger:
    """A change triggered by a condition. ``on = "value"``: once a device's own (final, clipped) value is
    above ``above`` (or below ``below``) in a round, from the next round on its value becomes
    value x ``factor`` + ``add``. ``on = "mean"``: once the population's mean value is past the level in a
    round, the same happens to every device of the group (or a keyed ``fraction`` of it) from the next round
    on. Either way it stays triggered. State is kept per world through the ``observe`` hook."""

    name: ClassVar[str] = "trigger"

    def __init__(self, *, on: str = "value", above: float | None = None, below: float | None = None,
                 factor: float = 1.0, add: float = 0.0, fraction: float = 1.0) -> None:
        if on not in ("value", "mean"):
            raise BehaviorError("on", f'must be "value" (a device\'s own value) or "mean" (the population\'s), '
                                      f"got {on!r}")
        if (above is None) == (below is None):
            raise BehaviorError("above", "give one level: above or below")
        self.on = on
        self.above = _number("above", above) if above is not None else None
        self.below = _number("below", below) if below is not None else None
        self.factor = _number("factor", factor, 0, what=">= 0")
        self.add = _number("add", add)
        self.fraction = _number("fraction", fraction, 0, 1, lo_open=True, what="a number in (0, 1]")
        self.fired: np.ndarray | None = None  # on = "value": per device of the group
        self.fired_at: int | None = None  # on = "mean": the round the population crossed
        self.newly: tuple[int, np.ndarray] | None = None  # on = "value": (round, devices that first crossed in it)

    def _crossed(self, x: np.ndarray | float) -> np.ndarray | bool:
        return x > self.above if self.above is not None else x < self.below  # type: ignore[operator]

    def __call__(self, day: Day, ids: np.ndarray, value: np.ndarray) -> np.ndarray:
        if self.on == "mean":
            if self.fired_at is None and day.round > 1 and bool(self._crossed(day.mean)):
                self.fired_at = day.round - 1
            if self.fired_at is None:
                return value
            hit = _fraction_ids(day, ids, self.fraction)
        else:
            if self.fired is None:
                return value
            hit = self.fired if self.fraction >= 1.0 else self.fired & (day.keys.uniform(ids, "fraction")
                                                                       < self.fraction)
        changed = value * self.factor + self.add
        return changed if hit is None else np.where(hit, changed, value)

    def observe(self, day: Day, ids: np.ndarray, values: np.ndarray) -> None:
        if self.on == "value":
            crossed = np.asarray(self._crossed(values), dtype=np.bool_)
            self.newly = (day.round, crossed if self.fired is None else crossed & ~self.fired)
            self.fired = crossed if self.fired is None else self.fired | crossed

    def changed(self, day: Day, ids: np.ndarray) -> np.ndarray | None:
        """The devices the trigger reaches in the round after the one in which they (``on = "value"``) or the
        population (``"mean"``) crossed the level; none for x 1 + 0, which changes nothing."""
        if self.factor == 1.0 and self.add == 0.0:
            return None
        if self.on == "mean":
            if self.fired_at is None or day.round != self.fired_at + 1:
                return None
            hit = _fraction_ids(day, ids, self.fraction)
            return np.ones(ids.shape, np.bool_) if hit is None else hit
        if self.newly is None or day.round != self.newly[0] + 1:
            return None
        new = self.newly[1]
        return new if self.fraction >= 1.0 else new & (day.keys.uniform(ids, "fraction") < self.fraction)


#: the built-in behaviors by the name a scenario gives them
BUILTINS: dict[str, type] = {c.name: c for c in (Weekly, Trend, Burst, StepChange, Trigger)}


# ----------------------------------------------------------------------------------------- resolution
def resolve(spec: str) -> Callable[..., Any]:
    """The function or class a behavior name stands for: a built-in name, or ``"module:function"`` (a dotted
    attribute path after the colon), imported by name."""
    if ":" not in spec:
        if spec in BUILTINS:
            return BUILTINS[spec]
        raise BehaviorError("", f"unknown behavior {spec!r}: a built-in ({', '.join(BUILTINS)}) or "
                                f'"module:function"')
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise BehaviorError("", f'{spec!r}: expected "module:function"')
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise BehaviorError("", f"module {module_name!r} is not importable ({exc}): install it or put its "
                                    "directory on PYTHONPATH") from None
        raise BehaviorError("", f"module {module_name!r} failed to import: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- the user's module raised while importing: say so in one line
        raise BehaviorError("", f"module {module_name!r} failed to import: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BehaviorError("", f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BehaviorError("", f"{spec!r} is not a function or class")
    if inspect.isclass(obj) and not any("__call__" in vars(k) for k in obj.__mro__[:-1]):
        # a behavior class is built, then called every round: one whose instances cannot be called is not one
        # (and is not constructed: a scenario must not instantiate an arbitrary class with its parameters)
        raise BehaviorError("", f"{spec!r} is a class whose instances are not callable: not a behavior")
    return obj


def name_of(obj: Callable[..., Any]) -> str:
    """The name a behavior given as a Python object is recorded under: its built-in name, or
    ``"module:qualname"``, checked to import back to the very object (else a ``BehaviorError``)."""
    for name, cls in BUILTINS.items():
        if obj is cls:
            return name
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise BehaviorError("", f"{obj!r} has no importable name (a lambda or a nested function?): define it "
                                "at the top level of an importable module, so that scenario.json can name it")
    name = f"{module}:{qualname}"
    try:
        back = resolve(name)
    except BehaviorError:
        back = None
    if back is not obj:
        raise BehaviorError("", f"{name} does not import back to {obj!r}: define it at the top level of an "
                                "importable module, so that scenario.json can name it")
    return name


def _parameters(target: Callable[..., Any]) -> tuple[list[str], list[str], bool, dict[str, Any]]:
    """(all keyword parameter names, required ones, whether it takes **kwargs, defaults) of a behavior's
    parameters: a class's constructor, or a function's parameters after (day, ids, value)."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return [], [], True, {}
    ps = list(sig.parameters.values())
    if not inspect.isclass(target):
        positional = [p for p in ps if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in ps):
            raise BehaviorError("", f"{getattr(target, '__qualname__', target)} must take (day, ids, value) "
                                    "and then its parameters")
        ps = ps[3:] if len(positional) >= 3 else [p for p in ps if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    names = [p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.default is p.empty]
    defaults = {p.name: p.default for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                and p.default is not p.empty}
    return names, required, any(p.kind == p.VAR_KEYWORD for p in ps), defaults


_SCALARS: dict[type, str] = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _declared_types(target: Callable[..., Any], defaults: dict[str, Any]) -> dict[str, tuple[type, ...]]:
    """The scalar types each parameter of a behavior accepts, from its annotations (``int``, ``float``,
    ``bool``, ``str``, any of them ``| None``) or, unannotated, from a scalar default's type; a parameter
    declared otherwise (a list, a table, Any) is not listed (its values are the behavior's to check)."""
    import types
    import typing

    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # an annotation that does not resolve: nothing to check by
        hints = {}
    out: dict[str, tuple[type, ...]] = {}
    for name in set(hints) | set(defaults):
        hint = hints.get(name)
        if hint is None:
            default = defaults.get(name)
            kinds: tuple[Any, ...] = (type(default),) if type(default) in _SCALARS else ()
        else:
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            kinds = tuple(a for a in typing.get_args(hint) if a is not type(None)) if union else (hint,)
        if kinds and all(k in _SCALARS for k in kinds):
            out[name] = kinds
    return out


def _fits(v: Any, kinds: tuple[type, ...]) -> bool:
    """Whether a TOML value is of one of ``kinds`` (an integer counts as a number; a boolean is no number)."""
    if v is None:
        return True
    if isinstance(v, bool):
        return bool in kinds
    if isinstance(v, int):
        return int in kinds or float in kinds
    return any(isinstance(v, k) for k in kinds if k is not bool and k is not int)


def _toml_value(v: Any) -> bool:
    """Whether ``v`` is a value TOML (and scenario.json) can hold: what a run directory can record."""
    if isinstance(v, bool | int | str):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_toml_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _toml_value(x) for k, x in v.items())
    return False


# ----------------------------------------------------------------------------------------- composition
@dataclass(frozen=True, eq=False)
class Step:
    """One behavior of a group: its recorded ``name`` (built-in or ``"module:function"``), the function or
    class it resolved to, and its parameters (checked against the signature; a class also checks its values
    on construction)."""

    name: str
    target: Callable[..., Any]
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: str | Callable[..., Any], params: Mapping[str, Any] | None = None) -> Step:
        """A step from a name or a Python function/class, with its parameters checked (``BehaviorError``
        naming the parameter)."""
        if isinstance(spec, str):
            name, target = spec, resolve(spec)
        elif callable(spec):
            name, target = name_of(spec), spec
        else:
            raise BehaviorError("", f"must be a name or a function, got {spec!r}")
        params = dict(params or {})
        names, required, var_kw, defaults = _parameters(target)
        declared = _declared_types(target, defaults)
        for key, v in params.items():
            if not isinstance(key, str):
                raise BehaviorError(str(key), "parameter names must be strings")
            if key not in names and not var_kw:
                raise BehaviorError(key, f"unknown parameter of {name} (its parameters: "
                                         f"{', '.join(names) if names else 'none'})")
            if not _toml_value(v):
                raise BehaviorError(key, f"must be a TOML value (number, string, boolean, array or table), got {v!r}")
        for key in required:
            if key not in params:
                raise BehaviorError(key, f"required parameter of {name}")
        step = cls(name, target, params)
        step.start()  # a class checks its parameters' values now (with its own words), ...
        for key, v in params.items():  # ... and every parameter's type is the one it declares
            if key in declared and not _fits(v, declared[key]):
                raise BehaviorError(key, f"must be {' or '.join(_SCALARS[k] for k in declared[key])} "
                                         f"(as {name} declares it), got {v!r}")
        return step

    def start(self) -> Callable[..., Any]:
        """What one world calls every round: a fresh instance of a class, or the function with its
        parameters bound."""
        if inspect.isclass(self.target):
            try:
                return cast(Callable[..., Any], self.target(**self.params))
            except BehaviorError:
                raise
            except TypeError as exc:
                raise BehaviorError("", f"{self.name}: {exc}") from None
        target, params = self.target, dict(self.params)
        if not params:
            return target
        return lambda day, ids, value: target(day, ids, value, **params)

    def recorded_params(self) -> dict[str, Any]:
        """The parameters as given (TOML values, checked by :meth:`of`): for scenario.json."""
        import copy

        return copy.deepcopy(dict(self.params))

    def _key(self) -> tuple[str, str]:
        import json

        return self.name, json.dumps(self.params, sort_keys=True, default=repr)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and self._key() == other._key() and self.target is other.target

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class Behavior:
    """A group's behaviors in order, and the length of a round (which the days' times need)."""

    steps: tuple[Step, ...]
    round_seconds: float = SECONDS_PER_DAY

    def bind(self, seed: int, group: int, max_value: float) -> Bound:
        """A fresh running copy for one world (instances of stateful behaviors are never shared)."""
        return Bound(self, seed, group, max_value)

    def record(self) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        """``behavior`` and ``params`` as a scenario file gives them (one, or arrays for several)."""
        names = [s.name for s in self.steps]
        params = [s.recorded_params() for s in self.steps]
        return (names[0], params[0]) if len(self.steps) == 1 else (names, params)


def compose(spec: str | Callable[..., Any] | Sequence[str | Callable[..., Any]],
            params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
            round_seconds: float = SECONDS_PER_DAY) -> Behavior:
    """A group's :class:`Behavior` from one name/function and its parameters, or lists of them (aligned).
    ``BehaviorError.key`` names the parameter at fault; for lists it is prefixed with the position."""
    if isinstance(spec, (list, tuple)):
        plist = list(params) if params is not None else [{}] * len(spec)
        if not isinstance(params, (list, tuple, type(None))) or len(plist) != len(spec):
            raise BehaviorError("params", f"{len(spec)} behaviors need an array of {len(spec)} tables of "
                                          "parameters")
        steps = []
        for i, (s, p) in enumerate(zip(spec, plist)):
            if not isinstance(p, Mapping):
                raise BehaviorError(f"params[{i}]", f"must be a table, got {p!r}")
            try:
                steps.append(Step.of(s, p))
            except BehaviorError as exc:
                raise BehaviorError(f"[{i}].{exc.key}" if exc.key else f"[{i}]", exc.message) from None
        if not steps:
            raise BehaviorError("", "an empty array of behaviors")
        return Behavior(tuple(steps), float(round_seconds))
    if params is not None and not isinstance(params, Mapping):
        raise BehaviorError("params", f"must be a table, got {params!r}")
    return Behavior((Step.of(cast("str | Callable[..., Any]", spec), params),), float(round_seconds))


class Bound:
    """A group's behaviors running in one world: :meth:`apply` each round, in order, then :meth:`observe`."""

    def __init__(self, behavior: Behavior, seed: int, group: int, max_value: float) -> None:
        self.behavior, self.max_value = behavior, float(max_value)
        self.group = int(group)
        self.calls = [s.start() for s in behavior.steps]
        self.keys = [Keys(int(seed), (int(group), k)) for k in range(len(behavior.steps))]

    def _day(self, k: int, day: int, mean: float) -> Day:
        return Day(day, self.behavior.round_seconds, self.max_value, self.keys[k], mean)

    def _key(self, k: int) -> str:
        """The scenario key of behavior k of this group, for an error raised while it runs."""
        many = len(self.calls) > 1
        return f"population.groups[{self.group}].behavior" + (f"[{k}]" if many else "")

    def apply(self, day: int, ids: np.ndarray, value: np.ndarray, mean: float = math.nan) -> np.ndarray:
        """The group's values on ``day`` from their base values (before clipping)."""
        for k, call in enumerate(self.calls):
            step = self.behavior.steps[k]
            where = self._key(k)
            try:
                # numpy's overflow warnings stay silent: a value that is not finite is this check's one line below
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    out = call(self._day(k, day, mean), ids, value)
            except BehaviorError:
                raise
            except Exception as exc:  # noqa: BLE001 -- name the behavior and the round in one line
                raise BehaviorError(where, f"behavior {step.name} failed in round {day}: "
                                           f"{type(exc).__name__}: {exc}") from exc
            out = np.asarray(out, dtype=np.float64)
            if out.shape != ids.shape:
                raise BehaviorError(where, f"behavior {step.name} returned shape {out.shape} for {ids.shape[0]} "
                                           f"devices in round {day}")
            if not np.isfinite(out).all():
                raise BehaviorError(where, f"behavior {step.name} returned a value that is not finite in round "
                                           f"{day}")
            value = out
        return value

    def changed(self, day: int, ids: np.ndarray, mean: float = math.nan) -> list[tuple[str, np.ndarray]]:
        """(name, devices as a mask over ``ids``) of each behavior whose change reaches devices first on ``day``
        (its ``changed`` hook, :class:`Changing`); called after :meth:`apply` of the same day."""
        out = []
        for k, call in enumerate(self.calls):
            hook = getattr(call, "changed", None)
            if hook is None:
                continue
            step = self.behavior.steps[k]
            try:
                mask = hook(self._day(k, day, mean), ids)
            except Exception as exc:  # noqa: BLE001 -- name the behavior and the round in one line
                raise BehaviorError(self._key(k), f"behavior {step.name}'s changed() failed in round {day}: "
                                                  f"{type(exc).__name__}: {exc}") from exc
            if mask is None:
                continue
            mask = np.asarray(mask)
            if mask.shape != ids.shape or mask.dtype != np.bool_:
                raise BehaviorError(self._key(k), f"behavior {step.name}'s changed() returned {mask.dtype} of "
                                                  f"shape {mask.shape} in round {day}, not a boolean mask of "
                                                  f"{ids.shape[0]} devices")
            if mask.any():
                out.append((step.name, mask))
        return out

    def observe(self, day: int, ids: np.ndarray, values: np.ndarray, mean: float = math.nan) -> None:
        """Tell the behaviors with an ``observe`` hook the group's final values of ``day``."""
        for k, call in enumerate(self.calls):
            hook = getattr(call, "observe", None)
            if hook is not None:
                hook(self._day(k, day, mean), ids, values)
