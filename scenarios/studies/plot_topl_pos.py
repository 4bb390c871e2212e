"""Figures and table of the ToPL-on-POS study, from its sweep's runs.jsonl.

    python scenarios/studies/plot_topl_pos.py docs/topl_pos

Writes fig_range_mse.png (range-query MSE against eps per threshold method, mean and min-max over the
repetitions, with the all-zero baseline), fig_threshold.png (the chosen theta per method against eps, with
the oracle's) and summary_table.md.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

METHODS = {"sw-w": ("SW-W (EM + pruning)", "tab:red"), "ems": ("SW with EMS", "tab:blue"),
           "oracle": ("oracle threshold", "black")}


def main() -> None:
    from study_args import spread, study_dir  # scenarios/studies/study_args.py (run as a script)

    path = study_dir(__doc__, "runs.jsonl")
    rows = [json.loads(line) for line in open(path / "runs.jsonl", encoding="utf-8")]
    cells: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in rows:
        point = r["point"]
        if "protocol.method" not in point or "protocol.epsilon" not in point:
            raise SystemExit(f"plot_topl_pos.py: error: {path}: not a topl_pos study: its grid varies "
                             f"{', '.join(point)}, where the study varies protocol.method and protocol.epsilon")
        cells[(point["protocol.method"], point["protocol.epsilon"])].append(r["summary"])
    epss = sorted({e for _, e in cells})
    missing = sorted({m for m in METHODS for e in epss if (m, e) not in cells})
    if missing:
        raise SystemExit(f"plot_topl_pos.py: error: {path}: not a topl_pos study: no runs of protocol.method "
                         f"{', '.join(missing)} at every ε")
    sw = json.loads((path / "sweep.json").read_text(encoding="utf-8"))
    size = f"{sw['scenario_data']['population']['devices']:,} devices x {sw['scenario_data']['rounds']} rounds"
    reps = max(len(c) for c in cells.values())
    over = f"{reps} repetition{'s' if reps != 1 else ''}"

    fig, ax = plt.subplots(figsize=(8, 4.8))
    zero = [np.mean([s["range_mse_zero_baseline"] for s in cells[("oracle", e)]]) for e in epss]
    ax.plot(epss, zero, "k--", lw=1, label="all-zero baseline")
    for m, (label, color) in METHODS.items():
        v = [np.array([s["range_mse"] for s in cells[(m, e)]]) for e in epss]
        mean = np.array([x.mean() for x in v])
        ax.fill_between(epss, [x.min() for x in v], [x.max() for x in v], color=color, alpha=0.15)
        ax.plot(epss, mean, "o-", color=color, ms=4, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("ε (Square Wave holdout and HM reports)")
    ax.set_ylabel("MSE of random range-sum queries")
    ax.set_title(f"ToPL on POS, {size} (mean, band: min-max over {over})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path / "fig_range_mse.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m, (label, color) in METHODS.items():
        th = [np.array([s["threshold"][0]["theta"] for s in cells[(m, e)]]) for e in epss]
        ax.errorbar(epss, [t.mean() for t in th], yerr=[t.std(ddof=1) if t.size > 1 else 0.0 for t in th],
                    fmt="o-", color=color, ms=4, capsize=3, label=label)
    ax.set_xlabel("ε")
    ax.set_ylabel("threshold θ (items per transaction)")
    ax.set_title(f"chosen threshold (mean ± sd over {over}); POS max 165, p99.5 39", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path / "fig_threshold.png", dpi=110)
    plt.close(fig)

    lines = ["| ε | θ SW-W | θ EMS | θ oracle | MSE SW-W / zero | MSE EMS / zero | MSE oracle / zero |",
             "|---|---|---|---|---|---|---|"]
    for e in epss:
        theta = {m: np.array([s["threshold"][0]["theta"] for s in cells[(m, e)]]) for m in METHODS}
        ratio = {m: np.array([s["range_mse"] / s["range_mse_zero_baseline"] for s in cells[(m, e)]])
                 for m in METHODS}
        lines.append(f"| {e:g} | " + " | ".join(f"{theta[m].mean():.1f}{spread(theta[m])}" for m in METHODS)
                     + " | " + " | ".join(f"{ratio[m].mean():.2e} (max {ratio[m].max():.1e})" for m in METHODS)
                     + " |")
    (path / "summary_table.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
