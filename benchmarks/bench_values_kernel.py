"""Benchmark: the world's daily values kernel, element-wise against blocked (vectorized), in the same run.

A day's value of every device is clip(level + sd N, 0, max_value), N a keyed normal (agents/world.py). The
element-wise loop (``_values_range``, the path of worlds with binary, data-set or behavior-shaped devices) and
the blocked loop the compiler vectorizes (``_plain_range``) are timed on the same 3M devices, serial and on all
cores, after checking that they give the same bits. Reports ns per value and the ratio; appends one record to
benchmarks/results.jsonl.

    python benchmarks/bench_values_kernel.py
    python benchmarks/bench_values_kernel.py --devices 1000000 --repeat 20 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from agents import world as W  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=3_000_000)
    ap.add_argument("--repeat", type=int, default=10, help="days timed per configuration")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()
    n = args.devices
    rng = np.random.default_rng(1)
    levels = rng.normal(5000, 4000, n)  # clipped at 0 often enough, and some at the top
    sds = np.full(n, 3000.0)
    sds[::7] = 0.0
    flags = (np.zeros(n, np.bool_), np.full(n, -1, np.int16), np.zeros(1), np.zeros(2, np.int64))
    binary, source, pool, offsets = flags
    free = np.zeros(n, np.bool_)
    key = np.uint64(12345)

    def call(plain: bool, parallel: bool, day: int, out: np.ndarray) -> int:
        common = (plain, levels, sds, binary, source, pool, offsets, key, 86400.0, free, day * n, out)
        return int(W._values_kernel(*common) if parallel else W._values_kernel_serial(*common, 0, n))

    results, outputs = {}, {}
    for parallel in (False, True):
        for plain in (False, True):
            out = np.empty(n)
            call(plain, parallel, 0, out)  # compile or load, and check
            outputs[(plain, parallel)] = out.copy()
            t = time.perf_counter()
            for day in range(1, args.repeat + 1):
                call(plain, parallel, day, out)
            results[("blocked" if plain else "element-wise") + (", all cores" if parallel else ", one core")] = \
                (time.perf_counter() - t) / args.repeat / n * 1e9
    ref = outputs[(False, False)].view(np.int64)
    same = all(np.array_equal(o.view(np.int64), ref) for o in outputs.values())
    record = {"benchmark": "values_kernel", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "devices": n, "repeat": args.repeat, "same_bits": same,
              "ns_per_value": {k: round(v, 2) for k, v in results.items()},
              "speedup_one_core": round(results["element-wise, one core"] / results["blocked, one core"], 2),
              "speedup_all_cores": round(results["element-wise, all cores"] / results["blocked, all cores"], 2)}
    print(json.dumps(record, indent=2))
    if not same:
        raise SystemExit("the blocked kernel's values differ from the element-wise loop's")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
