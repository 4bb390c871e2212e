"""Crash-safe live runs: the collector's journal (``ldpsim serve --resume``) and each device process's saved state
(``ldpsim devices --out``). Files are protocols.snapshot bytes (magic, sha256, msgpack with typed arrays), each
written to a temporary name and moved into place (scenarios.tables.atomic_path): a reader sees a whole file.

**Collector journal** (``RUN_DIR/journal.msgpack``, kind ``collector-journal``), rewritten after every closed
round and at every stage boundary of a round (a multi-stage collector's ``advance`` closed a stage and returned
the next stage's message: THRESH's decision, a ToPL threshold; written before that message is broadcast):
the scenario's name and the sha256 of its scenario.json text, the last closed round, the collector
side's snapshot (protocols: rounds, estimates, ToPL's thetas by version, THRESH's carried estimate, ToPS's
release state...), the RoundBook's records (truth, estimate, reports per round), the spend history,
the collector's counters and every downlink record. Transcript records are not rewritten each round: each
closed round record goes once to ``RUN_DIR/journal-records/`` (kind ``transcript-record``) and the journal
lists them. *Write-ahead:* a ToPL threshold is added to the journal before it is broadcast, so a collector
resumed in the middle of that round broadcasts the same theta under the same version.

At a stage boundary the journal also holds ``open``: the round, the open stage's name, its message (wire bytes)
and nominal close; the collector snapshot then has that stage open and empty (``open_stage``) beside the closed
stages' records and the decision or threshold just made.

A resumed collector restores all this and runs from the round after the last closed one; a journal written at a
stage boundary continues that round at the open stage, its message broadcast again (devices that answered it
re-send their frames; the earlier stages are not run again, so a decision never changes with fewer votes). A
round whose first stage was in progress when the collector died is run again from that stage. Devices that
had answered a message sent again re-send the frames they sent (agents/resumable.py), byte for byte, and are
charged nothing new; so a resumed run gives the uninterrupted run's transcript, estimates and ledger. A
journal of another scenario, or a corrupt one, is refused with one line (:class:`JournalError`). A finished
run removes its journal (:func:`finish`).

**Device state** (``OUT/devices-shard-I-of-N.state``, kind ``device-state``), saved after every message a
device process answers and before its frames go out: every cohort's snapshot (guard spend and last round,
memo reveals, THRESH caps and epoch sums, ToPL thetas...), the answers of the current round (for re-sending),
the devices' day and the shard's ledger. ``ldpsim devices`` loads it automatically when it is there (same
scenario, shard and connections, else it refuses), so a restarted process never answers a round twice or
spends a budget again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from protocols import snapshot, wire
from protocols.messages import CollectorMessage, Threshold
from scenarios.schema import Scenario, ScenarioError
from scenarios.tables import atomic_path

JOURNAL = "journal.msgpack"
RECORDS = "journal-records"
JOURNAL_KIND = "collector-journal"
RECORD_KIND = "transcript-record"
DEVICE_KIND = "device-state"
VERSION = 2  # of the journal's and the device state's fields (2: a guard's ignored_rows; the container has protocols.snapshot.FORMAT)


class JournalError(ScenarioError):
    """A journal or device state that cannot be used: missing, corrupt, or of another scenario (one line)."""


def scenario_sha256(sc: Scenario) -> str:
    """sha256 of the scenario.json text a run directory holds (output.write_run_dir writes the same text)."""
    return hashlib.sha256((json.dumps(sc.as_run, indent=2) + "\n").encode()).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def _scalar(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    return v


# ----------------------------------------------------------------------------------------------- collector
class CollectorJournal:
    """Keeps ``RUN_DIR/journal.msgpack`` for a live collector (:func:`attach` wires it in)."""

    def __init__(self, run_dir: Path, sc: Scenario, server: Any, book: Any) -> None:
        self.dir, self.sc, self.server, self.book = Path(run_dir), sc, server, book
        self.path = self.dir / JOURNAL
        self.files: dict[str, list[str]] = {}  # stage -> record files written, in round order
        self.thresholds: list[list[Any]] = []  # [version, theta, round] of every threshold broadcast
        self.last_round = 0
        self._state: dict[str, Any] | None = None

    # -- writing
    def write_round(self, t: int) -> None:
        """The state after closed round ``t`` (records of new rounds go to their own files first)."""
        self._write_state(t, None)

    def write_stage(self, msg: CollectorMessage) -> None:
        """The state at a stage boundary of round ``msg.round``: its earlier stages closed (their records go to
        their own files), the decision or threshold made, and ``msg`` (the open stage's message, about to be
        broadcast) kept for a resumed collector to broadcast again."""
        protocol = self.server.protocol
        name = next((n for n, s in protocol.stages() if s.is_open()), "")
        self._write_state(int(msg.round) - 1, {"round": int(msg.round), "stage": name, "message": wire.encode(msg),
                                               "close_at": float(msg.deadline)})

    def _write_state(self, t: int, open_: dict[str, Any] | None) -> None:
        protocol = self.server.protocol
        state = protocol.snapshot(records=False)
        (self.dir / RECORDS).mkdir(parents=True, exist_ok=True)
        for index, (name, stage) in enumerate(protocol.stages()):
            files = self.files.setdefault(name, [])
            for i in range(len(files), len(stage.transcript)):
                rnd = stage.transcript[i][0]
                fname = f"{index}-{name}-{rnd:010d}.rec"
                _write(self.dir / RECORDS / fname, snapshot.encode(
                    {"stage": name, "round": int(rnd), "record": stage.record_array(i)}, RECORD_KIND))
                files.append(fname)
            state["stages"][name]["record_files"] = list(files)
        server, book = self.server, self.book
        stats = {k: _scalar(v) if not isinstance(v, dict) else {a: int(b) for a, b in v.items()}
                 for k, v in vars(server.stats).items()}
        self.last_round = int(t)
        self._state = {
            "version": VERSION, "scenario": self.sc.name, "scenario_sha256": scenario_sha256(self.sc),
            "last_round": int(t), "open": open_,
            "protocol": state,
            "rounds": [{"round": int(r.round), "time": float(r.time), "truth": _scalar(r.truth),
                        "estimate": _scalar(r.estimate), "reports": int(r.reports), "clipped": int(r.clipped),
                        "sd_theory": _scalar(r.sd_theory), "info": {k: _scalar(v) for k, v in r.info.items()}}
                       for r in book.records],
            "spend_history": [{k: _scalar(v) for k, v in h.items()} for h in book.ledger.history],
            "stats": stats, "frames_sent": int(server.frames_sent),
            "drops": {k: int(v) for k, v in getattr(server, "drops", {}).items()},
            "downlink": [{k: _scalar(v) for k, v in d.items()} for d in server.downlink],
            "hostile_versions": [int(v) for v in getattr(server.hostility, "_versions", [])],
        }
        self._flush()

    def threshold(self, msg: Threshold, flush: bool = True) -> None:
        """Write-ahead: a threshold about to be broadcast is journaled first."""
        entry = [int(msg.version), float(msg.theta), int(msg.round)]
        if entry not in self.thresholds:
            self.thresholds.append(entry)
            if flush:
                self._flush()

    def _flush(self) -> None:
        if self._state is None:
            return
        _write(self.path, snapshot.encode({**self._state, "thresholds": self.thresholds}, JOURNAL_KIND))


def check(run_dir: Path | str, sc: Scenario) -> dict[str, Any]:
    """The journal in ``run_dir`` (without its transcript records), checked against ``sc``; JournalError (one
    line) when there is none, it is corrupt, or it is of another scenario."""
    run_dir = Path(run_dir)
    path = run_dir / JOURNAL
    if not path.is_file():
        raise JournalError(f"--resume {run_dir}: no {JOURNAL} there (nothing to resume; a finished run removes it)")
    try:
        state = snapshot.decode(path.read_bytes(), JOURNAL_KIND)
        if state.get("version") != VERSION:
            raise snapshot.SnapshotError(f"journal version {state.get('version')!r:.20} (this build reads {VERSION})")
        name = snapshot.field(state, "scenario", str)
    except OSError as exc:
        raise JournalError(f"--resume {run_dir}: cannot read the journal: {exc.strerror or exc}") from None
    except snapshot.SnapshotError as exc:
        raise JournalError(f"--resume {run_dir}: {JOURNAL} is corrupt or foreign: {exc}") from None
    if state.get("scenario_sha256") != scenario_sha256(sc):
        raise JournalError(f"--resume {run_dir}: the journal is of scenario {name!r} with other settings "
                           f"(its scenario.json hash differs); resume with the same scenario and --set options")
    return state


def load(run_dir: Path | str, sc: Scenario) -> dict[str, Any]:
    """:func:`check`, then the transcript records read back from their files (JournalError if one is missing,
    corrupt or not the round the journal says)."""
    run_dir = Path(run_dir)
    state = check(run_dir, sc)
    try:
        stages = snapshot.field(snapshot.field(state, "protocol", dict), "stages", dict)
        for sname, stage in stages.items():
            rounds = snapshot.array(stage, "record_rounds", np.int64, (None,)).tolist()
            files = snapshot.field(stage, "record_files", list)
            if len(files) != len(rounds):
                raise snapshot.SnapshotError(f"stage {sname!r} lists {len(files)} record files for "
                                             f"{len(rounds)} rounds")
            records = []
            for fname, rnd in zip(files, rounds):
                if not isinstance(fname, str) or "/" in fname or "\\" in fname or fname.startswith("."):
                    raise snapshot.SnapshotError(f"bad record file name {fname!r:.60}")
                fpath = run_dir / RECORDS / fname
                if not fpath.is_file():
                    raise snapshot.SnapshotError(f"record file {RECORDS}/{fname} is missing")
                try:
                    rec = snapshot.decode(fpath.read_bytes(), RECORD_KIND)
                except snapshot.SnapshotError as exc:
                    raise snapshot.SnapshotError(f"record file {RECORDS}/{fname}: {exc}") from None
                if rec.get("stage") != sname or rec.get("round") != rnd:
                    raise snapshot.SnapshotError(f"record file {RECORDS}/{fname} is not stage {sname!r} round {rnd}")
                records.append(snapshot.field(rec, "record", np.ndarray))
            stage["records"] = records
    except OSError as exc:
        raise JournalError(f"--resume {run_dir}: cannot read the journal's records: {exc.strerror or exc}") from None
    except snapshot.SnapshotError as exc:
        raise JournalError(f"--resume {run_dir}: the journal's transcript records are corrupt: {exc}") from None
    return state


def resume(state: dict[str, Any], server: Any, book: Any) -> int:
    """Restore a loaded journal into a freshly built server and book; returns the first round to run. A journal
    written at a stage boundary (``open``) also sets ``server.resume_stage``: that round continues at the open
    stage, its message broadcast again."""
    from scenarios.runner import RoundRecord

    try:
        protocol = server.protocol
        pstate = snapshot.field(state, "protocol", dict)
        for stage in pstate["stages"].values():
            stage.pop("record_files", None)
        protocol.restore(pstate)
        for version, theta, _ in snapshot.field(state, "thresholds", list):
            if hasattr(protocol, "pin_threshold"):
                protocol.pin_threshold(int(version), float(theta))
        book.records[:] = [RoundRecord(r["round"], r["time"], r["truth"], r["estimate"], r["reports"], r["clipped"],
                                       r["sd_theory"], dict(r["info"])) for r in snapshot.field(state, "rounds", list)]
        # the collector's ledger holds no charges (`ldpsim serve`: the devices keep them), only the spend history
        book.ledger.history[:] = [dict(h) for h in snapshot.field(state, "spend_history", list)]
        last = snapshot.field(state, "last_round", int)
        book.world.advance_to(last * book.epoch_length)  # the world is a function of (seed, day)
        book.fired_through = last * book.epoch_length  # its behaviors' changes to then were logged before
        for k, v in snapshot.field(state, "stats", dict).items():
            if hasattr(server.stats, k):
                setattr(server.stats, k, dict(v) if isinstance(v, dict) else v)
        open_ = state.get("open")
        if open_ is not None:
            msg = wire.decode(snapshot.field(open_, "message", bytes))
            if (msg.round != last + 1 or snapshot.field(open_, "round", int) != last + 1
                    or not protocol.is_open()):
                raise snapshot.SnapshotError(f"open stage {open_.get('stage')!r:.20} of round {msg.round} does not "
                                             f"follow closed round {last}")
            server.resume_stage = (msg, snapshot.field(open_, "close_at", float))
        elif protocol.is_open():
            raise snapshot.SnapshotError("the collector state has a stage open, the journal names none")
        server.frames_sent = snapshot.field(state, "frames_sent", int)
        if isinstance(getattr(server, "drops", None), dict):
            server.drops.update(snapshot.field(state, "drops", dict))
        server.downlink[:] = snapshot.field(state, "downlink", list)
        if server.hostility is not None and hasattr(server.hostility, "_versions"):
            server.hostility._versions[:] = snapshot.field(state, "hostile_versions", list)
    except (snapshot.SnapshotError, wire.WireError, KeyError, TypeError, ValueError) as exc:
        raise JournalError(f"the journal does not fit this collector: {exc}"[:300]) from None
    return last + 1


def attach(run_dir: Path | str, sc: Scenario, server: Any, book: Any, resume_from: bool = False) -> int:
    """Journal ``server`` into ``run_dir`` after every closed round and at every stage boundary (before the next
    stage's message goes out). With ``resume_from``: first restore the journal there (``server.resume_stage``
    set when it was written at a stage boundary). Returns the first round the server should run."""
    run_dir = Path(run_dir)
    journal = CollectorJournal(run_dir, sc, server, book)
    first = 1
    if resume_from:
        state = load(run_dir, sc)
        journal.files = {n: list(s["record_files"]) for n, s in state["protocol"]["stages"].items()}
        journal.thresholds = [list(e) for e in state["thresholds"]]
        first = resume(state, server, book)
        if server.resume_stage is not None:
            journal.write_stage(server.resume_stage[0])
        else:
            journal.write_round(first - 1)
    else:
        (run_dir / JOURNAL).unlink(missing_ok=True)
        shutil.rmtree(run_dir / RECORDS, ignore_errors=True)
        journal.write_round(0)
    closed = server.on_round_closed

    def on_round_closed(t: int, result: Any, close_time: float) -> None:
        if closed is not None:
            closed(t, result, close_time)
        journal.write_round(t)

    server.on_round_closed = on_round_closed
    protocol = server.protocol
    advance = protocol.advance

    def journaled_advance(deadline: float) -> Any:
        msg = advance(deadline)
        if msg is not None and server.current_round <= server.rounds:  # not a hostile extra round
            if isinstance(msg, Threshold):
                journal.threshold(msg, flush=False)
            journal.write_stage(msg)
        return msg

    protocol.advance = journaled_advance  # the instance's own: each stage boundary is journaled before its broadcast
    server.journal = journal
    return first


def finish(run_dir: Path | str) -> None:
    """The run directory is complete: its journal is no longer needed."""
    run_dir = Path(run_dir)
    (run_dir / JOURNAL).unlink(missing_ok=True)
    shutil.rmtree(run_dir / RECORDS, ignore_errors=True)


# ----------------------------------------------------------------------------------------------- devices
def device_state_path(out: Path | str, index: int, count: int) -> Path:
    """``OUT/devices-shard-I-of-N.state`` (1-based I), beside the shard's ledger."""
    return Path(out) / f"devices-shard-{index}-of-{count}.state"


class DeviceStore:
    """The saved state of one ``ldpsim devices`` process: its clients' cohorts and answers, the day, the ledger."""

    def __init__(self, path: Path, sc: Scenario, index: int, count: int, clients: list[Any], ledger: Any,
                 days: Any) -> None:
        self.path, self.sc, self.index, self.count = Path(path), sc, int(index), int(count)
        self.clients, self.ledger, self.days = clients, ledger, days
        self.done = False
        self.saves = 0

    def _header(self) -> dict[str, Any]:
        return {"version": VERSION, "scenario": self.sc.name, "scenario_sha256": scenario_sha256(self.sc),
                "shard": f"{self.index}/{self.count}",
                "clients": [[int(c.ids[0]), int(c.ids[-1]) + 1] for c in self.clients]}

    def save(self, done: bool | None = None) -> None:
        if done is not None:
            self.done = bool(done)
        clients = []
        for c in self.clients:
            clients.append({"cohorts": [cohort.snapshot() for cohort in c.cohorts],
                            "answered_round": int(getattr(c, "answered_round", 0)),
                            "answered": [{"message": key, "frames": list(frames)}
                                         for key, (frames, _) in getattr(c, "answered", {}).items()]})
        day = int(self.days.world.day)
        state = {**self._header(), "day": day, "done": self.done, "client_state": clients,
                 "ledger": self.ledger.snapshot()}
        _write(self.path, snapshot.encode(state, DEVICE_KIND))
        self.saves += 1

    def load(self) -> bool:
        """Restore the saved state if there is one (True); JournalError if it is corrupt or not this shard's."""
        if not self.path.is_file():
            return False
        where = f"{self.path}"
        try:
            state = snapshot.decode(self.path.read_bytes(), DEVICE_KIND)
            head = self._header()
            if state.get("version") != VERSION:
                raise snapshot.SnapshotError(f"device state version {state.get('version')!r:.20} (this build reads "
                                             f"{VERSION})")
            for key in ("scenario_sha256", "shard", "clients"):
                if state.get(key) != head[key]:
                    what = {"scenario_sha256": f"scenario {state.get('scenario')!r} with other settings",
                            "shard": f"shard {state.get('shard')}",
                            "clients": "another --connections split"}[key]
                    raise JournalError(f"{where}: saved device state of {what}; this process is {self.sc.name!r} "
                                       f"shard {head['shard']} (remove the file to start these devices afresh, "
                                       f"which forgets what they spent)")
            saved = snapshot.field(state, "client_state", list)
            for c, cs in zip(self.clients, saved):
                cohorts = snapshot.field(cs, "cohorts", list)
                if len(cohorts) != len(c.cohorts):
                    raise snapshot.SnapshotError(f"{len(cohorts)} cohorts saved for {len(c.cohorts)}")
                for cohort, cstate in zip(c.cohorts, cohorts):
                    cohort.restore(cstate)
                if hasattr(c, "answered"):
                    from agents.resumable import NEW_CONNECTION

                    c.answered_round = snapshot.field(cs, "answered_round", int)
                    c.answered = {snapshot.field(a, "message", bytes): [list(snapshot.field(a, "frames", list)),
                                                                        NEW_CONNECTION]
                                  for a in snapshot.field(cs, "answered", list)}
            self.ledger.restore(snapshot.field(state, "ledger", dict))
            day = snapshot.field(state, "day", int)
            self.days.world.advance_to(day)
            for c in self.clients:
                c.day = day
            self.done = snapshot.field(state, "done", bool)
        except OSError as exc:
            raise JournalError(f"{where}: cannot read the saved device state: {exc.strerror or exc}") from None
        except snapshot.SnapshotError as exc:
            raise JournalError(f"{where}: saved device state is corrupt or foreign: {exc}") from None
        return True


def _finished(path: Path, index: int, count: int) -> str:
    return (f"{path}: the saved state of shard {index}/{count} is of a finished run (every round answered); "
            "give another --out, or remove that file to start a new run")


def refuse_finished_state(out: Path | str, index: int, count: int) -> None:
    """JournalError when shard ``index`` (1-based) of ``count`` has a saved state in ``out`` of a finished run
    (checked before a devices process says anything; :func:`open_device_store` checks it again)."""
    path = device_state_path(out, index, count)
    try:
        done = snapshot.decode(path.read_bytes(), DEVICE_KIND).get("done")
    except (OSError, snapshot.SnapshotError):  # none, or damaged: open_device_store says which
        return
    if done is True:
        raise JournalError(_finished(path, index, count))


def open_device_store(out: Path | str, sc: Scenario, index: int, count: int, clients: list[Any], ledger: Any,
                      days: Any, require: bool = False) -> DeviceStore:
    """The store of shard ``index`` (1-based) of ``count`` in ``out``, its saved state loaded when there is one
    (``require``: JournalError when there is none), wired into the clients (saved after every answer)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    store = DeviceStore(device_state_path(out, index, count), sc, index, count, clients, ledger, days)
    if not store.load() and require:
        raise JournalError(f"--resume: no saved device state at {store.path}")
    if store.done:  # answering again would start over from nothing: devices that spend twice
        raise JournalError(_finished(store.path, index, count))
    for c in clients:
        c.store = store
    return store
