"""Strict JSON out: RFC 8259 has no NaN or infinity, and Python's ``json`` writes them as bare ``NaN`` and
``Infinity``, which most other readers (jq, JavaScript, pandas' strict mode, Go) reject.

:func:`finite` replaces each non-finite float by ``null`` and says where it was, so a file can record what
the null stands for (summary.json's ``non_finite``) instead of passing an unknown off as a number.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["finite", "dumps", "document", "write_document", "MEANING"]

#: what a ``non_finite`` entry says about the nulls it lists
MEANING = "these figures are null in this file: not finite (nan: undefined, inf: unbounded or infeasible)"


def _label(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def finite(obj: Any, where: str = "") -> tuple[Any, dict[str, str]]:
    """``obj`` (dicts, lists, tuples, scalars) with every NaN or infinite float as None, and a dict from each
    such value's dotted path (``parameters.derived.a``, ``rounds[3].theta``) to ``"nan"``, ``"inf"`` or
    ``"-inf"``."""
    found: dict[str, str] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, float):
            if math.isfinite(o):
                return o
            found[path] = _label(o)
            return None
        if isinstance(o, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(o)]
        return o

    return walk(obj, where), found


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite`'s copy of ``obj``: never a bare NaN or Infinity."""
    return json.dumps(finite(obj)[0], allow_nan=False, **kwargs)


def document(obj: Any) -> Any:
    """:func:`finite`'s copy of ``obj`` that says where its nulls stand for non-finite figures: a dict gets a
    ``non_finite`` entry ({"values": {path: "nan" | "inf" | "-inf"}, "meaning": ...}) when it held any; a
    list of dicts gets one in each dict that did. Anything else: the copy alone."""
    if isinstance(obj, list) and all(isinstance(o, dict) for o in obj):
        return [document(o) for o in obj]
    clean, found = finite(obj)
    if found and isinstance(clean, dict):
        clean["non_finite"] = {"values": found, "meaning": MEANING}
    return clean


def write_document(obj: Any, **kwargs: Any) -> str:
    """The strict JSON text of :func:`document`'s copy of ``obj``."""
    return json.dumps(document(obj), allow_nan=False, **kwargs)
