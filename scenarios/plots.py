"""Run-directory pictures: estimate against truth per round, and per-device spend over time.

Figures are plain ``matplotlib.figure.Figure`` objects drawn by the Agg canvas (the same bytes as pyplot's
Agg figures): drawing a run directory never imports pyplot nor touches its global figure registry (the run
directory's tables are written by another thread meanwhile, scenarios/output.py). ``plots.plt`` (pyplot, Agg
backend) is still there for code that wants it, imported on first use.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
import numpy as np  # noqa: E402

from scenarios.labels import BAND, TRUTH_MEAN, with_unit  # noqa: E402

#: the legend entry of the dotted lines at the rounds a scripted change or a behavior's step or trigger happened
CHANGE_LABEL = "change ([[changes]] or a behavior)"


def subplots(*args: Any, figsize: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """``plt.subplots(*args, figsize=..., **kwargs)`` without pyplot: a Figure (not registered with pyplot's
    figure manager, so nothing to close) and its axes."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


def count_axis(ax: Any, label: str) -> None:
    """Label the x axis of rounds or epochs and tick it at whole numbers only (a run of 3 rounds is ticked 1, 2,
    3, not 1.0, 1.5, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def __getattr__(name: str) -> Any:
    if name == "plt":  # pyplot on demand (Agg: matplotlib.use above)
        import matplotlib.pyplot as plt

        return plt
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def save(fig: Figure, path: Path, dpi: int = 110) -> None:
    """Write a figure under a temporary name beside ``path`` and move it into place: a reader never sees a
    half-written picture."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        _close(fig)


def _close(fig: Figure) -> None:
    """Forget a pyplot figure (one made by plt.subplots elsewhere); Figures made here need nothing."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(fig)


def estimates_plot(path: Path, rounds: np.ndarray, truth: np.ndarray, estimate: np.ndarray, sd: np.ndarray,
                   title: str, change_rounds: list[int], ylabel: str = "mean counter",
                   truth_label: str = TRUTH_MEAN, band_label: str = BAND, error_label: str = "estimate − truth"
                   ) -> None:
    """Truth and estimate per round with the theory's ±1.96 sd band (none where ``sd`` is NaN), and the error
    below; ``ylabel`` and ``truth_label`` say what is estimated (a mean, or a sum for ToPL and ToPS), ``ylabel``
    and ``error_label`` in which unit (:func:`with_unit`)."""
    fig, (top, bottom) = subplots(2, 1, figsize=(9, 6), sharex=True, height_ratios=(3, 1.3))
    if np.isfinite(sd).any():
        top.fill_between(rounds, truth - 1.96 * sd, truth + 1.96 * sd, color="tab:blue", alpha=0.15,
                         label=band_label)
    top.plot(rounds, truth, color="tab:blue", lw=2, label=truth_label)
    top.plot(rounds, estimate, "o-", color="tab:orange", ms=3.5, lw=1, label="estimate")
    for i, r in enumerate(change_rounds):
        for ax in (top, bottom):
            ax.axvline(r, color="grey", ls=":", lw=1, label=CHANGE_LABEL if ax is top and i == 0 else None)
    top.set_ylabel(ylabel)
    fig.suptitle(title)
    # above the axes, in one row: inside them it covered the late rounds' points
    labels = top.get_legend_handles_labels()[1]  # one row when they fit the width, else two, else one a row
    ncol = 4 if sum(map(len, labels)) <= 120 else 2 if max(map(len, labels)) <= 60 else 1
    top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=ncol, fontsize=8, frameon=False)
    bottom.axhline(0, color="black", lw=0.8)
    bottom.fill_between(rounds, -1.96 * sd, 1.96 * sd, color="tab:blue", alpha=0.15)
    bottom.plot(rounds, estimate - truth, "o-", color="tab:red", ms=3, lw=1)
    bottom.set_ylabel(error_label)
    count_axis(bottom, "round")
    fig.tight_layout()
    save(fig, path)


def spend_plot(path: Path, history: list[dict[str, float]], final: tuple[np.ndarray, np.ndarray], title: str,
               label: str = "cumulative ε per device", guarantee: tuple[float, str] | None = None,
               note: str = "", xlabel: str = "round", budget: tuple[float, str] | None = None) -> None:
    """Spend over time and at the end. ``final``: the distinct final spend values (sorted) and how many devices
    hold each. ``label`` names the kind of number the ledger holds (e.g. within-pattern spend for memoized
    protocols); ``guarantee`` and ``budget`` (value, label) are drawn as lines; ``note`` is printed under the
    plot (e.g. the worst-case loss, a different kind of number, stated apart); ``xlabel`` what the history's
    rounds count."""
    lines = note.count("\n") + 1 if note else 0
    fig, (left, right) = subplots(1, 2, figsize=(11, 4.2 + 0.25 * lines), width_ratios=(1.6, 1))
    r = np.array([h["round"] for h in history])
    if r.size:
        get = lambda k: np.array([h[k] for h in history])  # noqa: E731
        left.fill_between(r, get("min"), get("max"), color="tab:purple", alpha=0.12, label="min–max")
        left.fill_between(r, get("p50"), get("p99"), color="tab:purple", alpha=0.25, label="p50–p99")
        left.plot(r, get("p50"), color="tab:purple", lw=2, label="median")
        left.plot(r, get("mean"), color="black", ls="--", lw=1, label="mean")
    if guarantee is not None:
        left.axhline(guarantee[0], color="tab:red", ls=":", lw=1.2, label=guarantee[1])
    if budget is not None:
        left.axhline(budget[0], color="tab:orange", ls="--", lw=1.2, label=budget[1])
    count_axis(left, xlabel)
    left.set_ylabel(label)
    left.set_title(title)
    left.legend(loc="upper left", fontsize=8)
    values, counts = (np.asarray(a) for a in final)
    shares = counts / max(int(counts.sum()), 1)
    if values.size <= 40:
        right.bar([f"{v:g}" for v in values], shares, color="tab:purple")
        right.tick_params(axis="x", labelrotation=45 if values.size > 8 else 0)
    else:  # the histogram of the devices' spend: each distinct value weighted by its devices
        right.hist(values, bins=40, weights=shares, color="tab:purple")
    right.set_xlabel(f"final: {label}")
    right.set_ylabel("share of devices")
    right.set_title("spend at the end")
    if note:
        fig.text(0.01, 0.01, note, fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.06 * lines, 1, 1))
    save(fig, path)


#: buckets beyond which the histogram is drawn as outlines (steps and a band) instead of a bar per bucket
MANY_BUCKETS = 64


def histogram_plot(path: Path, rounds: np.ndarray, per_round: list[dict[str, float]], truth: np.ndarray,
                   est: np.ndarray, sd: np.ndarray, width: float, title: str, change_rounds: list[int],
                   unit: str | None = None) -> None:
    """Per-round max bucket error and Wasserstein distance; the last round's histogram against the truth.
    ``unit``: what the values count (the x axis and the Wasserstein distance are in it)."""
    fig, (top, bottom) = subplots(2, 1, figsize=(9, 7), height_ratios=(1, 1.3))
    top.plot(rounds, [m["max_abs"] for m in per_round], "o-", color="tab:red", ms=3, label="max bucket error")
    top.set_ylabel("max |ĥ(v) − h(v)|", color="tab:red")
    twin = top.twinx()
    twin.plot(rounds, [m["wasserstein"] for m in per_round], "s--", color="tab:blue", ms=3,
              label=with_unit("Wasserstein-1", unit or "value units"))
    twin.set_ylabel(with_unit("W1, clipped and renormalized", unit), color="tab:blue")
    for i, r in enumerate(change_rounds):
        top.axvline(r, color="grey", ls=":", lw=1, label=CHANGE_LABEL if i == 0 else None)
    count_axis(top, "round")
    top.set_title(title, fontsize=10)
    top.legend(*[sum(h, []) for h in zip(top.get_legend_handles_labels(), twin.get_legend_handles_labels())],
               loc="upper right", fontsize=8)
    last = len(rounds) - 1
    k = truth.shape[1]
    if k <= MANY_BUCKETS:
        centers = (np.arange(k) + 0.5) * width
        bottom.bar(centers, truth[last], width=width * 0.9, color="tab:blue", alpha=0.35, label="truth")
        bottom.errorbar(centers, est[last], yerr=1.96 * sd[last], fmt="o", color="tab:orange", ms=3, lw=1,
                        label="estimate ± 1.96 sd (theory)")
    else:  # one step outline or band per series: a bar and an error bar per bucket take minutes at 65,536
        # buckets (and so do Axes.stairs' patches, whose limits are found curve by curve)
        edges = np.arange(k + 1) * width
        step = lambda a: np.append(a, a[-1])  # noqa: E731 (the value of bucket i over [edge i, edge i + 1))
        bottom.fill_between(edges, step(truth[last]), step="post", color="tab:blue", alpha=0.35, lw=0,
                            label="truth")
        bottom.fill_between(edges, step(est[last] - 1.96 * sd[last]), step(est[last] + 1.96 * sd[last]),
                            step="post", color="tab:orange", alpha=0.3, lw=0, label="± 1.96 sd (theory)")
        bottom.step(edges, step(est[last]), where="post", color="tab:orange", lw=0.8, label="estimate")
    bottom.axhline(0, color="black", lw=0.8)
    bottom.set_xlabel(with_unit("value", unit))
    bottom.set_ylabel("frequency")
    bottom.set_title(f"round {int(rounds[last])}, {k:,} buckets", fontsize=10)
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save(fig, path)


def counters_plot(path: Path, rounds: np.ndarray, truth: np.ndarray, est: np.ndarray, sd: np.ndarray,
                  title: str, change_rounds: list[int], unit: str | None = None) -> None:
    """One panel: each counter's truth (line, with the ±1.96 sd band) and estimate (dots); ``unit``: what the
    counters count."""
    fig, ax = subplots(figsize=(9, 5))
    for j in range(truth.shape[1]):
        color = f"C{j % 10}"
        ax.fill_between(rounds, truth[:, j] - 1.96 * sd[:, j], truth[:, j] + 1.96 * sd[:, j], color=color,
                        alpha=0.12)
        ax.plot(rounds, truth[:, j], color=color, lw=2, label=f"counter {j}: truth")
        ax.plot(rounds, est[:, j], "o", color=color, ms=3.5, label=f"counter {j}: estimate")
    for i, r in enumerate(change_rounds):
        ax.axvline(r, color="grey", ls=":", lw=1, label=CHANGE_LABEL if i == 0 else None)
    count_axis(ax, "round")
    ax.set_ylabel(with_unit("mean counter", unit))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save(fig, path)


def epochs_plot(path: Path, epochs: np.ndarray, truth: np.ndarray, est: np.ndarray, update: np.ndarray,
                title: str, change_epochs: list[int]) -> None:
    """THRESH: the published estimate against the truth per epoch, global updates marked."""
    fig, ax = subplots(figsize=(10, 4.5))
    ax.plot(epochs, truth, color="tab:blue", lw=2, label="truth p^t (mean of the group probabilities)")
    ax.step(epochs, est, where="post", color="tab:orange", lw=1.3, label="published estimate")
    if update.any():
        ax.plot(epochs[update], est[update], "v", color="tab:red", ms=7, label="global update")
    for e in change_epochs:
        ax.axvline(e, color="grey", ls=":", lw=1)
    count_axis(ax, "epoch")
    ax.set_ylabel("mean of the bits")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save(fig, path)
