"""Snapshots and resumes: every protocol side survives snapshot -> bytes -> restore mid-run and goes on exactly as
the original; corrupt and foreign snapshot files are refused; a collector and a device process killed with
SIGKILL mid-run resume without losing rounds, reusing a threshold version or answering a round twice."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from agents.world import World
from protocols import snapshot, wire
from protocols.ledger import Ledger
from scenarios import audit, journal, output, runner, schema, tables
from tests.support import PROTOCOL_TABLES, protocol_scenario


def _scenarios() -> dict[str, schema.Scenario]:
    base = {"simulation.cohort_size": 100, "network.loss": 0, "network.jitter": 0, "population.devices": 300}
    out = {p: protocol_scenario(p, **base) for p in ("1bitrrpm", "1bitmean")}
    for name, table in PROTOCOL_TABLES.items():
        out[name] = schema.parse({**protocol_scenario("1bitmean", **base).raw, "protocol": table})
    out["1bitrrpm-budget"] = protocol_scenario("1bitrrpm", **base, **{"privacy.budget": 2.5})
    out["thresh"] = schema.load("thresh_stable", ["population.devices=300", "rounds=28", "simulation.cohort_size=100",
                                                  "protocol.tau_scale=0.2"])
    out["epochrr"] = schema.parse({**out["thresh"].raw, "protocol": {"name": "epochrr", "epsilon": 1.0,
                                                                     "epoch_length": 4}})
    out["topl"] = schema.load("topl_pos", ["population.devices=300", "rounds=6", "protocol.rethreshold_every=3",
                                           "simulation.cohort_size=100"])
    out["tops"] = schema.load("tops_pos", ["population.devices=300", "rounds=6", "simulation.cohort_size=100"])
    out["1bitmulti"] = schema.load("apps_multi", ["population.devices=300", "rounds=4", "simulation.cohort_size=100"])
    return out


SCENARIOS = _scenarios()


def same(a, b, path: str = "") -> None:
    """Deep equality of snapshot states (arrays bit-exact, NaN equal to NaN)."""
    assert type(a) is type(b) or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


class Run:
    """A scenario driven through the sans-IO sides directly (the messages through the wire format)."""

    def __init__(self, sc: schema.Scenario) -> None:
        self.sc = sc
        self.world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
        self.length = int(getattr(sc.protocol, "epoch_length", 1))
        self.devices = [sc.protocol.make_devices(sc.seed, np.arange(lo, min(lo + 100, sc.devices)), sc.limits)
                        for lo in range(0, sc.devices, 100)]
        self.collector = sc.protocol.make_collector(sc.devices)
        self.ledger = Ledger(sc.devices)
        self.results: list = []
        self.day = 0

    def advance(self, day: int) -> None:
        while self.day < day:
            self.day += 1
            self.world.advance_to(self.day)
            for dev in self.devices:
                if hasattr(dev, "observe"):
                    ids = dev.device_ids.astype(np.int64)
                    dev.observe(self.day, self.world.values(ids)[0], self.world.present(ids))

    def round(self, t: int) -> None:
        self.advance(t * self.length)
        if getattr(self.sc.protocol, "method", None) == "oracle":
            self.collector.oracle_values = self.world.values(np.arange(self.sc.devices))[0].copy()
        msg = self.collector.request(t, 10.0 * t)
        while msg is not None:
            msg = wire.decode(wire.encode(msg))
            for dev in self.devices:
                ids = dev.device_ids.astype(np.int64)
                batch, charges = dev.respond(msg, self.day, self.world.values(ids)[0], 10.0 * t - 5,
                                             self.world.present(ids))
                for c in charges:
                    self.ledger.record(c)
                if batch is not None and len(batch):
                    self.collector.receive(wire.decode(wire.encode(batch)))
            msg = self.collector.advance(10.0 * t)
        res = self.collector.close_round()
        self.results.append((res.round, np.asarray(res.estimate, dtype=np.float64).tolist(), res.reports))

    def snapshot_bytes(self) -> tuple[list[bytes], bytes, bytes]:
        return ([snapshot.encode(d.snapshot(), "devices") for d in self.devices],
                snapshot.encode(self.collector.snapshot(), "collector"),
                snapshot.encode(self.ledger.snapshot(), "ledger"))

    def restore_bytes(self, data: tuple[list[bytes], bytes, bytes], day: int) -> None:
        devices, collector, ledger = data
        for dev, raw in zip(self.devices, devices):
            dev.restore(snapshot.decode(raw, "devices"))
        self.collector.restore(snapshot.decode(collector, "collector"))
        self.ledger.restore(snapshot.decode(ledger, "ledger"))
        self.world.advance_to(day)
        self.day = day


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_snapshot_round_trip_mid_run_continues_identically(name: str) -> None:
    """Run to the middle, snapshot every side to bytes, restore into fresh objects (a new process would build),
    and run both to the end: the restored sides' snapshots equal the originals', and every later round's
    estimate, every charge and the transcript digest are the same."""
    sc = SCENARIOS[name]
    total = sc.collections
    for mid in sorted({max(1, total // 2), max(1, min(total - 1, total // 2 + 1))}):
        _round_trip_at(sc, mid)


def _round_trip_at(sc: schema.Scenario, mid: int) -> None:
    total = sc.collections
    a = Run(sc)
    for t in range(1, mid + 1):
        a.round(t)
    data = a.snapshot_bytes()
    b = Run(sc)
    b.restore_bytes(data, a.day)
    for x, y in zip(a.devices, b.devices):
        same(x.snapshot(), y.snapshot())
    same(a.collector.snapshot(), b.collector.snapshot())
    same(a.ledger.snapshot(), b.ledger.snapshot())
    b.results = list(a.results)
    for t in range(mid + 1, total + 1):
        a.round(t)
        b.round(t)
    assert repr(b.results) == repr(a.results)  # bit-identical estimates (repr: NaN equals NaN)
    assert b.collector.transcript_digest() == a.collector.transcript_digest()
    assert b.ledger.digest() == a.ledger.digest()
    np.testing.assert_array_equal(b.ledger.spend, a.ledger.spend)
    assert sum(d.guard.ignored for d in b.devices) == sum(d.guard.ignored for d in a.devices)


def test_restored_devices_refuse_rounds_they_answered() -> None:
    """A device side restored from a snapshot taken after round 3 refuses round 3 (and earlier) again."""
    sc = SCENARIOS["1bitmean"]
    a = Run(sc)
    for t in range(1, 4):
        a.round(t)
    b = Run(sc)
    b.restore_bytes(a.snapshot_bytes(), a.day)
    from protocols.messages import CollectionRequest

    dev = b.devices[0]
    ids = dev.device_ids.astype(np.int64)
    for t in (1, 3):
        batch, charges = dev.respond(CollectionRequest(t, sc.protocol.name, 1.0), 3, b.world.values(ids)[0], 1.0)
        assert batch is None and charges == []
    assert dev.guard.ignored == a.devices[0].guard.ignored + 2


def test_snapshot_refused_with_a_stage_open() -> None:
    sc = SCENARIOS["topl"]
    r = Run(sc)
    r.collector.request(1, 1.0)
    with pytest.raises(ValueError, match="stage open"):
        r.collector.snapshot()


def test_snapshot_into_another_protocol_or_cohort_is_refused() -> None:
    a, b = Run(SCENARIOS["1bitmean"]), Run(SCENARIOS["kflip"])
    state = snapshot.decode(snapshot.encode(a.devices[0].snapshot(), "devices"))
    with pytest.raises(snapshot.SnapshotError, match="cannot be restored"):
        b.devices[0].restore(state)
    with pytest.raises(snapshot.SnapshotError, match="does not fit this cohort"):
        a.devices[1].restore(state)
    with pytest.raises(snapshot.SnapshotError, match="cannot be restored"):
        b.collector.restore(a.collector.snapshot())


# ------------------------------------------------------------------------------------------- the file format
def test_encoder_round_trips_values() -> None:
    state = {"i": -3, "f": float("nan"), "inf": float("inf"), "s": "x", "b": b"\x00\x01", "none": None, "t": True,
             "nested": {"l": [1, 2.5, "z", np.arange(3, dtype=np.uint16)]},
             **{f"a_{dt}": (np.arange(12) % 2).astype(dt).reshape(3, 2, 2)
                for dt in ("bool", "u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f4", "f8")},
             "empty": np.empty((0, 5)), "nan": np.array([np.nan, -np.inf])}
    back = snapshot.decode(snapshot.encode(state, "test"), "test")
    same({**state, "nested": {"l": [1, 2.5, "z", state["nested"]["l"][3]]}}, back)
    assert back["a_f8"].flags.writeable
    with pytest.raises(TypeError):
        snapshot.encode({"o": np.array([object()])}, "test")


def test_corrupt_and_foreign_files_are_refused() -> None:
    good = snapshot.encode({"x": np.arange(100)}, "collector")
    cases = {
        "not an ldpsim snapshot": b"PAR1" + good[4:],
        "truncated in its header": good[:20],
        "checksum mismatch": good[:-1],
    }
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF
    cases["checksum mismatch "] = bytes(flipped)
    for why, data in cases.items():
        with pytest.raises(snapshot.SnapshotError, match=why.strip()):
            snapshot.decode(data)
    with pytest.raises(snapshot.SnapshotError, match="expected 'devices'"):
        snapshot.decode(good, "devices")
    import hashlib

    import msgpack

    body = msgpack.packb({"format": 99, "kind": "collector", "state": {}})
    with pytest.raises(snapshot.SnapshotError, match="format 99"):
        snapshot.decode(snapshot.MAGIC + hashlib.sha256(body).digest() + body)
    body = msgpack.packb({"format": 1, "kind": "collector", "state": {"a": msgpack.ExtType(1, b"\x63\x01")}})
    with pytest.raises(snapshot.SnapshotError, match="dtype code"):
        snapshot.decode(snapshot.MAGIC + hashlib.sha256(body).digest() + body)


# ------------------------------------------------------------------------------------------- SIGKILL, over TCP

CLI = [sys.executable, "-m", "scenarios.cli"]
KILLED = {
    # ToPL: thresholds in rounds 1 and 4: the second version is chosen by the resumed collector
    "topl": ("topl_pos", ["population.devices=400", "rounds=6", "protocol.rethreshold_every=3",
                          "simulation.cohort_size=100"]),
    # THRESH: an update in epoch 2, carried forward through the epochs after the restart
    "thresh": ("thresh_stable", ["population.devices=400", "rounds=42", "simulation.cohort_size=100",
                                 "protocol.tau_scale=0.2"]),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(*args: object) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[1])


def _sets(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def _wait(pred, timeout: float, procs: list[subprocess.Popen], what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited early: {p.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    raise AssertionError(f"{what}: timed out")


def _finish(procs: list[subprocess.Popen], timeout: float = 90) -> None:
    try:
        for p in procs:
            assert p.wait(timeout=timeout) == 0, p.stderr.read().decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _shard_ledgers(dev: Path, pattern: str = "ledger-shard-*.parquet") -> pa.Table:
    """The device shards' ledger.parquet files, concatenated (reasons as plain strings: their dictionaries differ)."""
    parts = [pq.read_table(f) for f in sorted(dev.glob(pattern))]
    assert parts, f"no {pattern} in {dev}"
    return pa.concat_tables([t.set_column(3, "reason", t["reason"].cast(pa.string())) for t in parts])


def _journal_round(srv: Path, sc: schema.Scenario) -> int:
    try:
        return journal.load(srv, sc)["last_round"]
    except journal.JournalError:
        return 0


@pytest.mark.parametrize("name", sorted(KILLED))
def test_collector_killed_mid_run_resumes_with_the_uninterrupted_digests(tmp_path: Path, name: str) -> None:
    """`ldpsim serve` is SIGKILLed once its journal holds round 3 while two `ldpsim devices` shards keep running;
    `ldpsim serve --resume` takes over on the same port, the shards reconnect by themselves, and the run
    directory's transcript and estimates digests and the shards' ledgers equal an uninterrupted simulated run's
    (ToPL: the second threshold version comes from the resumed collector; THRESH: the carried estimate)."""
    with _killed_serve(tmp_path, name, pause=0.25) as run:
        _wait(lambda: _journal_round(run.srv, run.sc) >= 3, 90, run.procs, "journal of round 3")
        cut = run.kill()
        assert 3 <= cut < run.sc.collections  # the run was really cut short
        run.resume()
    sim_result = run.assert_like_uninterrupted()
    if name == "topl":
        assert len(sim_result.collector.protocol.thetas) == 2
    else:
        est = [r.estimate for r in sim_result.rounds]
        assert any(r.info["global_update"] for r in sim_result.rounds[:cut])
        assert est[cut:] == [est[cut - 1]] * (len(est) - cut)  # carried forward across the restart


class _KilledServe:
    """`ldpsim serve` with two `ldpsim devices` shards as subprocesses on 127.0.0.1, for the SIGKILL tests."""

    def __init__(self, tmp_path: Path, name: str, pause: float) -> None:
        self.spec, self.sets = KILLED[name]
        self.sc = schema.load(self.spec, self.sets)
        self.port, self.srv, self.dev = _port(), tmp_path / "srv", tmp_path / "dev"
        self.common = _sets(self.sets)  # the collector alone closes stages: --stage-timeout is serve's
        self.server = _spawn("serve", self.spec, "--port", self.port, "--out", self.srv, "--round-pause", str(pause),
                             "--stage-timeout", "20", *self.common)
        self.shards = [_spawn("devices", self.spec, "--connect", f"127.0.0.1:{self.port}", "--shard", f"{i}/2",
                              "--out", self.dev, *self.common) for i in (1, 2)]
        self.procs = [self.server, *self.shards]

    def kill(self) -> int:
        """SIGKILL the collector; returns the last round it had journaled."""
        self.server.send_signal(signal.SIGKILL)
        self.server.wait(timeout=10)
        assert not (self.srv / "summary.json").exists()
        return _journal_round(self.srv, self.sc)

    def resume(self) -> None:
        """`ldpsim serve --resume` on the same port; the shards reconnect by themselves; the run finishes."""
        resumed = _spawn("serve", self.spec, "--port", self.port, "--resume", self.srv, "--stage-timeout", "20",
                         *self.common)
        self.procs.append(resumed)
        _finish([resumed, *self.shards])

    def assert_like_uninterrupted(self):
        """The run directory's transcript and estimates digests and the shards' ledgers equal an uninterrupted
        simulated run's, and the finished run dropped its journal; returns the simulated result."""
        got = json.loads((self.srv / "summary.json").read_text())
        sim_result = runner.run(schema.load(self.spec, [*self.sets, "network.loss=0"]))  # live runs lose nothing
        sim = output.summary(sim_result)
        assert got["digests"]["transcript"] == sim["digests"]["transcript"]
        assert got["digests"]["estimates"] == sim["digests"]["estimates"]
        assert tables.ledger_rows_digest_of_table(_shard_ledgers(self.dev)) == sim_result.ledger.rows_digest()
        assert not (self.srv / journal.JOURNAL).exists()  # a finished run drops its journal
        # the resumed run's directory audits clean against the shards' ledgers: every broadcast of both
        # collector processes is in downlink.jsonl, every report in the transcript
        record = audit.audit(self.srv, ledgers=sorted(self.dev.glob("ledger-shard-*.parquet")), write=False)
        assert record["runtime"] == "live" and record["verdict"] == "clean", record["mismatches"]
        assert record["reports_checked"]["matched"] == record["reports_checked"]["reference_reports"] > 0
        return sim_result


@contextlib.contextmanager
def _killed_serve(tmp_path: Path, name: str, pause: float):
    run = _KilledServe(tmp_path, name, pause)
    try:
        yield run
    finally:
        for p in run.procs:
            if p.poll() is None:
                p.kill()


def test_device_process_killed_mid_run_never_spends_twice(tmp_path: Path, capsys) -> None:
    """Shard 1 of 2 (`ldpsim devices --out`) is SIGKILLed mid-run and started again: it reloads its saved state
    (caps, memo reveals, last round, ledger) and finishes. Its ledger has no device above the guarantee and no
    (device, round, reason) charged twice, and equals the uninterrupted run's; so do the collector's digests."""
    import pandas as pd

    spec, sets = "quickstart", ["population.devices=600", "rounds=8", "network.loss=0", "simulation.cohort_size=100"]
    sc = schema.load(spec, sets)
    port, srv, dev = _port(), tmp_path / "srv", tmp_path / "dev"
    common = _sets(sets)
    server = _spawn("serve", spec, "--port", port, "--out", srv, "--round-pause", "0.25", "--stage-timeout", "30",
                    *common)
    args = ["devices", spec, "--connect", f"127.0.0.1:{port}", "--connections", "2", "--out", dev, *common]
    shard1, shard2 = _spawn(*args, "--shard", "1/2"), _spawn(*args, "--shard", "2/2")
    state = journal.device_state_path(dev, 1, 2)

    def saved_day() -> int:
        try:
            return snapshot.decode(state.read_bytes(), journal.DEVICE_KIND)["day"]
        except (OSError, snapshot.SnapshotError):
            return 0

    try:
        _wait(lambda: saved_day() >= 3, 90, [server, shard1, shard2], "shard state of day 3")
        shard1.send_signal(signal.SIGKILL)
        shard1.wait(timeout=10)
        day = saved_day()
        assert 3 <= day < sc.rounds
        restarted = _spawn(*args, "--shard", "1/2")
        _finish([restarted, shard2, server])
    finally:
        for p in [server, shard1, shard2]:
            if p.poll() is None:
                p.kill()
    summary = json.loads((srv / "summary.json").read_text())
    guarantee = summary["privacy"]["guarantee"]
    ledger = pd.read_parquet(dev / "ledger-shard-1-of-2.parquet")
    assert not ledger.duplicated(["device", "round", "reason"]).any()
    assert ledger.groupby("device")["amount"].sum().max() <= guarantee + 1e-9
    sim_result = runner.run(sc)
    sim = output.summary(sim_result)
    half = sc.devices // 2
    tables.write_ledger(tmp_path / "sim-ledger.parquet", sim_result.ledger.rows())
    sim_rows = pq.read_table(tmp_path / "sim-ledger.parquet")
    sim_rows = sim_rows.filter(pc.less(sim_rows["device"], half))
    assert (tables.ledger_rows_digest_of_table(_shard_ledgers(dev, "ledger-shard-1-of-2.parquet"))
            == tables.ledger_rows_digest_of_table(sim_rows))
    assert summary["digests"]["transcript"] == sim["digests"]["transcript"]
    assert summary["digests"]["estimates"] == sim["digests"]["estimates"]
    assert snapshot.decode(state.read_bytes(), journal.DEVICE_KIND)["done"]
    # the same command once more: its saved state is of a finished run, so it refuses (answering again from
    # nothing would charge the devices twice) instead of reporting "done" without connecting
    from scenarios import cli

    assert cli.main([*map(str, args), "--shard", "1/2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is of a finished run" in err[0], err


def test_resume_refuses_another_scenario_and_a_corrupt_journal(tmp_path: Path) -> None:
    """`ldpsim serve --resume DIR` exits 2 with one line naming the problem: no journal, a journal of other
    settings, a corrupt journal."""
    from scenarios import cli

    spec, sets = KILLED["topl"]
    sc = schema.load(spec, sets)
    run_dir = tmp_path / "srv"
    run_dir.mkdir()
    assert cli.main(["serve", spec, "--resume", str(run_dir), *_sets(sets)]) == 2
    # a journal as a collector writes it after round 2 (the sans-IO sides driven directly, no server)
    from types import SimpleNamespace

    from collector.process import CollectorStats

    r = Run(sc)
    for t in (1, 2):
        r.round(t)
    server = SimpleNamespace(protocol=r.collector, stats=CollectorStats(), frames_sent=0, downlink=[], hostility=None)
    book = SimpleNamespace(records=[], ledger=Ledger(sc.devices), epoch_length=1, world=r.world)
    journal.CollectorJournal(run_dir, sc, server, book).write_round(2)
    state = journal.load(run_dir, sc)
    assert state["last_round"] == 2 and len(state["protocol"]["stages"]["holdout"]["records"]) == 1
    other = schema.load(spec, [*sets, "seed=5"])
    with pytest.raises(journal.JournalError, match="other settings"):
        journal.load(run_dir, other)
    data = (run_dir / journal.JOURNAL).read_bytes()
    (run_dir / journal.JOURNAL).write_bytes(data[:-3])
    with pytest.raises(journal.JournalError, match="corrupt"):
        journal.load(run_dir, sc)
    (run_dir / journal.JOURNAL).write_bytes(data)
    rec = sorted((run_dir / journal.RECORDS).iterdir())[0]
    raw = bytearray(rec.read_bytes())
    raw[-1] ^= 0xFF
    rec.write_bytes(bytes(raw))
    with pytest.raises(journal.JournalError, match="corrupt"):
        journal.load(run_dir, sc)
    (run_dir / journal.JOURNAL).write_bytes(b"PAR1 not a journal")
    with pytest.raises(journal.JournalError, match="not an ldpsim snapshot"):
        journal.load(run_dir, sc)



# ------------------------------------------------------------------------------------------- a round in progress
class Killed(Exception):
    pass


OPEN_STAGE = {"topl": "report", "thresh": "estimate"}


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["boundary", "first_stage"])
@pytest.mark.parametrize("name", ["topl", "thresh"])
async def test_collector_dying_mid_round_is_resumed_where_it_stopped(tmp_path: Path, name: str, where: str) -> None:
    """In process: the collector dies in round 4. ``boundary``: in its last stage (ToPL: after its second
    threshold went out; THRESH: after the decision), with every report of that stage in hand; the journal was
    written at that stage boundary, and a resumed collector continues at that stage: it broadcasts the same
    threshold or decision again and never re-runs the first stage. ``first_stage``: before the first stage
    closed; the journal is of round 3 and round 4 is run again from its first stage. Either way the clients
    re-send the frames they sent (byte-identical, no new charge), the same threshold version carries the same
    theta, and the digests and ledger are the uninterrupted run's."""
    from collector.server import LiveSettings
    from scenarios import live

    fast = LiveSettings(stage_timeout=5.0, read_timeout=1.0, startup_timeout=20.0)
    spec, sets = KILLED[name]
    sc = schema.load(spec, sets)
    sim_result = runner.run(sc)
    ledger = Ledger(sc.devices)
    first, book1, _ = live.build_server(sc, ledger, None, fast)
    journal.attach(tmp_path, sc, first, book1)
    close_round = first.protocol.close_round

    def dying_close_round():
        if first.protocol.round == 4 if name == "topl" else first.protocol.epoch == 4:
            raise Killed
        return close_round()

    advance = first.protocol.advance  # the journal's (attach wraps the instance's)

    def dying_advance(deadline):
        if (first.protocol.round == 4 if name == "topl" else first.protocol.epoch == 4):
            raise Killed
        return advance(deadline)

    if where == "boundary":
        first.protocol.close_round = dying_close_round
    else:
        first.protocol.advance = dying_advance
    port = await first.start("127.0.0.1", 0)
    days = live.process_days(sc)
    clients = [live.build_client(sc, live.shard(sc.devices, i, 2), ledger, "127.0.0.1", port, days) for i in range(2)]
    tasks = [asyncio.create_task(c.run()) for c in clients]
    with pytest.raises(Killed):
        await first.run()
    await first.close()
    if name == "topl":
        assert [e[0] for e in first.journal.thresholds] == ([1, 2] if where == "boundary" else [1])
    state = journal.check(tmp_path, sc)
    if where == "boundary":  # journaled at the boundary: the open stage, its message, the decision made
        assert state["last_round"] == 3 and state["open"]["round"] == 4
        assert state["open"]["stage"] == OPEN_STAGE[name]
        assert state["protocol"]["open_stage"] == OPEN_STAGE[name]
        assert wire.decode(state["open"]["message"]) == wire.decode(wire.encode(first.protocol.open_message(
            state["open"]["close_at"])))
    else:
        assert state["last_round"] == 3 and state["open"] is None
    second, book2, _ = live.build_server(sc, ledger, None, fast)
    assert journal.attach(tmp_path, sc, second, book2, resume_from=True) == 4
    assert (second.resume_stage is not None) == (where == "boundary")
    requested = []
    request = second.protocol.request

    def counting_request(t, deadline):
        requested.append(t)
        return request(t, deadline)

    second.protocol.request = counting_request
    await second.start("127.0.0.1", port)
    await second.run(first_round=4)
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    await second.close()
    assert sum(c.resent for c in clients) >= 2  # round 4's answers went out again
    got = output.summary(live.live_result(sc, second, book2, ledger, 0.0, sum(c.rejected for c in clients)))
    sim = output.summary(sim_result)
    assert got["digests"] == sim["digests"]
    if name == "topl":
        assert second.protocol.thetas == sim_result.collector.protocol.thetas
    last = sc.collections
    assert requested == (list(range(5, last + 1)) if where == "boundary" else list(range(4, last + 1)))
    if name == "thresh":  # the decision of epoch 4 is the uninterrupted run's (made once, on every vote)
        assert book2.records[3].info == sim_result.rounds[3].info


def _journal_open(srv: Path, sc: schema.Scenario) -> dict | None:
    try:
        return journal.check(srv, sc)["open"]
    except journal.JournalError:
        return None


@pytest.mark.parametrize("name", sorted(KILLED))
def test_collector_killed_at_a_stage_boundary_resumes_at_that_stage(tmp_path: Path, name: str) -> None:
    """`ldpsim serve` is SIGKILLed while its journal is at a stage boundary of round 3 or later (THRESH: the
    decision went out and the estimate stage is open; ToPL: round 4's threshold went out); `--round-pause` holds
    such a stage open a while once answered. `ldpsim serve --resume` continues at that stage (the journal names
    it; the first stage is not run again) and the digests and the shards' ledgers equal an uninterrupted
    simulated run's."""
    with _killed_serve(tmp_path, name, pause=0.5) as run:
        _wait(lambda: (o := _journal_open(run.srv, run.sc)) is not None and o["round"] >= 3, 90, run.procs,
              "journal at a stage boundary")
        run.kill()
        state = journal.check(run.srv, run.sc)
        assert state["open"] is not None and state["open"]["stage"] == OPEN_STAGE[name]
        cut = state["open"]["round"]
        assert 3 <= cut <= run.sc.collections and state["last_round"] == cut - 1
        run.resume()
    run.assert_like_uninterrupted()
    downlink = [json.loads(line) for line in (run.srv / "downlink.jsonl").read_text().splitlines()]
    of_cut = [d["type"] for d in downlink if d.get("round") == cut]
    assert of_cut == ["collect", {"topl": "threshold", "thresh": "decision"}[name]], of_cut  # each once


def test_snapshot_at_a_stage_boundary_round_trips() -> None:
    """Right after advance (the decision / threshold made, the next stage open and empty) a collector snapshots;
    restored into a fresh collector it takes that stage's reports and closes the round as the original does.
    With a report received in the open stage it refuses."""
    for name in ("thresh", "topl"):
        sc = SCENARIOS[name]
        a = Run(sc)
        for t in (1, 2, 3):
            a.round(t)
        t = 4
        a.advance(t * a.length)
        msg = a.collector.request(t, 10.0 * t)
        for dev in a.devices:
            ids = dev.device_ids.astype(np.int64)
            batch, _ = dev.respond(wire.decode(wire.encode(msg)), a.day, a.world.values(ids)[0], 10.0 * t - 5,
                                   a.world.present(ids))
            if batch is not None and len(batch):
                a.collector.receive(batch)
        msg = a.collector.advance(10.0 * t)
        assert msg is not None
        saved = snapshot.decode(snapshot.encode(a.collector.snapshot(), "collector"))
        assert saved["open_stage"] == OPEN_STAGE[name]
        b = Run(sc).collector
        b.restore(saved)
        assert b.open_message(msg.deadline) == msg
        same(b.snapshot(), a.collector.snapshot())
        batches = []
        for dev in a.devices:
            ids = dev.device_ids.astype(np.int64)
            batch, _ = dev.respond(wire.decode(wire.encode(msg)), a.day, a.world.values(ids)[0], 10.0 * t - 5,
                                   a.world.present(ids))
            if batch is not None and len(batch):
                batches.append(batch)
        for batch in batches:
            a.collector.receive(batch)
            b.receive(batch)
        if batches:
            with pytest.raises(ValueError, match="stage open"):
                a.collector.snapshot()
        assert a.collector.advance(10.0 * t) is None and b.advance(10.0 * t) is None
        ra, rb = a.collector.close_round(), b.close_round()
        assert repr((ra.estimate, ra.reports, ra.info)) == repr((rb.estimate, rb.reports, rb.info))
        assert a.collector.transcript_digest() == b.transcript_digest()



def test_a_threshold_broadcast_before_a_crash_keeps_its_theta() -> None:
    """ToPL's write-ahead: version 2 went out (journaled) and the collector died before round 4 closed. The
    resumed collector re-runs round 4 with fewer holdout reports (devices gone): EM would choose another theta,
    but it broadcasts the journaled one under version 2, so no device decodes with another theta."""
    sc = SCENARIOS["topl"]
    a = Run(sc)
    for t in (1, 2, 3):
        a.round(t)
    saved = snapshot.decode(snapshot.encode(a.collector.snapshot(), "collector"))
    a.round(4)
    theta2 = a.collector.thetas[2]
    b = Run(sc)
    b.collector.restore(saved)
    b.collector.pin_threshold(2, theta2)
    b.devices = b.devices[:1]  # most holdout reports are missing in the re-run
    b.advance(3)
    b.round(4)
    assert b.collector.thetas[2] == theta2
    c = Run(sc)
    c.collector.restore(saved)
    c.devices = c.devices[:1]
    c.advance(3)
    c.round(4)
    assert c.collector.thetas[2] != theta2  # without the pin the re-run would have chosen another theta


def test_device_state_round_trip_and_refusals(tmp_path: Path) -> None:
    """A device process's saved state (cohorts, answers of the round, day, ledger) restores into a fresh process of
    the same shard; another scenario, shard or connection split, or a corrupt file, is refused in one line."""
    from scenarios import live

    sc = SCENARIOS["thresh"]

    def process(sc_: schema.Scenario, index: int = 1, parts: int = 2):
        ledger, days = Ledger(sc_.devices), live.process_days(sc_)
        ids = live.shard(sc_.devices, index - 1, 2)
        clients = [live.build_client(sc_, ids[len(ids) * k // parts:len(ids) * (k + 1) // parts], ledger, "127.0.0.1",
                                     1, days) for k in range(parts)]
        return clients, ledger, days

    clients, ledger, days = process(sc)
    store = journal.open_device_store(tmp_path, sc, 1, 2, clients, ledger, days)
    from protocols.messages import CollectionRequest

    frames = clients[0].answer(CollectionRequest(1, sc.protocol.name, 7.0 * 86400))  # epoch 1: observes days 1..7
    assert len(frames) >= 2 and store.saves == 1
    fresh, ledger2, days2 = process(sc)
    store2 = journal.open_device_store(tmp_path, sc, 1, 2, fresh, ledger2, days2, require=True)
    assert not store2.done and days2.world.day == 7 and fresh[0].day == 7
    for a, b in zip(clients, fresh):
        for x, y in zip(a.cohorts, b.cohorts):
            same(x.snapshot(), y.snapshot())
    assert ledger2.digest() == ledger.digest()
    again = fresh[0].answer(CollectionRequest(1, sc.protocol.name, 7.0 * 86400))  # a new connection: re-sent
    assert again == frames and fresh[0].resent == 1
    assert ledger2.digest() == ledger.digest()  # nothing charged again
    for bad, why in ((schema.load("thresh_stable", ["population.devices=300", "rounds=28", "simulation.cohort_size=100",
                                                    "protocol.tau_scale=0.3"]), "other settings"),):
        c, led, d = process(bad)
        with pytest.raises(journal.JournalError, match=why):
            journal.open_device_store(tmp_path, bad, 1, 2, c, led, d)
    c, led, d = process(sc, parts=3)
    with pytest.raises(journal.JournalError, match="connections"):
        journal.open_device_store(tmp_path, sc, 1, 2, c, led, d)
    path = journal.device_state_path(tmp_path, 1, 2)
    path.write_bytes(path.read_bytes()[:-10])
    c, led, d = process(sc)
    with pytest.raises(journal.JournalError, match="corrupt"):
        journal.open_device_store(tmp_path, sc, 1, 2, c, led, d)
    c, led, d = process(sc)
    with pytest.raises(journal.JournalError, match="no saved device state"):
        journal.open_device_store(tmp_path / "empty", sc, 1, 2, c, led, d, require=True)


def test_reveal_set_round_trip_dense_and_hashed() -> None:
    """Memo reveals survive a snapshot in both representations (bitset; hash set for > 256 memo inputs)."""
    from protocols.memo import RevealSet

    rng = np.random.default_rng(3)
    for width in (11, 5000):
        a = RevealSet(300, width)
        for _ in range(4):
            rows = rng.choice(300, 120, replace=False)
            a.insert(rows, rng.integers(0, width, rows.size))
        b = RevealSet(300, width)
        b.restore(snapshot.decode(snapshot.encode(a.snapshot(), "reveals")))
        np.testing.assert_array_equal(b.counts(), a.counts())
        rows = np.arange(300)
        items = rng.integers(0, width, 300)
        np.testing.assert_array_equal(b.contains(rows, items), a.contains(rows, items))
        np.testing.assert_array_equal(b.insert(rows, items), a.insert(rows, items))
        with pytest.raises(snapshot.SnapshotError):
            RevealSet(299, width).restore(a.snapshot())


def test_a_resumed_collector_logs_no_behavior_change_twice(tmp_path: Path) -> None:
    """Steps in rounds 2 and 5, a collector journaled after round 3 and resumed: its world computes rounds 1-3
    again (and records the round-2 step again), but the resumed event log shows only the round-5 step; round 2's
    was logged before the crash."""
    from types import SimpleNamespace

    from collector.process import CollectorStats
    from collector.server import LiveSettings
    from scenarios import live

    group = {"name": "u", "share": 1.0, "counter": {"dist": "normal", "mean": 3600, "sd": 900},
             "behavior": ["step", "step"], "params": [{"round": 2, "add": 100.0}, {"round": 5, "add": 50.0}]}
    sc = schema.parse({"name": "steps", "seed": 3, "rounds": 8, "population": {"devices": 200, "groups": [group]},
                       "protocol": {"name": "1bitrrpm", "epsilon": 1.0, "max_value": 86400, "granularity": 3600},
                       "simulation": {"cohort_size": 100}})
    r = Run(sc)
    for t in (1, 2, 3):
        r.round(t)
    server = SimpleNamespace(protocol=r.collector, stats=CollectorStats(), frames_sent=0, downlink=[], hostility=None)
    book = SimpleNamespace(records=[], ledger=Ledger(sc.devices), epoch_length=1, world=r.world)
    journal.CollectorJournal(tmp_path, sc, server, book).write_round(3)
    second, book2, _ = live.build_server(sc, Ledger(sc.devices), None, LiveSettings())
    logged: list[tuple[str, dict]] = []
    book2.log = SimpleNamespace(info=lambda event, **kw: logged.append((event, kw)))
    assert journal.resume(journal.load(tmp_path, sc), second, book2) == 4
    book2.world.advance_to(6)
    book2.world.values(np.empty(0, np.int64))
    book2.log_fired()
    assert [e for e, _ in logged] == ["behavior_fired"] and logged[0][1]["round"] == 5
    assert [f[0] for f in book2.world.behavior_fired] == [2, 5]
