"""Benchmark: one run's cohorts answered in parallel: by N worker processes (``[simulation] workers``,
scenarios/parallel.py) or by T threads of the run's own process (``[simulation] threads``, agents/shard.py).

Runs the shipped 31-day app-usage scenario (1BitRRPM, gamma 0.1) at the given population once per configuration,
each in a fresh child process that sets the allocator as the ``ldpsim`` program does (scenarios/allocator.py):
first one thread confined to one core (``--one-core``, on by default: the baseline of the speed-ups, since one
thread left on a machine with a spare core computes the next day's values there), then every thread count in
one process (workers = 1), then every worker count above one. It reports the simulation's wall time
(``runner.run``) and CPU seconds (user and system, the run's process), the speed-up over the first
configuration measured in the same invocation, whether every digest equals that run's, the run's peak memory
(its own process plus its workers) and, as the machine's yardstick, numpy's single-thread uniform draws per
second. Appends one record to benchmarks/results.jsonl.

    python benchmarks/bench_parallel.py                      # 3,000,000 x 31: 1 thread on one core, then on
                                                             # every core, 2 threads, 2 workers
    python benchmarks/bench_parallel.py --repeat 3           # the same, alternated three times, fastest kept
    python benchmarks/bench_parallel.py --workers 1,2,4,8,16 --threads 1,16 --devices 3000000
    python benchmarks/bench_parallel.py --workers 1 --threads 2 --devices 100000000 --cohort-size 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


from yardstick import append_result, numpy_uniforms_per_second  # benchmarks/yardstick.py

ROOT = Path(__file__).resolve().parent


def one(devices: int, rounds: int, cohort: int, workers: int, threads: int, one_core: bool = False) -> dict:
    """One run in this process (called in a child): its wall time, CPU time, digests and memory.
    ``one_core``: the process (and so every thread it starts) may run on one core only."""
    if one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sys.path.insert(0, str(ROOT.parent))
    from scenarios import allocator, output, runner, schema

    allocator.tune()  # what the ldpsim program does first

    runner.run(schema.load("app_usage_31d", ["population.devices=1000", "rounds=2", "simulation.workers=1"]))
    sc = schema.load("app_usage_31d", [f"population.devices={devices}", f"rounds={rounds}",
                                       f"simulation.cohort_size={cohort}", f"simulation.workers={workers}",
                                       f"simulation.threads={threads}", "protocol.gamma=0.1",
                                       "analysis.attacks=false"])
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = runner.run(sc)
    after = resource.getrusage(resource.RUSAGE_SELF)
    summ = output.summary(result)
    own = after.ru_maxrss / 1024
    stats = result.extra.get("worker_stats", [])
    return {"workers": result.extra["workers"], "threads": result.extra["threads"], "one_core": one_core,
            "simulate_seconds": round(result.wall_seconds, 3),
            "cpu_user_seconds": round(after.ru_utime - before.ru_utime, 2),
            "cpu_system_seconds": round(after.ru_stime - before.ru_stime, 2), "digests": summ["digests"],
            "mean_abs_error": summ["error"]["mean_abs"], "peak_mb_run_process": round(own),
            "peak_mb_workers": [round(w["peak_mb"]) for w in stats],
            "worker_answer_seconds": [round(w["answer_seconds"], 2) for w in stats],
            "worker_send_seconds": [round(w["send_seconds"], 2) for w in stats],
            "worker_cpu_seconds": [round(w["cpu_seconds"], 2) for w in stats],
            "worker_prefetch_seconds": [round(w.get("prefetch_seconds", 0.0), 2) for w in stats],
            "peak_mb_total": round(own + sum(w["peak_mb"] for w in stats))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--cohort-size", type=int, default=100_000)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker process counts; the first is the baseline")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, each run with one process "
                                                     "(workers = 1); the first is the baseline's")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--one-threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--confined", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-one-core", dest="one_core", action="store_false",
                    help="no one-core baseline: the first configuration is the baseline")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the configurations, alternated (the machine "
                                                         "drifts); each configuration's fastest run is kept")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.devices, args.rounds, args.cohort_size, args.one, args.one_threads,
                             args.confined)))
        return
    threads = [int(t) for t in args.threads.split(",")]
    runs = [(w, t, False) for w in (int(w) for w in args.workers.split(",")) for t in (threads if w == 1 else [1])]
    if args.one_core and hasattr(os, "sched_setaffinity"):
        runs.insert(0, (1, 1, True))
    uni = numpy_uniforms_per_second()
    every: dict[tuple[int, int, bool], list[dict]] = {r: [] for r in runs}
    for _ in range(args.repeat):  # alternated: each configuration once a round
        for w, t, confined in runs:
            out = subprocess.run([sys.executable, __file__, "--one", str(w), "--one-threads", str(t),
                                  "--devices", str(args.devices), "--rounds", str(args.rounds),
                                  "--cohort-size", str(args.cohort_size)] + (["--confined"] if confined else []),
                                 check=True, capture_output=True, text=True)
            every[(w, t, confined)].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for w, t, confined in runs:
        runs_of = every[(w, t, confined)]
        row = min(runs_of, key=lambda r: r["simulate_seconds"])
        row["simulate_seconds_all"] = [r["simulate_seconds"] for r in runs_of]
        row["digests_equal_all"] = all(r["digests"] == every[runs[0]][0]["digests"] for r in runs_of)
        rows.append(row)
        base = rows[0]
        row["speedup"] = round(base["simulate_seconds"] / row["simulate_seconds"], 2)
        row["digests_equal"] = row["digests"] == base["digests"] and row["digests_equal_all"]
        dr = args.devices * args.rounds / row["simulate_seconds"]
        where = "one core" if confined else f"{os.cpu_count()} cores"
        print(f"| {w:>3} workers, {t:>2} threads, {where} | {row['simulate_seconds']:7.2f} s | "
              f"cpu {row['cpu_user_seconds']:.2f} user + {row['cpu_system_seconds']:.2f} system s | "
              f"{dr / 1e6:6.1f} M device-rounds/s | x{row['speedup']:.2f} | {dr / uni:.3f} of numpy draws/s | "
              f"digests equal: {row['digests_equal']} | peak {row['peak_mb_total']:,} MB | "
              f"all runs {row['simulate_seconds_all']} |", flush=True)
    record = {"benchmark": "parallel_cohorts", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "devices": args.devices, "rounds": args.rounds, "cohort_size": args.cohort_size,
              "repeat": args.repeat, "numpy_uniforms_per_second": round(uni),
              "baseline": "1 worker, 1 thread, one core" if runs[0][2] else "the first configuration",
              "runs": [{k: v for k, v in r.items() if k != "digests"} for r in rows],
              "digests_equal": all(r["digests_equal"] for r in rows)}
    print(json.dumps(record))
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
