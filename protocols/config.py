"""Reading a protocol's parameter table: strict, with errors that name the key (docs/design.md section 7).

A scenario's ``[protocol]`` table is parsed by the protocol itself: the registry (protocols/registry.py) finds
the parameter class for ``name`` and calls its ``from_table(name, table, context)``, which reads its keys
through a :class:`Table` (typed ``get`` with a check and a description of what is allowed) and the run's
:class:`Context`. Unknown keys, wrong types and inconsistent values raise :class:`ConfigError` (the scenario
loader raises its own subclass) with a message that starts with the offending key. Sans-IO: no file access.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ConfigError", "Context", "Table", "epsilon", "optional_epsilon", "max_value", "holdout_share",
           "positive", "GAMMA", "EPSILON_RANGE", "TOTAL_EPSILON_RANGE",
           "MAX_VALUE_RANGE"]

#: how an error names the type a key needs
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", dict: "a table",
               list: "an array"}


class ConfigError(ValueError):
    """A parameter table that cannot run; the message starts with the offending key."""


@dataclass(frozen=True)
class Context:
    """What a protocol's table may depend on besides its own keys: the run's rounds (days), devices, groups
    (and the smallest group's size), seed and collector behavior."""

    rounds: int
    devices: int
    groups: int = 1
    smallest_group: int = 0
    seed: int = 0
    behavior: str = "honest"


class Table:
    """One TOML table, remembering which keys were used so the rest can be reported as unknown. ``error`` is
    the exception class raised (a subclass of ConfigError)."""

    def __init__(self, data: Any, where: str, error: type[ConfigError] = ConfigError) -> None:
        if not isinstance(data, dict):
            raise error(f"{where or 'scenario'}: must be a table")
        self.data: dict[str, Any] = data
        self.where, self.error = where, error
        self.used: set[str] = set()

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, message: str) -> ConfigError:
        """The error for ``key``: ``where.key: message``."""
        return self.error(f"{self.path(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...,
            check: Callable[[Any], bool] | None = None, what: str = "") -> Any:
        """The value of ``key``, of type ``kind`` (an int is accepted for a float), passing ``check`` (else an
        error saying it must be ``what``); ``default`` when absent (``...``: required)."""
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                self._unknown_near(key)
                raise self.fail(key, "required")
            return default
        given = v = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
            names = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
            raise self.fail(key, f"must be {names}, got {given!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise self.fail(key, f"must be finite, got {given}")
        if check is not None and not check(v):
            raise self.fail(key, f"must be {what}, got {given!r}")  # as written: 65536, not 65536.0
        return v

    def table(self, key: str, default: Any = ...) -> "Table":
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise self.fail(key, "required table")
            return Table({}, self.path(key), self.error)
        return Table(self.data[key], self.path(key), self.error)

    def _unknown_near(self, key: str) -> None:
        """A required key is missing: a misspelled key given instead is the real error, so name it."""
        unread = sorted(set(self.data) - self.used)
        close = difflib.get_close_matches(key, unread, n=1, cutoff=0.75)
        if not close and len(key) >= 2:  # a short key lengthened (sd -> sdev) is too far for the ratio
            close = [k for k in unread if k.startswith(key)][:1]
        if close:
            raise self.fail(close[0], f"unknown key (did you mean {key}?)")

    def done(self) -> None:
        """Every key was read: anything else is unknown (with the closest known key as a hint)."""
        extra = sorted(set(self.data) - self.used)
        if extra:
            close = difflib.get_close_matches(extra[0], sorted(self.used), n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise self.fail(extra[0], f"unknown key{hint}")


def positive(v: float) -> bool:
    return v > 0


def holdout_share(table: Table, devices: int) -> float:
    """``holdout``: a share of devices in (0, 1), or a number of devices (converted to a share)."""
    hold = table.get("holdout", float, check=lambda v: 0 < v < devices,
                     what=f"a share in (0, 1) or a number of devices below {devices}")
    return hold if hold < 1 else hold / devices


#: the range of a privacy parameter of one mechanism (the papers' figures stop at 10). Below 1e-6, e^eps - 1
#: loses most of its digits in floating point (at 1e-17 it is 0 and every estimator divides by zero). Above
#: 10, the (eps, delta) accountant's hockey-stick curves, evaluated up to likelihood ratios e^eps, carry
#: rounding of about e^eps x 2^-52 (2e-8 at eps = 20: more than the delta = 1e-9 it reports), and past 30 a
#: probability 1/(e^eps + 1) vanishes next to 1 (at 40 a loss of eps comes out infinite).
EPSILON_RANGE = (1e-6, 10.0)

#: the range of a total epsilon spread over a run's epochs (THRESH, its baselines): each epoch's or message's
#: share must then lie in :data:`EPSILON_RANGE`
TOTAL_EPSILON_RANGE = (1e-6, 1000.0)

#: the range of ``max_value`` (the counter's units): squared errors of values up to 1e15 stay finite in
#: doubles, and a domain below 1e-9 is below the resolution of any telemetry counter
MAX_VALUE_RANGE = (1e-9, 1e15)


def _within(bounds: tuple[float, float]) -> Callable[[Any], bool]:
    return lambda v: bounds[0] <= v <= bounds[1]


def epsilon(table: Table, key: str = "epsilon", default: Any = ..., total: bool = False) -> float:
    """A privacy parameter: a number in [1e-6, 10] (:data:`EPSILON_RANGE`); with ``total``, a run's total
    that the protocol divides (:data:`TOTAL_EPSILON_RANGE`)."""
    v = optional_epsilon(table, key, default, total)
    assert v is not None  # default is a number or required
    return v


def optional_epsilon(table: Table, key: str, default: Any = None, total: bool = False) -> float | None:
    """A privacy parameter that may be left out (None: derived by the protocol)."""
    bounds = TOTAL_EPSILON_RANGE if total else EPSILON_RANGE
    v = table.get(key, float, default, check=_within(bounds), what=f"a number in [{bounds[0]:g}, {bounds[1]:g}]")
    return v if v is None else float(v)


def max_value(table: Table) -> float:
    """``max_value``, the top of the counter's domain [0, m]: a number in [1e-9, 1e15] (:data:`MAX_VALUE_RANGE`)."""
    low, high = MAX_VALUE_RANGE
    return float(table.get("max_value", float, check=_within(MAX_VALUE_RANGE), what=f"a number in [{low:g}, {high:g}]"))


#: ``get`` keywords of output perturbation's flip probability gamma (Ding et al. 2017, section 3.2)
GAMMA: dict[str, Any] = dict(check=lambda v: 0 <= v < 0.5, what="a number in [0, 0.5)")
