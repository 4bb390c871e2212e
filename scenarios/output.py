"""The run directory: summary.json, estimates.csv, ledger.csv, spend.csv, spend_over_time.csv, scenario.json,
events.jsonl (written during the run) and the plots. summary.json is written last: its presence marks a
complete run directory.

The large tables (spend.parquet, ledger.parquet, transcript.parquet) are written in a background thread while
the calling thread draws the plots, computes the attack metrics and the summary: pyarrow encodes and compresses
without holding the GIL (the writer takes it a few times per million rows); matplotlib and the digests hold it.
With a core free the tables cost next to nothing. matplotlib (scenarios/plots.py) is imported only when the
first plot is drawn. ``ldpsim run`` of a large run passes a plot process (scenarios/plot_process.py), started
when the run began, which draws estimates.png and spend.png while this process writes the rest."""

from __future__ import annotations

import hashlib
import json
import textwrap
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from protocols.base import ProtocolParams
from protocols.ledger import ChargeRows, Ledger, exceeds
from scenarios import attacks
from scenarios.metrics import error_of, error_summary, range_mse, range_queries, round_metrics
from scenarios.runner import RunResult, bucket_width, protocol_parameters
from scenarios import tables
from scenarios import accounting, jsonout
from scenarios.labels import BAND, TRUTH_MEAN, with_unit
from scenarios.tables import atomic_path

if TYPE_CHECKING:
    from scenarios.plot_process import PlotProcess


CSV_CHUNK = 200_000


def _fmt(col: np.ndarray | Sequence) -> list[str]:
    a = np.asarray(col)
    if a.dtype.kind in "iub":
        return list(map(str, a.astype(np.int64).tolist()))
    if a.dtype.kind == "f":
        return list(map(repr, a.astype(np.float64).tolist()))
    # mixed columns (a figure only some rounds have): None is an empty cell, which CSV readers take as missing
    return ["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in a.tolist()]


def write_csv(path: Path, header: Sequence[str], columns: Sequence[np.ndarray | Sequence]) -> None:
    """A plain CSV (pandas, polars and spreadsheets read it) from aligned columns, written atomically."""
    n = len(columns[0]) if columns else 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(",".join(header) + "\n")
        for lo in range(0, n, CSV_CHUNK):  # chunked: a row as Python strings costs ~60 bytes a field
            rows = zip(*(_fmt(c[lo:lo + CSV_CHUNK]) for c in columns))
            f.writelines(",".join(r) + "\n" for r in rows)


def write_ledger_csv(path: Path, chunks: Iterable[ChargeRows]) -> int:
    """Long-form ledger: one row per (device, charge): device, round, time, reason, amount (atomically)."""
    rows = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
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


def _timed(seconds: dict[str, float], name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its wall time recorded as ``seconds[name]`` (summary.json ``write_seconds``)."""
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        seconds[name] = round(time.perf_counter() - t, 4)


def _plots() -> Any:
    from scenarios import plots  # matplotlib: imported by the first plot, not by ``import scenarios.output``

    return plots


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


def width_of(params: ProtocolParams) -> int | None:
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


RANGE_QUERIES = 1000


def _range_errors(sc, truth: np.ndarray, est: np.ndarray) -> dict:
    queries = range_queries(sc.rounds, RANGE_QUERIES, sc.seed)
    return {"range_mse": range_mse(truth, est, queries),
            "range_mse_zero_baseline": range_mse(truth, np.zeros_like(truth), queries)}


def _stream_summary(result: RunResult, truth: np.ndarray, est: np.ndarray) -> dict:
    """Streams (kind "stream"): the MSE of random range-sum queries beside the all-zero baseline."""
    sc = result.scenario
    queries = range_queries(sc.rounds, RANGE_QUERIES, sc.seed)
    return {
        "range_mse": range_mse(truth, est, queries),
        "range_mse_zero_baseline": range_mse(truth, np.zeros_like(truth), queries),
        "range_queries": {"count": RANGE_QUERIES, "over": f"rounds 1..{sc.rounds}",
                          "endpoints": "uniform, sorted (keyed by the seed)", "answer": "sum of per-round sums"},
    }


def protocol_summary(result: RunResult) -> dict:
    """The protocol's own part of summary.json (its ``run_summary(rounds, spend_by_reason, devices)``), if
    it has one."""
    hook = getattr(result.scenario.protocol, "run_summary", None)
    if hook is None:
        return {}
    return hook(result.rounds, spend_by_reason(result), result.scenario.devices)


def write_downlink(result: RunResult, out: Path) -> None:
    """downlink.jsonl: every collector broadcast in order (honest and hostile), with its simulated send time:
    the other half of the transcript, which an audit replays the devices against."""
    records = getattr(result.collector, "downlink", [])
    tmp = out / "downlink.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    tmp.replace(out / "downlink.jsonl")


def draw_spend(result: RunResult, path: Path, painter: PlotProcess | None = None) -> None:
    """spend.png, labelled with the kind of number the ledger holds and the run's guarantee; for memoized
    protocols the worst-case loss against any device is stated apart, never drawn beside the spend.
    ``painter``: draw it there (scenarios/plot_process.py), not in this process."""
    sc = result.scenario
    g = sc.protocol.guarantee(sc.collections)
    label, note = "cumulative ε per device", ""
    if g.worst_case is not None:
        label = "within-pattern ε (pattern width × ε)"
        value, exact, method = g.worst_case
        shown = f"{value:.3g}" if np.isfinite(value) else "unbounded"
        how = method if exact or method.startswith("upper bound") else f"upper bound: {method}"
        note = textwrap.fill(f"Not on this plot (a different kind of number): the worst-case loss of a device's whole "
                             f"transcript against any other device's is {shown} ({how}).", 160)
    # the final spend as its distinct values (to 9 digits: sums of the same charges in another order are one
    # value) and their counts: a few numbers to draw, not one per device to send to the plot process
    values, counts = result.ledger.spend_counts()
    values, where = np.unique(np.round(values, 9), return_inverse=True)
    final = (values, np.bincount(where, weights=counts, minlength=values.size).astype(np.int64))
    # epoch protocols (THRESH, HeavyTHRESH, EpochRR, EpochKRR) close a ledger round per epoch
    length = int(getattr(sc.protocol, "epoch_length", 1))
    xlabel = f"epoch (of {length} rounds)" if length > 1 else "round"
    args = (result.ledger.history, final, f"per-device spend: {sc.protocol.name}", label,
            (g.value, f"guarantee {g.value:.3g}" + (" (within pattern)" if note else "")), note, xlabel,
            None if sc.budget is None else (sc.budget, f"budget {sc.budget:.3g} (devices refuse reports past it)"))
    if painter is not None:
        painter.draw("spend_plot", path, *args)
    else:
        _plots().spend_plot(path, *args)


def privacy_summary(result: RunResult) -> dict:
    """What each device was promised (accounting.promises: the guarantee with its derivation and scope, the
    per-report epsilon, the budget and horizon the devices enforced, (eps, delta), the worst-case loss of
    memoized protocols) and what it spent: the largest spend against the guarantee and the budget, the devices'
    refusals and ignored messages and, for memoized protocols, the within-pattern spend (a different kind of
    number from the worst-case loss, named as such)."""
    sc = result.scenario
    promised = accounting.promises(sc)
    kept = _ledger_here(result)
    spend = result.ledger.spend
    max_spend = float(spend.max()) if kept and spend.size else None
    g = promised["guarantee"]
    out: dict = {
        **{k: promised[k] for k in ("guarantee", "derivation", "scope", "round_epsilon", "budget", "horizon",
                                    "collector_behavior")},
        "ledger": "this run" if kept else "device shards",
        "max_spend": max_spend,
        "within_guarantee": None if max_spend is None else not exceeds(max_spend, g),
        "within_budget": (None if max_spend is None or sc.budget is None
                          else not exceeds(max_spend, sc.budget)),
        "refusals": result.guards.get("refusals") if kept else None,
        "ignored_messages": result.guards.get("ignored") if kept else None,
        "eps_delta": promised["eps_delta"],  # (eps, delta) beside pure eps: a PLD accountant, cached per run
    }
    if "worst_case_loss" in promised:
        out["worst_case_loss"] = promised["worst_case_loss"]
        out["within_pattern_spend"] = {"guarantee": g, "max": max_spend,
                                       "meaning": "pattern width x eps: indistinguishable from devices with the "
                                                  "same behavior pattern (Theorem 4)"}
    return out


def _report_counts(result: RunResult) -> dict:
    """summary.json's ``reports``. A live collector counts only the reports it took in: what the devices sent
    and what the network lost are known to the device processes alone, so those are None, with why."""
    accepted = result.collector.stats.reports_accepted
    if result.extra.get("runtime") == "live":
        return {"sent": None, "delivered": None, "lost": None, "accepted": accepted,
                "unknown": "a live collector sees only the reports that reach it: sent, delivered and lost are "
                           "known to the device clients alone"}
    traffic = result.network.traffic
    return {"sent": traffic.reports_sent + traffic.reports_lost, "delivered": traffic.reports_sent,
            "lost": traffic.reports_lost, "accepted": accepted}


def summary(result: RunResult) -> dict:
    sc, recs = result.scenario, result.rounds
    k = width_of(sc.protocol)
    truth = _stack([r.truth for r in recs], k)
    est = _stack([r.estimate for r in recs], k)
    stats, traffic = result.collector.stats, result.network.traffic
    kept = _ledger_here(result)
    return {
        "scenario": sc.name,
        "protocol": sc.protocol.name,
        "seed": sc.seed,
        "runtime": result.extra.get("runtime", "simulated"),
        "devices": sc.devices,
        "rounds": sc.rounds,
        "unit": sc.unit,  # what the counters count ([population] unit); None where the scenario does not say
        "cohort_size": sc.simulation.cohort_size,
        # how the device cohorts were answered (None: a live run, whose devices are processes of their own)
        "parallelism": result.extra.get("parallelism"),
        "parameters": {**protocol_parameters(sc.protocol), "round_epsilon": sc.protocol.round_epsilon},
        "error": {**error_summary(sc.protocol.kind, truth, est, bucket_width(sc.protocol)),
                  **(_range_errors(sc, truth, est) if sc.protocol.kind == "stream" else {})},
        # what the error figures are errors of, in words with the counters' unit (a sweep's rows and plots
        # tell a mean's seconds from a histogram's frequencies by it)
        "errors_of": error_of(sc.protocol, sc.unit),
        "epsilon": result.ledger.summary() if kept else None,
        "round_epsilon_max": float(sc.protocol.round_epsilon),
        "privacy": privacy_summary(result),
        "messages": {"sent": traffic.messages_sent, "delivered": traffic.messages_delivered,
                     "rejected": stats.rejected, "late": stats.late,
                     # why the first message was rejected that was neither late nor a dropped connection
                     # (None: none was)
                     "first_rejection": stats.first_reason,
                     "rejected_by_devices": result.device_rejected,
                     **({} if result.device_rejected is not None else
                        {"unknown": "rejected_by_devices: the devices run in other processes (ldpsim devices), "
                                    "each of which prints its own count"})},
        "reports": _report_counts(result),
        "clipped_values": int(sum(r.clipped for r in recs)),
        **protocol_summary(result),
        **(_stream_summary(result, truth, est) if sc.protocol.kind == "stream" else {}),
        # the ledger's digest where this run kept it (`ldpsim serve`: the device shards do; None, not the
        # digest of an empty ledger)
        # ledger: every charge, per-report guarantees included; ledger_rows: the cumulative charges, which
        # ledger.parquet holds and an audit recomputes this from
        "digests": {"transcript": result.transcript_digest, **_ledger_digests(result.ledger if kept else None),
                    "estimates": _sha256_bytes(np.array([r.round for r in recs], "<i8"), est.astype("<f8"))},
        "wall_seconds": result.wall_seconds,
        **({"live": result.extra["live"]} if "live" in result.extra else {}),  # live runs: drops by cause
    }


def _ledger_digests(ledger: Ledger | None) -> dict[str, str | None]:
    """summary.json's ledger digests (None, not the digests of an empty ledger, where the run kept none)."""
    full, rows = ledger.digests() if ledger is not None else (None, None)
    return {"ledger": full, "ledger_rows": rows}


def _write_estimates(result: RunResult, out: Path, seconds: dict[str, float] | None = None,
                     painter: PlotProcess | None = None) -> None:
    """estimates.csv and estimates.png; their seconds into ``seconds`` (the picture's when ``painter`` has
    drawn it, which is asked to draw it rather than this process)."""
    sc, recs = result.scenario, result.rounds
    seconds = {} if seconds is None else seconds

    def table(header: Sequence[str], columns: Sequence[np.ndarray | Sequence]) -> None:
        _timed(seconds, "estimates.csv", write_csv, out / "estimates.csv", header, columns)

    def draw(plot: str, *args: Any) -> None:
        if painter is not None:
            painter.draw(plot, out / "estimates.png", *args)
            return
        _timed(seconds, "estimates.png", lambda: getattr(_plots(), plot)(out / "estimates.png", *args))

    rounds = np.array([r.round for r in recs])
    reports = np.array([r.reports for r in recs])
    clipped = np.array([r.clipped for r in recs])
    # scripted changes and behaviors' (step, trigger): a dotted line at each round one happened
    fired = [day for day, *_ in result.world.behavior_fired]
    changed = sorted({r for r in [c.round for c in sc.changes] + fired if r <= sc.rounds})
    # the protocol's own per-round columns (its round_columns: info key, value when missing; flags as 0/1)
    own = tuple(getattr(sc.protocol, "round_columns", ()))
    names = [k for k, _ in own]
    extra = [[int(v) if isinstance(v, bool) else v for v in (r.info.get(k, d) for r in recs)] for k, d in own]
    if sc.protocol.kind == "epoch":
        truth, est, sd = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate", "sd_theory"))
        update = np.array([bool(r.info.get("global_update")) for r in recs])
        table(["epoch", "truth", "estimate", "error", *names, "reports", "theory_sd"],
              [rounds, truth, est, est - truth, *extra, reports, sd])
        epoch_length = int(getattr(sc.protocol, "epoch_length"))  # the epoch protocols' own parameters
        title = (f"{sc.name}: {sc.protocol.name}, ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}, "
                 f"{getattr(sc.protocol, 'epochs')} epochs of {epoch_length} rounds")
        draw("epochs_plot", rounds, truth, est, update, title,
             [(r - 1) // epoch_length + 1 for r in changed])
        return
    if sc.protocol.kind == "stream":
        # theory_sd: ToPL's is an upper bound (theta = max_value), ToPS has none (nan, not 0)
        truth, est, sd = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate", "sd_theory"))
        table(["round", "truth", "estimate", "error", *names, "reports", "theory_sd"],
              [rounds, truth, est, est - truth, *extra, reports, sd])
        title = (f"{sc.name}: {sc.protocol.name} ({getattr(sc.protocol, 'method')}), ε = {sc.protocol.epsilon:g}, "
                 f"n = {sc.devices:,}")
        draw("estimates_plot", rounds, truth, est, sd, title, changed,
             with_unit("sum of counters over devices", sc.unit), "truth (population sum)",
             "truth ± 1.96 sd (theory, upper bound)", with_unit("estimate − truth", sc.unit))
        return
    if sc.protocol.kind == "mean":
        truth, est, sd = (_stack([getattr(r, f) for r in recs], None) for f in ("truth", "estimate", "sd_theory"))
        table(["round", "truth", "estimate", "error", "theory_sd", "reports", "clipped"],
              [rounds, truth, est, est - truth, sd, reports, clipped])
        title = f"{sc.name}: {sc.protocol.name}, ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}"
        label = getattr(sc.protocol, "estimate_label", None)  # a plugin's own words for what it estimates,
        # which need not be in the counters' unit
        unit = None if label else sc.unit
        draw("estimates_plot", rounds, truth, est, sd, title, changed,
             str(label) if label else with_unit("mean counter", unit), TRUTH_MEAN, BAND,
             with_unit("estimate − truth", unit))
        return
    k = width_of(sc.protocol)
    if k is None:
        raise ValueError(f"protocol kind {sc.protocol.kind!r}: not a mean, histogram, counters, epoch or stream")
    truth, est, sd = (_stack([getattr(r, f) for r in recs], k) for f in ("truth", "estimate", "sd_theory"))
    if sc.protocol.kind == "counters":
        table(["round", "counter", "truth", "estimate", "error", "theory_sd", "reports", "clipped"],
              [np.repeat(rounds, k), np.tile(np.arange(k), len(recs)), truth.ravel(), est.ravel(),
               (est - truth).ravel(), sd.ravel(), np.repeat(reports, k), np.repeat(clipped, k)])
        draw("counters_plot", rounds, truth, est, sd,
             f"{sc.name}: {sc.protocol.name}, c = {k}, ε = {sc.protocol.epsilon:g} per counter "
             f"(joint {sc.protocol.round_epsilon:.3g}), n = {sc.devices:,}",
             changed, sc.unit)
        return
    width = bucket_width(sc.protocol)
    bucket = np.tile(np.arange(k), len(recs))
    table(["round", "bucket", "low", "high", "truth", "estimate", "error", "theory_sd", "reports", "clipped", *names],
          [np.repeat(rounds, k), bucket, bucket * width, (bucket + 1) * width, truth.ravel(), est.ravel(),
           (est - truth).ravel(), sd.ravel(), np.repeat(reports, k), np.repeat(clipped, k),
           *([v for v in column for _ in range(k)] for column in extra)])  # a round's own figures on each bucket
    per_round = [round_metrics("histogram", t, e, width) for t, e in zip(truth, est)]
    bits = getattr(sc.protocol, "bits", None)  # dBitFlip's d; a protocol without one shows none
    title = (f"{sc.name}: {sc.protocol.name}, k = {k}{'' if bits is None else f', d = {bits}'}, "
             f"ε = {sc.protocol.epsilon:g}, n = {sc.devices:,}")
    draw("histogram_plot", rounds, per_round, truth, est, sd, width, title, changed, sc.unit)


TRANSCRIPT_AUTO_LIMIT = 50_000_000  # --transcript auto: transcript.parquet when devices x rounds is at most this
CSV_DEVICE_LIMIT = 100_000  # ledger.csv and spend.csv (beside the Parquet tables) for at most this many devices
TRANSCRIPT_POLICIES = ("always", "auto", "never")


def _write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _skipped(out: Path, name: str, why: str) -> dict:
    (out / name).unlink(missing_ok=True)  # --force over an older run: no stale copy stays behind
    return {"written": False, "why": why}


def _ledger_here(result: RunResult) -> bool:
    return result.extra.get("ledger", "this run") == "this run"


def write_tables(result: RunResult, out: Path, ledger_rows: bool = True, transcript: str = "auto",
                 seconds: dict[str, float] | None = None, separate_ledger: bool = False) -> dict:
    """spend.parquet (+ spend.csv), ledger.parquet (+ ledger.csv) and transcript.parquet, each atomically; returns
    summary.json's ``files``: for each, written (with rows and bytes) or why not. The seconds each file took go
    into ``seconds``. ``separate_ledger``: the ledger's tables in a thread of their own meanwhile (waited for,
    its error raised, before this returns)."""
    if transcript not in TRANSCRIPT_POLICIES:
        raise ValueError(f"transcript must be one of {TRANSCRIPT_POLICIES}, got {transcript!r}")
    sc, led, files = result.scenario, result.ledger, {}
    seconds = {} if seconds is None else seconds
    small = sc.devices <= CSV_DEVICE_LIMIT
    if not _ledger_here(result):  # `ldpsim serve`: the device processes keep the ledger, this run has none
        for name in (tables.SPEND, "spend.csv", "spend_over_time.csv", tables.LEDGER, "ledger.csv"):
            files[name] = _skipped(out, name, "the ledger is kept by the device shards (ldpsim devices --out)")
        ledger_rows = False
    csv_why = f"more than {CSV_DEVICE_LIMIT:,} devices: see the .parquet table"

    def ledger_files() -> dict:
        n = _timed(seconds, tables.LEDGER, tables.write_ledger, out / tables.LEDGER, led.rows())
        return {tables.LEDGER: {"written": True, "rows": n, "bytes": (out / tables.LEDGER).stat().st_size},
                "ledger.csv": ({"written": True, "rows": _timed(seconds, "ledger.csv", write_ledger_csv,
                                                                out / "ledger.csv", led.rows())}
                               if small else _skipped(out, "ledger.csv", csv_why))}

    # the largest table started first, in a thread of its own beside the others (Parquet encoding releases the GIL)
    ledger_job = _Background(ledger_files, "ldpsim-ledger-table") if ledger_rows and separate_ledger else None
    try:
        ids = np.arange(sc.devices)
        group_index, names = result.world.group_of(ids), [g.name for g in sc.groups]
        if _ledger_here(result):
            # the per-report guarantee of every report a device sends (at least the protocol's; larger where a
            # non-cumulative per-report charge recorded more)
            round_eps = np.maximum(led.round_epsilon, float(sc.protocol.round_epsilon))
            changed = attacks.first_change_round(result.world, 1, sc.rounds)  # which devices a change reached
            _timed(seconds, tables.SPEND, tables.write_spend, out / tables.SPEND, group_index, names, led.spend,
                   round_eps, changed)
            files[tables.SPEND] = {"written": True, "rows": int(sc.devices),
                                   "bytes": (out / tables.SPEND).stat().st_size}
            if small:
                _timed(seconds, "spend.csv", write_csv, out / "spend.csv",
                       ["device", "group", "spend", "round_epsilon", "first_change_round"],
                       [ids, np.array(names)[group_index], led.spend, round_eps,
                        np.where(changed > 0, changed.astype(str), "")])
                files["spend.csv"] = {"written": True, "rows": int(sc.devices)}
            else:
                files["spend.csv"] = _skipped(out, "spend.csv", csv_why)
        if ledger_rows and ledger_job is None:
            files.update(ledger_files())
        elif _ledger_here(result) and not ledger_rows:
            for name in (tables.LEDGER, "ledger.csv"):
                files[name] = _skipped(out, name, "--no-ledger-rows")
        size = sc.devices * sc.rounds
        collector = getattr(result.collector, "protocol", None)
        if not hasattr(collector, "stages"):
            files[tables.TRANSCRIPT] = _skipped(out, tables.TRANSCRIPT, "the collector keeps no report stages")
        elif transcript == "never" or (transcript == "auto" and size > TRANSCRIPT_AUTO_LIMIT):
            why = ("--transcript never" if transcript == "never" else
                   f"devices x rounds = {size:,} > {TRANSCRIPT_AUTO_LIMIT:,} (--transcript auto; use always)")
            files[tables.TRANSCRIPT] = _skipped(out, tables.TRANSCRIPT, why)
        else:
            files[tables.TRANSCRIPT] = {"written": True, **_timed(seconds, tables.TRANSCRIPT, tables.write_transcript,
                                                                  out / tables.TRANSCRIPT, collector, sc.protocol.name)}
    except BaseException:
        if ledger_job is not None:
            ledger_job.wait()  # not left writing behind the error
        raise
    if ledger_job is not None:
        files.update(ledger_job.result())
    return files


def _write_eps_delta(result: RunResult, out: Path) -> dict:
    """eps_delta.csv: eps(delta) after each round beside basic composition (scenarios/accounting.py)."""
    sc = result.scenario
    entry, table = accounting.summary_entry(sc.protocol, sc.collections)
    if table is None:
        return {accounting.CSV: _skipped(out, accounting.CSV, entry["why"])}
    with atomic_path(out / accounting.CSV) as tmp:
        rows = accounting.write_table(table, tmp)
    return {accounting.CSV: {"written": True, "rows": rows}}


class _Background:
    """``fn()`` in a thread of its own; :meth:`result` waits for it and returns its value or raises its error."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._fn: Callable[[], Any] = fn
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the caller by result()
            self._error = exc

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def write_run_dir(result: RunResult, out: Path, ledger_rows: bool = True, transcript: str = "auto",
                  painter: PlotProcess | None = None) -> dict:
    """Write every file of the run directory except events.jsonl (streamed during the run). ``ledger_rows``:
    write the ledger tables; ``transcript``: "always", "auto" (when devices x rounds <= TRANSCRIPT_AUTO_LIMIT)
    or "never" writes transcript.parquet. Every file is written under a temporary name and moved into place;
    summary.json last. The tables are written in a background thread while this one draws the plots and makes the
    summary (module docstring); summary.json's ``write_seconds`` holds the seconds of the whole directory
    (``total``, up to summary.json), of each file (``files``: a file's own wall time, which overlaps the other
    thread's files) and of the summary and the attack metrics (``computed``). ``painter``: a plot process
    (scenarios/plot_process.py) that draws estimates.png and spend.png meanwhile; they are waited for before
    summary.json."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    sc = result.scenario
    led = result.ledger
    table_seconds: dict[str, float] = {}
    seconds: dict[str, float] = {}
    computed: dict[str, float] = {}  # seconds of what is computed rather than written

    background = _Background(lambda: write_tables(result, out, ledger_rows, transcript, table_seconds,
                                                  separate_ledger=True),
                             "ldpsim-run-dir-tables")
    try:
        _write_estimates(result, out, seconds, painter)
        files: dict[str, dict] = {}
        hist = led.history
        keys = ["round", "min", "mean", "p50", "p90", "p99", "max"]
        if _ledger_here(result):
            _timed(seconds, "spend_over_time.csv", write_csv, out / "spend_over_time.csv", keys,
                   [np.array([h[k] for h in hist]) for k in keys])
            files["spend_over_time.csv"] = {"written": True, "rows": len(hist)}
            if painter is not None:  # plots.save writes it under a temporary name, then renames it
                draw_spend(result, out / "spend.png", painter)
            else:
                with atomic_path(out / "spend.png") as tmp:
                    _timed(seconds, "spend.png", draw_spend, result, tmp)
        else:
            (out / "spend.png").unlink(missing_ok=True)
        _timed(seconds, "scenario.json", _write_text, out / "scenario.json", json.dumps(sc.as_run, indent=2) + "\n")
        _timed(seconds, "downlink.jsonl", write_downlink, result, out)
        # [analysis] attacks: attacks.csv, attacks.png, summary.json "attacks" (in this thread: a thread of their
        # own made them slower still, their numpy work holding the GIL much of the time)
        report = _timed(computed, "attacks", attacks.analyze, result)
        if report.rows:
            attack_files = _timed(seconds, f"{attacks.CSV} + {attacks.PNG}", attacks.write, report, out)
        else:
            why = report.summary.get("averaging", {}).get("why") or report.summary["why"]
            attack_files = {name: _skipped(out, name, why) for name in (attacks.CSV, attacks.PNG)}
        s = _timed(computed, "summary", summary, result)
        eps_delta = _timed(seconds, accounting.CSV, _write_eps_delta, result, out)
    except BaseException:
        background.wait()  # no table is left half-written behind the error
        raise
    table_files = background.result()
    if painter is not None:
        painter.finish(seconds)
    if not eps_delta[accounting.CSV]["written"]:
        del seconds[accounting.CSV]
    s["attacks"] = report.summary
    s["files"] = {**table_files, **files, **eps_delta, **attack_files}
    s["write_seconds"] = {"total": round(time.perf_counter() - start, 4), "files": {**table_seconds, **seconds},
                          "computed": computed}
    clean = jsonout.document(s)  # strict JSON has no NaN or infinity: each is null in the file, and named
    if "non_finite" in clean:
        s["non_finite"] = clean["non_finite"]
    _write_text(out / "summary.json", json.dumps(clean, indent=2, allow_nan=False) + "\n")
    return s
