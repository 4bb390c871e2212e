"""Axis and column labels that carry the unit a scenario gives its counters (``[population] unit``).

Kept apart from scenarios/plots.py so the run's own process can word a picture's labels without importing
matplotlib (the pictures are drawn in a child process, scenarios/plot_process.py).
"""

from __future__ import annotations


def with_unit(label: str, unit: str | None) -> str:
    """``label (unit)``, or the label alone where the scenario does not say what its counters count."""
    return f"{label} ({unit})" if unit else label
