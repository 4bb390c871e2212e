"""Benchmark: ToPL on 1,000,000 devices x 100 rounds of POS-distributed values, and the EM step alone.

The shipped topl_pos scenario scaled up (a fresh SW holdout of 5% every 25 rounds, EM with SW-W, threshold
broadcast, HM reports; SimPy, msgpack, ledger), then EM alone on the 1024 x 1024 Square Wave transition
matrix for the holdout of one threshold round (50,000 reports), with and without EMS smoothing. Records to
benchmarks/results.jsonl.

    python benchmarks/bench_topl.py
    python benchmarks/bench_topl.py --devices 200000 --no-record
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from protocols import keyed, numeric  # noqa: E402
from scenarios import output, runner, schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--cohort-size", type=int, default=250_000)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    runner.run(schema.load("topl_pos", ["population.devices=2000", "rounds=3"]))  # JIT warm-up
    sc = schema.load("topl_pos", [f"population.devices={args.devices}", f"rounds={args.rounds}",
                                  f"simulation.cohort_size={args.cohort_size}"])
    result = runner.run(sc, events=io.StringIO())
    summ = output.summary(result)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    data = schema.load_data("pos_transaction_lengths.txt.gz", "bench")
    h = int(args.devices * sc.protocol.holdout)
    v = data[(keyed.uniform(keyed.stream_key(1, 5), np.arange(h)) * data.size).astype(int)] / 165
    u1, u2 = (keyed.uniform(keyed.stream_key(1, 6, k), np.arange(h)) for k in (0, 1))
    eps = sc.protocol.threshold_epsilon
    t = time.perf_counter()
    m = numeric.sw_transition_matrix(eps, 1024, 1024)
    matrix_s = time.perf_counter() - t
    b = numeric.sw_b(eps)
    counts = np.histogram(numeric.sw_randomize(v, eps, u1, u2), bins=1024, range=(-b, 1 + b))[0].astype(float)
    em = {}
    for name, smooth in (("em_sw_w", False), ("ems", True)):
        t = time.perf_counter()
        _, iters = numeric.em_estimate(counts, m, smoothing=smooth)
        em[name] = {"seconds": round(time.perf_counter() - t, 3), "iterations": int(iters)}
    record = {
        "benchmark": "topl_full_simulation", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "devices": args.devices, "rounds": args.rounds, "cohort_size": args.cohort_size,
        "simulate_seconds": round(result.wall_seconds, 2),
        "device_rounds_per_second": round(args.devices * args.rounds / result.wall_seconds),
        "peak_memory_mb": round(peak), "thresholds": summ["threshold"],
        "range_mse": summ["range_mse"], "range_mse_zero_baseline": summ["range_mse_zero_baseline"],
        "em_alone": {"reports": h, "transition_matrix_seconds": round(matrix_s, 3), **em},
    }
    print(json.dumps(record, indent=2))
    print(f"| {args.devices:,} x {args.rounds} | {result.wall_seconds:.1f} s | "
          f"{record['device_rounds_per_second'] / 1e6:.1f} M/s | {peak:,.0f} MB | EM {em['em_sw_w']['seconds']} s "
          f"({em['em_sw_w']['iterations']} it), EMS {em['ems']['seconds']} s |")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
