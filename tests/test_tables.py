"""Run-directory tables: transcript.parquet, ledger.parquet and spend.parquet are complete, readable by pyarrow,
pandas and polars, and an auditor recomputes summary.json's transcript digest from transcript.parquet alone,
for every protocol, with network loss and with ToPL's downlink loss."""

from __future__ import annotations

import csv
import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from protocols import collecting
from protocols.ledger import Charge
from scenarios import output, runner, schema, tables
from scenarios.cli import main

SMALL = ["population.devices=2000", "simulation.cohort_size=700"]

# (shipped scenario, overrides, protocol table replacing the shipped one or None)
VARIANTS = {
    "1bitrrpm": ("quickstart", ["rounds=6"], None),
    "1bitrrpm-loss": ("quickstart", ["rounds=6", "network.loss=0.3", "network.jitter=2", "network.deadline=3"], None),
    "1bitmean": ("quickstart", ["rounds=6"],
                 {"name": "1bitmean", "epsilon": 1.0, "max_value": 86400, "gamma": 0.1}),
    "laplace": ("quickstart", ["rounds=4"], {"name": "laplace", "epsilon": 1.0, "max_value": 86400}),
    "dbitflippm": ("usage_histogram", ["rounds=4"], None),
    "dbitflip": ("usage_histogram", ["rounds=4"],
                 {"name": "dbitflip", "epsilon": 1.0, "max_value": 24, "buckets": 24, "bits": 3, "gamma": 0.1}),
    "binflip": ("usage_histogram", ["rounds=3"], {"name": "binflip", "epsilon": 1.0, "max_value": 24, "buckets": 6}),
    "kflip": ("usage_histogram", ["rounds=3"], {"name": "kflip", "epsilon": 1.0, "max_value": 24, "buckets": 300}),
    "1bitmulti": ("apps_multi", ["rounds=3"], None),
    "thresh": ("thresh_stable", ["rounds=70"], None),
    "epochrr": ("thresh_stable", ["rounds=28"], {"name": "epochrr", "epsilon": 1.0, "epoch_length": 7}),
    "topl-downlink-loss": ("topl_pos", ["rounds=8", "protocol.rethreshold_every=3", "network.downlink_loss=0.3",
                                        "network.loss=0.05"], None),
    "tops": ("tops_pos", ["rounds=5"], None),
}
STAGES = {"thresh": ["vote", "estimate"], "topl-downlink-loss": ["holdout", "report"]}


def _scenario(variant: str) -> schema.Scenario:
    name, sets, protocol = VARIANTS[variant]
    sc = schema.load(name, [*SMALL, *sets])
    return sc if protocol is None else schema.parse({**sc.raw, "protocol": protocol})


_RUNS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    def get(variant: str):
        if variant not in _RUNS:
            out = tmp_path_factory.mktemp(variant)
            result = runner.run(_scenario(variant))
            _RUNS[variant] = (result, out, output.write_run_dir(result, out))
        return _RUNS[variant]

    yield get
    _RUNS.clear()


def reference_digest(collector) -> str:
    """The digest definition of protocols/transcript.py written out plainly, one round and device at a time."""
    stages = collector.stages()
    n = stages[0][1].n_devices
    h = hashlib.sha256(b"ldpsim-transcript/2\n" + f"devices={n}\n".encode())
    for name, stage in stages:
        by_round: dict[int, list[tuple[int, dict]]] = {}
        for device in range(stage.n_devices):
            for rnd, values in stage.device_reports(device):
                if values is not None:
                    by_round.setdefault(rnd, []).append((device, values))
        bits = {c.name for c in stage.columns if np.dtype(c.dtype) == np.uint8 and c.high == 1}
        cols = ",".join(f"{c.name}:{np.dtype(c.dtype).name}:{c.width}" + (":bits" if c.name in bits else "")
                        for c in stage.columns)
        total = sum(len(v) for v in by_round.values())
        h.update(f"stage={name};rows={total};columns={cols}\n".encode())
        for rnd in sorted(by_round):
            rows = by_round[rnd]  # already in device order
            h.update(f"round={rnd};rows={len(rows)}\n".encode())
            present = [0] * n
            for device, _ in rows:
                present[device] = 1
            h.update(np.packbits(np.array(present, dtype=np.uint8)).tobytes())
            for c in stage.columns:
                item = np.dtype(c.dtype).itemsize
                for p in range(c.width):
                    chunks = [bytes(v[c.name][p * item:(p + 1) * item]) if v[c.name].dtype == np.uint8
                              else v[c.name][p:p + 1].tobytes() for _, v in rows]
                    if c.name in bits:
                        h.update(np.packbits(np.frombuffer(b"".join(chunks), np.uint8)).tobytes())
                    else:
                        h.update(b"".join(chunks))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------- transcript
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transcript_digest_recomputed_from_the_table(variant, run_dirs):
    result, out, summary = run_dirs(variant)
    table = tables.read_transcript(out)
    digest = summary["digests"]["transcript"]
    assert digest == result.transcript_digest == result.collector.protocol.transcript_digest()
    assert tables.transcript_digest_of_table(table) == digest
    assert reference_digest(result.collector.protocol) == digest
    shuffled = table.take(np.random.default_rng(0).permutation(table.num_rows))  # row order is not part of it
    assert tables.transcript_digest_of_table(shuffled) == digest
    # the table's rows are the delivered reports, sorted by (stage order, round, device)
    assert table.num_rows == summary["reports"]["accepted"] == summary["files"]["transcript.parquet"]["rows"]
    meta = tables.transcript_meta(table)
    stages = [s["name"] for s in meta["stages"]]
    assert stages == STAGES.get(variant, ["report"])
    assert meta["protocol"] == summary["protocol"] and meta["devices"] == summary["devices"]
    key = np.array([stages.index(s) for s in table["stage"].to_pylist()], np.int64)
    rnd, dev = table["round"].to_numpy(), table["device"].to_numpy()
    order = np.lexsort((dev, rnd, key))
    np.testing.assert_array_equal(order, np.arange(table.num_rows))
    assert not np.any((np.diff(key) == 0) & (np.diff(rnd) == 0) & (np.diff(dev) <= 0))  # one report a round
    # each report column is null exactly outside its own stage, and typed as the protocol declares
    for s in meta["stages"]:
        mine = key == stages.index(s["name"])
        for c in s["columns"]:
            col = table[c["name"]]
            assert col.is_null().to_numpy(zero_copy_only=False).tolist() == (~mine).tolist()
            typ = col.type.value_type if c["width"] > 1 else col.type
            assert typ == pa.from_numpy_dtype(np.dtype(c["dtype"]))
            assert (c["width"] > 1) == pa.types.is_fixed_size_list(col.type)
    if variant == "1bitrrpm-loss":
        assert summary["reports"]["lost"] > 0 and summary["messages"]["late"] > 0
    if variant == "topl-downlink-loss":  # devices that missed a broadcast report with the version they hold
        rep = table.filter(pc.equal(table["stage"].cast(pa.string()), "report"))
        assert len(set(rep["v"].to_pylist())) > 1


@pytest.mark.parametrize("variant", ["1bitrrpm-loss", "dbitflip", "thresh", "topl-downlink-loss"])
def test_device_rows_are_the_collectors_reports(variant, run_dirs):
    result, out, _ = run_dirs(variant)
    table = tables.read_transcript(out)
    names = [name for name, _ in result.collector.protocol.stages()]
    sample = [0, 1, 777, 1999]
    both = tables.device_rows(table, sample)
    filtered = tables.read_transcript(out, filters=[("device", "in", sample)])
    assert both.equals(filtered)
    for device in sample:
        rows = tables.device_rows(table, device).to_pylist()
        want = []
        for name, stage in result.collector.protocol.stages():
            for rnd, values in stage.device_reports(device):
                if values is not None:
                    want.append((name, rnd, {k: v.tolist() if v.size > 1 else v.item() for k, v in values.items()}))
        want.sort(key=lambda w: (names.index(w[0]), w[1]))
        got = [(r["stage"], r["round"], {c: r[c] for c in w[2]}) for r, w in zip(rows, want)]
        assert len(rows) == len(want) and got == want


def test_pandas_and_polars_read_every_table(run_dirs):
    pd = pytest.importorskip("pandas")
    for variant in ("dbitflip", "topl-downlink-loss"):
        result, out, summary = run_dirs(variant)
        for name in ("transcript.parquet", "ledger.parquet", "spend.parquet"):
            frame = pd.read_parquet(out / name)
            assert len(frame) == summary["files"][name]["rows"] > 0
        spend = pd.read_parquet(out / "spend.parquet")
        np.testing.assert_array_equal(spend["spend"].to_numpy(), result.ledger.spend)
        ledger = pd.read_parquet(out / "ledger.parquet")
        assert list(ledger.columns) == ["device", "round", "time", "reason", "amount"]
        try:
            import polars as pl
        except ImportError:
            continue
        for name in ("transcript.parquet", "ledger.parquet", "spend.parquet"):
            assert pl.read_parquet(out / name).height == summary["files"][name]["rows"]
        tr = pl.read_parquet(out / "transcript.parquet")
        assert tr.columns[:3] == ["stage", "round", "device"]


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("variant", ["1bitrrpm", "topl-downlink-loss"])
def test_ledger_and_spend_tables_equal_the_csvs(variant, run_dirs):
    result, out, summary = run_dirs(variant)
    ledger = tables.read_ledger(out)
    assert ledger.schema.names == ["device", "round", "time", "reason", "amount"]
    assert pa.types.is_dictionary(ledger["reason"].type)
    rows = _csv(out / "ledger.csv")
    assert ledger.num_rows == len(rows) == summary["files"]["ledger.parquet"]["rows"]
    assert ledger["device"].to_pylist() == [int(r["device"]) for r in rows]
    assert ledger["round"].to_pylist() == [int(r["round"]) for r in rows]
    assert ledger["time"].to_pylist() == [float(r["time"]) for r in rows]
    assert ledger["amount"].to_pylist() == [float(r["amount"]) for r in rows]
    assert ledger["reason"].cast(pa.string()).to_pylist() == [r["reason"] for r in rows]
    total = defaultdict(float)
    for d, a in zip(ledger["device"].to_pylist(), ledger["amount"].to_pylist()):
        total[d] += a
    assert all(total.get(d, 0.0) == s for d, s in enumerate(result.ledger.spend))
    spend = tables.read_spend(out)
    srows = _csv(out / "spend.csv")
    assert spend["device"].to_pylist() == [int(r["device"]) for r in srows] == list(range(2000))
    assert spend["group"].cast(pa.string()).to_pylist() == [r["group"] for r in srows]
    assert spend["spend"].to_pylist() == [float(r["spend"]) for r in srows]
    assert spend["round_epsilon"].to_pylist() == [float(r["round_epsilon"]) for r in srows]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left behind


# --------------------------------------------------------------------------------- bounded-memory paths
def test_spilled_packed_and_blockwise_paths_give_the_same_table_and_digest(monkeypatch, tmp_path):
    """Spilled records (ToPL floats), bit-packed records (1BitRRPM), tiny digest blocks and tiny row groups
    (many blocks per round, blocks not starting at device 0) change neither the digest nor the table."""
    from collector import spill

    for variant in ("topl-downlink-loss", "1bitrrpm-loss"):
        sc = _scenario(variant)
        kept = runner.run(sc)
        base = tables.read_transcript(_write(kept, tmp_path / f"{variant}-kept"))
        monkeypatch.setattr(collecting, "SPILL_BYTES", 0)
        monkeypatch.setattr(tables, "ROW_GROUP", 296)  # a multiple of 8, far below the population
        spilled = runner.run(sc)
        if variant.startswith("topl"):
            assert any(isinstance(r, spill.SpilledRecord) for _, r in spilled.collector.protocol.reports.transcript)
        else:
            assert spilled.collector.protocol._bits_only
        assert spilled.collector.protocol.transcript_digest() == kept.transcript_digest
        table = tables.read_transcript(_write(spilled, tmp_path / f"{variant}-spilled"))
        assert table.equals(base)
        assert tables.transcript_digest_of_table(table) == kept.transcript_digest
        monkeypatch.undo()


def _write(result, out: Path) -> Path:
    output.write_run_dir(result, out)
    return out


class _Bits(collecting.ReportCollector):
    name = "bits"
    columns = (collecting.Column("bit", np.uint8, high=1),)

    def estimate(self, reports):
        return 0.0


def test_digest_streams_with_bounded_memory():
    """300,000 devices x 31 rounds of one bit, 10% missing each round: the digest holds one round's record at
    a time (all rows at once as (device, round, bit) would be 158 MB)."""
    import tracemalloc

    from protocols.messages import ReportBatch

    n, rounds = 300_000, 31
    col = _Bits(n)
    rng = np.random.default_rng(1)
    ids = np.arange(n, dtype=np.uint32)
    for r in range(1, rounds + 1):
        col.request(r, 0.0)
        keep = ids[rng.random(n) < 0.9]
        col.receive(ReportBatch(r, "bits", keep, {"bit": (rng.random(keep.size) < 0.5).astype(np.uint8)}))
        col.close_round()
    tracemalloc.start()
    digest = col.transcript_digest()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < (16 << 20), peak
    assert digest == tables.transcript_digest_of_table(_table_of(col))


def test_digest_inputs_prepared_ahead_are_used_only_for_the_records_they_were_computed_from():
    """transcript.prepare_ahead (a runtime calls it after each round, on another core): the digest equals the
    one computed at the end; the prepared inputs are what the digest hashes (poisoned ones change it), and a
    record replaced since is computed again rather than taken from a stale job, as is every record after a
    restore."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from protocols import transcript as canonical
    from protocols.messages import ReportBatch

    n = 1003  # not a multiple of 8
    ids = np.arange(n, dtype=np.uint32)

    def filled(submit=None) -> _Bits:
        col = _Bits(n)
        rng = np.random.default_rng(5)
        for r in range(1, 8):
            col.request(r, 0.0)
            keep = ids if r == 3 else ids[rng.random(n) < 0.8]  # round 3: everyone answers
            col.receive(ReportBatch(r, "bits", keep, {"bit": (rng.random(keep.size) < 0.5).astype(np.uint8)}))
            col.close_round()
            if submit is not None:
                canonical.prepare_ahead(col.stages(), submit)
        return col

    plain = filled().transcript_digest()
    with ThreadPoolExecutor(1) as pool:
        ahead = filled(pool.submit)
        assert sorted(ahead.digest_ahead) == list(range(7))  # every record prepared, once
        assert ahead.transcript_digest() == plain

    def poisoned(job):  # the job's inputs with the report bits flipped: not what the record holds
        done: Future = Future()
        presence, packed = job()
        done.set_result((presence, {k: [np.bitwise_not(np.asarray(p)) for p in v] for k, v in packed.items()}))
        return done

    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(1) as pool:  # a budget of three records' bytes
        mp.setattr(canonical, "AHEAD_BYTES", 3 * ((n + 7) // 8) * 2)
        ahead = filled(pool.submit)
        assert sorted(ahead.digest_ahead) == [0, 1, 2] and ahead.transcript_digest() == plain
    spoiled = filled(poisoned)
    assert spoiled.transcript_digest() != plain  # the prepared inputs are the ones hashed
    spoiled.transcript = [(r, record.copy()) for r, record in spoiled.transcript]  # other records: not used
    assert spoiled.transcript_digest() == plain
    spoiled = filled(poisoned)
    spoiled.restore(spoiled.snapshot())  # a restore forgets what was prepared
    assert spoiled.digest_ahead == {} and spoiled.transcript_digest() == plain


def _table_of(col) -> pa.Table:
    """The transcript table of a bare collector, through the writer (a temporary file)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tables.write_transcript(Path(d) / "t.parquet", col, col.name)
        return tables.read_transcript(Path(d) / "t.parquet")


# ---------------------------------------------------------------------------------------- run directory
def test_run_files_and_policies(monkeypatch, tmp_path):
    sc = _scenario("1bitrrpm")
    result = runner.run(sc)
    s = output.write_run_dir(result, tmp_path / "a")
    for name in ("transcript.parquet", "ledger.parquet", "spend.parquet", "ledger.csv", "spend.csv"):
        assert (tmp_path / "a" / name).is_file() and s["files"][name]["written"], name
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["files"] == s["files"]
    # above the CSV limit only the Parquet tables; above the transcript limit (auto) no transcript
    monkeypatch.setattr(output, "CSV_DEVICE_LIMIT", 1999)
    monkeypatch.setattr(output, "TRANSCRIPT_AUTO_LIMIT", sc.devices * sc.rounds - 1)
    s = output.write_run_dir(result, tmp_path / "a")
    for name in ("transcript.parquet", "ledger.csv", "spend.csv"):
        assert not (tmp_path / "a" / name).exists() and not s["files"][name]["written"], name
        assert s["files"][name]["why"]
    for name in ("ledger.parquet", "spend.parquet"):
        assert (tmp_path / "a" / name).is_file() and s["files"][name]["written"], name
    s = output.write_run_dir(result, tmp_path / "b", ledger_rows=False, transcript="always")
    assert (tmp_path / "b" / "transcript.parquet").is_file() and s["files"]["transcript.parquet"]["written"]
    assert not (tmp_path / "b" / "ledger.parquet").exists() and s["files"]["ledger.parquet"]["why"] == "--no-ledger-rows"
    s = output.write_run_dir(result, tmp_path / "b", transcript="never")
    assert not (tmp_path / "b" / "transcript.parquet").exists() and not s["files"]["transcript.parquet"]["written"]


def test_cli_transcript_option(tmp_path, capsys):
    base = ["run", "quickstart", "--quiet", "--set", "population.devices=500", "--set", "rounds=3"]
    assert main([*base, "--out", str(tmp_path / "n"), "--transcript", "never", "--no-ledger-rows"]) == 0
    assert main([*base, "--out", str(tmp_path / "y")]) == 0
    capsys.readouterr()
    assert not (tmp_path / "n" / "transcript.parquet").exists() and not (tmp_path / "n" / "ledger.parquet").exists()
    s = json.loads((tmp_path / "y" / "summary.json").read_text())
    assert tables.transcript_digest_of_table(tables.read_transcript(tmp_path / "y")) == s["digests"]["transcript"]
    assert json.loads((tmp_path / "n" / "summary.json").read_text())["digests"] == s["digests"]


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "t.parquet"
    with pytest.raises(RuntimeError):
        with tables.atomic_path(target) as tmp:
            tmp.write_bytes(b"partial")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    with tables.atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [target]


# ------------------------------------------------------------------ the run directory's writer (issue 13)
def _ledger_one_batch_per_chunk(path: Path, chunks: list[dict]) -> int:
    """The ledger writer as it was: one record batch per chunk, its dictionary the reasons seen so far."""
    reasons: list[str] = []

    def batches():
        for ch in chunks:
            k = ch["devices"].size
            if not k:
                continue
            if ch["reason"] not in reasons:
                reasons.append(ch["reason"])
            reason = pa.DictionaryArray.from_arrays(pa.array(np.full(k, reasons.index(ch["reason"]), np.int32)),
                                                    pa.array(reasons, pa.string()))
            yield pa.RecordBatch.from_arrays(
                [pa.array(ch["devices"].astype(np.int64)), pa.array(np.full(k, ch["round"], np.int64)),
                 pa.array(np.full(k, ch["time"], np.float64)), reason,
                 pa.array(np.full(k, ch["amount"], np.float64))], schema=tables.LEDGER_SCHEMA)

    return tables._write_batches(path, tables.LEDGER_SCHEMA, batches(), ["round", "time", "reason", "amount"],
                                 tables.LEDGER_STATISTICS)


def test_ledger_batches_merged_per_row_group_give_the_same_file(monkeypatch, tmp_path):
    """write_ledger builds one batch per row group (and per growth of the reasons' dictionary), not one per
    chunk: the file is byte for byte the one-batch-per-chunk file, row groups and dictionaries included."""
    import pyarrow.parquet as pq

    monkeypatch.setattr(tables, "ROW_GROUP", 100)
    rng = np.random.default_rng(3)
    chunks = []
    for i in range(60):
        k = int(rng.integers(0, 70)) if i % 7 else 0
        reason = "report" if i % 5 else ["report", "vote", "estimate"][min(i // 20, 2)]
        chunks.append({"round": i // 4 + 1, "time": i * 0.5, "reason": reason, "amount": 0.25 * (i % 3 + 1),
                       "devices": np.sort(rng.choice(1000, k, replace=False))})
    n = tables.write_ledger(tmp_path / "new.parquet", iter(chunks))
    assert n == _ledger_one_batch_per_chunk(tmp_path / "old.parquet", chunks) == sum(c["devices"].size for c in chunks)
    assert (tmp_path / "new.parquet").read_bytes() == (tmp_path / "old.parquet").read_bytes()
    meta = pq.ParquetFile(tmp_path / "new.parquet").metadata
    assert meta.num_row_groups > 3 and sum(meta.row_group(i).num_rows for i in range(meta.num_row_groups)) == n
    table = tables.read_ledger(tmp_path / "new.parquet")
    assert table["reason"].to_pylist() == [c["reason"] for c in chunks for _ in range(c["devices"].size)]


_TINY: list[runner.RunResult] = []


def _tiny_result() -> runner.RunResult:
    """A 300-device, 3-round quickstart run without the attack metrics, made once."""
    if not _TINY:
        _TINY.append(runner.run(schema.load("quickstart", ["population.devices=300", "rounds=3",
                                                           "analysis.attacks=false"])))
    return _TINY[0]


def test_write_seconds_in_the_summary(tmp_path):
    result = _tiny_result()
    s = output.write_run_dir(result, tmp_path / "a", transcript="always")
    ws = s["write_seconds"]
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["write_seconds"] == ws
    assert list(s)[-3:] == ["attacks", "files", "write_seconds"]
    written = {name for name, f in s["files"].items() if f["written"]}
    others = {"estimates.csv", "estimates.png", "spend.png", "scenario.json", "downlink.jsonl"}
    assert written | others == set(ws["files"])
    assert set(ws["computed"]) == {"summary", "attacks"}
    for v in [ws["total"], *ws["files"].values(), *ws["computed"].values()]:
        assert isinstance(v, float) and 0 <= v < 60
    assert ws["total"] >= max(ws["files"].values())


@pytest.mark.parametrize("where", ["background", "spend table", "foreground"])
def test_a_failing_write_reaches_the_caller_and_leaves_no_summary(where, monkeypatch, tmp_path):
    """A table written in the background threads that fails raises in write_run_dir (the ledger's in a thread of
    its own, or the spend table beside it, which then waits for the ledger's); a plot that fails waits for the
    background threads first. Either way no summary.json and no temporary file is left."""
    result = _tiny_result()

    class NoPlots:  # the plots are not what is tested here: empty files, at once
        def __getattr__(self, _name):
            return lambda path, *_args: Path(path).write_bytes(b"")

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(output, "_plots", NoPlots)
    monkeypatch.setattr(*{"background": (tables, "write_ledger", broken),
                          "spend table": (tables, "write_spend", broken),
                          "foreground": (output, "draw_spend", broken)}[where])
    with pytest.raises(OSError, match="disk full"):
        output.write_run_dir(result, tmp_path / "a")
    names = [p.name for p in (tmp_path / "a").iterdir()]
    assert "summary.json" not in names and not [n for n in names if ".tmp-" in n], names
    if where == "foreground":  # the background thread finished its tables before the error went up
        assert {"spend.parquet", "ledger.parquet"} <= set(names)
    if where == "spend table":  # the ledger's thread finished its table before the error went up
        assert "ledger.parquet" in names and "spend.parquet" not in names


def test_the_spend_picture_gets_the_final_spend_as_distinct_values_and_device_counts(monkeypatch, tmp_path):
    """draw_spend hands the plot the devices' final spend as (distinct values to 9 digits, devices holding
    each), which is np.unique of the rounded spend, whether the ledger's kept order is up to date or not."""
    result = _tiny_result()
    seen: list = []

    class Capture:
        def __getattr__(self, _name):
            return lambda path, *args: seen.append(args)

    monkeypatch.setattr(output, "_plots", Capture)
    want = np.unique(np.round(result.ledger.spend, 9), return_counts=True)
    output.draw_spend(result, tmp_path / "spend.png")
    result.ledger.record(Charge(99, 0.0, "x", 1 / 3, np.arange(3)))  # the kept order is now out of date
    after = np.unique(np.round(result.ledger.spend, 9), return_counts=True)
    output.draw_spend(result, tmp_path / "spend.png")
    for (_history, (values, counts), *_rest), (v, c) in zip(seen, (want, after)):
        assert np.array_equal(values, v) and np.array_equal(counts, c) and counts.sum() == result.scenario.devices
