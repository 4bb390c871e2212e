"""``ldpsim compare SCENARIO``: a protocol against its naive baseline at equal total privacy per device, e.g.
THRESH against per-epoch randomized response (Joseph et al. 2018's motivating comparison).

The protocol names its baseline (``baseline_table()`` on its parameter class: the baseline's [protocol] table
at the same total guarantee, e.g. THRESH's exact worst case spread evenly over the epochs). Both runs share
the world, seed and network.
Writes compare.csv (per epoch: truth, both estimates, both errors, both mean and max cumulative spend),
compare.json (the error and spend summaries side by side) and compare.png. For a protocol that publishes one
frequency per item each epoch (``kind = "histogram"``: a frequency oracle against per-epoch k-ary randomized
response), compare.csv is in long form (one row per epoch and item, with the item's value range), compare.json
adds each side's per-epoch max item error and how often its most frequent item is the true one, and
compare.png follows the items that are ever the most frequent, with the max item error per epoch beneath.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from scenarios import jsonout, output, plots, runner
from scenarios.schema import Scenario, ScenarioError, apply_overrides, parse


def naive_twin(sc: Scenario) -> Scenario:
    """The same scenario with the protocol replaced by its baseline at the same total budget."""
    baseline = getattr(sc.protocol, "baseline_table", None)
    if baseline is None:
        from protocols import registry

        able = [n for n in registry.builtin_names() if hasattr(registry.lookup(n).params, "baseline_table")]
        raise ScenarioError(f"protocol.name: {sc.protocol.name!r} has no naive baseline to compare with: compare "
                            f"runs {' and '.join(able)} against theirs at equal total privacy (a plugin names its "
                            f"own with baseline_table() on its parameter class)")
    raw = apply_overrides(sc.raw, [])
    raw.pop("collector", None)
    raw["protocol"] = baseline()
    return parse(raw)


def compare(sc: Scenario, out: Path,
            progress: Callable[[str, int], tuple[Callable[[int, int], None] | None, Callable[[], None]]] | None = None
            ) -> dict:
    """Run ``sc`` and its naive twin; write compare.csv, compare.json and compare.png to ``out``. The table is
    keyed by the protocol's name and "naive". ``progress(label, rounds)``: an (update, close) pair for each run
    (``update(done, total)`` after each round, as runner.run's ``progress``)."""
    twin = naive_twin(sc)
    out.mkdir(parents=True, exist_ok=True)
    name = sc.protocol.name
    results = {}
    for label, scenario in ((name, sc), ("naive", twin)):
        update, close = progress(label, scenario.rounds) if progress is not None else (None, lambda: None)
        try:
            results[label] = runner.run(scenario, progress=update)
        finally:
            close()
    summaries = {k: output.summary(r) for k, r in results.items()}
    if sc.protocol.kind == "histogram":
        return _compare_items(sc, twin, out, results, summaries)
    epochs = np.array([r.round for r in results[name].rounds])
    truth = np.array([r.truth for r in results[name].rounds])
    cols: list[Any] = [epochs, truth]
    header = ["epoch", "truth"]
    spend = {}
    for k, r in results.items():
        est = np.array([x.estimate for x in r.rounds])
        spend[k] = r.ledger.history
        cols += [est, est - truth, [h["mean"] for h in r.ledger.history], [h["max"] for h in r.ledger.history]]
        header += [f"{k}_estimate", f"{k}_error", f"{k}_spend_mean", f"{k}_spend_max"]
    output.write_csv(out / "compare.csv", header, cols)
    table: dict[str, Any] = {k: {"error": s["error"], "epsilon": s["epsilon"], "updates": s.get("updates"),
                                 "per_epoch_epsilon": results[k].scenario.protocol.round_epsilon}
                             for k, s in summaries.items()}
    table["budget"] = twin.protocol.guarantee(twin.collections).value
    output._write_text(out / "compare.json", jsonout.write_document(table, indent=2) + "\n")  # strict, atomic
    _plot(out / "compare.png", epochs, truth, results, sc)
    return table


def _epoch_label(sc: Scenario) -> str:
    """The x axis of a comparison: epochs, with their length in rounds and hours."""
    length = int(getattr(sc.protocol, "epoch_length", 1))
    return f"epoch ({length} rounds of {sc.simulation.round_seconds / 3600:g} h each)"


def _plot(path: Path, epochs, truth, results, sc: Scenario) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(2, 1))
    top.step(epochs, truth, where="post", color="black", lw=2, label="truth (an epoch's p^t)")
    top.plot(epochs, [r.estimate for r in results["naive"].rounds], ".", color="tab:grey", ms=4,
             label=f"naive per-epoch RR (ε/T = {results['naive'].scenario.protocol.round_epsilon:.3g} each)")
    name = sc.protocol.name
    top.step(epochs, [r.estimate for r in results[name].rounds], where="post", color="tab:orange", lw=1.5,
             label=name)
    upd = [r.round for r in results[name].rounds if r.info.get("global_update")]
    if upd:
        top.plot(upd, [truth[u - 1] for u in upd], "v", color="tab:red", label=f"{name} global update")
    top.set_ylim(-0.25, 1.25)
    top.set_ylabel("mean of the bits")
    budget = sc.protocol.guarantee(sc.collections).value
    top.set_title(f"{sc.name}: equal total privacy per device (ε = {budget:.3g})", fontsize=10)
    top.legend(fontsize=8)
    for k, color in ((name, "tab:orange"), ("naive", "tab:grey")):
        hist = results[k].ledger.history
        bottom.plot(epochs, [h["max"] for h in hist], color=color, lw=1.5, label=f"{k}: max")
        bottom.plot(epochs, [h["mean"] for h in hist], color=color, lw=1, ls="--", label=f"{k}: mean")
    plots.count_axis(bottom, _epoch_label(sc))
    bottom.set_ylabel("cumulative ε per device")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    plots.save(fig, path)


# ------------------------------------------------------------------------------------------- item frequencies
def _max_item_error(truth: np.ndarray, est: np.ndarray) -> np.ndarray:
    """Per epoch, the largest |f_hat(v) - f(v)| over the items (NaN before any estimate)."""
    err = np.abs(est - truth)
    return np.where(np.all(np.isfinite(err), axis=1), np.nan_to_num(err).max(axis=1), np.nan)


def _top_agreement(truth: np.ndarray, est: np.ndarray) -> float | None:
    """The share of epochs with an estimate whose most frequent estimated item is the most frequent true one."""
    ok = np.all(np.isfinite(est), axis=1)
    if not ok.any():
        return None
    return float(np.mean(np.argmax(est[ok], axis=1) == np.argmax(truth[ok], axis=1)))


def _compare_items(sc: Scenario, twin: Scenario, out: Path, results: dict, summaries: dict) -> dict:
    """compare() for protocols that publish item frequencies: long-form CSV, the table, the item plot."""
    name = sc.protocol.name
    recs = results[name].rounds
    epochs = np.array([r.round for r in recs])
    truth = np.array([np.asarray(r.truth, dtype=np.float64) for r in recs])
    k = truth.shape[1]
    width = runner.bucket_width(sc.protocol)
    item = np.tile(np.arange(k), len(recs))
    cols: list = [np.repeat(epochs, k), item, item * width, (item + 1) * width, truth.ravel()]
    header = ["epoch", "item", "low", "high", "truth"]
    ests: dict[str, np.ndarray] = {}
    table: dict[str, Any] = {}
    for key, r in results.items():
        est = np.array([np.asarray(x.estimate, dtype=np.float64) * np.ones(k) for x in r.rounds])
        ests[key] = est
        hist = r.ledger.history
        cols += [est.ravel(), (est - truth).ravel(), np.repeat([h["mean"] for h in hist], k),
                 np.repeat([h["max"] for h in hist], k)]
        header += [f"{key}_estimate", f"{key}_error", f"{key}_spend_mean", f"{key}_spend_max"]
        s = summaries[key]
        per_epoch = _max_item_error(truth, est)
        table[key] = {"error": s["error"], "epsilon": s["epsilon"], "updates": s.get("updates"),
                      "per_epoch_epsilon": r.scenario.protocol.round_epsilon,
                      "max_item_error_by_epoch": [None if not np.isfinite(v) else float(v) for v in per_epoch],
                      "top_item_agreement": _top_agreement(truth, est)}
    output.write_csv(out / "compare.csv", header, cols)
    table["budget"] = twin.protocol.guarantee(twin.collections).value
    output._write_text(out / "compare.json", jsonout.write_document(table, indent=2) + "\n")  # strict, atomic
    _plot_items(out / "compare.png", epochs, truth, ests, results, sc, width)
    return table


def _plot_items(path: Path, epochs, truth, ests: dict, results, sc: Scenario, width: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    name = sc.protocol.name
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True, height_ratios=(2.2, 1, 1))
    tracked = list(dict.fromkeys(int(v) for v in np.argmax(truth, axis=1)))[:4]  # ever the most frequent
    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    for v, color in zip(tracked, colors):
        top.step(epochs, truth[:, v], where="post", color=color, lw=2.5, alpha=0.45)
        top.step(epochs, ests[name][:, v], where="post", color=color, lw=1.5)
        top.plot(epochs, ests["naive"][:, v], ".", color=color, ms=5, alpha=0.7)
    upd = [r.round for r in results[name].rounds if r.info.get("global_update")]
    if upd:
        top.plot(upd, np.full(len(upd), 0.98), "v", color="black", ms=6)
    eps_naive = results["naive"].scenario.protocol.round_epsilon
    handles = [Line2D([], [], color=c, lw=3, label=f"item {v}: values in [{v * width:g}, {(v + 1) * width:g})")
               for v, c in zip(tracked, colors)]
    handles += [Line2D([], [], color="grey", lw=2.5, alpha=0.45, label="truth"),
                Line2D([], [], color="grey", lw=1.5, label=f"{name} (published estimate)"),
                Line2D([], [], color="grey", ls="", marker=".", ms=8,
                       label=f"naive per-epoch RR (ε/T = {eps_naive:.3g})"),
                Line2D([], [], color="black", ls="", marker="v", label=f"{name} global update")]
    top.legend(handles=handles, fontsize=8, ncol=2, loc="upper right")
    top.set_ylim(-0.3, 1.02)
    top.set_ylabel("item frequency (share of devices)")
    budget = sc.protocol.guarantee(sc.collections).value
    top.set_title(f"{sc.name}: the most frequent items, equal total privacy per device (ε = {budget:.3g})",
                  fontsize=10)
    for key, color in ((name, "tab:orange"), ("naive", "tab:grey")):
        mid.plot(epochs, _max_item_error(truth, ests[key]), color=color, lw=1.5, marker="o", ms=3, label=key)
        hist = results[key].ledger.history
        bottom.plot(epochs, [h["max"] for h in hist], color=color, lw=1.5, label=f"{key}: max")
        bottom.plot(epochs, [h["mean"] for h in hist], color=color, lw=1, ls="--", label=f"{key}: mean")
    mid.set_ylabel("max item error\n(share of devices)")
    mid.legend(fontsize=8)
    plots.count_axis(bottom, _epoch_label(sc))
    bottom.set_ylabel("cumulative ε per device")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    plots.save(fig, path)
