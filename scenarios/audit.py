"""``ldpsim audit RUN_DIR``: an independent check of a finished run, device by device.

The audit reads what the run left behind (scenario.json, summary.json, transcript.parquet, ledger.parquet,
downlink.jsonl), chooses devices (all up to 100,000, else a keyed sample; ``--devices N`` or ``all``),
rebuilds each chosen device's private values day by day from the scenario and seed (agents.world.World, the
same keyed draws), and replays it through its reference model (protocols/reference.py: one device, plain
Python, written from the formulas) against every broadcast the collector recorded, in order, with the
per-device downlink loss recomputed from its keyed draws. The sample is keyed by the auditor's seed
(``--sample-seed``; default a fresh random one, recorded in audit.json), never by the run's, so whoever wrote
the directory cannot know which devices will be replayed. Then it compares:

- every transcript row of the device with the reference report of that round and stage (``report_value``;
  a row with no reference report: ``unexpected_report``; two rows for one report: ``duplicate_report``);
- every reference report missing from the transcript with the network's keyed loss and latency draws: lost
  or late is fine (counted under ``not_delivered``), otherwise ``missing_report``; a row the network should
  have lost or delayed past the deadline is ``unexpected_delivery``;
- the reference charges with the device's ledger rows, as multisets of (round, reason, amount)
  (``charge_amount``, ``charge_missing``, ``charge_unexpected``);
- every device's ledger total (the whole ledger, sampled or not) with the guarantee and the budget computed
  from scenario.json (``over_guarantee``, ``over_budget``), and with spend.parquet wherever the audit read
  this directory's ledger (``spend_total``; the table itself, ``spend_table``: present, one row per device in
  order, its group the scenario's, its per-report epsilon at least the protocol's);
- every transcript row and every charge, of every device, with the rounds the collector broadcast
  (``report_round``, ``charge_round``);
- summary.json's privacy claims with what scenario.json and the ledger give (``summary_claim``): every figure
  that follows from the scenario (scenarios.accounting.promises: guarantee, derivation, scope, per-report
  epsilon, budget, horizon, (eps, delta), worst-case loss), and, where the audit read this directory's
  ledger.parquet, max spend, ``epsilon`` max/mean/p50/p99, within_guarantee, within_budget and the
  within-pattern max from the ledger's totals; and, where every device was replayed, ``refusals`` and
  ``ignored_messages`` with the reference devices' own counts (reports the budget refused, collector
  messages refused);
- what summary.json says of the run that scenario.json gives (``summary_claim``): name, devices, rounds,
  cohort size, unit, ``errors_of`` and every protocol parameter; the rest (error figures, messages, timings,
  attack metrics) is listed in audit.json's ``not_checked`` with the files the audit does not read;
- the transcript digest recomputed from transcript.parquet with summary.json's ``digests.transcript``
  (``transcript_digest``), and the ledger rows digest recomputed from ledger.parquet with
  ``digests.ledger_rows`` (``ledger_digest``: it covers the charges' times too, which no other check reads).

Floats compare to 1e-9 relative. The result goes to RUN_DIR/audit.json (atomically): devices, reports and
charges checked, mismatches by kind with the first examples of each, the largest spend, the guarantee, and
the verdict, "clean" or "failed". Exit status 0 when clean, 1 when not, 2 for a run directory that cannot be
audited (a one-line error naming what is missing or malformed).

Scope: runs of the simulated runtime (``ldpsim run``) and of the live one (``ldpsim live``, ``ldpsim serve``),
whose downlink.jsonl carries the simulator's nominal times. A live run has no simulated network (every
broadcast reaches every connected device; no keyed loss or latency): it is replayed without downlink loss,
and a reference report missing from its transcript is counted as ``unverified`` instead of lost or late
(the runtime is summary.json's ``runtime``, else the first event's in events.jsonl). So that this weaker
check cannot hide deleted reports, a run that says it is live must have an event log that says so, and its
summary.json must state ``reports.accepted``, which the transcript's rows must equal (``summary_claim``).

``--ledger PATH`` (repeatable) audits against the ledger.parquet files that device shards wrote
(``ldpsim devices --out``) instead of RUN_DIR's.
"""

from __future__ import annotations

import bisect
import json
import math
import secrets
import sys
import time
from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from protocols import keyed
from protocols.keyed import Purpose, stream_key
from protocols.ledger import exceeds
from protocols.messages import CollectionRequest, Decision, Threshold
from protocols import reference, wire
from scenarios import jsonout, resources
from scenarios.schema import Scenario, ScenarioError, parse

DEFAULT_DEVICES = 100_000
EXAMPLES = 5  # examples kept per mismatch kind
REL_TOL = 1e-9
#: stream purpose of the audit's device sample (not a protocols.keyed.Purpose: no device draws it)
AUDIT_SAMPLE = 0x61756469
KINDS = {"collect": 1, "decision": 2, "threshold": 3}  # keys of the downlink loss draws (agents/cohort.py)
MISMATCH_KINDS = ("report_value", "unexpected_report", "duplicate_report", "missing_report", "unexpected_delivery",
                  "report_columns", "charge_amount", "charge_missing", "charge_unexpected", "over_guarantee",
                  "ledger_digest", "over_budget", "spend_total", "spend_table", "summary_claim", "transcript_digest",
                  "report_round", "charge_round")


class AuditInputError(ScenarioError):
    """A run directory that cannot be audited; the message names the file and what is wrong with it."""

    status = 2  # the command's exit status: cannot audit


class RunAltered(AuditInputError):
    """A file the run wrote (summary.json says so) that is gone: the directory was changed after the run, which
    fails the audit (exit status 1) though nothing can be checked without it."""

    status = 1


def _written(run: Path, summary: dict, name: str) -> None:
    """RunAltered when summary.json says the run wrote ``name`` and it is not there."""
    entry = summary.get("files", {}).get(name) if isinstance(summary.get("files"), dict) else None
    if isinstance(entry, dict) and entry.get("written") is True and not (run / name).exists():
        rows = entry.get("rows")
        said = f" ({rows:,} rows)" if isinstance(rows, int) and not isinstance(rows, bool) else ""
        raise RunAltered(f"{run / name}: missing, although summary.json says the run wrote it{said}: the run "
                         "directory was changed after the run")


# ------------------------------------------------------------------------------------------- inputs
@dataclass
class RunFiles:
    run_dir: Path
    scenario: Scenario
    summary: dict
    downlink: list[Any]  # message objects in broadcast order
    times: list[float]  # their simulated send times
    transcript: Any  # pyarrow Table
    ledger: Any  # pyarrow Table
    ledger_source: str
    spend: Any | None = None
    runtime: str = "simulated"  # "live": real TCP, no simulated loss, latency or downlink loss
    logged_runtime: str | None = None  # the runtime events.jsonl names (events_runtime), None without one


def _json(path: Path) -> Any:
    if not path.is_file():
        raise AuditInputError(f"{path}: missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AuditInputError(f"{path}: not valid JSON: {exc}") from None


def _message(record: Any, where: str) -> tuple[float, Any]:
    """One downlink.jsonl record as (send time, message object)."""
    try:
        kind = record["type"]
        common: dict[str, Any] = dict(round=int(record["round"]), protocol=str(record["protocol"]),
                                      deadline=float(record["deadline"]))
        if kind == "collect":
            msg: Any = CollectionRequest(**common)
        elif kind == "decision":
            if not isinstance(record["update"], bool):
                raise TypeError("update must be true or false")
            msg = Decision(update=record["update"], **common)
        elif kind == "threshold":
            msg = Threshold(theta=float(record["theta"]), version=int(record["version"]), **common)
        else:
            raise ValueError(f"unknown type {kind!r}")
        t = float(record["time"])
        if not math.isfinite(t) or not math.isfinite(msg.deadline):
            raise ValueError("time and deadline must be finite")
        return t, msg
    except (KeyError, TypeError, ValueError) as exc:
        raise AuditInputError(f"{where}: malformed broadcast record: {exc!s}"[:300]) from None


#: the type each key column of the run's tables must have: (test on the Arrow type, what it must be)
_COLUMN_TYPES: dict[str, tuple[str, str]] = {
    "device": ("integer", "integers"), "round": ("integer", "integers"), "amount": ("number", "numbers"),
    "spend": ("number", "numbers"), "round_epsilon": ("number", "numbers"), "time": ("number", "numbers"),
    "stage": ("text", "strings"), "reason": ("text", "strings"), "group": ("text", "strings")}


def _type_is(kind: str, t: Any) -> bool:
    import pyarrow as pa

    if kind == "text":
        return pa.types.is_string(t) or pa.types.is_large_string(t) or (
            pa.types.is_dictionary(t) and (pa.types.is_string(t.value_type) or pa.types.is_large_string(t.value_type)))
    return pa.types.is_integer(t) or (kind == "number" and pa.types.is_floating(t))


def _parquet(path: Path, what: str, required: Sequence[str]) -> Any:
    """A run's table with the ``required`` columns, each of its type (:data:`_COLUMN_TYPES`)."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise AuditInputError(f"{path}: missing ({what})")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise AuditInputError(f"{path}: not a readable Parquet file: {exc!s}"[:300]) from None
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise AuditInputError(f"{path}: no column {missing[0]!r}")
    for c in required:
        kind, plural = _COLUMN_TYPES.get(c, ("", ""))
        if kind and not _type_is(kind, table.schema.field(c).type):
            raise AuditInputError(f"{path}: column {c!r} must hold {plural}, not {table.schema.field(c).type}")
        if table[c].null_count:
            raise AuditInputError(f"{path}: column {c!r} has {table[c].null_count:,} missing (null) value(s)")
    return table


def _report_column_problem(column: Any, width: int) -> str | None:
    """What keeps a transcript report column from holding ``width`` numbers a row (as its metadata says), or
    None: one number for width 1, else lists of exactly ``width`` numbers."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type

    def numeric(x: Any) -> bool:
        return bool(pa.types.is_integer(x) or pa.types.is_floating(x) or pa.types.is_boolean(x))

    if width == 1:
        return None if numeric(t) else f"must hold one number a row (metadata width 1), not {t}"
    if not (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)) \
            or not numeric(t.value_type):
        return f"must hold lists of {width} numbers (metadata width {width}), not {t}"
    if pa.types.is_fixed_size_list(t):
        return None if t.list_size == width else f"holds lists of {t.list_size}, its metadata says {width}"
    lengths = pc.list_value_length(column)
    wrong = int(pc.sum(pc.not_equal(lengths, width)).as_py() or 0)
    return f"has {wrong:,} row(s) whose list is not {width} long (its metadata width)" if wrong else None


def named_code(raw: dict) -> list[str]:
    """What a scenario (scenario.json) names as code to import: behaviors and a protocol given as
    ``"module:name"`` ("key = value" each). Loading such a scenario imports those modules and calls the behaviors
    with the file's parameters, so an audit of a directory it did not write runs them only when allowed."""
    named = []
    population = raw.get("population")
    groups = population.get("groups") if isinstance(population, dict) else None
    for i, g in enumerate(groups if isinstance(groups, list) else []):
        spec = g.get("behavior") if isinstance(g, dict) else None
        for s in (spec if isinstance(spec, list) else [spec]):
            if isinstance(s, str) and ":" in s:
                named.append(f"population.groups[{i}].behavior = {s!r}")
    protocol = raw.get("protocol")
    name = protocol.get("name") if isinstance(protocol, dict) else None
    if isinstance(name, str) and ":" in name:
        named.append(f"protocol.name = {name!r}")
    return named


def load(run_dir: Path | str, ledgers: Sequence[Path | str] | None = None, allow_code: bool = False) -> RunFiles:
    """Read and validate everything an audit needs; AuditInputError names the first problem. ``allow_code``:
    load a scenario.json that names modules to import (:func:`named_code`); refused otherwise."""
    import pyarrow as pa

    from scenarios import tables

    run = Path(run_dir)
    if not run.is_dir():
        raise AuditInputError(f"{run}: not a run directory")
    summary = _json(run / "summary.json")
    raw = _json(run / "scenario.json")
    if not isinstance(summary, dict) or not isinstance(raw, dict):
        raise AuditInputError(f"{run}: summary.json and scenario.json must hold JSON objects")
    code = named_code(raw)
    if code and not allow_code:
        raise AuditInputError(f"{run / 'scenario.json'}: names code to import ({code[0]}"
                              f"{f' and {len(code) - 1} more' if len(code) > 1 else ''}); auditing it runs that code: "
                              "pass --allow-code if you trust it")
    try:
        scenario = parse(raw)
        resources.check_memory(scenario.devices)  # the replay holds per-device arrays of the whole population
    except ScenarioError as exc:
        raise AuditInputError(f"{run / 'scenario.json'}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise AuditInputError(f"{run / 'scenario.json'}: invalid scenario: {exc}") from None
    try:
        reference.model_of(scenario.protocol)
    except ValueError as exc:  # a plugin protocol that brings no reference model
        raise AuditInputError(f"{run / 'scenario.json'}: {exc}") from None
    privacy = summary.get("privacy")
    if not isinstance(privacy, dict) or not isinstance(privacy.get("guarantee"), (int, float)):
        raise AuditInputError(f"{run / 'summary.json'}: no privacy.guarantee")
    digests = summary.get("digests")
    digest = digests.get("transcript") if isinstance(digests, dict) else None
    if not isinstance(digest, str):
        raise AuditInputError(f"{run / 'summary.json'}: no digests.transcript")
    if summary.get("protocol") != scenario.protocol.name or summary.get("seed") != scenario.seed:
        raise AuditInputError(f"{run / 'summary.json'}: protocol or seed differ from scenario.json")
    path = run / "downlink.jsonl"
    if not path.is_file():
        raise AuditInputError(f"{path}: missing (the collector's broadcasts)")
    downlink, times = [], []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise AuditInputError(f"{path}: not UTF-8 text: {exc}"[:300]) from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise AuditInputError(f"{path}:{i}: not valid JSON: {exc}") from None
        t, msg = _message(record, f"{path}:{i}")
        times.append(t)
        downlink.append(msg)
    if any(b < a for a, b in zip(times, times[1:])):
        raise AuditInputError(f"{path}: broadcasts are not in time order")
    _written(run, summary, tables.TRANSCRIPT)
    transcript = _parquet(run / tables.TRANSCRIPT, "the delivered reports; write it with ldpsim run --transcript "
                          "always", ("stage", "round", "device"))
    try:
        meta = tables.transcript_meta(transcript)
    except ValueError as exc:
        raise AuditInputError(f"{run / tables.TRANSCRIPT}: {exc}") from None
    missing = [c for _, cols in tables.stage_specs(meta) for c, _, _ in cols if c not in transcript.column_names]
    if missing:
        raise AuditInputError(f"{run / tables.TRANSCRIPT}: no column {missing[0]!r} (its metadata lists it)")
    for _, cols in tables.stage_specs(meta):
        for c, _, width in cols:
            problem = _report_column_problem(transcript[c], width)
            if problem:
                raise AuditInputError(f"{run / tables.TRANSCRIPT}: column {c!r} {problem}")
    if meta.get("protocol") != scenario.protocol.name:
        raise AuditInputError(f"{run / tables.TRANSCRIPT}: holds protocol {meta.get('protocol')!r}, the scenario "
                              f"runs {scenario.protocol.name!r}")
    need = ("device", "round", "time", "reason", "amount")
    if ledgers:
        parts = [_parquet(Path(p), "a device shard's ledger", need).select(list(need)) for p in ledgers]
        ledger = pa.concat_tables([_plain_reason(t) for t in parts])
        source = f"{len(parts)} device shard ledger(s)"
    else:
        shards = privacy.get("ledger") == "device shards"
        hint = ("the run's ledger is kept by its device shards: pass --ledger" if shards
                else "the run was written with --no-ledger-rows")
        _written(run, summary, tables.LEDGER)
        ledger = _plain_reason(_parquet(run / tables.LEDGER, hint, need).select(list(need)))
        source = "ledger.parquet"
    spend = None  # whenever the audit reads this directory's ledger (whatever summary.json says of it)
    if not ledgers and (run / tables.SPEND).is_file():
        spend = _parquet(run / tables.SPEND, "per-device spend", ("device", "group", "spend", "round_epsilon"))
    logged = events_runtime(run)
    # which runtime wrote the run: summary.json's runtime if it says, else the event log's, else simulated
    runtime = summary["runtime"] if isinstance(summary.get("runtime"), str) else logged or "simulated"
    if runtime != "simulated" and logged is None:
        raise AuditInputError(f"{run / 'events.jsonl'}: missing or unreadable; a {runtime} run's event log says "
                              "which runtime wrote it (its missing reports are otherwise unverifiable)")
    return RunFiles(run, scenario, summary, downlink, times, transcript, ledger, source, spend, runtime, logged)


def events_runtime(run: Path) -> str | None:
    """The runtime events.jsonl's events name: the live runtime tags every event with ``"runtime": "live"``,
    simulated events carry no tag; ``"mixed"`` when they disagree; None without a readable events.jsonl."""
    seen: set[str] = set()
    try:
        with open(run / "events.jsonl", encoding="utf-8") as f:
            for line in f:
                event = json.loads(line) if line.strip() else None
                if isinstance(event, dict):
                    seen.add(str(event.get("runtime", "simulated")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return None if not seen else seen.pop() if len(seen) == 1 else "mixed"


def _plain_reason(table: Any) -> Any:
    """The reason column as plain strings (shards' dictionaries differ)."""
    import pyarrow as pa

    i = table.column_names.index("reason")
    return table.set_column(i, "reason", table.column("reason").cast(pa.string()))


# ------------------------------------------------------------------------------------------- devices
def choose_devices(n: int, seed: int, wanted: int | str | None) -> tuple[np.ndarray, str]:
    """The devices to audit, sorted, and how they were chosen: all (``"all"``, or None with n <= 100,000), or a
    keyed sample of ``wanted`` (default 100,000): the devices with the smallest uniforms keyed by ``seed``, the
    auditor's sample seed (not the run's: whoever wrote the run directory must not know which devices the
    audit replays)."""
    if wanted == "all" or (wanted is None and n <= DEFAULT_DEVICES):
        return np.arange(n, dtype=np.int64), "all"
    k = DEFAULT_DEVICES if wanted is None else int(wanted)
    if k >= n:
        return np.arange(n, dtype=np.int64), "all"
    key_ = stream_key(seed, AUDIT_SAMPLE)
    best_u, best_id = np.empty(0), np.empty(0, np.int64)
    for lo in range(0, n, 1 << 24):  # bounded memory whatever the population
        ids = np.arange(lo, min(n, lo + (1 << 24)), dtype=np.int64)
        u = np.concatenate([best_u, keyed.uniform(key_, ids)])
        ids = np.concatenate([best_id, ids])
        keep = np.argpartition(u, k - 1)[:k] if u.size > k else np.arange(u.size)
        best_u, best_id = u[keep], ids[keep]
    return np.sort(best_id), f"keyed sample of {k:,}"


# ------------------------------------------------------------------------------------------- schedule
def _stages(params: Any, t: int) -> int:
    """Broadcast stages of collection t: the protocol's ``broadcast_stages(t)`` (e.g. a vote then estimates),
    else 1."""
    hook = getattr(params, "broadcast_stages", None)
    return 1 if hook is None else int(hook(t))


def world_days(sc: Scenario, times: Sequence[float]) -> tuple[list[int], int]:
    """The day the world is at when each broadcast is sent, and the last day needed. The runner's clock:
    day r starts at max((r - 1) x round_seconds, the end of the previous collection); a collection (on the
    last day of each epoch) lasts its stages x deadline; hostile collectors' extra rounds go on the same way."""
    rs, dl = sc.simulation.round_seconds, sc.network.deadline
    length = int(getattr(sc.protocol, "epoch_length", 1))
    last = max(times) if times else 0.0
    starts: list[float] = []
    now, day = 0.0, 0
    while day < sc.rounds or (now <= last + dl and day < sc.rounds + 1000 * length):
        day += 1
        now = max(now, (day - 1) * rs)
        starts.append(now)
        if day % length == 0:
            now += _stages(sc.protocol, day // length) * dl
    # a broadcast is sent at or after its day's start and at least a deadline before the next day's
    out = [max(1, bisect.bisect_right(starts, t + dl / 2)) for t in times]
    return out, max([sc.rounds, *out])


# ------------------------------------------------------------------------------------------- replay
class StageReports:
    """Reference reports of one stage, column by column in compact arrays (for vectorized comparison):
    the device, the round, the broadcast it answered (its index in downlink.jsonl), and each column's values
    (width values a report, flattened)."""

    def __init__(self, columns: dict[str, tuple[str, int]]) -> None:
        self.spec = dict(columns)  # name -> (numpy dtype name, width), from the transcript's metadata
        self.device = array("q")
        self.round = array("q")
        self.message = array("q")
        self.columns: dict[str, array] = {c: array(_typecode(d)) for c, (d, _) in self.spec.items()}
        self.extra: set[str] = set()  # columns the reference sends that the transcript does not have
        self.missing: set[str] = set()  # columns the transcript has that the reference does not send
        self.count = 0

    def add(self, device: int, round_: int, message: int, values: dict[str, Any]) -> None:
        self.device.append(device)
        self.round.append(round_)
        self.message.append(message)
        self.count += 1
        if len(values) != len(self.columns) or not values.keys() <= self.columns.keys():
            self.extra.update(set(values) - set(self.columns))
            self.missing.update(set(self.columns) - set(values))
            return
        for c, v in values.items():
            if type(v) is tuple:
                self.columns[c].extend(v)
            else:
                self.columns[c].append(v)

    def values(self, name: str) -> np.ndarray:
        dtype, width = self.spec[name]
        a = np.frombuffer(self.columns[name], dtype=np.float64 if np.dtype(dtype).kind == "f" else np.int64)
        return a.reshape(-1, width) if width > 1 else a


def _typecode(dtype: str) -> str:
    return "d" if np.dtype(dtype).kind == "f" else "q"


@dataclass
class Replay:
    stages: dict[str, StageReports]
    charges: tuple[array, array, list[str], array, array]  # device, round, reasons, reason index, amount
    spent: np.ndarray  # the reference devices' own totals
    time_left: np.ndarray  # per broadcast: its deadline minus the time it reached the devices
    messages: int
    refusals: int = 0  # the reference devices' reports refused for the budget
    ignored: int = 0  # and collector messages they refused


def _decodable(msg: Any) -> bool:
    """Whether the devices can decode a recorded broadcast: they receive its bytes (protocols.wire), and one
    the decoder refuses (a ToPL threshold theta < 0) reaches no device model, as in the run, where it is
    counted under ``messages.rejected_by_devices`` and not as ignored."""
    try:
        wire.decode(wire.encode(msg))
    except (ValueError, OverflowError):  # wire.WireError included
        return False
    return True


def replay(files: RunFiles, ids: np.ndarray, progress: bool = False) -> Replay:
    """Every chosen device through its reference model, against every recorded broadcast in order (the ones
    its devices can decode)."""
    from agents.world import World
    from scenarios import tables

    sc = files.scenario
    p = sc.protocol
    net = sc.network
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, p.max_value)
    devices = [reference.reference_device(p, sc.seed, int(i), sc.limits) for i in ids]
    epoch = hasattr(p, "epoch_length")
    simulated = files.runtime != "live"  # the live runtime has no simulated network: every broadcast arrives
    days, last_day = world_days(sc, files.times)
    by_day: dict[int, list[int]] = defaultdict(list)
    for k, d in enumerate(days):
        by_day[d].append(k)
    meta = {s["name"]: {c["name"]: (c["dtype"], int(c["width"])) for c in s["columns"]}
            for s in tables.transcript_meta(files.transcript)["stages"]}
    stages = {s: StageReports(meta.get(s, {})) for s in reference.stages_of(p)}
    ch_dev, ch_round, ch_reason, ch_amount = array("q"), array("q"), array("q"), array("d")
    reasons: dict[str, int] = {}
    time_left = np.array([m.deadline - (t + net.latency) for m, t in zip(files.downlink, files.times)])
    id_list = ids.tolist()
    everyone = [True] * len(id_list)
    decodable = [_decodable(m) for m in files.downlink]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=last_day + len(files.downlink), unit="step", desc=f"auditing {len(id_list):,} devices",
                   file=sys.stderr, dynamic_ncols=True)
    try:  # (a reference model that raises: the bar closed before its one line)
        for day in range(1, last_day + 1):
            world.advance_to(day)
            present = world.present(ids)
            here = everyone if present is None else present.tolist()
            values: list | None = None
            if epoch:
                for dev, x, h in zip(devices, world.values(ids)[0].tolist(), here):
                    dev.observe(day, x, h)
                values = [None] * len(id_list)  # epoch protocols report what they observed
            for k in by_day.get(day, ()):
                msg, sent = files.downlink[k], files.times[k]
                if not decodable[k]:
                    if bar is not None:
                        bar.update(1)
                    continue
                now = sent + net.latency  # a broadcast reaches the devices after the base latency
                device_day = int(now // sc.simulation.round_seconds) + 1
                got = here
                if net.downlink_loss > 0 and simulated:  # keyed per (round, kind, device), as agents/cohort.py draws it
                    u = keyed.uniform(stream_key(sc.seed, Purpose.DOWNLINK, msg.round, KINDS[msg.TYPE]), ids)
                    got = [h and r for h, r in zip(here, (u >= net.downlink_loss).tolist())]
                if values is None:
                    values = world.values(ids)[0].tolist()
                for dev, i, x, g in zip(devices, id_list, values, got):
                    rep, charges = dev.on_message(msg, device_day, x, g, now)
                    if rep is not None:
                        stages[rep.stage].add(i, rep.round, k, rep.columns)
                    for c in charges:
                        if c.cumulative:
                            ch_dev.append(i)
                            ch_round.append(c.round)
                            ch_reason.append(reasons.setdefault(c.reason, len(reasons)))
                            ch_amount.append(c.amount)
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    spent = np.array([d.spent for d in devices], dtype=np.float64)
    return Replay(stages, (ch_dev, ch_round, list(reasons), ch_reason, ch_amount), spent, time_left,
                  len(files.downlink), sum(d.refusals for d in devices), sum(d.ignored for d in devices))


# ------------------------------------------------------------------------------------------- comparison
class Findings:
    """Mismatches by kind: a count and the first few examples."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[dict]] = defaultdict(list)

    def add(self, kind: str, **example: Any) -> None:
        self.counts[kind] += 1
        self.example(kind, **example)

    def example(self, kind: str, **example: Any) -> None:
        """Keep an example without counting it (the count is added separately)."""
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append({k: _plain(v) for k, v in example.items()})

    def count(self, kind: str, n: int | np.integer) -> None:
        self.counts[kind] += int(n)

    def as_dict(self) -> dict:
        return {k: {"count": int(self.counts[k]), "examples": self.examples[k]} for k in sorted(self.counts)
                if self.counts[k]}


def _plain(v: Any) -> Any:
    """JSON-friendly values for examples."""
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, np.generic):
        return _plain(v.item())
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    return v


def _close(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality, floats to 1e-9 relative (absolute near 0); an infinity equals only itself (the
    relative test would take inf for any number) and NaN nothing."""
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a, b = a.astype(np.float64), b.astype(np.float64)
        with np.errstate(invalid="ignore"):
            near = np.abs(a - b) <= REL_TOL * np.maximum(1.0, np.maximum(np.abs(a), np.abs(b)))
        ok = (near & np.isfinite(a) & np.isfinite(b)) | (a == b)
    else:
        ok = a.astype(np.int64) == b.astype(np.int64)
    return ok.reshape(ok.shape[0], -1).all(axis=1) if ok.ndim > 1 else ok


def _column_values(column: Any, width: int) -> np.ndarray:
    arr = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if width > 1:
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
    return arr.to_numpy(zero_copy_only=False)


ROUND_SPAN = 1 << 32  # report keys: device x 2^32 + round (rounds <= 2^31 - 1)


def _keys(device: np.ndarray, round_: np.ndarray) -> np.ndarray:
    return device.astype(np.int64) * ROUND_SPAN + round_.astype(np.int64)


def compare_reports(files: RunFiles, ids: np.ndarray, rep: Replay, findings: Findings) -> dict:
    """Transcript rows of the chosen devices against the reference reports, stage by stage."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sc = files.scenario
    table = files.transcript
    if ids.size < sc.devices:
        table = table.filter(pc.is_in(table["device"], value_set=pa.array(ids, pa.int64())))
    stage_col = table["stage"].cast(pa.string())
    # matched: transcript rows paired with a reference report (same device, round and stage); equal: of those,
    # the rows whose every column equals the reference's (the others are report_value mismatches)
    counts = {"transcript_rows": int(table.num_rows), "reference_reports": 0, "matched": 0, "equal": 0}
    not_delivered = {"lost": 0, "late": 0}
    names = set(pc.unique(stage_col).to_pylist()) if table.num_rows else set()
    for name in sorted(names - set(rep.stages)):
        findings.add("report_columns", stage=name, problem="the transcript has a stage this protocol does not")
    for name, ref in rep.stages.items():
        if ref.extra or ref.missing:
            findings.add("report_columns", stage=name, transcript=sorted(ref.spec),
                         reference=sorted((set(ref.spec) - ref.missing) | ref.extra))
            continue
        sub = table.filter(pc.equal(stage_col, name))
        t_dev = sub["device"].to_numpy().astype(np.int64)
        t_round = sub["round"].to_numpy().astype(np.int64)
        r_dev = np.frombuffer(ref.device, dtype=np.int64)
        r_round = np.frombuffer(ref.round, dtype=np.int64)
        counts["reference_reports"] += ref.count
        t_key, r_key = _keys(t_dev, t_round), _keys(r_dev, r_round)
        # one report per device, round and stage: a second row is a duplicate
        t_sorted = np.sort(t_key)
        dup = t_sorted[1:][t_sorted[1:] == t_sorted[:-1]]
        for key_ in dup[:EXAMPLES]:
            findings.example("duplicate_report", stage=name, device=int(key_ // ROUND_SPAN),
                             round=int(key_ % ROUND_SPAN))
        findings.count("duplicate_report", dup.size)
        order = np.argsort(r_key, kind="stable")
        r_sorted = r_key[order]
        pos = np.minimum(np.searchsorted(r_sorted, t_key), max(r_sorted.size - 1, 0))
        matched = r_sorted[pos] == t_key if r_sorted.size else np.zeros(t_key.size, bool)
        values = {c: _column_values(sub[c], w) for c, (_, w) in ref.spec.items()}
        for j in np.flatnonzero(~matched)[:EXAMPLES]:
            findings.example("unexpected_report", stage=name, device=t_dev[j], round=t_round[j],
                             row={c: v[j] for c, v in values.items()})
        findings.count("unexpected_report", np.count_nonzero(~matched))
        t_idx = np.flatnonzero(matched)
        r_idx = order[pos[t_idx]]  # the reference report of each matched row
        counts["matched"] += int(t_idx.size)
        bad = np.zeros(t_idx.size, dtype=bool)
        for c in ref.spec:
            have, want = values[c][t_idx], ref.values(c)[r_idx]
            ok = _close(have, want)
            for j in np.flatnonzero(~ok)[:EXAMPLES]:
                findings.example("report_value", stage=name, device=t_dev[t_idx[j]], round=t_round[t_idx[j]],
                                 column=c, transcript=have[j], reference=want[j])
            bad |= ~ok
        findings.count("report_value", np.count_nonzero(bad))
        counts["equal"] += int(t_idx.size - np.count_nonzero(bad))
        # reference reports without a row must have been lost or late
        seen = np.zeros(r_dev.size, dtype=bool)
        seen[r_idx] = True
        if files.runtime == "live":  # real TCP: no keyed loss or latency to recompute
            not_delivered["unverified"] = not_delivered.get("unverified", 0) + int(np.count_nonzero(~seen))
            continue
        lost, late = _network(sc.seed, sc.network, r_dev, r_round,
                              rep.time_left[np.frombuffer(ref.message, dtype=np.int64)])
        delivered = ~lost & ~late
        missing = ~seen & delivered
        for j in np.flatnonzero(missing)[:EXAMPLES]:
            findings.example("missing_report", stage=name, device=r_dev[j], round=r_round[j],
                             reference={c: ref.values(c)[j] for c in ref.spec})
        findings.count("missing_report", np.count_nonzero(missing))
        not_delivered["lost"] += int(np.count_nonzero(~seen & lost))
        not_delivered["late"] += int(np.count_nonzero(~seen & late))
        extra = seen & ~delivered
        for j in np.flatnonzero(extra)[:EXAMPLES]:
            findings.example("unexpected_delivery", stage=name, device=r_dev[j], round=r_round[j],
                             network="lost" if lost[j] else "late")
        findings.count("unexpected_delivery", np.count_nonzero(extra))
    return {**counts, "not_delivered": not_delivered}


def _network(seed: int, net: Any, device: np.ndarray, round_: np.ndarray, time_left: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """(lost, late) of each report from the network's keyed draws (collector/network.py): lost when the loss
    uniform of (round, device) is below ``loss``; otherwise late unless latency - jitter ln(1 - u) (the
    latency uniform of (round, device)) is below the time left until the deadline."""
    lost = np.zeros(device.size, dtype=bool)
    late = np.zeros(device.size, dtype=bool)
    for r in np.unique(round_):
        at = np.flatnonzero(round_ == r)
        who = device[at]
        if net.loss > 0:
            lost[at] = keyed.uniform(stream_key(seed, Purpose.LOSS, int(r)), who) < net.loss
        if net.jitter > 0:
            delay = net.latency - net.jitter * np.log1p(-keyed.uniform(stream_key(seed, Purpose.LATENCY, int(r)), who))
        else:
            delay = np.full(at.size, net.latency)
        late[at] = ~(delay < time_left[at])
    return lost, late & ~lost


def compare_charges(files: RunFiles, ids: np.ndarray, rep: Replay, findings: Findings) -> dict:
    """The chosen devices' ledger rows against the reference charges, per device as multisets of (round,
    reason, amount); returns the counts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ledger = files.ledger
    if ids.size < files.scenario.devices:
        ledger = ledger.filter(pc.is_in(ledger["device"], value_set=pa.array(ids, pa.int64())))
    l_dev = ledger["device"].to_numpy().astype(np.int64)
    l_round = ledger["round"].to_numpy().astype(np.int64)
    l_amount = ledger["amount"].to_numpy().astype(np.float64)
    encoded = pc.dictionary_encode(ledger["reason"]).combine_chunks()
    vocab = list(rep.charges[2])
    code_of = {s: i for i, s in enumerate(vocab)}
    for s in encoded.dictionary.to_pylist():
        code_of.setdefault(s, len(code_of))
    names = sorted(code_of, key=code_of.__getitem__)
    l_code = np.array([code_of[s] for s in encoded.dictionary.to_pylist()], dtype=np.int64)[
        encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)] if l_dev.size else np.empty(0, np.int64)
    r_dev = np.frombuffer(rep.charges[0], dtype=np.int64)
    r_round = np.frombuffer(rep.charges[1], dtype=np.int64)
    r_code = np.frombuffer(rep.charges[3], dtype=np.int64)
    r_amount = np.frombuffer(rep.charges[4], dtype=np.float64)
    slot_l = np.minimum(np.searchsorted(ids, l_dev), max(ids.size - 1, 0))
    unknown = ids[slot_l] != l_dev if ids.size else np.ones(l_dev.size, bool)
    for j in np.flatnonzero(unknown)[:EXAMPLES]:
        findings.example("charge_unexpected", device=l_dev[j], round=l_round[j], reason=names[l_code[j]],
                         amount=l_amount[j], problem="no such device in the run")
    findings.count("charge_unexpected", np.count_nonzero(unknown))
    keep = ~unknown
    l_dev, l_round, l_code, l_amount, slot_l = l_dev[keep], l_round[keep], l_code[keep], l_amount[keep], slot_l[keep]
    slot_r = np.searchsorted(ids, r_dev)
    # devices with as many charges on both sides: sorted the same way, their rows align one to one
    bad = np.bincount(slot_l, minlength=ids.size) != np.bincount(slot_r, minlength=ids.size)
    lo = np.lexsort((l_amount, l_code, l_round, l_dev))
    ro = np.lexsort((r_amount, r_code, r_round, r_dev))
    li, ri = lo[~bad[slot_l[lo]]], ro[~bad[slot_r[ro]]]
    differ = (l_round[li] != r_round[ri]) | (l_code[li] != r_code[ri]) | ~_close(l_amount[li], r_amount[ri])
    bad[slot_l[li[differ]]] = True
    # the devices that differ, one by one: pair what matches, name the rest
    rows_l: dict[int, list] = defaultdict(list)
    rows_r: dict[int, list] = defaultdict(list)
    for j in np.flatnonzero(bad[slot_l]):
        rows_l[int(l_dev[j])].append((int(l_round[j]), names[l_code[j]], float(l_amount[j])))
    for j in np.flatnonzero(bad[slot_r]):
        rows_r[int(r_dev[j])].append((int(r_round[j]), names[r_code[j]], float(r_amount[j])))
    for dev in ids[bad].tolist():
        _classify(dev, sorted(rows_r[dev]), sorted(rows_l[dev]), findings)
    return {"ledger_rows": int(l_dev.size + np.count_nonzero(unknown)), "reference_charges": int(r_dev.size)}


def _classify(dev: int, ref_rows: list, led_rows: list, findings: Findings) -> None:
    def same(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and a[1] == b[1] and abs(a[2] - b[2]) <= REL_TOL * max(1.0, abs(a[2]), abs(b[2]))

    ref_left = list(ref_rows)
    led_left = []
    for row in led_rows:
        hit = next((k for k, r in enumerate(ref_left) if same(r, row)), None)
        if hit is None:
            led_left.append(row)
        else:
            ref_left.pop(hit)
    for row in list(led_left):
        hit = next((k for k, r in enumerate(ref_left) if r[:2] == row[:2]), None)
        if hit is not None:
            r = ref_left.pop(hit)
            led_left.remove(row)
            findings.add("charge_amount", device=dev, round=row[0], reason=row[1], ledger=row[2], reference=r[2])
    for r in ref_left:
        findings.add("charge_missing", device=dev, round=r[0], reason=r[1], amount=r[2])
    for row in led_left:
        findings.add("charge_unexpected", device=dev, round=row[0], reason=row[1], amount=row[2])


def ledger_totals(files: RunFiles) -> np.ndarray:
    """Every device's total in the ledger (the whole ledger, whichever devices the audit replays); charges of
    devices outside the population are left out (compare_charges names them)."""
    dev = files.ledger["device"].to_numpy().astype(np.int64)
    amount = files.ledger["amount"].to_numpy().astype(np.float64)
    n = files.scenario.devices
    inside = (dev >= 0) & (dev < n)
    return np.bincount(dev[inside], weights=amount[inside], minlength=n)


def check_bounds(files: RunFiles, totals: np.ndarray, findings: Findings) -> tuple[float, float | None]:
    """Every device's total against the guarantee and the budget of scenario.json (the bounds themselves are
    recomputed, not read from summary.json), and against spend.parquet; returns (guarantee, budget)."""
    sc = files.scenario
    guarantee = float(sc.protocol.guarantee(sc.collections).value)
    budget = None if sc.budget is None else float(sc.budget)
    for kind, bound in (("over_guarantee", guarantee), ("over_budget", budget)):
        if bound is None:
            continue
        over = np.flatnonzero(exceeds(totals, bound))
        for j in over[:EXAMPLES]:
            findings.example(kind, device=j, spend=totals[j], bound=bound)
        findings.count(kind, over.size)
    if files.spend is not None:  # the run's own per-device totals
        check_spend_table(files, files.spend, totals, findings)
    elif files.ledger_source == "ledger.parquet":  # a run that keeps its ledger writes spend.parquet beside it
        findings.add("spend_table", problem="spend.parquet is missing beside ledger.parquet")
    return guarantee, budget


def check_spend_table(files: RunFiles, table: Any, totals: np.ndarray, findings: Findings) -> None:
    """spend.parquet against the ledger and the scenario: one row per device, devices 0..n-1 in order
    (``spend_table``: a second row for a device, or one for a device outside the population, would let a reader
    find another figure than the one checked), each total equal to the ledger's (``spend_total``), each
    device's group the scenario's and its per-report epsilon at least the protocol's (``spend_table``)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from agents.world import split_shares

    sc = files.scenario
    dev = table["device"].to_numpy().astype(np.int64)
    n = totals.size
    if dev.size != n or not np.array_equal(dev, np.arange(n)):
        findings.add("spend_table", rows=int(dev.size),
                     problem=f"{dev.size:,} rows; it must hold devices 0..{n - 1:,} once each, in order")
        return
    val = table["spend"].to_numpy().astype(np.float64)
    wrong = ~_close(val, totals)
    for j in np.flatnonzero(wrong)[:EXAMPLES]:
        findings.example("spend_total", device=j, spend_table=val[j], ledger=totals[j])
    findings.count("spend_total", np.count_nonzero(wrong))
    round_eps = table["round_epsilon"].to_numpy().astype(np.float64)
    least = float(sc.protocol.round_epsilon)
    low = ~(round_eps >= least * (1 - REL_TOL))  # NaN is wrong too
    for j in np.flatnonzero(low)[:EXAMPLES]:
        findings.example("spend_table", device=j, round_epsilon=round_eps[j], protocol_round_epsilon=least)
    findings.count("spend_table", np.count_nonzero(low))
    names = [g.name for g in sc.groups]
    want = np.repeat(np.arange(len(names)), np.diff(split_shares(n, [g.share for g in sc.groups])))
    have = pc.index_in(table["group"].cast(pa.string()), value_set=pa.array(names, pa.string()))
    have = have.to_numpy(zero_copy_only=False) if have.null_count == 0 else \
        pc.fill_null(have, -1).to_numpy(zero_copy_only=False)
    other = np.flatnonzero(np.asarray(have, dtype=np.int64) != want)
    for j in other[:EXAMPLES]:
        findings.example("spend_table", device=int(j), group=table["group"][int(j)].as_py(), scenario_group=names[want[j]])
    findings.count("spend_table", other.size)


def check_rounds(files: RunFiles, findings: Findings) -> None:
    """Every transcript row and every ledger charge, of every device (sampled or not), belongs to a round the
    collector broadcast (``report_round``, ``charge_round``): a report or a charge of a round that never took
    place (a round of 2^32, whose key would pass for another device's) is no device's doing."""
    rounds = np.unique(np.array([m.round for m in files.downlink], dtype=np.int64))
    for kind, table, extra in (("report_round", files.transcript, "stage"), ("charge_round", files.ledger, "reason")):
        r = table["round"].to_numpy().astype(np.int64)
        at = np.minimum(np.searchsorted(rounds, r), max(rounds.size - 1, 0))
        bad = np.flatnonzero(rounds[at] != r) if rounds.size else np.arange(r.size)
        if bad.size:
            dev, what = table["device"].to_numpy(), table[extra]
            for j in bad[:EXAMPLES]:
                findings.example(kind, device=int(dev[j]), round=int(r[j]), **{extra: str(what[int(j)])},
                                 problem="the collector broadcast no such round")
        findings.count(kind, bad.size)


def _promised_claims(privacy: dict, promised: dict, where: str = "privacy") -> list[tuple[str, Any, Any]]:
    """(key, summary's value, recomputed value) for every figure of ``promised`` (accounting.promises, as
    summary.json writes it: non-finite figures null), nested dicts and lists key by key."""
    out: list[tuple[str, Any, Any]] = []
    for key, true in promised.items():
        said = privacy.get(key) if isinstance(privacy, dict) else None
        path = f"{where}.{key}"
        if isinstance(true, dict):
            out += _promised_claims(said, true, path) if isinstance(said, dict) else [(path, said, true)]
        elif isinstance(true, list):
            if not isinstance(said, list) or len(said) != len(true):
                out.append((path, said, true))
            else:
                for i, (a, b) in enumerate(zip(said, true)):
                    out += (_promised_claims(a, b, f"{path}[{i}]") if isinstance(b, dict) and isinstance(a, dict)
                            else [(f"{path}[{i}]", a, b)])
        else:
            out.append((path, said, true))
    return out


def check_claims(files: RunFiles, guarantee: float, budget: float | None, totals: np.ndarray,
                 findings: Findings) -> None:
    """summary.json's privacy figures against the recomputed ones (``summary_claim``, one per figure that
    differs): every figure that follows from the scenario alone (accounting.promises: guarantee, derivation,
    scope, per-report epsilon, budget, horizon, (eps, delta), worst-case loss), and, where the audit read this
    directory's own ledger.parquet, the spend figures from the ledger's totals (max, mean, p50, p99,
    within_guarantee, within_budget, the within-pattern max)."""
    from scenarios import accounting

    privacy, sc = files.summary["privacy"], files.scenario
    promised = json.loads(jsonout.dumps(accounting.promises(sc)))  # as summary.json holds it
    if accounting.dependency_problem():  # this machine cannot recompute (eps, delta): not checked, not failed
        promised.pop("eps_delta", None)
    else:  # the figures, not how long the accountant took nor which version it was
        for key in ("seconds", "accountant"):
            promised["eps_delta"].pop(key, None)
    claims = _promised_claims(privacy, promised)
    claims.append(("round_epsilon_max", files.summary.get("round_epsilon_max"), float(sc.protocol.round_epsilon)))
    claims += _scenario_claims(files.summary, sc)
    if files.ledger_source == "ledger.parquet":
        max_spend = float(totals.max()) if totals.size else 0.0
        epsilon = files.summary.get("epsilon")
        epsilon = epsilon if isinstance(epsilon, dict) else {}
        p50, p99 = (np.quantile(totals, (0.5, 0.99)) if totals.size else (0.0, 0.0))
        claims += [("privacy.ledger", privacy.get("ledger"), "this run"),
                   ("privacy.max_spend", privacy.get("max_spend"), max_spend),
                   ("epsilon.max", epsilon.get("max"), max_spend),
                   ("epsilon.mean", epsilon.get("mean"), float(totals.mean()) if totals.size else 0.0),
                   ("epsilon.p50", epsilon.get("p50"), float(p50)), ("epsilon.p99", epsilon.get("p99"), float(p99)),
                   ("privacy.within_guarantee", privacy.get("within_guarantee"), not exceeds(max_spend, guarantee))]
        if budget is not None:
            claims.append(("privacy.within_budget", privacy.get("within_budget"),
                           not exceeds(max_spend, budget)))
        if "worst_case_loss" in promised:
            pattern = privacy.get("within_pattern_spend")
            claims.append(("privacy.within_pattern_spend.max",
                           pattern.get("max") if isinstance(pattern, dict) else None, max_spend))
    # a live run's missing reports are unverifiable (module docstring): the runtime must be the one the event
    # log names, and the transcript must hold every report the collector says it accepted
    logged = files.logged_runtime
    if logged is not None or files.runtime != "simulated":  # the weaker check claimed: the event log must say so
        claims.append(("runtime", files.runtime, logged or "simulated"))
    reports = files.summary.get("reports")
    accepted = reports.get("accepted") if isinstance(reports, dict) else None
    if accepted is not None or files.runtime != "simulated":  # a live run must say how many it accepted
        claims.append(("reports.accepted", accepted, int(files.transcript.num_rows)))
    for key, said, true in claims:
        if isinstance(true, (bool, np.bool_)):  # a verdict: only true or false will do
            wrong = not isinstance(said, bool) or said != bool(true)
        elif isinstance(true, (str, list, dict)) or true is None or said is None:
            wrong = said != true
        else:  # a number: not a boolean standing in for 0 or 1
            wrong = (isinstance(said, bool) or not isinstance(said, (int, float))
                     or not _close(np.array([float(said)]), np.array([float(true)]))[0])
        if wrong:
            findings.add("summary_claim", key=key, summary=said, recomputed=true)


def _scenario_claims(summary: dict, sc: Scenario) -> list[tuple[str, Any, Any]]:
    """What summary.json says of the run that scenario.json alone gives (``summary_claim`` when it differs):
    its name, population, rounds, cohort size and unit, every protocol parameter as the run used it
    (``parameters.epsilon`` 0.5 on a run at 1 reads as a privacy claim), and what its error figures are errors
    of."""
    from scenarios.metrics import error_of
    from scenarios.runner import protocol_parameters

    used = json.loads(jsonout.dumps({**protocol_parameters(sc.protocol), "round_epsilon": sc.protocol.round_epsilon}))
    said = summary.get("parameters")
    said = said if isinstance(said, dict) else {}
    claims: list[tuple[str, Any, Any]] = [("scenario", summary.get("scenario"), sc.name),
                                          ("devices", summary.get("devices"), sc.devices),
                                          ("rounds", summary.get("rounds"), sc.rounds),
                                          ("cohort_size", summary.get("cohort_size"), sc.simulation.cohort_size)]
    if "unit" in summary:  # (runs before summaries said it have none)
        claims.append(("unit", summary.get("unit"), sc.unit))
    if "errors_of" in summary:
        claims.append(("errors_of", summary.get("errors_of"), error_of(sc.protocol, sc.unit)))
    claims += [(f"parameters.{k}", said.get(k), v) for k, v in used.items()]
    claims += [(f"parameters.{k}", v, None) for k, v in said.items() if k not in used]  # one the run had not
    return claims


#: summary.json's entries the audit recomputes or compares, in whole (the others are listed in audit.json's
#: ``not_checked``): identity, parameters and privacy figures; of ``digests`` and ``reports`` the parts below
CHECKED_SUMMARY = {"scenario", "protocol", "seed", "runtime", "devices", "rounds", "cohort_size", "unit", "errors_of",
                   "parameters", "epsilon", "round_epsilon_max", "privacy"}
CHECKED_PARTS = {"digests": {"transcript", "ledger_rows"}, "reports": {"accepted"}}
#: the run directory's files the audit reads
CHECKED_FILES = {"scenario.json", "summary.json", "downlink.jsonl", "events.jsonl", "transcript.parquet",
                 "ledger.parquet", "spend.parquet", "audit.json"}


def not_checked(files: RunFiles, counted: bool) -> dict[str, list[str]]:
    """audit.json ``not_checked``: summary.json's entries the audit neither recomputes nor compares (the
    utility figures: errors, messages, timings, attacks ...; ``counted``: whether the devices' counters were),
    and the files of the run directory it does not read (convenience copies and pictures)."""
    summary = files.summary
    keys = [k for k in summary if k not in CHECKED_SUMMARY and k not in CHECKED_PARTS]
    for k, parts in CHECKED_PARTS.items():
        if isinstance(summary.get(k), dict):
            keys += [f"{k}.{sub}" for sub in summary[k] if sub not in parts]
    if not counted:
        keys += [f"privacy.{k}" for k in ("refusals", "ignored_messages") if k in summary.get("privacy", {})]
    names = sorted(p.name for p in files.run_dir.iterdir() if p.is_file() and p.name not in CHECKED_FILES
                   and not p.name.startswith("."))
    return {"summary": keys, "files": names}


def check_counters(files: RunFiles, rep: Replay, everyone: bool, findings: Findings) -> dict:
    """summary.json's ``privacy.refusals`` and ``privacy.ignored_messages`` against the reference devices' own
    counts (``summary_claim``), when the audit replayed every device and the devices' counts are this run's
    (its ledger here: a ``serve`` collector's devices count in their own processes, and summary.json says
    null). A sample's counts are recorded, not compared: the summary holds the population's totals only."""
    privacy = files.summary["privacy"]
    checked = everyone and files.ledger_source == "ledger.parquet"
    out: dict = {}
    for key, counted in (("refusals", rep.refusals), ("ignored_messages", rep.ignored)):
        said = privacy.get(key)
        out[key] = {"summary": said, "reference": counted, "checked": checked}
        if checked and (isinstance(said, bool) or not isinstance(said, int) or said != counted):
            findings.add("summary_claim", key=f"privacy.{key}", summary=said, recomputed=counted)
    return out


def check_ledger_digest(files: RunFiles, findings: Findings) -> dict:
    """The ledger rows digest recomputed from the ledger read against summary.json's ``digests.ledger_rows``
    (``ledger_digest``): a row of ledger.parquet changed, added or removed (its time included, which no other
    check reads) fails. A run whose ledger this run directory keeps must state the digest; shards' ledgers
    (``--ledger``) have none in summary.json and are recomputed only."""
    from scenarios import tables

    digests = files.summary["digests"]
    said = digests.get("ledger_rows")
    recomputed = tables.ledger_rows_digest_of_table(files.ledger)
    if files.ledger_source == "ledger.parquet":
        if not isinstance(said, str):
            findings.add("ledger_digest", problem="summary.json states no digests.ledger_rows for its ledger.parquet")
        elif said != recomputed:
            findings.add("ledger_digest", recomputed=recomputed, summary=said)
    return {"recomputed": recomputed, "summary": said if isinstance(said, str) else None}


# ------------------------------------------------------------------------------------------- the audit
def audit(run_dir: Path | str, devices: int | str | None = None, ledgers: Sequence[Path | str] | None = None,
          progress: bool = False, write: bool = True, allow_code: bool = False, sample_seed: int | None = None) -> dict:
    """Audit a run directory; returns the audit.json record (and writes it unless ``write`` is False).
    ``sample_seed`` keys the sample of devices replayed when not all are (None: a fresh random one, recorded in
    audit.json). AuditInputError for a run directory that cannot be audited."""
    from scenarios import tables

    t0 = time.perf_counter()
    timing: dict[str, float] = {}
    files = load(run_dir, ledgers, allow_code)
    timing["load"] = time.perf_counter() - t0
    sc = files.scenario
    if isinstance(devices, int) and devices < 1:
        raise AuditInputError(f"--devices {devices}: must be at least 1 (or all)")
    if sample_seed is None:
        sample_seed = secrets.randbits(63)
    ids, how = choose_devices(sc.devices, sample_seed, devices)
    findings = Findings()
    try:
        digest: str | None = tables.transcript_digest_of_table(files.transcript)
    except ValueError as exc:  # rows no collector could have accepted (a repeated report, a device out of range)
        digest = None
        findings.add("transcript_digest", problem=str(exc)[:300])
    if digest is not None and digest != files.summary["digests"]["transcript"]:
        findings.add("transcript_digest", recomputed=digest, summary=files.summary["digests"]["transcript"])
    ledger_digest = check_ledger_digest(files, findings)
    timing["digest"] = time.perf_counter() - t0 - sum(timing.values())
    rep = replay(files, ids, progress)
    timing["replay"] = time.perf_counter() - t0 - sum(timing.values())
    report_counts = compare_reports(files, ids, rep, findings)
    charge_counts = compare_charges(files, ids, rep, findings)
    totals = ledger_totals(files)
    guarantee, budget = check_bounds(files, totals, findings)
    max_spend = float(totals.max()) if totals.size else 0.0
    check_rounds(files, findings)
    check_claims(files, guarantee, budget, totals, findings)
    counters = check_counters(files, rep, how == "all", findings)
    timing["compare"] = time.perf_counter() - t0 - sum(timing.values())
    mismatches = findings.as_dict()
    record = {
        "run_dir": str(files.run_dir),
        "scenario": sc.name,
        "protocol": sc.protocol.name,
        "seed": sc.seed,
        "runtime": files.runtime,
        "devices": {"population": sc.devices, "checked": int(ids.size), "chosen": how,
                    "sample_seed": sample_seed if how != "all" else None},
        "broadcasts": rep.messages,
        "reports_checked": report_counts,
        "charges_checked": {**charge_counts, "source": files.ledger_source},
        "max_spend": max_spend,  # over the whole ledger
        "reference_max_spend": float(rep.spent.max()) if rep.spent.size else 0.0,
        "guarantee": guarantee,
        "budget": budget,
        "counters": counters,
        "transcript_digest": {"recomputed": digest, "summary": files.summary["digests"]["transcript"]},
        "ledger_digest": ledger_digest,
        "not_checked": not_checked(files, all(c["checked"] for c in counters.values())),
        "mismatches": mismatches,
        "verdict": "clean" if not mismatches else "failed",
        "seconds": round(time.perf_counter() - t0, 3),
        "timing": {k: round(v, 3) for k, v in timing.items()},
    }
    if write:
        with tables.atomic_path(files.run_dir / "audit.json") as tmp:
            tmp.write_text(jsonout.write_document(record, indent=2) + "\n", encoding="utf-8")
    return record


def describe(record: dict) -> str:
    """One line for the terminal."""
    r, c = record["reports_checked"], record["charges_checked"]
    head = (f"audit {record['verdict']}: {record['devices']['checked']:,} device(s) ({record['devices']['chosen']}), "
            f"{r['transcript_rows']:,} transcript row(s) and {r['reference_reports']:,} reference report(s) "
            f"({', '.join(f'{v:,} {k}' for k, v in r['not_delivered'].items())}), {c['ledger_rows']:,} "
            f"charge(s); max spend {record['max_spend']:.6g} <= guarantee {record['guarantee']:.6g}")
    if record["verdict"] == "clean":
        return head
    kinds = ", ".join(f"{k} {v['count']:,}" for k, v in record["mismatches"].items())
    return head.replace("<=", "vs") + f"; mismatches: {kinds}"


def _abbreviated(v: Any, items: int = 8) -> Any:
    """An example's value with every list longer than ``items`` cut to its first ``items`` and a count (a
    report of 1,024 bits is not a line to read)."""
    if isinstance(v, dict):
        return {k: _abbreviated(x, items) for k, x in v.items()}
    if isinstance(v, list):
        head = [_abbreviated(x, items) for x in v[:items]]
        return head + [f"... {len(v):,} values in all"] if len(v) > items else head
    return v


def mismatch_lines(record: dict) -> list[str]:
    """One line per kind of mismatch: its count and its first example, long values abbreviated."""
    return [f"  {kind}: {v['count']:,}" + (f", e.g. {json.dumps(_abbreviated(v['examples'][0]))}"
                                            if v["examples"] else "")
            for kind, v in record["mismatches"].items()]


def parse_devices(text: str | None) -> int | str | None:
    if text is None:
        return None
    if text == "all":
        return "all"
    if not text.isdecimal() or int(text) < 1:
        raise AuditInputError(f"--devices {text!r}: expected a positive number or 'all'")
    return int(text)


def main(run_dir: str, devices: str | None, ledgers: Iterable[str] | None, as_json: bool, quiet: bool = False,
         allow_code: bool = False, sample_seed: int | None = None) -> int:
    """The ``ldpsim audit`` command: 0 clean, 1 failed (AuditInputError -> 2 in scenarios.cli)."""
    record = audit(run_dir, parse_devices(devices), list(ledgers or []) or None, progress=not (as_json or quiet),
                   allow_code=allow_code, sample_seed=sample_seed)
    if as_json:
        print(jsonout.write_document(record, indent=2))
    else:
        print("\n".join([describe(record), *mismatch_lines(record)]))
    return 0 if record["verdict"] == "clean" else 1
