"""Benchmark: ``ldpsim audit`` throughput (devices audited per second) on full-size runs.

Two runs are simulated and written to a temporary run directory (transcript.parquet always), then audited:
- ``1bitrrpm``: the shipped app_usage_31d scenario, 100,000 devices x 31 rounds (1BitRRPM with gamma = 0.1,
  2% loss, 0.5 s latency jitter), every device audited;
- ``thresh``: the shipped thresh_stable scenario, 200,000 devices x 364 rounds (52 epochs of 7 days), a keyed
  sample of devices audited (``--thresh-audit``, default 20,000): each is replayed through all 364 days.
The audit replays each device through its pure-Python reference model, so its cost is per device and round;
the figures are devices (and device-rounds) audited per second, with the audit's phases (load, transcript
digest, replay, comparison). Prints a JSON record per case and appends it to benchmarks/results.jsonl.

    python benchmarks/bench_audit.py
    python benchmarks/bench_audit.py --case 1bitrrpm --devices 20000 --no-record
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import audit, output, runner, schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)

CASES = {
    "1bitrrpm": ("app_usage_31d", "population.devices", 100_000),
    "thresh": ("thresh_stable", "population.devices", 200_000),
}


def run_case(case: str, devices: int, audited: int | None, out: Path) -> dict:
    name, key, _ = CASES[case]
    sc = schema.load(name, [f"{key}={devices}"])
    t = time.perf_counter()
    result = runner.run(sc, events=io.StringIO())
    simulate = time.perf_counter() - t
    t = time.perf_counter()
    output.write_run_dir(result, out, transcript="always")
    written = time.perf_counter() - t
    del result
    record = audit.audit(out, devices=audited)
    checked = record["devices"]["checked"]
    seconds = record["seconds"]
    return {
        "benchmark": f"audit_{case}", "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "scenario": name, "devices": sc.devices, "rounds": sc.rounds, "audited": checked,
        "chosen": record["devices"]["chosen"], "simulate_seconds": round(simulate, 2),
        "write_run_dir_seconds": round(written, 2), "audit_seconds": seconds, "timing": record["timing"],
        "devices_per_second": round(checked / seconds),
        "device_rounds_per_second": round(checked * sc.rounds / seconds),
        "transcript_rows_checked": record["reports_checked"]["transcript_rows"],
        "ledger_rows_checked": record["charges_checked"]["ledger_rows"], "verdict": record["verdict"],
        "peak_memory_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--devices", type=int, help="population (default: 100,000 for 1bitrrpm, 200,000 for thresh)")
    ap.add_argument("--thresh-audit", type=int, default=20_000, help="THRESH devices audited (keyed sample)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    runner.run(schema.load("quickstart", ["population.devices=2000", "rounds=3"]))  # JIT warm-up
    for case in CASES if args.case == "all" else [args.case]:
        with tempfile.TemporaryDirectory(prefix="ldpsim-bench-audit-") as tmp:
            devices = args.devices or CASES[case][2]
            record = run_case(case, devices, args.thresh_audit if case == "thresh" else None, Path(tmp) / "run")
        print(json.dumps(record, indent=2))
        print(f"| audit {case}: {record['audited']:,} of {record['devices']:,} devices x {record['rounds']} rounds | "
              f"{record['audit_seconds']:.1f} s | {record['devices_per_second']:,} devices/s | "
              f"{record['device_rounds_per_second']:,} device-rounds/s | {record['verdict']} |")
        if not args.no_record:
            append_result(record)


if __name__ == "__main__":
    main()
