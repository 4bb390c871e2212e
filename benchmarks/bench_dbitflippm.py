"""Benchmark: dBitFlipPM histograms on 1,000,000 devices through the full simulation, against multi-freq-ldpy.

Ours: the usage-histogram scenario (k = 32 buckets on [0, 24] h, d = 1, eps = 1, 31 rounds, cohorts of
100,000) through scenarios.runner.run: SimPy cohorts and collector, msgpack on every message, ledger and
event log. Also, like for like with the peer, one round outside the simulation: DBitFlipDevices setup (J
sampling) + report_bits + estimate_histogram on the same n values.
Peer (multi-freq-ldpy 0.2.5, the `peer` extra): dBitFlipPM_Client once per device, then
dBitFlipPM_Aggregator_MI, on the same bucketized values (the last simulated round's; input in [0, k), b = k).
The peer is slow, so it is timed on a random subsample of n_peer devices and extrapolated linearly (both of
its steps are linear in n). Appends a record to benchmarks/results.jsonl and prints a README table row.

    python benchmarks/bench_dbitflippm.py                          # 1,000,000 x 31 rounds; peer on 100,000
    python benchmarks/bench_dbitflippm.py --peer-devices 1000000   # peer on the whole population (slow)
    python benchmarks/bench_dbitflippm.py --devices 200000 --no-record
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

from protocols.dbitflip import DBitFlipDevices, bucket_of, estimate_histogram  # noqa: E402
from scenarios import output, runner, schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)

TARGET_RATIO = 50.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ours_single_round(params, values: np.ndarray, seed: int, repeat: int = 3) -> dict[str, float]:
    """Best of ``repeat``: device setup (J), report_bits and estimate_histogram for one round, no simulation."""
    n = values.size
    ids = np.arange(n)
    best = {"setup": np.inf, "report": np.inf, "estimate": np.inf}
    for _ in range(repeat):
        t0 = time.perf_counter()
        dev = DBitFlipDevices(params, seed, ids)
        t1 = time.perf_counter()
        bits, _ = dev.report_bits(1, values)
        t2 = time.perf_counter()
        est = estimate_histogram(dev.J, bits, params.buckets, params.epsilon, params.gamma)
        t3 = time.perf_counter()
        for key, s in (("setup", t1 - t0), ("report", t2 - t1), ("estimate", t3 - t2)):
            best[key] = min(best[key], s)
    total = sum(best.values())
    err = float(np.abs(est - np.bincount(bucket_of(values, params.buckets, params.max_value),
                                         minlength=params.buckets) / n).max())
    return {"max_abs_error": err, "setup_seconds": best["setup"], "report_seconds": best["report"], "estimate_seconds": best["estimate"],
            "seconds": total, "device_rounds_per_second": n / total}


def peer_single_round(buckets: np.ndarray, k: int, d: int, eps: float, seed: int) -> dict[str, float]:
    """The peer's client once per device (a Python loop over a numba function), then its aggregator."""
    import numba
    from multi_freq_ldpy.long_freq_est.dBitFlipPM import dBitFlipPM_Aggregator_MI, dBitFlipPM_Client

    @numba.njit
    def seed_numba_rng(s):  # np.random.seed from Python does not reach numba's generator
        np.random.seed(s)

    seed_numba_rng(seed)
    t = time.perf_counter()
    dBitFlipPM_Client(0, k, k, d, eps)  # JIT (the peer does not cache its compiled code)
    jit = time.perf_counter() - t
    values = [int(v) for v in buckets]  # the peer checks isinstance(k, int); inputs as Python ints too
    t = time.perf_counter()
    reports = [dBitFlipPM_Client(v, k, k, d, eps) for v in values]
    client = time.perf_counter() - t
    t = time.perf_counter()
    est = dBitFlipPM_Aggregator_MI(reports, k, d, eps)
    agg = time.perf_counter() - t
    assert np.isclose(est.sum(), 1.0), est.sum()
    n = buckets.size
    return {"n": n, "jit_seconds": jit, "client_seconds": client, "aggregator_seconds": agg,
            "client_us_per_device": client / n * 1e6, "aggregator_us_per_device": agg / n * 1e6,
            "device_rounds_per_second": n / (client + agg), "estimate": est}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--buckets", type=int, default=32)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--cohort-size", type=int, default=100_000)
    ap.add_argument("--peer-devices", type=int, default=100_000,
                    help="n_peer: the peer is timed on this many devices and extrapolated linearly")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    args = ap.parse_args()

    base = [f"protocol.buckets={args.buckets}", f"protocol.bits={args.bits}", "protocol.max_value=24"]
    sc = schema.load("usage_histogram", base + [
        f"population.devices={args.devices}", f"rounds={args.rounds}", f"simulation.cohort_size={args.cohort_size}"])
    p = sc.protocol
    # JIT warm-up on a tiny population (numba caches compiled kernels on disk; a fresh install pays once)
    t = time.perf_counter()
    runner.run(schema.load("usage_histogram", base + ["population.devices=1000", "rounds=2"]))
    warmup = time.perf_counter() - t

    # (a) the full simulation
    result = runner.run(sc, events=io.StringIO())
    sim = result.wall_seconds
    sim_peak = peak_mb()  # before anything else runs in this process
    summ = output.summary(result)
    accepted, expected = summ["reports"]["accepted"], args.devices * args.rounds
    if accepted != expected:  # a run whose batches the collector rejected does less work: not a benchmark
        sys.exit(f"bench_dbitflippm: the collector accepted {accepted:,} of {expected:,} reports "
                 f"(rejected messages: {result.collector.stats.reasons}); not recording this run")
    ours_dr = args.devices * args.rounds / sim

    # the workload of one round: the last simulated round's values
    values = np.array(result.world.values(np.arange(args.devices))[0])
    del result
    buckets = bucket_of(values, p.buckets, p.max_value)

    # (c) ours, one round, like for like (same n values, no simulation)
    single = ours_single_round(p, values, sc.seed)

    # (b) the peer on a random subsample, extrapolated
    n_peer = min(args.peer_devices, args.devices)
    sub = np.sort(np.random.default_rng(sc.seed).choice(args.devices, n_peer, replace=False))
    peer = peer_single_round(buckets[sub], p.buckets, p.bits, p.epsilon, sc.seed)
    peer_est = peer.pop("estimate")
    truth_sub = np.bincount(buckets[sub], minlength=p.buckets) / n_peer
    peer_at_n = (peer["client_seconds"] + peer["aggregator_seconds"]) * args.devices / n_peer
    ratio = ours_dr / peer["device_rounds_per_second"]
    ratio_single = single["device_rounds_per_second"] / peer["device_rounds_per_second"]

    record = {
        "benchmark": "dbitflippm_full_simulation_vs_multi_freq_ldpy",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "devices": args.devices, "rounds": args.rounds, "cohort_size": args.cohort_size,
        "buckets": p.buckets, "bits": p.bits, "epsilon": p.epsilon,
        "simulate_seconds": round(sim, 3),
        "jit_warmup_seconds": round(warmup, 3),
        "device_rounds_per_second": round(ours_dr),
        "peak_memory_mb": round(sim_peak),
        "hist_max_abs": summ["error"]["hist_max_abs"],
        "epsilon_max": summ["epsilon"]["max"],
        "ours_single_round": {key: (round(v) if key == "device_rounds_per_second" else round(v, 4))
                              for key, v in single.items()},
        "peer": {"package": "multi-freq-ldpy 0.2.5", "measured_on_devices": n_peer,
                 "extrapolated_linearly_to": args.devices,
                 **{key: round(v, 4) if isinstance(v, float) else v for key, v in peer.items()},
                 "extrapolated_seconds_at_devices": round(peer_at_n, 2),
                 "max_abs_error_on_subsample": float(np.abs(peer_est - truth_sub).max())},
        "ratio_full_simulation_vs_peer_single_round": round(ratio, 1),
        "ratio_single_round_vs_peer_single_round": round(ratio_single, 1),
        "target_ratio": TARGET_RATIO,
    }
    print(json.dumps(record, indent=2))
    how = ("measured on all devices" if n_peer == args.devices else
           f"measured on n_peer = {n_peer:,} devices and extrapolated linearly to {args.devices:,}")
    print(f"\nPeer figures were {how}: client {peer['client_us_per_device']:.2f} us/device + aggregator "
          f"{peer['aggregator_us_per_device']:.2f} us/device = {peer_at_n:.1f} s for one round of {args.devices:,}.")
    print(f"Ours (full {args.rounds}-round simulation) vs peer (one round, client + aggregator): "
          f"{ratio:.1f}x in device-rounds/s (target >= {TARGET_RATIO:.0f}x: "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}); ours one round without the simulation: "
          f"{ratio_single:.1f}x.\n")
    print("| devices x rounds | k, d | cohort size | wall time (simulation) | device-rounds/s | peak memory "
          "| peer device-rounds/s (n_peer, extrapolated) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.devices:,} x {args.rounds} | {p.buckets}, {p.bits} | {args.cohort_size:,} | {sim:.1f} s | "
          f"{ours_dr / 1e6:.1f} M/s | {sim_peak:,.0f} MB | {peer['device_rounds_per_second'] / 1e3:.0f} k/s "
          f"({n_peer:,}) | {ratio:.0f}x |")
    if not args.no_record:
        append_result(record)


if __name__ == "__main__":
    main()
