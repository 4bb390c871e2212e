"""Benchmark: the whole ``ldpsim run`` process (start, imports, simulation, run directory, exit) against numpy.

Issue 13's yardstick: 3,000,000 devices x 31 rounds of 1BitRRPM (gamma = 0.1, the shipped app_usage_31d
scenario), the whole command timed as a subprocess, run directory included:

    ldpsim run app_usage_31d --set population.devices=3000000 --set rounds=31 --set protocol.name=1bitrrpm
        --set protocol.gamma=0.1 --set simulation.cohort_size=100000 --out TMP --force --quiet

Reports device-rounds per second of the whole process and its ratio to numpy's single-thread uniform draws
per second (``np.random.default_rng().random``, a few hundred million draws, best of 3) measured in the same
benchmark, before and after the runs. The breakdown of each run:

- ``before_simulation``: interpreter start, imports, scenario loading (up to the simulation's start, which is
  events.jsonl's last write minus summary.json's ``wall_seconds``); ``import_seconds`` beside it measures the
  modules ``ldpsim run`` imports before simulating, in a separate interpreter (best of 3);
- ``simulate``: summary.json ``wall_seconds``;
- ``run_dir``: from the simulation's end (events.jsonl closed) to summary.json written, with the per-file
  seconds from summary.json ``write_seconds`` (files written in a background thread overlap the others, so the
  per-file figures can sum to more than ``run_dir``; older versions without it: estimated from the files'
  modification times, marked ``estimated``) and the seconds of the summary (digests) and the attack metrics;
- ``exit``: summary.json written to the process gone (the one-line report, interpreter teardown).

A JIT warm-up run (1,000 devices) comes first, so numba's on-disk cache is hot. Appends a JSON line to
benchmarks/results.jsonl and prints a short table.

    python benchmarks/bench_run_process.py                   # 3,000,000 x 31, cohort 100,000
    python benchmarks/bench_run_process.py --devices 300000 --repeat 2 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from yardstick import append_result, numpy_uniforms_per_second  # benchmarks/yardstick.py

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
SCENARIO = "app_usage_31d"
#: what ``ldpsim run`` imports before it simulates (scenarios/cli.py: the module, then output and runner)
PRE_SIMULATION_IMPORTS = "import scenarios.cli; from scenarios import output, runner"


def ldpsim() -> list[str]:
    """The ``ldpsim`` console script when it runs this checkout's code, else ``python -m scenarios.cli`` in it
    (a copy of the repository: the same program from its own files)."""
    exe = Path(sys.executable).with_name("ldpsim")
    where = subprocess.run([sys.executable, "-c", "import scenarios; print(scenarios.__file__)"], cwd="/",
                           capture_output=True, text=True).stdout.strip()
    if exe.exists() and where and Path(where).resolve().parent.parent == REPO.resolve():
        return [str(exe)]
    return [sys.executable, "-m", "scenarios.cli"]


def python_seconds(code: str, repeat: int = 3) -> float:
    """Wall time of ``python -c code`` (a fresh interpreter), best of ``repeat``."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def import_seconds(repeat: int = 3) -> float:
    """Seconds to import what ``ldpsim run`` imports before the simulation, measured inside a fresh
    interpreter (interpreter start excluded), best of ``repeat``."""
    code = ("import time; t = time.perf_counter(); " + PRE_SIMULATION_IMPORTS +
            "; print(time.perf_counter() - t)")
    best = float("inf")
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
        best = min(best, float(out.stdout.split()[-1]))
    return best


def estimated_file_seconds(out: Path, sim_end: float) -> dict[str, float]:
    """Per-file seconds of a run directory without summary.json ``write_seconds``: the gaps between the
    files' modification times, in the order written (an estimate: files are written one after another)."""
    written = sorted((p.stat().st_mtime, p.name) for p in out.iterdir()
                     if p.is_file() and p.name != "events.jsonl" and p.stat().st_mtime >= sim_end)
    seconds, last = {}, sim_end
    for mtime, name in written:
        seconds[name] = round(mtime - last, 3)
        last = mtime
    return seconds


def run_once(cmd: list[str], out: Path) -> dict:
    """One whole ``ldpsim run`` process: its wall time and the breakdown (module docstring)."""
    if out.exists():
        shutil.rmtree(out)
    start = time.time()
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    end = start + wall
    if proc.returncode != 0:
        raise SystemExit(f"ldpsim run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    sim = summary["wall_seconds"]
    sim_end = (out / "events.jsonl").stat().st_mtime
    done = (out / "summary.json").stat().st_mtime
    timing = summary.get("write_seconds")
    if timing is not None:
        files, estimated = {k: round(v, 3) for k, v in timing["files"].items()}, False
        computed = {k: round(v, 3) for k, v in timing.get("computed", {}).items()}
    else:
        files, estimated, computed = estimated_file_seconds(out, sim_end), True, {}
    return {
        "process_seconds": round(wall, 3),
        "before_simulation": round(sim_end - sim - start, 3),
        "simulate": round(sim, 3),
        "run_dir": round(done - sim_end, 3),
        "exit": round(end - done, 3),
        "file_seconds": files, "file_seconds_estimated": estimated, "computed_seconds": computed,
        "bytes": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
        "digests": summary["digests"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--gamma", type=float, default=0.1)
    ap.add_argument("--cohort-size", type=int, default=100_000)
    ap.add_argument("--workers", type=int, help="[simulation] workers (default: the scenario's, i.e. the cores)")
    ap.add_argument("--repeat", type=int, default=1, help="whole-process runs (each reported; best kept)")
    ap.add_argument("--numpy-draws", type=int, default=200_000_000, help="uniform draws per numpy measurement")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()

    sets = [f"population.devices={args.devices}", f"rounds={args.rounds}", "protocol.name=1bitrrpm",
            f"protocol.gamma={args.gamma}", f"simulation.cohort_size={args.cohort_size}"]
    if args.workers is not None:
        sets.append(f"simulation.workers={args.workers}")
    load_before = os.getloadavg()
    uni_before = numpy_uniforms_per_second(args.numpy_draws)
    with tempfile.TemporaryDirectory(prefix="ldpsim-bench-process-") as tmp:
        out = Path(tmp) / "run"
        base = ldpsim() + ["run", SCENARIO]
        tail = ["--out", str(out), "--force", "--quiet"]
        t = time.perf_counter()  # JIT warm-up: numba's cache on disk, the imports in the page cache
        subprocess.run(base + ["--set", "population.devices=1000", "--set", "rounds=2"] + tail, cwd=REPO,
                       check=True, capture_output=True)
        warmup = time.perf_counter() - t
        cmd = base + [a for s in sets for a in ("--set", s)] + tail
        runs = [run_once(cmd, out) for _ in range(args.repeat)]
    startup = python_seconds("pass")
    imports = import_seconds()
    uni_after = numpy_uniforms_per_second(args.numpy_draws)
    uni = max(uni_before, uni_after)
    best = min(runs, key=lambda r: r["process_seconds"])
    device_rounds = args.devices * args.rounds
    rate = device_rounds / best["process_seconds"]
    shown = " ".join("'" + a + "'" if " " in a else a for a in
                     ["ldpsim", "run", SCENARIO] + [a for s in sets for a in ("--set", s)] +
                     ["--out", "TMP", "--force", "--quiet"])
    record = {
        "benchmark": "1bitrrpm_run_process",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "command": shown, "runs_as": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(base[:-2])),
        "devices": args.devices, "rounds": args.rounds, "cohort_size": args.cohort_size, "gamma": args.gamma,
        "workers": args.workers if args.workers is not None else f"default ({os.cpu_count()} cores)",
        "process_seconds": best["process_seconds"],
        "process_seconds_all": [r["process_seconds"] for r in runs],
        "device_rounds_per_second": round(rate),
        "numpy_uniforms_per_second": round(uni),
        "numpy_uniforms_per_second_before_after": [round(uni_before), round(uni_after)],
        "ratio_to_numpy": round(rate / uni, 4),
        "breakdown": {k: best[k] for k in ("before_simulation", "simulate", "run_dir", "exit")},
        "startup_seconds": round(startup, 3), "import_seconds": round(imports, 3),
        "simulation_device_rounds_per_second": round(device_rounds / best["simulate"]),
        "file_seconds": best["file_seconds"], "file_seconds_estimated": best["file_seconds_estimated"],
        "computed_seconds": best["computed_seconds"],
        "bytes": best["bytes"],
        "runs": [{k: r[k] for k in ("process_seconds", "before_simulation", "simulate", "run_dir", "exit")}
                 for r in runs],
        "jit_warmup_seconds": round(warmup, 3),
        "peak_memory_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "load_average_before": [round(x, 2) for x in load_before],
        "digests": best["digests"],
    }
    print(json.dumps(record, indent=2))
    b = record["breakdown"]
    print(f"\n| {args.devices:,} x {args.rounds} 1BitRRPM | whole process {best['process_seconds']:.2f} s | "
          f"{rate / 1e6:.1f} M device-rounds/s | numpy {uni / 1e6:.0f} M draws/s | ratio {rate / uni:.3f} |")
    print(f"| before simulation {b['before_simulation']:.2f} s (python {startup:.2f} s, imports {imports:.2f} s) "
          f"| simulate {b['simulate']:.2f} s | run directory {b['run_dir']:.2f} s | exit {b['exit']:.2f} s |")
    est = " (estimated from mtimes)" if best["file_seconds_estimated"] else ""
    print(f"run directory, seconds per file{est}:")
    for name, s in sorted(best["file_seconds"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<24} {s:7.3f} s  {best['bytes'].get(name, 0):>12,} bytes")
    for name, s in best["computed_seconds"].items():
        print(f"  ({name}: {s:.3f} s)")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
