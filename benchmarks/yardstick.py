"""The machine's yardstick for every benchmark here: numpy's default generator drawing uniform doubles on one
thread. Benchmarks report their throughput as a fraction of it, measured in the same invocation, so figures
from noisy or different machines can be compared."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results.jsonl"


def numpy_uniforms_per_second(draws: int = 50_000_000, chunk: int = 10_000_000, repeat: int = 3) -> float:
    """Uniform doubles per second from ``numpy.random.default_rng().random`` over ``draws`` draws (in chunks
    into one preallocated array), best of ``repeat``."""
    rng = np.random.default_rng(0)
    out = np.empty(chunk)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(max(draws // chunk, 1)):
            rng.random(out=out)
        best = min(best, time.perf_counter() - t)
    return max(draws // chunk, 1) * chunk / best


def append_result(entry: dict) -> None:
    """Append one benchmark's record to benchmarks/results.jsonl as one JSON line (the file every benchmark here
    records to, read by the README's tables)."""
    with open(RESULTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
