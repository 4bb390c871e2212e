"""Axis and column labels that carry the unit a scenario gives its counters (``[population] unit``).

Kept apart from scenarios/plots.py so the run's own process can word a picture's labels without importing
matplotlib (the pictures are drawn in a child process, scenarios/plot_process.py).
"""

from __future__ import annotations

#: the estimates picture's default legend entries for a mean (scenarios/plots.estimates_plot)
TRUTH_MEAN = "truth (mean over the devices present)"
BAND = "truth ± 1.96 sd (theory)"


def with_unit(label: str, unit: str | None) -> str:
    """``label (unit)`` for a picture, or the label alone where the scenario does not say what its counters
    count. A ``$`` in the unit is drawn as itself (matplotlib reads text between two as math and failed on
    ``$_$``)."""
    return f"{label} ({plain(unit)})" if unit else label


def plain(text: str) -> str:
    """``text`` drawn by matplotlib as written: its ``$`` escaped."""
    return text.replace("$", r"\$")
