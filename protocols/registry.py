"""The protocol registry: which parameter class runs a scenario's ``[protocol] name``.

A protocol is a parameter class (the descriptor the runtimes use, protocols.base.ProtocolParams) with a
``from_table(name, table, context)`` class method that parses and checks its own TOML table (protocols.config).
Three ways in:

- the built-in protocols (:data:`BUILTIN`, name -> ``module:Class``, imported on first use);
- installed plugins: a distribution declares an entry point in the group ``ldpsim.protocols`` whose name is
  the protocol's name and whose object is its parameter class, e.g. in its pyproject.toml::

      [project.entry-points."ldpsim.protocols"]
      loloha = "ldpsim_loloha:LolohaParams"

- a ``module:Class`` given as the name itself (``name = "mypkg.proto:MyParams"``), for a protocol under
  development that is importable but not installed.

``ldpsim protocols`` lists what is registered. Lookups are cached per process; nothing is mutated at import.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from protocols.config import ConfigError

if TYPE_CHECKING:
    from protocols.base import ProtocolParams

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "Registered", "RegistryError", "available", "builtin_names", "lookup"]

ENTRY_POINT_GROUP = "ldpsim.protocols"

#: the built-in protocols, in the order they are listed (name -> "module:Class")
BUILTIN: dict[str, str] = {
    "1bitmean": "protocols.onebit:OneBitParams",
    "1bitrrpm": "protocols.onebit:OneBitParams",
    "dbitflip": "protocols.dbitflip:DBitFlipParams",
    "dbitflippm": "protocols.dbitflip:DBitFlipParams",
    "binflip": "protocols.dbitflip:DBitFlipParams",
    "binflipplus": "protocols.binflipplus:BinFlipPlusParams",
    "kflip": "protocols.baselines:KFlipParams",
    "laplace": "protocols.baselines:LaplaceParams",
    "1bitmulti": "protocols.multicounter:MultiParams",
    "thresh": "protocols.thresh:ThreshParams",
    "epochrr": "protocols.epochrr:EpochRRParams",
    "heavythresh": "protocols.heavythresh:HeavyThreshParams",
    "epochkrr": "protocols.epochkrr:EpochKRRParams",
    "topl": "protocols.topl:ToplParams",
    "tops": "protocols.tops_protocol:TopsParams",
}

#: what every parameter class must provide (checked when it is loaded)
REQUIRED = ("from_table", "make_devices", "make_collector", "guarantee", "truth", "estimate_sd")


class RegistryError(ConfigError):
    """A protocol name that does not resolve to a usable parameter class."""


@dataclass(frozen=True)
class Registered:
    """A registered protocol: its name, parameter class, where it came from and a one-line description."""

    name: str
    params: type[ProtocolParams]
    source: str

    @property
    def summary(self) -> str:
        """The class's ``summaries[name]`` if it has one (a class that runs several protocols), else the first
        paragraph of its module's docstring (what the protocol is), else of its own, on one line: whole up to
        :data:`SUMMARY_CHARS`, else cut at a word with "..." (never mid-word)."""
        module = importlib.import_module(self.params.__module__)
        own = getattr(self.params, "summaries", {})
        for doc in (own.get(self.name) if isinstance(own, dict) else None, module.__doc__, self.params.__doc__):
            if doc and doc.strip():
                text = " ".join(doc.strip().split("\n\n")[0].split())
                if len(text) <= SUMMARY_CHARS:
                    return text
                return text[:SUMMARY_CHARS - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
        return ""


#: the longest one-line summary of a protocol (`ldpsim protocols`)
SUMMARY_CHARS = 160


def builtin_names() -> tuple[str, ...]:
    return tuple(BUILTIN)


def _load(spec: str, what: str) -> type:
    """Import ``module:Class`` and check it is a parameter class."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise RegistryError(f"{what}: expected module:Class, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise RegistryError(f"{what}: cannot import module {module!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RegistryError(f"{what}: module {module!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise RegistryError(f"{what}: {spec} is not a class")
    missing = [m for m in REQUIRED if not hasattr(obj, m)]
    if missing:
        raise RegistryError(f"{what}: {spec} is not a protocol parameter class (it lacks {', '.join(missing)})")
    return obj


@lru_cache(maxsize=None)
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


@lru_cache(maxsize=None)
def lookup(name: str) -> Registered:
    """The protocol called ``name``: built-in, an installed plugin's entry point, or ``module:Class``."""
    if name in BUILTIN:
        return Registered(name, _load(BUILTIN[name], f"protocol {name!r}"), "built-in")
    eps = _entry_points()
    if name in eps:
        ep = eps[name]
        dist = ep.dist.name if ep.dist is not None else "an installed package"
        return Registered(name, _load(ep.value, f"protocol {name!r} (entry point of {dist})"), f"plugin: {dist}")
    if ":" in name:
        return Registered(name, _load(name, f"protocol {name!r}"), "module:Class")
    known = list(BUILTIN) + sorted(eps)
    raise RegistryError(f"protocol.name: {name!r} is not a registered protocol (one of {known}, or a "
                        f"module:Class); `ldpsim protocols` lists them")


def available() -> list[Registered]:
    """Every built-in protocol, then every installed plugin (one that fails to load raises RegistryError
    naming it and its package)."""
    out = [lookup(n) for n in BUILTIN]
    for name in sorted(_entry_points()):
        if name in BUILTIN:
            continue
        out.append(lookup(name))
    return out
