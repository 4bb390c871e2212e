"""The run directory: summary.json, estimates.csv, ledger.csv, spend.csv, spend_over_time.csv, scenario.json,
events.jsonl (written during the run) and the plots. summary.json is written last: its presence marks a
complete run directory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from scenarios import plots
from scenarios.metrics import error_summary, range_mse, range_queries, round_metrics
from scenarios.runner import RunResult, bucket_width


CSV_CHUNK = 200_000


def _fmt(col: np.ndarray | Sequence) -> list[str]:
    a = np.asarray(col)
    if a.dtype.kind in "iub":
        return list(map(str, a.astype(np.int64).tolist()))
    if a.dtype.kind == "f":
        return list(map(repr, a.astype(np.float64).tolist()))
    return list(map(str, a.tolist()))


def write_csv(path: Path, header: Sequence[str], columns: Sequence[np.ndarray | Sequence]) -> None:
    """A plain CSV (pandas, polars and spreadsheets read it) from aligned columns."""
    n = len(columns[0]) if columns else 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(",".join(header) + "\n")
        for lo in range(0, n, CSV_CHUNK):  # chunked: a row as Python strings costs ~60 bytes a field
            rows = zip(*(_fmt(c[lo:lo + CSV_CHUNK]) for c in columns))
            f.writelines(",".join(r) + "\n" for r in rows)


def write_ledger_csv(path: Path, chunks: Iterable[dict]) -> int:
    """Long-form ledger: one row per (device, charge): device, round, time, reason, amount."""
    rows = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write("device,round,time,reason,amount\n")
        for ch in chunks:
            devices = ch["devices"]
            if devices.size == 0:
                continue
            tail = f",{ch['round']},{float(ch['time'])!r},{ch['reason']},{float(ch['amount'])!r}\n"
            for lo in range(0, devices.size, CSV_CHUNK):
                f.write(tail.join(map(str, devices[lo:lo + CSV_CHUNK].tolist())) + tail)
            rows += devices.size
    return rows


def _sha256_bytes(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _stack(values: list, k: int | None) -> np.ndarray:
    """Per-round numbers as an array: (rounds,) for means, (rounds, k) for histograms (NaN when missing)."""
    if k is None:
        return np.array([float(v) for v in values])
    return np.array([np.full(k, np.nan) if np.ndim(v) == 0 else np.asarray(v, dtype=np.float64) for v in values])


def width_of(params: object) -> int | None:
    """Numbers estimated per round: None for a mean, k for a histogram, c for several counters."""
    return {"histogram": getattr(params, "buckets", None), "counters": getattr(params, "counters", None)}.get(
        params.kind)


def spend_by_reason(result: RunResult) -> dict[str, np.ndarray]:
    """Per-device cumulative spend of each reason, recomputed from the ledger's charges."""
    out: dict[str, np.ndarray] = {}
    for row in result.ledger.rows():
        acc = out.setdefault(row["reason"], np.zeros(result.scenario.devices))
        acc[row["devices"]] += row["amount"]
    return out


def _thresh_summary(result: RunResult) -> dict:
    p = result.scenario.protocol
    by = spend_by_reason(result)
    cv, ce = (by.get(k, np.zeros(result.scenario.devices)) for k in ("thresh_vote", "thresh_estimate"))
    reached = (lambda c, step: c >= p.cap - 1e-12) if p.cap_rule == "paper" else (lambda c, step: c + step > p.cap)
    return {
        "updates": int(sum(bool(r.info.get("global_update")) for r in result.rounds)),
        "update_epochs": [r.round for r in result.rounds if r.info.get("global_update")],
        "caps": {"cap": p.cap, "vote_cap_reached": float(np.mean(reached(cv, p.vote_noise))),
                 "estimate_cap_reached": float(np.mean(reached(ce, p.estimate_noise))),
                 "vote_spend_max": float(cv.max()), "estimate_spend_max": float(ce.max())},
        "thresh": {"a": p.vote_noise, "b": p.estimate_noise, "taus": p.taus.tolist(),
                   "vote_threshold": p.vote_threshold, "guarantee": p.guarantee,
                   "theorem_4_3_bound": _theorem_bound(p), "problems": p.problems()},
    }


def _theorem_bound(p) -> float:
    from protocols.thresh import theorem_4_3_bound

    return theorem_4_3_bound(p.devices, p.epochs, p.epoch_length, p.delta)


RANGE_QUERIES = 1000


def _range_errors(sc, truth: np.ndarray, est: np.ndarray) -> dict:
    queries = range_queries(sc.rounds, RANGE_QUERIES, sc.seed)
    return {"range_mse": range_mse(truth, est, queries),
            "range_mse_zero_baseline": range_mse(truth, np.zeros_like(truth), queries)}


def _stream_summary(result: RunResult, truth: np.ndarray, est: np.ndarray) -> dict:
    """ToPL: thresholds chosen (and the oracle's), and the MSE of random range-sum queries."""
    sc = result.scenario
    queries = range_queries(sc.rounds, RANGE_QUERIES, sc.seed)
    if sc.protocol.name == "tops":
        thresholds = [{"round": 1, "theta": result.rounds[0].info.get("theta")}] if result.rounds else []
    else:
        thresholds = [{"round": r.round, "theta": r.info.get("theta"), "oracle_theta": r.info["oracle_theta"]}
                      for r in result.rounds if "oracle_theta" in r.info]
    return {
        "threshold": thresholds,
        "range_mse": range_mse(truth, est, queries),
        "range_mse_zero_baseline": range_mse(truth, np.zeros_like(truth), queries),
        "range_queries": {"count": RANGE_QUERIES, "over": f"rounds 1..{sc.rounds}",
                          "endpoints": "uniform, sorted (keyed by the seed)", "answer": "sum of per-round sums"},
        "event_level": {"epsilon_per_report": sc.protocol.epsilon,
                        "threshold_epsilon": sc.protocol.threshold_epsilon,
                        "cumulative_per_device": "see epsilon: each report is charged its epsilon"},
    }


def summary(result: RunResult) -> dict:
    sc, recs = result.scenario, result.rounds
    k = width_of(sc.protocol)
    truth = _stack([r.truth for r in recs], k)
    est = _stack([r.estimate for r in recs], k)
    stats, traffic = result.collector.stats, result.network.traffic
    return {
        "scenario": sc.name,
        "protocol": sc.protocol.name,
        "seed": sc.seed,
        "devices": sc.devices,
        "rounds": sc.rounds,
        "cohort_size": sc.simulation.cohort_size,
        "parameters": {**dataclasses.asdict(sc.protocol), "round_epsilon": sc.protocol.round_epsilon},
        "error": {**error_summary(sc.protocol.kind, truth, est, bucket_width(sc.protocol)),
                  **(_range_errors(sc, truth, est) if sc.protocol.kind == "stream" else {})},
        "epsilon": result.ledger.summary(),
        "round_epsilon_max": float(result.ledger.round_epsilon.max()) if sc.devices else 0.0,
        "messages": {"sent": traffic.messages_sent, "delivered": traffic.messages_delivered,
                     "rejected": stats.rejected, "late": stats.late,
                     "rejected_by_devices": result.device_rejected},
        "reports": {"sent": traffic.reports_sent, "lost": traffic.reports_lost,
                    "accepted": stats.reports_accepted},
        "clipped_values": int(sum(r.clipped for r in recs)),
        **(_thresh_summary(result) if sc.protocol.name == "thresh" else {}),
        **(_stream_summary(result, truth, est) if sc.protocol.kind == "stream" else {}),
        "digests": {"transcript": result.transcript_digest, "ledger": result.ledger.digest(),
                    "estimates": _sha256_bytes(np.array([r.round for r in recs], "<i8"), est.astype("<f8"))},
        "wall_seconds": result.wall_seconds,
    }


def _write_estimates(result: RunResult, out: Path) -> None:
    sc, recs = result.scenario, result.rounds
    rounds = np.array([r.round for r in recs])
    reports = np.array([r.reports for r in recs])
    clipped = np.array([r.clipped for r in recs])
    if sc.protocol.kind == "epoch":
        truth, est, sd = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate", "sd_theory"))
        update = np.array([bool(r.info.get("global_update")) for r in recs])
        write_csv(out / "estimates.csv", ["epoch", "truth", "estimate", "error", "global_update", "vote_mean", "votes",
                                          "reports", "theory_sd"],
                  [rounds, truth, est, est - truth, update.astype(int), [r.info.get("vote_mean") for r in recs],
                   [r.info.get("votes", 0) for r in recs], reports, sd])
        title = (f"{sc.name}: {sc.protocol.name}, ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}, "
                 f"{sc.protocol.epochs} epochs of {sc.protocol.epoch_length} rounds")
        plots.epochs_plot(out / "estimates.png", rounds, truth, est, update, title,
                          [(c.round - 1) // sc.protocol.epoch_length + 1 for c in sc.changes])
        return
    if sc.protocol.kind == "stream":
        truth, est = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate"))
        write_csv(out / "estimates.csv", ["round", "truth", "estimate", "error", "theta", "holdout_reports",
                                          "reports"],
                  [rounds, truth, est, est - truth, [r.info.get("theta") for r in recs],
                   [r.info.get("holdout_reports", 0) for r in recs], reports])
        title = (f"{sc.name}: {sc.protocol.name} ({sc.protocol.method}), ε = {sc.protocol.epsilon:g}, "
                 f"n = {sc.devices:,}")
        plots.estimates_plot(out / "estimates.png", rounds, truth, est, np.zeros_like(truth), title,
                             [c.round for c in sc.changes])
        return
    if sc.protocol.kind == "mean":
        truth, est, sd = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate", "sd_theory"))
        write_csv(out / "estimates.csv", ["round", "truth", "estimate", "error", "theory_sd", "reports", "clipped"],
                  [rounds, truth, est, est - truth, sd, reports, clipped])
        title = f"{sc.name}: {sc.protocol.name}, ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}"
        plots.estimates_plot(out / "estimates.png", rounds, truth, est, sd, title, [c.round for c in sc.changes])
        return
    k = width_of(sc.protocol)
    truth, est, sd = (_stack([getattr(r, f) for r in recs], k) for f in ("truth", "estimate", "sd_theory"))
    if sc.protocol.kind == "counters":
        write_csv(out / "estimates.csv",
                  ["round", "counter", "truth", "estimate", "error", "theory_sd", "reports", "clipped"],
                  [np.repeat(rounds, k), np.tile(np.arange(k), len(recs)), truth.ravel(), est.ravel(),
                   (est - truth).ravel(), sd.ravel(), np.repeat(reports, k), np.repeat(clipped, k)])
        plots.counters_plot(out / "estimates.png", rounds, truth, est, sd,
                            f"{sc.name}: {sc.protocol.name}, c = {k}, ε = {sc.protocol.epsilon:g} per counter "
                            f"(joint {sc.protocol.round_epsilon:.3g}), n = {sc.devices:,}",
                            [c.round for c in sc.changes])
        return
    width = bucket_width(sc.protocol)
    bucket = np.tile(np.arange(k), len(recs))
    write_csv(out / "estimates.csv",
              ["round", "bucket", "low", "high", "truth", "estimate", "error", "theory_sd", "reports", "clipped"],
              [np.repeat(rounds, k), bucket, bucket * width, (bucket + 1) * width, truth.ravel(), est.ravel(),
               (est - truth).ravel(), sd.ravel(), np.repeat(reports, k), np.repeat(clipped, k)])
    per_round = [round_metrics("histogram", t, e, width) for t, e in zip(truth, est)]
    title = (f"{sc.name}: {sc.protocol.name}, k = {k}, d = {getattr(sc.protocol, 'bits', 1)}, "
             f"ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}")
    plots.histogram_plot(out / "estimates.png", rounds, per_round, truth, est, sd, width, title,
                         [c.round for c in sc.changes])


def write_run_dir(result: RunResult, out: Path, ledger_rows: bool = True) -> dict:
    """Write every file of the run directory except events.jsonl (streamed during the run)."""
    out.mkdir(parents=True, exist_ok=True)
    sc = result.scenario
    _write_estimates(result, out)
    led = result.ledger
    ids = np.arange(sc.devices)
    write_csv(out / "spend.csv", ["device", "group", "spend", "round_epsilon"],
              [ids, np.array([g.name for g in sc.groups])[result.world.group_of(ids)], led.spend,
               led.round_epsilon])
    hist = led.history
    keys = ["round", "min", "mean", "p50", "p90", "p99", "max"]
    write_csv(out / "spend_over_time.csv", keys, [np.array([h[k] for h in hist]) for k in keys])
    if ledger_rows:
        write_ledger_csv(out / "ledger.csv", led.rows())
    (out / "scenario.json").write_text(json.dumps(sc.raw, indent=2) + "\n", encoding="utf-8")
    plots.spend_plot(out / "spend.png", hist, led.spend, f"per-device spend: {sc.protocol.name}")
    s = summary(result)
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    return s
