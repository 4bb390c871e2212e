"""Figures and table of the behavior-pattern study (Ding et al. 2017, figure 3), from its directory.

    python scenarios/studies/plot_ding_patterns.py docs/ding_patterns    # after scenarios/studies/ding_patterns.py

Reads sweep.json, supports.csv and results.csv (written by ding_patterns.py, which also calls this) and writes:

- ``fig_supports.png``: every pattern's support in decreasing order, against its rank, log-log; one panel per
  app, one line per grid point (each s). The paper's figure 3 plots the supports the same way.
- ``fig_share_at_least_k.png``: the share of devices in patterns with support at least K, against K (log);
  one panel per app, one line per grid point.
- ``summary_table.md``: per app and s, the number of patterns, the largest pattern (its share of the app's
  devices and its width), the second largest, the share of devices alone in their pattern and the shares in
  patterns with support >= 10 and >= 1,000. With several repetitions, a figure is the mean, with its range in
  brackets; the figures plot repetition 0.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from scenarios import plots

S_KEY = "protocol.granularity"


# ------------------------------------------------------------------------------------------- data
def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def duration(seconds: float, m: float | None = None) -> str:
    """A grid step in words: 3600 -> "1 h", 900 -> "15 min", 86400 with m = 86400 -> "24 h = m"."""
    if seconds % 3600 == 0:
        text = f"{seconds / 3600:g} h"
    elif seconds % 60 == 0:
        text = f"{seconds / 60:g} min"
    else:
        text = f"{seconds:g} s"
    return f"{text} = m" if m is not None and seconds == m else text


class Study:
    """A pattern study's directory: its grid (``keys``, in sweep.json order), apps, and per (point label,
    repetition, app) the support counts and the results row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        meta = json.loads((path / "sweep.json").read_text(encoding="utf-8"))
        self.keys: list[str] = list(meta["grid"])
        self.name = str(meta["scenario_data"].get("name", path.name))
        self.max_value = float(meta["scenario_data"].get("protocol", {}).get("max_value", math.nan))
        self.supports: dict[tuple[tuple[str, ...], int, str], list[tuple[int, int]]] = defaultdict(list)
        self.points: list[tuple[str, ...]] = []
        self.apps: list[str] = []
        for row in read_csv(path / "supports.csv"):
            point = tuple(row[k] for k in self.keys)
            if point not in self.points:
                self.points.append(point)
            if row["app"] not in self.apps:
                self.apps.append(row["app"])
            self.supports[(point, int(row["repetition"]), row["app"])].append((int(row["support"]),
                                                                               int(row["patterns"])))
        self.results: dict[tuple[tuple[str, ...], str], list[dict[str, str]]] = defaultdict(list)
        for row in read_csv(path / "results.csv"):
            self.results[(tuple(row[k] for k in self.keys), row["app"])].append(row)
        if S_KEY in self.keys:  # coarse to fine
            j = self.keys.index(S_KEY)
            self.points.sort(key=lambda p: -float(p[j]))

    def label(self, point: tuple[str, ...]) -> str:
        parts = []
        for key, value in zip(self.keys, point):
            if key == S_KEY:
                parts.append(f"s = {duration(float(value), self.max_value)}")
            else:
                parts.append(f"{key} = {value}")
        return ", ".join(parts)


def staircase(counts: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Supports in decreasing order against their rank (1 = the largest), as the corners of a staircase: a
    support shared by c patterns spans c ranks."""
    pairs = sorted(counts, key=lambda sc: -sc[0])
    ranks, values, r = [], [], 1
    for s, c in pairs:
        ranks += [r, r + c - 1]
        values += [s, s]
        r += c
    return np.asarray(ranks, dtype=float), np.asarray(values, dtype=float)


def share_curve(counts: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """K (every support value, ascending) and the share of devices in patterns with support >= K."""
    pairs = sorted(counts)
    k = np.asarray([s for s, _ in pairs], dtype=float)
    devices = np.asarray([s * c for s, c in pairs], dtype=float)
    at_least = devices[::-1].cumsum()[::-1] / devices.sum()
    return k, at_least


# ------------------------------------------------------------------------------------------- figures
def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.9 * j / max(n - 1, 1)) for j in range(n)]


def figure_supports(study: Study, path: Path) -> None:
    fig, axes = plots.subplots(1, len(study.apps), figsize=(4.6 * len(study.apps), 4.4), squeeze=False)
    for ax, app in zip(axes[0], study.apps):
        n = 0
        for colour, point in zip(_colours(len(study.points)), study.points):
            counts = study.supports.get((point, 0, app))
            if not counts:
                continue
            ranks, values = staircase(counts)
            n = sum(s * c for s, c in counts)
            ax.loglog(ranks, values, "-", color=colour, lw=1.4,
                      label=f"{study.label(point)}: {sum(c for _, c in counts):,} patterns")
        ax.set_xlabel("pattern rank (1 = largest support)")
        ax.set_ylabel("support (devices in the pattern)")
        ax.set_title(f"{app}: {n:,} devices", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{study.name}: behavior-pattern supports in decreasing order (Ding et al. 2017, fig. 3)",
                 fontsize=11)
    fig.tight_layout()
    plots.save(fig, path)


def figure_share(study: Study, path: Path) -> None:
    fig, axes = plots.subplots(1, len(study.apps), figsize=(4.6 * len(study.apps), 4.7), squeeze=False)
    for ax, app in zip(axes[0], study.apps):
        for colour, point in zip(_colours(len(study.points)), study.points):
            counts = study.supports.get((point, 0, app))
            if not counts:
                continue
            k, at_least = share_curve(counts)
            ax.step(np.r_[1.0, k], 100.0 * np.r_[1.0, at_least], where="pre", color=colour, lw=1.4,
                    label=study.label(point))
        ax.set_xscale("log")
        ax.set_ylim(0, 102)
        ax.set_xlabel("K (devices)")
        ax.set_ylabel("devices in patterns with support ≥ K (%)")
        ax.set_title(app, fontsize=10)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(f"{study.name}: share of devices that blend with at least K devices (Ding et al. 2017, fig. 3)",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    plots.save(fig, path)


# ------------------------------------------------------------------------------------------- table
def _pct(rows: list[dict[str, str]], col: str, spread: bool = True) -> str:
    """The mean of a share column over repetitions in per cent, with its range when ``spread``."""
    vals = [float(r[col]) for r in rows if r.get(col, "") != ""]
    if not vals:
        return "—"
    text = f"{100 * np.mean(vals):.1f}%"
    return text if len(vals) == 1 or not spread else f"{text} ({100 * min(vals):.1f}–{100 * max(vals):.1f})"


def _int(rows: list[dict[str, str]], col: str) -> str:
    vals = [int(float(r[col])) for r in rows if r.get(col, "") != ""]
    if not vals:
        return "—"
    text = f"{round(float(np.mean(vals))):,}"
    return text if len(vals) == 1 else f"{text} ({min(vals):,}–{max(vals):,})"


def write_table(study: Study, path: Path) -> None:
    reps = max((len(v) for v in study.results.values()), default=0)
    lines = [f"# {study.name}: behavior-pattern supports per app and grid step"
             + (f" (mean over {reps} repetitions, range in brackets)" if reps > 1 else ""), ""]
    for app in study.apps:
        rows0 = next((rs for (p, a), rs in study.results.items() if a == app), [])
        n = int(rows0[0]["app_devices"]) if rows0 else 0
        lines += [f"## {app} ({n:,} devices)", "",
                  "| grid point | patterns | largest pattern | its width | width 1: measured (closed form) | second largest "
                  "| alone (support 1) | support ≤ 2 | support ≥ 10 | support ≥ 1,000 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for point in study.points:
            rows = study.results.get((point, app), [])
            if not rows:
                continue
            widths = sorted({r["largest_width"] for r in rows})
            lines.append(f"| {study.label(point)} | {_int(rows, 'patterns')} | {_pct(rows, 'largest_share')} "
                         f"| {', '.join(widths)} | {_pct(rows, 'width_one_share', spread=False)} "
                         f"({_pct(rows, 'width_one_expected', spread=False)}) | {_pct(rows, 'second_share')} "
                         f"| {_pct(rows, 'share_alone')} "
                         f"| {_pct(rows, 'share_support_le_2')} | {_pct(rows, 'share_support_ge_10')} "
                         f"| {_pct(rows, 'share_support_ge_1000')} |")
        lines.append("")
    lines += ["Shares are of the app's devices. Width: the number of distinct memo inputs (grid values) in the "
              "largest pattern. Width 1: the share of devices that keep one grid value all month (together, the "
              "width-1 pattern); in brackets the alpha-point rule's prediction from their values, the mean of "
              "max(0, 1 - R/s) with R the spread of a device's values. Alone: the share of devices in a pattern "
              "of support 1.", ""]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines), encoding="utf-8")
    tmp.replace(path)


def plot(path: Path) -> list[Path]:
    """Every figure and the table of the study in ``path``; returns what was written."""
    study = Study(Path(path))
    written = [path / "fig_supports.png", path / "fig_share_at_least_k.png", path / "summary_table.md"]
    figure_supports(study, written[0])
    figure_share(study, written[1])
    write_table(study, written[2])
    return written


def main() -> None:
    from study_args import study_dir  # scenarios/studies/study_args.py (run as a script)

    path = study_dir(__doc__, "results.csv")
    plot(path)
    print((path / "summary_table.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
