"""``ldpsim compare SCENARIO``: a protocol against its naive baseline at equal total privacy per device, e.g.
THRESH against per-epoch randomized response (Joseph et al. 2018's motivating comparison).

The protocol names its baseline (``baseline_table()`` on its parameter class: the baseline's [protocol] table
at the same total guarantee, e.g. THRESH's exact worst case spread evenly over the epochs). Both runs share
the world, seed and network.
Writes compare.csv (per epoch: truth, both estimates, both errors, both mean and max cumulative spend),
compare.json (the error and spend summaries side by side) and compare.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from scenarios import output, plots, runner
from scenarios.schema import Scenario, ScenarioError, apply_overrides, parse


def naive_twin(sc: Scenario) -> Scenario:
    """The same scenario with the protocol replaced by its baseline at the same total budget."""
    baseline = getattr(sc.protocol, "baseline_table", None)
    if baseline is None:
        raise ScenarioError(f"protocol.name: compare needs a protocol that names an equal-budget baseline "
                            f"(baseline_table on its parameter class); {sc.protocol.name!r} does not")
    raw = apply_overrides(sc.raw, [])
    raw.pop("collector", None)
    raw["protocol"] = baseline()
    return parse(raw)


def compare(sc: Scenario, out: Path) -> dict:
    """Run ``sc`` and its naive twin; write compare.csv, compare.json and compare.png to ``out``. The table is
    keyed by the protocol's name and "naive"."""
    twin = naive_twin(sc)
    out.mkdir(parents=True, exist_ok=True)
    name = sc.protocol.name
    results = {name: runner.run(sc), "naive": runner.run(twin)}
    summaries = {k: output.summary(r) for k, r in results.items()}
    epochs = np.array([r.round for r in results[name].rounds])
    truth = np.array([r.truth for r in results[name].rounds])
    cols, header = [epochs, truth], ["epoch", "truth"]
    spend = {}
    for k, r in results.items():
        est = np.array([x.estimate for x in r.rounds])
        spend[k] = r.ledger.history
        cols += [est, est - truth, [h["mean"] for h in r.ledger.history], [h["max"] for h in r.ledger.history]]
        header += [f"{k}_estimate", f"{k}_error", f"{k}_spend_mean", f"{k}_spend_max"]
    output.write_csv(out / "compare.csv", header, cols)
    table = {k: {"error": s["error"], "epsilon": s["epsilon"], "updates": s.get("updates"),
                 "per_epoch_epsilon": results[k].scenario.protocol.round_epsilon} for k, s in summaries.items()}
    table["budget"] = twin.protocol.guarantee(twin.collections).value
    (out / "compare.json").write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
    _plot(out / "compare.png", epochs, truth, results, sc)
    return table


def _plot(path: Path, epochs, truth, results, sc: Scenario) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(2, 1))
    top.plot(epochs, truth, color="black", lw=2, label="truth")
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
    bottom.set_xlabel("epoch")
    bottom.set_ylabel("cumulative ε per device")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    plots.save(fig, path)
