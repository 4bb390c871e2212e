"""Housekeeping CI checks: the type checker passes on every package, and every package says what it holds.

The type check is mypy with the configuration in pyproject.toml ([tool.mypy]: protocols/, agents/, collector/ and
scenarios/, the study scripts included); it verifies, among the rest,
every protocol's parameter class against protocols.base.ProtocolParams and through it its device and collector
sides against DeviceSide and CollectorSide (each protocol module ends with that check).
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "agents", "collector", "scenarios")


def test_mypy_passes_on_every_package() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"mypy {' '.join(PACKAGES)}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("name", PACKAGES)
def test_a_package_lists_its_modules_and_imports_none_of_them(name: str) -> None:
    """``__all__`` names every module of the package (and a docstring says what it holds); importing the
    package alone imports none of them (no numba compilation, no SimPy, for ``import protocols``)."""
    package = importlib.import_module(name)
    modules = sorted(m.name for m in pkgutil.iter_modules(package.__path__))
    assert sorted(package.__all__) == modules
    assert package.__doc__ and "placeholder" not in package.__doc__
    probe = (f"import sys; import {name}; "
             f"print(sorted(m for m in sys.modules if m.startswith('{name}.') or m in ('numba', 'simpy')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
