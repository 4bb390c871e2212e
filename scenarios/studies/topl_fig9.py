"""Wang et al. (CCS 2021) figure 9: one ToPL stream against the truth on DNS, two ways, one figure.

    python scenarios/studies/topl_fig9.py docs/topl_fig9

1. ldpsim: scenarios/studies/topl_fig9_dns.toml (120 rounds x 8,738 devices, each value a fresh draw from the
   DNS file), run in this process; per round, the estimated and the true mean value per device.
2. The paper's setting, replayed: the DNS file in its own order as one stream, one value per second. The
   first 65,536 values are the holdout (Square Wave at eps, EM + SW-W pruning on unit bins, theta by the
   paper's objective with the exact integer bias, R = the stream's length, one report a time step); every
   later value is truncated to [0, theta] and sent with HM at eps (protocols.numeric, the functions ToPL's
   devices and collector use). Shown, as in the paper, as the mean of each of 120 equal intervals.

Writes fig9_dns.png, fig9_stream.csv (both series) and fig9_summary.json (thresholds, range-query MSE against
the all-zero answer). Deterministic (seed 2021); a few seconds, so it is rerun whole rather than resumed.
"""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from protocols import numeric  # noqa: E402
from protocols.topl import ToplCollector, ToplParams, choose_threshold  # noqa: E402
from scenarios import output, runner, schema  # noqa: E402
from scenarios.metrics import range_mse, range_queries  # noqa: E402

SCENARIO = Path(__file__).with_name("topl_fig9_dns.toml")
DATA = "dns_google_queries_per_second.txt.gz"
EPS, HOLDOUT, INTERVALS, SEED = 1.0, 65536, 120, 2021


def simulated() -> dict:
    sc = schema.load(str(SCENARIO))
    result = runner.run(sc)
    s = output.summary(result)
    n = sc.devices
    return {"rounds": [r.round for r in result.rounds], "truth": [r.truth / n for r in result.rounds],
            "estimate": [r.estimate / n for r in result.rounds], "theta": s["threshold"][0]["theta"],
            "oracle_theta": s["threshold"][0]["oracle_theta"], "range_mse": s["range_mse"],
            "range_mse_zero_baseline": s["range_mse_zero_baseline"], "devices": n, "rounds_n": sc.rounds,
            "holdout_reports": result.rounds[0].info["holdout_reports"]}


def replayed() -> dict:
    x = schema.load_data(DATA, DATA).astype(np.float64)
    hold, stream = x[:HOLDOUT], x[HOLDOUT:]
    mx = int(x.max()) + 1  # unit bins, the top value in a bin of its own
    rng = np.random.default_rng(SEED)
    params = ToplParams("topl", EPS, EPS, float(mx), 0.5, 0, stream.size, 1, "sw-w", mx, (), "paper", True)
    s = numeric.sw_randomize(hold / mx, EPS, rng.random(hold.size), rng.random(hold.size))
    dens = ToplCollector(params, 1).density(s)
    # the paper's objective for one stream: R = the stream's length, one report per time step
    theta = choose_threshold(dens, float(mx), EPS, stream.size, 1, "paper", True)
    true_hist = np.bincount(hold.astype(np.int64), minlength=mx).astype(np.float64)[:mx]
    oracle = choose_threshold(true_hist, float(mx), EPS, stream.size, 1, "paper", True)
    t = 2.0 * np.minimum(stream, theta) / theta - 1.0
    y = numeric.hm_randomize(t, EPS, rng.random(t.size), rng.random(t.size), rng.random(t.size))
    est = (y + 1.0) * theta / 2.0
    q = range_queries(stream.size, 1000, SEED)
    cut = np.array_split(np.arange(stream.size), INTERVALS)
    return {"truth": [float(stream[c].mean()) for c in cut], "estimate": [float(est[c].mean()) for c in cut],
            "interval_seconds": int(cut[0].size), "stream": int(stream.size), "theta": theta, "oracle_theta": oracle,
            "range_mse": range_mse(stream, est, q), "range_mse_zero_baseline": range_mse(stream, np.zeros_like(est), q),
            "truncated_share": float((stream > theta).mean())}


def main() -> None:
    from study_args import study_dir  # scenarios/studies/study_args.py (run as a script)

    out = study_dir(__doc__)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sim, rep = simulated(), replayed()
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5))
    ax = axes[0]
    x = np.arange(1, INTERVALS + 1)
    ax.plot(x, rep["truth"], color="black", lw=1.4, label="truth")
    ax.plot(x, rep["estimate"], color="tab:red", lw=1.1,
            label=f"ToPL (θ = {rep['theta']:g}; oracle θ {rep['oracle_theta']:g})")
    ax.set_xlabel(f"interval of {rep['interval_seconds']:,} seconds (the file's order, after the 65,536-s holdout)")
    ax.set_ylabel("mean google.com queries per second")
    ax.set_title(f"paper's setting: the DNS file as one stream, one HM report per second at ε = {EPS:g} "
                 f"(range-query MSE / all-zero: {rep['range_mse'] / rep['range_mse_zero_baseline']:.1e})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    ax.plot(sim["rounds"], sim["truth"], color="black", lw=1.4, label="truth")
    ax.plot(sim["rounds"], sim["estimate"], color="tab:red", lw=1.1,
            label=f"ToPL (θ = {sim['theta']:g}; oracle θ {sim['oracle_theta']:g})")
    ax.set_xlabel("round")
    ax.set_ylabel("mean queries per second per device")
    ax.set_title(f"ldpsim: {sim['rounds_n']} rounds x {sim['devices']:,} devices, fresh draws from the file, "
                 f"ε = {EPS:g} (range-query MSE / all-zero: "
                 f"{sim['range_mse'] / sim['range_mse_zero_baseline']:.1e})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    lo = min(min(rep["truth"]), min(rep["estimate"]), min(sim["estimate"]))
    hi = max(max(rep["truth"]), max(rep["estimate"]), max(sim["estimate"]))
    for a in axes:
        a.set_ylim(max(0.0, lo - 0.3), hi + 0.3)
    fig.suptitle("ToPL on DNS against the truth (Wang et al. CCS 2021, fig. 9)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "fig9_dns.png", dpi=100)
    plt.close(fig)
    with open(out / "fig9_stream.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["setting", "index", "truth", "estimate"])
        w.writerows(("replayed", i + 1, a, b) for i, (a, b) in enumerate(zip(rep["truth"], rep["estimate"])))
        w.writerows(("simulated", r, a, b) for r, a, b in zip(sim["rounds"], sim["truth"], sim["estimate"]))
    summary = {"epsilon": EPS, "threshold_epsilon": EPS,
               "replayed": {k: v for k, v in rep.items() if k not in ("truth", "estimate")},
               "simulated": {k: v for k, v in sim.items() if k not in ("truth", "estimate", "rounds")},
               "wall_seconds": round(time.perf_counter() - t0, 1)}  # the whole study: replay, simulation, figure
    (out / "fig9_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
