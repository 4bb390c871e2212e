"""How to install one of ldpsim's optional extras (``ray``, ``dask``, ``accounting``, ...), in the words that
work where this copy of ldpsim runs from: ``pip install 'ldpsim[ray]'`` for an installed package, and
``pip install -e '/path/to/checkout[ray]'`` for a checkout (run in place or installed editable), where the
first would fetch a second ldpsim from the package index instead."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout when scenarios/ sits beside pyproject.toml


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this ldpsim."""
    if (ROOT / "pyproject.toml").is_file() and (ROOT / "protocols").is_dir():
        return f"pip install -e '{ROOT}[{extra}]'"
    return f"pip install 'ldpsim[{extra}]'"
