"""``ldpsim compare SCENARIO``: a THRESH scenario against naive per-epoch randomized response at equal total
privacy per device (Joseph et al. 2018's motivating comparison).

Both runs share the world, seed and network. The naive run spends, per device, exactly THRESH's exact
worst-case guarantee (ThreshParams.total_epsilon) spread evenly over the epochs (eps_total / T per epoch).
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
    """The same scenario with THRESH replaced by per-epoch randomized response at THRESH's total budget."""
    p = sc.protocol
    raw = apply_overrides(sc.raw, [])
    raw.pop("collector", None)
    raw["protocol"] = {"name": "epochrr", "epsilon": p.total_epsilon, "epoch_length": p.epoch_length}
    return parse(raw)


def compare(sc: Scenario, out: Path) -> dict:
    if sc.protocol.name != "thresh":
        raise ScenarioError(f"protocol.name: compare takes a thresh scenario, got {sc.protocol.name!r}")
    out.mkdir(parents=True, exist_ok=True)
    results = {"thresh": runner.run(sc), "naive": runner.run(naive_twin(sc))}
    summaries = {k: output.summary(r) for k, r in results.items()}
    epochs = np.array([r.round for r in results["thresh"].rounds])
    truth = np.array([r.truth for r in results["thresh"].rounds])
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
    table["budget"] = sc.protocol.total_epsilon
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
    top.step(epochs, [r.estimate for r in results["thresh"].rounds], where="post", color="tab:orange", lw=1.5,
             label="THRESH")
    upd = [r.round for r in results["thresh"].rounds if r.info.get("global_update")]
    top.plot(upd, [truth[u - 1] for u in upd], "v", color="tab:red", label="THRESH global update")
    top.set_ylim(-0.25, 1.25)
    top.set_ylabel("mean of the bits")
    top.set_title(f"{sc.name}: equal total privacy per device (ε = {sc.protocol.total_epsilon:.3g})", fontsize=10)
    top.legend(fontsize=8)
    for k, color in (("thresh", "tab:orange"), ("naive", "tab:grey")):
        hist = results[k].ledger.history
        bottom.plot(epochs, [h["max"] for h in hist], color=color, lw=1.5, label=f"{k}: max")
        bottom.plot(epochs, [h["mean"] for h in hist], color=color, lw=1, ls="--", label=f"{k}: mean")
    bottom.set_xlabel("epoch")
    bottom.set_ylabel("cumulative ε per device")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    plots.save(fig, path)
