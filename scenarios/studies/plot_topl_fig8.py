"""Figures and tables of the Wang et al. (CCS 2021) figure 8 studies (ToPL threshold finding), four data sets.

    python scenarios/studies/plot_topl_fig8.py docs/topl_fig8

Reads DIR/<data set>/runs.jsonl of each sweep (scenarios/studies/topl_fig8_<data set>.toml) and writes
DIR/<data set>/thresholds.csv (one row per run: the grid point, the theta chosen, the oracle's theta, the
range-query MSE and the all-zero baseline's), from which it draws when runs.jsonl is absent (the shipped
directories keep thresholds.csv, not the large runs.jsonl). Writes to DIR:

- fig8_range_mse.png: range-query MSE against the threshold epsilon, one column per data set, one row per
  domain (data maximum + 1 with unit bins and the exact integer bias; the authors' domain with 1,024 bins),
  SW-W, EMS and the oracle with the paper's weighting (solid) and the authors' (dotted), the all-zero baseline
  dashed; mean over repetitions, band min-max (SW-W and EMS with the paper's weighting).
- fig8_threshold.png: the theta chosen, same layout (log scale in the authors' domain).
- summary_table.md: per data set, domain and objective, the MSE ratios to the baseline and the thetas.
- integer_bias.md: on each data file's own distribution, the oracle theta with bin-centre and with exact
  integer bias under both weightings, and the overstatement 1/2 P(X >= theta) of bin centres.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from protocols.topl import choose_threshold, range_mse, support_points, truncation_bias  # noqa: E402
from scenarios.schema import load_data  # noqa: E402

SETS = {  # directory: (label, data file)
    "dns": ("DNS (google.com queries/s)", "dns_google_queries_per_second.txt.gz"),
    "webview2": ("BMS-WebView-2 (for Kosarak)", "bms_webview2_session_lengths.txt.gz"),
    "pos": ("POS", "pos_transaction_lengths.txt.gz"),
    "retail": ("Retail", "retail_transaction_lengths.txt.gz"),
}
UNITS = {"dns": "queries per second", "webview2": "pages per session", "pos": "items per transaction",
         "retail": "items per basket"}
METHODS = {"sw-w": ("SW-W", "tab:red"), "ems": ("SW (EMS)", "tab:blue"), "oracle": ("oracle", "black")}
OBJECTIVES = {"paper": "-", "authors": ":"}  # line style per weighting
WEIGHTING = {"paper": "paper's weighting", "authors": "authors' code's weighting"}
DOMAINS = ("data", "authors")  # unit bins on [0, max + 1] with exact integer bias; the authors' [0, max_ell]
FIELDS = ("domain", "max_value", "bins", "threshold_epsilon", "method", "objective", "repetition", "theta",
          "oracle_theta", "range_mse", "range_mse_zero_baseline")
ROUNDS, DEVICES, EPS = 8, 131072, 1.0  # the studies' setting: 2^20 values, HM at eps = 1


def rows_of(d: Path) -> list[dict]:
    """One dict per run, from runs.jsonl (then written to thresholds.csv) or from thresholds.csv."""
    if (d / "runs.jsonl").exists():
        rows = []
        for line in open(d / "runs.jsonl", encoding="utf-8"):
            r = json.loads(line)
            pt, s = r["point"], r["summary"]
            table = pt["protocol "]
            rows.append({"domain": "data" if table.get("integer") else "authors", "max_value": table["max_value"],
                         "bins": table["bins"], "threshold_epsilon": pt["protocol.threshold_epsilon"],
                         "method": pt["protocol.method"], "objective": pt["protocol.objective"],
                         "repetition": r["repetition"], "theta": s["threshold"][0]["theta"],
                         "oracle_theta": s["threshold"][0]["oracle_theta"], "range_mse": s["range_mse"],
                         "range_mse_zero_baseline": s["range_mse_zero_baseline"]})
        rows.sort(key=lambda x: (x["domain"], x["threshold_epsilon"], x["method"], x["objective"], x["repetition"]))
        with open(d / "thresholds.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        return rows
    out = []
    for r in csv.DictReader(open(d / "thresholds.csv", encoding="utf-8")):
        out.append({**r, **{k: float(r[k]) for k in ("max_value", "bins", "threshold_epsilon", "theta",
                                                      "oracle_theta", "range_mse", "range_mse_zero_baseline")},
                    "repetition": int(r["repetition"])})
    return out


def setting(d: Path) -> tuple[int, int, int | None]:
    """(rounds, devices, holdout reports) of the sweep in ``d`` as it ran (its sweep.json: the base scenario
    with --set applied, the grid's protocol tables, a --set protocol.holdout over them); holdout None where the
    grid's tables differ in it."""
    sw = json.loads((d / "sweep.json").read_text(encoding="utf-8"))
    data = sw["scenario_data"]
    tables = next((v for k, v in sw["grid"].items() if k.strip() == "protocol"), [data["protocol"]])
    holdouts = {t.get("holdout", data["protocol"].get("holdout")) for t in tables}
    for override in sw.get("overrides", []):
        key, _, value = str(override).partition("=")
        if key.strip() == "protocol.holdout":
            holdouts = {int(value)}
    (holdout,) = holdouts if len(holdouts) == 1 else (None,)
    return int(data["rounds"]), int(data["population"]["devices"]), None if holdout is None else int(holdout)


def describe_setting(path: Path, data: dict[str, dict]) -> str:
    """The figures' setting in words, read from the sweeps drawn (not the shipped studies' own numbers: a
    sweep run small says its own size)."""
    settings = {ds: setting(path / ds) for ds in data if (path / ds / "sweep.json").is_file()}
    if len(set(settings.values())) != 1:
        return "the rounds, devices and holdout of each data set's sweep.json"
    rounds, devices, holdout = next(iter(settings.values()))
    held = f", {holdout:,} holdout reports" if holdout is not None else ""
    return f"{rounds} rounds x {devices:,} devices = {rounds * devices:,} values{held}"


def cells_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["domain"], r["method"], r["objective"], float(r["threshold_epsilon"]))].append(r)
    return cells


def plot(path: Path, data: dict[str, dict], key: str, ylabel: str, log: bool, name: str) -> None:
    width = max(4.2 * len(data), 9.0)  # one data set alone still has room for the title and the legend
    fig, axes = plt.subplots(2, len(data), figsize=(width, 7.6), squeeze=False)
    for col, (ds, cells) in enumerate(data.items()):
        epss = sorted({e for (_, _, _, e) in cells})
        for row, dom in enumerate(DOMAINS):
            ax = axes[row][col]
            some = next((c for (dm, _, _, _), c in cells.items() if dm == dom), None)
            if some is None:  # a sweep without this domain: say so rather than fail
                ax.text(0.5, 0.5, "not in this sweep", ha="center", va="center", transform=ax.transAxes)
                continue
            mx, bins = some[0]["max_value"], some[0]["bins"]
            if key == "range_mse":  # the all-zero answer: the same for every method of a run's stream
                zero = [np.mean([r["range_mse_zero_baseline"] for (dm, _, _, e2), c in cells.items()
                                 if dm == dom and e2 == e for r in c]) for e in epss]
                ax.plot(epss, zero, "--", color="grey", lw=1, label="all-zero baseline")
            for m, (label, color) in METHODS.items():
                for obj, ls in OBJECTIVES.items():
                    if any((dom, m, obj, e) not in cells for e in epss):
                        continue  # a method or weighting this sweep did not run
                    v = [np.array([r[key] for r in cells[(dom, m, obj, e)]]) for e in epss]
                    ax.plot(epss, [x.mean() for x in v], ls, marker="o" if obj == "paper" else "^", ms=3,
                            color=color, lw=1.4 if obj == "paper" else 1.1, label=f"{label}, {WEIGHTING[obj]}")
                    if obj == "paper" and m != "oracle":
                        ax.fill_between(epss, [x.min() for x in v], [x.max() for x in v], color=color, alpha=0.12)
            if log or dom == "authors":  # thresholds there span 5 to 1,500: log scale
                ax.set_yscale("log")
            ax.set_title(f"{SETS[ds][0]}\n" + (f"[0, {mx:g}], {bins:g} unit bins, exact integer bias" if dom == "data"
                                               else f"authors' domain [0, {mx:g}], {bins:g} bins, bin centres"),
                         fontsize=9)
            ax.set_xlabel("ε of the Square Wave holdout (HM reports at ε = 1)", fontsize=8)
            ax.set_ylabel(ylabel if key == "range_mse" else f"{ylabel} ({UNITS[ds]})", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 4 if width >= 12 else 2
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8)
    reps = max(len(c) for c in next(iter(data.values())).values())
    fig.suptitle(f"ToPL threshold finding (Wang et al. CCS 2021, fig. 8): {describe_setting(path, data)}; mean over "
                 f"{reps} repetition{'s' if reps != 1 else ''}, band min-max (SW-W and EMS, paper's weighting)",
                 fontsize=10, wrap=True)
    legend_rows = -(-len(labels) // ncol)
    fig.tight_layout(rect=(0, 0.03 * legend_rows + 0.01, 1, 0.93))
    fig.savefig(path / name, dpi=100)
    plt.close(fig)


def summary_table(data: dict[str, dict]) -> list[str]:
    from study_args import spread  # scenarios/studies/study_args.py (run as a script)

    lines = ["| data set | domain | weighting | ε | θ SW-W | θ EMS | θ oracle | MSE/zero SW-W | MSE/zero EMS | "
             "MSE/zero oracle |", "|---|---|---|---|---|---|---|---|---|---|"]
    for ds, cells in data.items():
        epss = sorted({e for (_, _, _, e) in cells})
        for dom in DOMAINS:
            for obj in OBJECTIVES:
                for e in epss:
                    th = {m: np.array([r["theta"] for r in cells[(dom, m, obj, e)]]) for m in METHODS}
                    ratio = {m: np.array([r["range_mse"] / r["range_mse_zero_baseline"]
                                          for r in cells[(dom, m, obj, e)]]) for m in METHODS}
                    lines.append(f"| {ds} | {dom} | {obj} | {e:g} | "
                                 + " | ".join(f"{th[m].mean():.1f}{spread(th[m])}" for m in METHODS) + " | "
                                 + " | ".join(f"{ratio[m].mean():.2e}" for m in METHODS) + " |")
    return lines


def headline(data: dict[str, dict]) -> list[str]:
    """Per data set and domain: over the 10 threshold epsilons, the geometric-mean MSE ratio SW-W / EMS, how
    often SW-W beats EMS, and the oracle's MSE / zero with each weighting."""
    lines = ["| data set | domain | weighting | SW-W / EMS MSE, geo. mean over ε (min–max) | SW-W < EMS at | "
             "oracle θ | oracle MSE / zero | worst MSE / zero of SW-W and EMS over ε |",
             "|---|---|---|---|---|---|---|---|"]
    for ds, cells in data.items():
        epss = sorted({e for (_, _, _, e) in cells})
        for dom in DOMAINS:
            for obj in OBJECTIVES:
                mean = {m: np.array([np.mean([r["range_mse"] for r in cells[(dom, m, obj, e)]]) for e in epss])
                        for m in METHODS}
                zero = np.array([np.mean([r["range_mse_zero_baseline"] for r in cells[(dom, "oracle", obj, e)]])
                                 for e in epss])
                q = mean["sw-w"] / mean["ems"]
                oth = np.mean([r["theta"] for e in epss for r in cells[(dom, "oracle", obj, e)]])
                worst = max(np.max(mean["sw-w"] / zero), np.max(mean["ems"] / zero))
                geo = np.exp(np.log(q).mean())
                lines.append(f"| {ds} | {dom} | {obj} | {geo:.2g} ({q.min():.2g}–{q.max():.2g}) | "
                             f"{int((q < 1).sum())} of {len(epss)} | {oth:.1f} | "
                             f"{np.mean(mean['oracle'] / zero):.2e} | "
                             f"{worst:.1e} |")
    return lines


def integer_bias_table() -> list[str]:
    """Oracle thresholds from each data file's own pmf at 2^20 values (8 rounds x 131,072), eps = 1, with the
    bias at bin centres and at the integers, under both weightings. The modelled MSE of a theta is the row's
    objective with the exact bias (so the exact theta is its minimizer); the last column prices the authors'
    weighting under the paper's objective with the exact bias (the error model of the range queries)."""
    lines = ["| data set | weighting | θ, bias at bin centres | θ, exact bias | B(θ) at centres | B(θ) exact | "
             "difference | "
             "½ P(X ≥ θ) | modelled MSE, centres' θ / exact θ | paper's model: authors' θ / paper's θ |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for ds, (_, file) in SETS.items():
        x = load_data(file, file).astype(np.int64)
        mx = int(x.max()) + 1
        dens = np.bincount(x, minlength=mx).astype(np.float64)[:mx]
        exact_pts, centre_pts = support_points(mx, mx, integer=True), support_points(mx, mx)
        best = {obj: choose_threshold(dens, mx, EPS, ROUNDS, DEVICES, obj, integer=True)
                for obj in ("paper", "authors")}
        paper_model = range_mse(np.array([best["authors"], best["paper"]]), dens, exact_pts, EPS, ROUNDS, DEVICES)
        for obj in ("paper", "authors"):
            tc, te = choose_threshold(dens, mx, EPS, ROUNDS, DEVICES, obj), best[obj]
            bc = float(truncation_bias(np.array([tc]), dens, centre_pts)[0])
            be = float(truncation_bias(np.array([tc]), dens, exact_pts)[0])
            model = range_mse(np.array([tc, te]), dens, exact_pts, EPS, ROUNDS, DEVICES, obj)
            lines.append(f"| {ds} | {obj} | {tc:g} | {te:g} | {bc:.4f} | {be:.4f} | {bc - be:.4f} | "
                         f"{0.5 * float((x >= tc).mean()):.4f} | {model[0] / model[1]:.3f} | "
                         + (f"{paper_model[0] / paper_model[1]:.2f} |" if obj == "authors" else "— |"))
    return lines


def main() -> None:
    from study_args import study_dir  # scenarios/studies/study_args.py (run as a script)

    path = study_dir(__doc__)
    data = {ds: cells_of(rows_of(path / ds)) for ds in SETS if (path / ds).is_dir()}
    if not data:
        raise SystemExit(f"no study directories under {path} (expected {', '.join(SETS)})")
    plot(path, data, "range_mse", "MSE of random range-sum queries", True, "fig8_range_mse.png")
    plot(path, data, "theta", "threshold θ", False, "fig8_threshold.png")
    complete = all((dom, m, obj, e) in cells for cells in data.values() for dom in DOMAINS for m in METHODS
                   for obj in OBJECTIVES for e in {k[3] for k in cells})
    if not complete:
        print("figures written; the tables need every domain, method (sw-w, ems, oracle) and weighting at each ε "
              "of the sweep, so they are skipped")
        return
    table = summary_table(data)
    head = headline(data)
    (path / "summary_table.md").write_text("\n".join(head) + "\n\n" + "\n".join(table) + "\n", encoding="utf-8")
    bias = integer_bias_table()
    (path / "integer_bias.md").write_text("\n".join(bias) + "\n", encoding="utf-8")
    print("\n".join(head) + "\n\n" + "\n".join(bias))


if __name__ == "__main__":
    main()
