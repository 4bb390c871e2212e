"""Benchmark: sweep parallel efficiency, the local pool and a Dask LocalCluster, 1 worker against N.

A sweep of 32 runs (the shipped quickstart scenario, 8 epsilons x 4 repetitions, --devices each, 14 rounds:
about 0.5-1 s of simulation a run) is run five ways in this one process: in-process (what ``--workers 1``
does, here with every thread pool pinned to one thread like a worker), in a local pool of 1 worker process and of N, and on a Dask LocalCluster (``--cluster local:N``) of
1 worker and of N. Each time covers what the sweep's runs cost end to end: starting the pool or cluster
(spawning, importing, warming the numba kernels), the runs, and stopping it; not the results files and
plots written after the runs (the same serial step whatever ran the runs, reported apart). Parallel
efficiency = T1 / (N * TN), with T1 the same machinery on 1 worker (and, beside it, with T1 in-process).
Every way must give the same per-run digests. Other processes share the machine's cores: the record
holds the load average and ``machine_speedup``, how much N copies of a CPU-bound loop speed up over one
(N on an idle machine), before and after. With --repeat k the ways alternate k times and each reports
its best time (other processes on the machine slow some passes). Appends a line to benchmarks/results.jsonl.

    python benchmarks/bench_sweep_scaling.py                 # N = os.cpu_count()
    python benchmarks/bench_sweep_scaling.py --repeat 2 --workers 16 --runs 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import sweep_worker  # noqa: E402  (imports nothing heavy)

# The in-process way is the serial baseline: one thread for numba and OpenBLAS here too, as in every worker,
# set before numpy and numba are imported. (Unpinned, `np.dot` in the 1BitMean variance wakes OpenBLAS's
# threads, which spin on the other core: twice the CPU time for the same runs.)
os.environ.update(sweep_worker.THREAD_ENV)

from scenarios import sweep  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)


SPIN = "s = 0\nfor i in range(15_000_000):\n    s += i\n"


def machine_speedup(n: int) -> float:
    """How many cores this machine gives now: N processes each running the same pure-Python loop, against
    one (N when the cores are free; less when other processes use them)."""
    import subprocess

    def run(k: int) -> float:
        t = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(k)]
        for p in procs:
            p.wait()
        return time.perf_counter() - t

    one = run(1)
    return round(n * one / run(n), 2)


def timed(results) -> tuple[float, dict]:
    t = time.perf_counter()
    out = {}
    for res in results:
        if "summary" not in res:
            raise SystemExit(f"run {res['index']}/{res['repetition']} failed: {res['error']}")
        out[(res["index"], res["repetition"])] = res["summary"]
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="N (default: os.cpu_count())")
    ap.add_argument("--runs", type=int, default=32, help="runs in the sweep (8 epsilons x runs/8 repetitions)")
    ap.add_argument("--devices", type=int, default=150_000, help="devices per run (14 rounds each)")
    ap.add_argument("--repeat", type=int, default=1, help="time every way this many times, alternating; "
                                                          "report the best")
    ap.add_argument("--no-cluster", action="store_true", help="skip the Dask LocalCluster")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()
    n = args.workers
    if n < 2:
        ap.error("--workers: N must be at least 2 (1 worker is always measured)")
    epsilons = [0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4]
    repeat = max(1, args.runs // len(epsilons))
    sw = sweep.plan("quickstart", [f"protocol.epsilon={','.join(map(str, epsilons))}"], repeat=repeat,
                    overrides=[f"population.devices={args.devices}"])
    jobs = sweep.build_jobs(sw)

    load_before = os.getloadavg()[0]  # other processes on the machine share its cores
    speedup_before = machine_speedup(n)
    times: dict[str, float] = {}
    summaries: dict[str, dict] = {}
    ways = [("in_process", lambda: sweep.run_jobs(jobs, 1)),
            ("pool_1", lambda: sweep.run_jobs(jobs, 1, in_process=False)),
            (f"pool_{n}", lambda: sweep.run_jobs(jobs, n))]
    if not args.no_cluster:
        ways += [("cluster_1", lambda: sweep.run_on_cluster(jobs, sweep.Cluster(local=1))),
                 (f"cluster_{n}", lambda: sweep.run_on_cluster(jobs, sweep.Cluster(local=n)))]
    sweep.sweep_worker.warm([jobs[0]["scenario"]])  # the in-process way starts with its kernels loaded too
    every: dict[str, list[float]] = {name: [] for name, _ in ways}
    for _ in range(args.repeat):  # the ways alternate; each keeps its best time (the least disturbed)
        for name, start in ways:
            seconds, summaries[name] = timed(start())
            every[name].append(round(seconds, 2))
            times[name] = min(every[name])
            print(f"{name}: {seconds:.2f} s", file=sys.stderr)
    digests = {name: {k: s["digests"] for k, s in got.items()} for name, got in summaries.items()}
    same = all(d == digests["in_process"] for d in digests.values())

    def median_run(name: str) -> float:  # the simulation time of a run, median over the sweep's runs
        walls = sorted(s["wall_seconds"] for s in summaries[name].values())
        return round(walls[len(walls) // 2], 3)
    with tempfile.TemporaryDirectory() as tmp:  # the serial tail: results.csv, results.parquet, plots
        out = Path(tmp)
        sweep._prepare(sw, out, force=True)
        with open(out / "runs.jsonl", "w", encoding="utf-8") as f:
            for (i, r), s in sorted(summaries["in_process"].items()):
                f.write(sweep._dumps({"point": dict(zip(sw.keys, sw.points[i])), "repetition": r,
                                      "seed": sw.seeds[r], "summary": s}) + "\n")
        t = time.perf_counter()
        sweep.rebuild(sw, out)
        rebuild_s = time.perf_counter() - t

    def eff(t1: float, tn: float) -> float:
        return round(t1 / (n * tn), 3)

    record = {
        "benchmark": "sweep_scaling",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # before, after
        # N copies of a CPU-bound loop against one, before and after: the cores free for the benchmark
        "machine_speedup": [speedup_before, machine_speedup(n)],
        "runs": len(jobs), "devices": args.devices, "rounds": sw.base.get("rounds"), "workers": n,
        "repeat": args.repeat,
        # longer runs with N workers than with 1 mean the N cores were not all free (other processes)
        "run_seconds_median": {name: median_run(name) for name, _ in ways},
        "seconds": {k: round(v, 2) for k, v in times.items()},  # the best of --repeat
        "seconds_every": every,
        "efficiency_pool": eff(times["pool_1"], times[f"pool_{n}"]),
        "efficiency_pool_vs_in_process": eff(times["in_process"], times[f"pool_{n}"]),
        "efficiency_cluster": None if args.no_cluster else eff(times["cluster_1"], times[f"cluster_{n}"]),
        "efficiency_cluster_vs_in_process": None if args.no_cluster else eff(times["in_process"],
                                                                                times[f"cluster_{n}"]),
        "results_files_seconds": round(rebuild_s, 2),
        "digests_equal": same,
    }
    print(json.dumps(record, indent=2))
    print(f"| {len(jobs)} runs x {args.devices:,} devices | {n} workers | pool {times['pool_1']:.1f} s -> "
          f"{times[f'pool_{n}']:.1f} s (eff. {record['efficiency_pool']}) | "
          + ("" if args.no_cluster else f"local:{n} {times['cluster_1']:.1f} s -> {times[f'cluster_{n}']:.1f} s "
                                        f"(eff. {record['efficiency_cluster']}) | ")
          + f"in-process {times['in_process']:.1f} s |")
    if not same:
        raise SystemExit("digests differ between the ways of running the sweep")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
