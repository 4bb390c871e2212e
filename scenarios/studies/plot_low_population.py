"""Figures and the summary table of the low-population study, from its sweep's results.csv.

    python scenarios/studies/plot_low_population.py docs/low_population

Writes fig_hist_max_abs.png and fig_wasserstein.png (rows: counter distribution; columns: d; x: n; one
line per eps, mean and one standard error over the repetitions; dashed: the closed-form prediction of the
max bucket error, E[max_v |N(0, Var_v)|] with the exact per-bucket variances of histogram_variance for
each distribution's bucket frequencies), fig_spend.png, and summary_table.md.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from protocols.dbitflip import histogram, histogram_variance  # noqa: E402

K = 32
KEYS = ("population.devices", "protocol.epsilon", "protocol.bits", "population.groups.0.counter")
DISTS = ("constant", "uniform", "normal")
HISTS: dict[str, np.ndarray] = {}


def load(path: Path) -> dict[tuple, list[dict[str, float]]]:
    cells: dict[tuple, list[dict[str, float]]] = defaultdict(list)
    with open(path / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        missing = [k for k in KEYS if k not in (reader.fieldnames or [])]
        if missing:
            raise SystemExit(f"plot_low_population.py: error: {path}: not a low_population study: its results.csv "
                             f"has no column {', '.join(missing)}")
        for row in reader:
            key = (int(row[KEYS[0]]), float(row[KEYS[1]]), int(row[KEYS[2]]), row[KEYS[3]])
            cells[key].append({k: float(v) for k, v in row.items() if k.startswith(("error_", "epsilon_"))})
    return cells


def study_histograms(draws: int = 2_000_000) -> dict[str, np.ndarray]:
    """Bucket frequencies h of each counter distribution of the study (its level distribution plus the
    N(0, 0.5^2) jitter, clipped to [0, 24]), by Monte Carlo with a fixed seed."""
    rng = np.random.default_rng(0)
    levels = {"constant": np.full(draws, 9.5), "uniform": rng.uniform(0, 24, draws)}
    tn = rng.normal(9, 4, 3 * draws)
    levels["normal"] = tn[(tn >= 0) & (tn <= 24)][:draws]
    return {k: histogram(np.clip(v + rng.normal(0, 0.5, v.size), 0, 24), K, 24.0) for k, v in levels.items()}


def predicted_max_error(n: np.ndarray, eps: float, d: int, h: np.ndarray) -> np.ndarray:
    """E[max_v |h_hat(v) - h(v)|] for normal errors with the exact per-bucket variances
    (protocols.dbitflip.histogram_variance), by Monte Carlo over the k buckets."""
    z = np.abs(np.random.default_rng(1).standard_normal((20_000, K)))
    return np.array([(z * np.sqrt(histogram_variance(h, int(m), K, d, eps))).max(axis=1).mean() for m in n])


def facet(cells, metric: str, ylabel: str, out: Path, theory: bool) -> None:
    ns = sorted({k[0] for k in cells})
    epss = sorted({k[1] for k in cells})
    ds = sorted({k[2] for k in cells})
    fig, axes = plt.subplots(len(DISTS), len(ds), figsize=(4.2 * len(ds), 3.3 * len(DISTS)), sharex=True,
                             sharey=True, squeeze=False)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(epss)))
    for r, dist in enumerate(DISTS):
        for c, d in enumerate(ds):
            ax = axes[r][c]
            for eps, color in zip(epss, colors):
                vals = [np.array([row[metric] for row in cells[(n, eps, d, dist)]]) for n in ns]
                mean = np.array([v.mean() for v in vals])
                se = np.array([v.std(ddof=1) / math.sqrt(v.size) for v in vals])
                ax.errorbar(ns, mean, yerr=se, fmt="o-", ms=3, lw=1.2, color=color, label=f"ε = {eps:g}")
                if theory:
                    ax.plot(ns, predicted_max_error(np.array(ns), eps, d, HISTS[dist]), "--", lw=0.9,
                            color=color)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.25)
            ax.set_title(f"{dist}, d = {d}", fontsize=10)
            if r == len(DISTS) - 1:
                ax.set_xlabel("devices n")
            if c == 0:
                ax.set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8, loc="upper right")
    fig.suptitle(f"dBitFlipPM, k = {K} buckets on [0, 24] h: {ylabel} (mean ± 1 s.e. over repetitions)"
                 + ("; dashed: closed form" if theory else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def table(cells, out: Path) -> None:
    """The smallest n in the grid whose mean max bucket error is at most 0.05 (uniform counters)."""
    ns = sorted({k[0] for k in cells})
    epss = sorted({k[1] for k in cells})
    ds = sorted({k[2] for k in cells})
    lines = ["| ε \\ d | " + " | ".join(f"d = {d}" for d in ds) + " |", "|---|" + "---|" * len(ds)]
    for eps in epss:
        row = []
        for d in ds:
            ok = [n for n in ns if np.mean([x["error_hist_max_abs"] for x in cells[(n, eps, d, "uniform")]]) <= 0.05]
            row.append(f"{ok[0]:,}" if ok else f"> {ns[-1]:,}")
        lines.append(f"| {eps:g} | " + " | ".join(row) + " |")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def spend(cells, out: Path) -> None:
    epss = sorted({k[1] for k in cells})
    ds = sorted({k[2] for k in cells})
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    width = 0.8 / len(DISTS)
    n = 10_000 if any(k[0] == 10_000 for k in cells) else max(k[0] for k in cells)  # the study's n, or the largest
    for i, dist in enumerate(DISTS):
        ratio = [np.mean([x["epsilon_mean"] / eps for x in cells.get((n, eps, d, dist), [])] or [np.nan])
                 for d in ds for eps in epss[:1]]
        ax.bar(np.arange(len(ds)) + i * width, ratio, width, label=dist)
    ax.set_xticks(np.arange(len(ds)) + width, [f"d = {d}" for d in ds])
    ax.set_ylabel("mean spend / ε (distinct reports revealed)")
    ax.set_title(f"memoized reports revealed per device over 4 rounds (n = {n:,})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    from study_args import study_dir  # scenarios/studies/study_args.py (run as a script)

    path = study_dir(__doc__, "results.csv")
    cells = load(path)
    HISTS.update(study_histograms())
    facet(cells, "error_hist_max_abs", "max bucket error", path / "fig_hist_max_abs.png", theory=True)
    facet(cells, "error_wasserstein", "Wasserstein-1 (hours)", path / "fig_wasserstein.png", theory=False)
    spend(cells, path / "fig_spend.png")
    table(cells, path / "summary_table.md")
    print((path / "summary_table.md").read_text())


if __name__ == "__main__":
    main()
