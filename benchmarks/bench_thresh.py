"""Benchmark: THRESH on 1,000,000 devices, 256 epochs of 16 rounds (4,096 rounds), full simulation.

The shipped thresh_stable scenario scaled up: every round the world draws each device's bit and every
cohort adds it to its epoch sums; at each epoch's end the collector runs the vote, broadcasts the decision
and takes the estimates (SimPy, msgpack on every message, ledger, event log). Reports wall time,
device-rounds per second and peak memory; appends a record to benchmarks/results.jsonl.

    python benchmarks/bench_thresh.py
    python benchmarks/bench_thresh.py --devices 200000 --no-record
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

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import output, runner, schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1_000_000)
    ap.add_argument("--epochs", type=int, default=256)
    ap.add_argument("--epoch-length", type=int, default=16)
    ap.add_argument("--cohort-size", type=int, default=250_000)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    rounds = args.epochs * args.epoch_length
    overrides = [f"population.devices={args.devices}", f"rounds={rounds}",
                 f"protocol.epoch_length={args.epoch_length}", f"simulation.cohort_size={args.cohort_size}",
                 f"changes.0.round={rounds * 2 // 5 + 1}", f"changes.1.round={rounds * 4 // 5 + 1}"]
    sc = schema.load("thresh_stable", overrides)
    t = time.perf_counter()
    runner.run(schema.load("thresh_stable", ["population.devices=2000", "rounds=28"]))  # numba warm-up
    warmup = time.perf_counter() - t
    result = runner.run(sc, events=io.StringIO())
    summ = output.summary(result)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record = {
        "benchmark": "thresh_full_simulation", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "devices": args.devices, "epochs": args.epochs, "epoch_length": args.epoch_length,
        "cohort_size": args.cohort_size, "simulate_seconds": round(result.wall_seconds, 2),
        "jit_warmup_seconds": round(warmup, 2),
        "device_rounds_per_second": round(args.devices * rounds / result.wall_seconds),
        "peak_memory_mb": round(peak), "updates": summ["updates"], "update_epochs": summ["update_epochs"],
        "mean_abs_error": summ["error"]["mean_abs"], "epsilon_max": summ["epsilon"]["max"],
    }
    print(json.dumps(record, indent=2))
    print(f"| {args.devices:,} x {args.epochs} epochs x {args.epoch_length} rounds | {result.wall_seconds:.1f} s | "
          f"{record['device_rounds_per_second'] / 1e6:.0f} M/s | {peak:,.0f} MB | {summ['updates']} updates |")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
