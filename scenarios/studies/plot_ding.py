"""Figures and tables of the Ding et al. figure 6 and 7 studies, from a sweep's sweep.json and results.csv.

    python scenarios/studies/plot_ding.py docs/ding_mean         # scenarios/studies/ding_mean.toml
    python scenarios/studies/plot_ding.py docs/ding_histogram    # scenarios/studies/ding_histogram.toml

A run's error is the sweep's own figure: for a mean, |mean_hat - mean| in seconds averaged over the 31 days
(``error.mean_abs``); for a histogram, max over buckets of |h_hat(v) - h(v)| averaged over the days
(``error.hist_max_abs``). Each point shows its mean over the repetitions with a bar of one standard
deviation over the repetitions (the paper's "one standard deviation"). Dashed, beside every measured curve
and in its colour: the closed form, from the protocol's own ``estimate_sd`` (the exact per-round standard
deviation for fixed inputs) on one day's values of the study's distribution (a 400,000-value Monte Carlo
sample: the level distribution plus the daily jitter, clipped to [0, m]):
- a mean: E|N(0, sd^2)| = sd sqrt(2/pi);
- a histogram: E[max_v |N(0, sd_v^2)|] over the k buckets (Monte Carlo over 20,000 normal vectors).

Writes fig_vs_n.png (eps = 1), fig_vs_eps.png (the largest n), fig_grid.png (every eps, against n) and
summary_table.md. Nothing here names a protocol: labels come from each run's [protocol] table.
"""

from __future__ import annotations

import copy
import csv
import json
import math
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from scenarios import schema  # noqa: E402
from scenarios.sweep import value_labels  # noqa: E402

SAMPLE = 400_000  # one day's values drawn for the closed forms
NORMALS = 20_000  # normal vectors for E[max_v |N(0, sd_v^2)|]
RNG_SEED = 0


# ------------------------------------------------------------------------------------------- data
class StudyError(ValueError):
    """A directory that holds another sweep than these studies: the script says so in one line."""


def canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def set_path(data: dict[str, Any], key: str, value: Any) -> None:
    """data[key] = value for a dotted scenario key (integers index arrays), as ``--set`` does."""
    parts = key.strip().split(".")
    node: Any = data
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(parts[-1])] = copy.deepcopy(value)
    else:
        node[parts[-1]] = copy.deepcopy(value)


class Study:
    """A finished sweep of one of the two studies: its grid keys by role and every run's error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sweep = json.loads((path / "sweep.json").read_text(encoding="utf-8"))
        grid = self.sweep["grid"]
        role = {k.strip(): k for k in grid}  # the study files write "protocol " (see their comment)
        needed = ("population.devices", "protocol", "protocol.epsilon", "population.groups.0")
        if any(k not in role for k in needed):
            raise StudyError(f"{path}: not a ding_mean or ding_histogram study: its grid varies "
                             f"{', '.join(k.strip() for k in grid)}, where these studies vary {', '.join(needed)}")
        self.k_n, self.k_proto = role["population.devices"], role["protocol"]
        self.k_eps, self.k_group = role["protocol.epsilon"], role["population.groups.0"]
        self.ns = sorted(grid[self.k_n])
        self.epss = sorted(grid[self.k_eps])
        self.variants = [canon(t) for t in grid[self.k_proto]]  # in the study file's order
        self.tables = {canon(t): t for t in grid[self.k_proto]}
        self.groups = {g["name"]: g for g in grid[self.k_group]}
        self.kind = ""
        self.cells: dict[tuple[str, str, int, float], list[float]] = defaultdict(list)
        # results.csv (one row per run; runs.jsonl need not be kept): a varied key's cell is its value's label
        # (ldpsim sweep's value_labels; older sweeps wrote a table's compact JSON), matched back to the value
        values = {k: {canon(v): v for v in vs} | {repr(v): v for v in vs} | {str(v): v for v in vs}
                  | dict(zip(value_labels(vs), vs)) for k, vs in grid.items()}
        with open(path / "results.csv", newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                pt = {k: values[k][row[k]] for k in grid}
                self.kind = "histogram" if row.get("error_hist_max_abs") not in (None, "") else "mean"
                value = row["error_hist_max_abs"] if self.kind == "histogram" else row["error_mean_abs"]
                if value not in (None, ""):
                    self.cells[(canon(pt[self.k_proto]), pt[self.k_group]["name"], int(pt[self.k_n]),
                                float(pt[self.k_eps]))].append(float(value))
        self.repeat = int(self.sweep["repeat"])
        self.days = int(self.sweep["scenario_data"]["rounds"])  # rounds of a day each
        self.m = float(self.sweep["scenario_data"]["protocol"]["max_value"])
        self._params: dict[tuple[str, float], Any] = {}
        self._days: dict[str, np.ndarray] = {}
        self._closed: dict[tuple[str, str, int, float], float] = {}
        self._z: np.ndarray | None = None

    # ------------------------------------------------------------------ closed forms
    def params(self, variant: str, eps: float) -> Any:
        """The protocol's parameter object at ``eps`` (parsed from the study's scenario at that point)."""
        key = (variant, eps)
        if key not in self._params:
            data = copy.deepcopy(self.sweep["scenario_data"])
            set_path(data, "protocol", self.tables[variant])
            set_path(data, "protocol.epsilon", float(eps))
            self._params[key] = schema.parse(data).protocol
        return self._params[key]

    def day_values(self, group: str) -> np.ndarray:
        """One day's values of the group's devices: level (constant, uniform or normal, truncated to [0, m]
        when asked) plus normal jitter, clipped to [0, m] (agents/world.py's model), by Monte Carlo."""
        if group not in self._days:
            rng = np.random.default_rng(RNG_SEED)
            g = self.groups[group]
            c = g["counter"]
            if c["dist"] == "constant":
                level = np.full(SAMPLE, float(c["value"]))
            elif c["dist"] == "uniform":
                level = rng.uniform(c["low"], c["high"], SAMPLE)
            elif c["dist"] == "normal":
                draws = rng.normal(c["mean"], c["sd"], 4 * SAMPLE)
                if c.get("truncate", False):
                    draws = draws[(draws >= 0) & (draws <= self.m)]
                level = draws[:SAMPLE]
            else:
                raise ValueError(f"counter {c['dist']!r}: not a distribution of these studies")
            jitter = g.get("jitter", {"dist": "none"})
            sd = float(jitter.get("sd", 0.0)) if jitter.get("dist") == "normal" else 0.0
            self._days[group] = np.clip(level + (rng.normal(0, sd, SAMPLE) if sd > 0 else 0.0), 0.0, self.m)
        return self._days[group]

    def closed_form(self, variant: str, group: str, n: float, eps: float) -> float:
        """The expected run error for n reports at eps (module docstring)."""
        key = (variant, group, int(round(n)), float(eps))
        if key not in self._closed:
            sd = np.asarray(self.params(variant, eps).estimate_sd(self.day_values(group), key[2]), dtype=np.float64)
            if self.kind == "mean":
                self._closed[key] = float(sd) * math.sqrt(2 / math.pi)
            else:
                if self._z is None or self._z.shape[1] != sd.size:
                    self._z = np.abs(np.random.default_rng(RNG_SEED + 1).standard_normal((NORMALS, sd.size)))
                self._closed[key] = float((self._z * sd).max(axis=1).mean())
        return self._closed[key]

    # ------------------------------------------------------------------ measured
    def stats(self, variant: str, group: str, n: int, eps: float) -> tuple[float, float, int]:
        """Mean, standard deviation over the repetitions, and the number of repetitions."""
        v = np.array(self.cells.get((variant, group, n, eps), []))
        if v.size == 0:
            return math.nan, math.nan, 0
        return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0, int(v.size)


# ------------------------------------------------------------------------------------------- labels, styles
def fraction_text(x: float) -> str:
    return f"{x:g}" if abs(x * 100 - round(x * 100)) < 1e-9 else str(Fraction(x).limit_denominator(100))


def label(table: dict[str, Any]) -> str:
    """A variant's label from its [protocol] table: its name, d when it has bits, OP(gamma) when gamma > 0."""
    text = str(table["name"])
    if "bits" in table:
        text += f", d = {table['bits']}"
    if float(table.get("gamma", 0.0)) > 0:
        text += f" + OP(γ = {fraction_text(float(table['gamma']))})"
    return text


def styles(study: Study) -> dict[str, tuple[Any, str]]:
    """A colour and marker per variant: the variants with ``bits`` in blues by d, the rest from a
    qualitative map, in the study file's order."""
    out: dict[str, tuple[Any, str]] = {}
    with_bits = [v for v in study.variants if "bits" in study.tables[v]]
    blues = plt.cm.Blues(np.linspace(0.45, 0.95, max(len(with_bits), 1)))
    others = [v for v in study.variants if v not in with_bits]
    qual = ["tab:red", "tab:orange", "tab:purple", "black", "tab:green", "tab:brown", "tab:gray"]
    order = ["black", "tab:red", "tab:green"] if with_bits else ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    markers = "osD^vP*X"
    for i, v in enumerate(with_bits):
        out[v] = (blues[i], markers[i % len(markers)])
    for i, v in enumerate(others):
        out[v] = ((order + qual)[i], markers[(i + len(with_bits)) % len(markers)])
    return out


def ylabel(study: Study) -> str:
    return ("mean absolute error of the daily mean (seconds)" if study.kind == "mean"
            else "histogram error: max bucket error (frequency)")


# ------------------------------------------------------------------------------------------- figures
#: said in a figure's title when a panel left out a lower error bar
NO_LOWER_BAR = "a lower bar reaching 0 or below is left out (log axis)"


def panel(ax: Any, study: Study, group: str, axis: str, fixed: float, style: dict[str, tuple[Any, str]],
          closed: bool = True) -> int:
    """One panel: every variant against n (at eps = fixed) or against eps (at n = fixed). Returns the points
    whose lower error bar (mean - sd <= 0) a log axis cannot draw, left out (it was drawn to the panel's
    bottom, as if the error could reach 0)."""
    omitted = 0
    xs = study.ns if axis == "n" else study.epss
    fine = np.geomspace(min(xs), max(xs), 25)
    for v in study.variants:
        color, marker = style[v]
        pts = [study.stats(v, group, int(x), float(fixed)) if axis == "n" else study.stats(v, group, int(fixed), x)
               for x in xs]
        mean = np.array([p[0] for p in pts])
        sd = np.array([p[1] for p in pts])
        low = np.where(mean - sd > 0, sd, 0.0)
        omitted += int(np.count_nonzero(mean - sd <= 0))
        ax.errorbar(xs, mean, yerr=np.vstack([low, sd]), fmt=marker + "-", ms=4, lw=1.2, capsize=2, color=color,
                    label=label(study.tables[v]))
        if closed:
            cf = [study.closed_form(v, group, x, fixed) if axis == "n" else study.closed_form(v, group, fixed, x)
                  for x in fine]
            ax.plot(fine, cf, "--", lw=0.9, color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    # ticked at the grid's own values, written plainly (matplotlib's 3×10⁻¹ and 4×10⁻¹ ran into each other)
    ax.set_xticks(xs, [f"{int(x):,}" if axis == "n" else f"{x:g}" for x in xs])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.25)
    return omitted


def figure(study: Study, axis: str, fixed: float, out: Path) -> None:
    style = styles(study)
    groups = list(study.groups)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.6), sharey=True, squeeze=False)
    omitted = 0
    for c, group in enumerate(groups):
        ax = axes[0][c]
        omitted += panel(ax, study, group, axis, fixed, style)
        ax.set_title(f"{group} counters, " + (f"ε = {fixed:g}" if axis == "n" else f"n = {int(fixed):,}"),
                     fontsize=10)
        ax.set_xlabel("devices n (reports per day)" if axis == "n" else "ε (per report)")
        if c == 0:
            ax.set_ylabel(ylabel(study))
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle(f"{study.sweep['scenario_data']['name']}: mean ± 1 sd over {study.repeat} repetitions of "
                 f"{study.days} days; dashed: closed form" + (f"\n{NO_LOWER_BAR}" if omitted else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def grid_figure(study: Study, out: Path) -> None:
    style = styles(study)
    groups = list(study.groups)
    fig, axes = plt.subplots(len(groups), len(study.epss), figsize=(3.6 * len(study.epss), 3.1 * len(groups)),
                             sharex=True, squeeze=False)
    omitted = 0
    for r, group in enumerate(groups):
        for c, eps in enumerate(study.epss):
            ax = axes[r][c]
            omitted += panel(ax, study, group, "n", eps, style)
            ax.set_title(f"{group}, ε = {eps:g}", fontsize=9)
            if r == len(groups) - 1:
                ax.set_xlabel("devices n")
            if c == 0:
                ax.set_ylabel("seconds" if study.kind == "mean" else "max bucket error")
    handles, labels = axes[0][0].get_legend_handles_labels()  # below the panels, off every curve
    ncol = min(len(labels), 4)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(f"{study.sweep['scenario_data']['name']}: {ylabel(study)} against n at every ε "
                 f"(mean ± 1 sd over {study.repeat} repetitions; dashed: closed form"
                 + (f"; {NO_LOWER_BAR})" if omitted else ")"), fontsize=11, wrap=True)
    rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, (0.25 + 0.22 * rows) / fig.get_figheight(), 1, 0.95))
    fig.savefig(out, dpi=90)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- tables
def fmt(x: float, kind: str) -> str:
    if not math.isfinite(x):
        return "–"
    return f"{x:,.0f}" if kind == "mean" else f"{x:.4f}"


def table_rows(study: Study, group: str, axis: str, fixed: float) -> list[str]:
    xs = study.ns if axis == "n" else study.epss
    head = ("n" if axis == "n" else "ε") + " | " + " | ".join(label(study.tables[v]) for v in study.variants)
    lines = [f"| {head} |", "|---|" + "---|" * len(study.variants)]
    for x in xs:
        cells = []
        for v in study.variants:
            n, eps = (int(x), fixed) if axis == "n" else (int(fixed), x)
            mean, sd, _ = study.stats(v, group, n, float(eps))
            cells.append(f"{fmt(mean, study.kind)} ± {fmt(sd, study.kind)} ({fmt(study.closed_form(v, group, n, eps), study.kind)})")
        lines.append(f"| {x:,} | " + " | ".join(cells) + " |" if axis == "n" else f"| {x:g} | " + " | ".join(cells) + " |")
    return lines


def pooled_ratios(study: Study) -> list[str]:
    """Per variant: measured / closed form over every (distribution, n, eps) point, mean and the range."""
    lines = ["| variant | measured / closed form: mean over all points | min | max | points |", "|---|---|---|---|---|"]
    for v in study.variants:
        ratios = []
        for group in study.groups:
            for n in study.ns:
                for eps in study.epss:
                    mean, _, k = study.stats(v, group, n, eps)
                    if k:
                        ratios.append(mean / study.closed_form(v, group, n, eps))
        r = np.array(ratios)
        lines.append(f"| {label(study.tables[v])} | {r.mean():.3f} | {r.min():.3f} | {r.max():.3f} | {r.size} |")
    return lines


def write_tables(study: Study, out: Path) -> None:
    eps1 = min(study.epss, key=lambda e: abs(math.log(e)))
    lines = [f"# {study.sweep['scenario_data']['name']}: measured mean ± 1 sd over {study.repeat} repetitions "
             "(closed form in brackets)", ""]
    for group in study.groups:
        lines += [f"## {group} counters, ε = {eps1:g}, against n", ""] + table_rows(study, group, "n", eps1) + [""]
    for group in study.groups:
        lines += [f"## {group} counters, n = {study.ns[-1]:,}, against ε", ""]
        lines += table_rows(study, group, "eps", study.ns[-1]) + [""]
    lines += ["## Measured against closed form, every point", ""] + pooled_ratios(study) + [""]
    out.write_text("\n".join(lines), encoding="utf-8")


def main() -> None:
    from study_args import study_dir  # scenarios/studies/study_args.py (run as a script)

    path = study_dir(__doc__, "results.csv")
    try:
        study = Study(path)
    except StudyError as exc:
        raise SystemExit(f"plot_ding.py: error: {exc}") from None
    eps1 = min(study.epss, key=lambda e: abs(math.log(e)))
    figure(study, "n", eps1, path / "fig_vs_n.png")
    figure(study, "eps", study.ns[-1], path / "fig_vs_eps.png")
    grid_figure(study, path / "fig_grid.png")
    write_tables(study, path / "summary_table.md")
    print((path / "summary_table.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
