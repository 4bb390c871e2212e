"""Benchmark: 1BitRRPM with output perturbation on millions of devices through the full actor simulation.

Runs the shipped 31-day app-usage scenario (SimPy cohorts and collector, msgpack on every message, network
fates, ledger, event log) at the given population, and reports wall time, device-rounds per second, peak
memory, and, measured in the same process, numpy's default generator's uniform draws per second (the
machine's yardstick). Results are appended to benchmarks/results.jsonl and printed as a README table row.

    python benchmarks/bench_1bitrrpm.py                      # 3,000,000 devices x 31 rounds, gamma = 0.1
    python benchmarks/bench_1bitrrpm.py --devices 300000 --cohort-size 10000
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import output, runner, schema  # noqa: E402

from yardstick import append_result, numpy_uniforms_per_second  # benchmarks/yardstick.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--cohort-size", type=int, default=100_000)
    ap.add_argument("--gamma", type=float, default=0.1)
    ap.add_argument("--write", action="store_true", help="also write the run directory and time it")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()

    overrides = [f"population.devices={args.devices}", f"rounds={args.rounds}",
                 f"simulation.cohort_size={args.cohort_size}", f"protocol.gamma={args.gamma}"]
    sc = schema.load("app_usage_31d", overrides)
    # JIT warm-up on a tiny population (numba caches compiled kernels on disk; a fresh install pays once)
    t = time.perf_counter()
    runner.run(schema.load("app_usage_31d", ["population.devices=1000", "rounds=2"]))
    warmup = time.perf_counter() - t

    events = io.StringIO()
    result = runner.run(sc, events=events)
    sim = result.wall_seconds
    t = time.perf_counter()
    summ = output.summary(result)  # digests over transcript and ledger
    digest_s = time.perf_counter() - t
    write_s = None
    if args.write:
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            output.write_run_dir(result, Path(tmp))
            write_s = time.perf_counter() - t
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    uni = numpy_uniforms_per_second()
    record = {
        "benchmark": "1bitrrpm_full_simulation",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, Python {platform.python_version()}",
        "devices": args.devices, "rounds": args.rounds, "cohort_size": args.cohort_size, "gamma": args.gamma,
        "network": {"loss": sc.network.loss, "jitter": sc.network.jitter},
        "simulate_seconds": round(sim, 3),
        "digest_seconds": round(digest_s, 3),
        "write_run_dir_seconds": None if write_s is None else round(write_s, 3),
        "jit_warmup_seconds": round(warmup, 3),
        "device_rounds_per_second": round(args.devices * args.rounds / sim),
        "peak_memory_mb": round(peak_mb),
        "numpy_uniforms_per_second": round(uni),
        "mean_abs_error": summ["error"]["mean_abs"],
        "epsilon_max": summ["epsilon"]["max"],
        "epsilon_mean": summ["epsilon"]["mean"],
        "messages": summ["messages"],
    }
    print(json.dumps(record, indent=2))
    print(f"| {args.devices:,} x {args.rounds} | cohort {args.cohort_size:,} | {sim:.1f} s | "
          f"{record['device_rounds_per_second'] / 1e6:.1f} M/s | {peak_mb:,.0f} MB | {uni / 1e6:.0f} M/s |")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
