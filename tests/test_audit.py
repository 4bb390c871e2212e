"""``ldpsim audit`` (scenarios/audit.py): every shipped scenario audits clean, also under each hostile collector
behavior and with loss, latency, downlink loss, churn and a budget; tampering with the ledger, the transcript
or a device side's accounting is caught with the right mismatch kind; bad run directories exit 2."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from protocols import onebit, thresh
from protocols.ledger import MEMO_REVEAL, ROUND_GUARANTEE, Charge
from scenarios import audit, cli, output, runner, schema, tables

SMALL = {
    "quickstart": ["population.devices=400", "rounds=6"],
    "app_usage_31d": ["population.devices=400", "rounds=16"],
    "app_usage_3apps_31d": ["population.devices=600", "rounds=17"],
    "apps_multi": ["population.devices=300", "rounds=9"],
    "usage_histogram": ["population.devices=400", "rounds=11"],
    "thresh_stable": ["population.devices=1500", "rounds=154"],
    "thresh_drift": ["population.devices=1500", "rounds=70"],
    "topl_pos": ["population.devices=400", "rounds=30"],
    "tops_pos": ["population.devices=400", "rounds=8"],
    "weekday_usage": ["population.devices=400", "rounds=10"],
    "heavythresh_shift": ["population.devices=400", "rounds=56"],
}
HOSTILE = ("beyond_horizon", "replay", "far_future", "bad_threshold")


def make_run(path: Path, name: str, extra: list[str] | None = None) -> Path:
    sc = schema.load(name, SMALL.get(name, []) + (extra or []))
    output.write_run_dir(runner.run(sc), path, transcript="always")
    return path


def kinds(record: dict) -> set[str]:
    return set(record["mismatches"])


def test_every_shipped_scenario_is_covered() -> None:
    shipped = {p.stem for p in schema.SHIPPED.glob("*.toml")}
    assert shipped == set(SMALL)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_shipped_scenarios_audit_clean(tmp_path, name) -> None:
    run = make_run(tmp_path / name, name)
    record = audit.audit(run)
    assert record["verdict"] == "clean", record["mismatches"]
    assert record["devices"]["checked"] == record["devices"]["population"]
    assert record["reports_checked"]["transcript_rows"] > 0
    assert record["reports_checked"]["matched"] == record["reports_checked"]["transcript_rows"]
    assert record["reports_checked"]["equal"] == record["reports_checked"]["matched"]
    assert record["charges_checked"]["ledger_rows"] == record["charges_checked"]["reference_charges"] > 0
    assert record["max_spend"] <= record["guarantee"]
    on_disk = json.loads((run / "audit.json").read_text())
    assert on_disk["verdict"] == "clean" and on_disk["transcript_digest"]["recomputed"] == on_disk[
        "transcript_digest"]["summary"]
    assert on_disk["ledger_digest"]["recomputed"] == on_disk["ledger_digest"]["summary"] is not None


def _with_protocol(base: str, protocol: dict, extra: list[str]) -> schema.Scenario:
    _, data = schema.read(base)
    data = schema.apply_overrides(data, SMALL[base] + extra)
    data["protocol"] = protocol
    return schema.parse(data)


@pytest.mark.parametrize("base,protocol", [
    ("quickstart", {"name": "1bitmean", "epsilon": 0.5, "max_value": 86400, "gamma": 0.2}),
    ("quickstart", {"name": "laplace", "epsilon": 1.0, "max_value": 86400}),
    ("usage_histogram", {"name": "kflip", "epsilon": 1.0, "max_value": 24, "buckets": 24}),
    ("usage_histogram", {"name": "dbitflip", "epsilon": 1.0, "max_value": 24, "buckets": 24, "bits": 1,
                         "gamma": 0.1}),
    ("usage_histogram", {"name": "dbitflippm", "epsilon": 2.0, "max_value": 24, "buckets": 300, "bits": 3}),
    ("usage_histogram", {"name": "binflip", "epsilon": 1.0, "max_value": 24, "buckets": 6}),
    ("thresh_stable", {"name": "epochrr", "epsilon": 4.0, "epoch_length": 7}),
    ("thresh_stable", {"name": "thresh", "epsilon": 2.0, "epoch_length": 7, "a": 0.2, "b": 0.3,
                       "tau_scale": 0.05, "cap_rule": "strict"}),
])
def test_protocols_without_a_shipped_scenario_audit_clean(tmp_path, base, protocol) -> None:
    sc = _with_protocol(base, protocol, ["network.loss=0.05", "network.downlink_loss=0.1", "privacy.budget=3"])
    output.write_run_dir(runner.run(sc), tmp_path / "run", transcript="always")
    record = audit.audit(tmp_path / "run")
    assert record["protocol"] == protocol["name"]
    assert record["verdict"] == "clean", record["mismatches"]
    assert record["reports_checked"]["matched"] > 0


@pytest.mark.parametrize("name,extra", [
    ("quickstart", ["network.jitter=900", "network.loss=0.05", "network.downlink_loss=0.2", "privacy.budget=2.1"]),
    ("usage_histogram", ["network.downlink_loss=0.15", "privacy.budget=2", "population.groups.1.leaves=6",
                         "population.groups.0.joins=3"]),
    ("thresh_stable", ["network.jitter=600", "network.loss=0.05", "network.downlink_loss=0.2",
                       "privacy.budget=2", "population.groups.1.joins=20"]),
    ("topl_pos", ["network.downlink_loss=0.3", "network.jitter=900", "privacy.budget=12",
                  "protocol.rethreshold_every=7"]),
    ("tops_pos", ["privacy.budget=3.5", "network.loss=0.1"]),
    ("apps_multi", ["privacy.budget=9", "network.jitter=1200"]),
])
def test_lossy_networks_churn_and_budgets_audit_clean(tmp_path, name, extra) -> None:
    record = audit.audit(make_run(tmp_path / "run", name, extra))
    assert record["verdict"] == "clean", record["mismatches"]
    nd = record["reports_checked"]["not_delivered"]
    if any(k.startswith("network.loss") or k.startswith("network.jitter") for k in extra):
        assert nd["lost"] + nd["late"] > 0  # the network really lost or delayed reports
    if record["budget"] is not None:
        assert record["max_spend"] <= record["budget"] + 1e-9


@pytest.fixture(scope="module")
def honest_runs(tmp_path_factory):
    """The honest run of a scenario with downlink loss, made once per module."""
    base = tmp_path_factory.mktemp("honest")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_run(base / name, name, ["network.downlink_loss=0.1"])
        return made[name]

    return get


@pytest.mark.parametrize("behavior", HOSTILE)
@pytest.mark.parametrize("name", ["quickstart", "thresh_stable", "topl_pos", "usage_histogram"])
def test_hostile_collectors_audit_clean(tmp_path, honest_runs, name, behavior) -> None:
    honest = honest_runs(name)
    run = make_run(tmp_path / behavior, name, [f'collector.behavior="{behavior}"', "network.downlink_loss=0.1"])
    lines = lambda p: len((p / "downlink.jsonl").read_text().splitlines())  # noqa: E731
    assert lines(run) > lines(honest)  # the hostile broadcasts are there
    record = audit.audit(run)
    assert record["verdict"] == "clean", record["mismatches"]
    digest = lambda p: json.loads((p / "summary.json").read_text())["digests"]["ledger"]  # noqa: E731
    # the devices ignored everything extra (a reused threshold version is refused even by a device that missed
    # it, since a version is only valid in its own threshold round): the same charges as under an honest one
    assert digest(run) == digest(honest)


def test_always_update_collector_audits_clean(tmp_path) -> None:
    run = make_run(tmp_path / "au", "thresh_stable", ['collector.behavior="always_update"', "privacy.budget=2.5"])
    record = audit.audit(run)
    assert record["verdict"] == "clean", record["mismatches"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"] == 22


# ------------------------------------------------------------------------------------------- tampering
@pytest.fixture(scope="module")
def clean_runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("clean")
    return {name: make_run(base / name, name) for name in ("quickstart", "thresh_stable", "topl_pos")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "audit.json").unlink(missing_ok=True)
    return dst


def _rewrite(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path)


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _retype(path: Path, column: str, to: pa.DataType) -> None:
    """The table with ``column`` cast to another type (e.g. numbers as strings), its metadata kept."""
    table = pq.read_table(path)
    at = table.schema.get_field_index(column)
    cast = table[column].cast(pa.string()) if pa.types.is_dictionary(table[column].type) else table[column]
    _rewrite(path, table.set_column(at, pa.field(column, to), cast.cast(to)))


def _drop_column(path: Path, column: str) -> None:
    table = pq.read_table(path)
    _rewrite(path, table.drop_columns([column]).replace_schema_metadata(table.schema.metadata))


def _null_at(path: Path, column: str, row: int) -> None:
    """The table with one value of ``column`` missing (null), its metadata kept."""
    table = pq.read_table(path)
    values = table[column].to_pylist()
    values[row] = None
    at = table.schema.get_field_index(column)
    _rewrite(path, table.set_column(at, pa.field(column, table.schema.field(column).type),
                                    pa.array(values, table.schema.field(column).type)))


META = f'"format": "{tables.FORMAT}", "protocol": "1bitrrpm"'  # the start of a transcript's metadata


def _listify(path: Path, column: str) -> None:
    """``column`` as one-element lists (its metadata still says width 1)."""
    table = pq.read_table(path)
    values = pa.array([[v] for v in table[column].to_pylist()], pa.list_(pa.int64()))
    at = table.schema.get_field_index(column)
    _rewrite(path, table.set_column(at, column, values).replace_schema_metadata(table.schema.metadata))


def _widened_meta(run: Path, column: str, width: int) -> str:
    meta = tables.transcript_meta(pq.read_table(run / "transcript.parquet"))
    for stage in meta["stages"]:
        for c in stage["columns"]:
            if c["name"] == column:
                c["width"] = width
    return json.dumps(meta)


def _transcript_meta(run: Path, text: str) -> None:
    table = pq.read_table(run / "transcript.parquet")
    _rewrite(run / "transcript.parquet", table.replace_schema_metadata({b"ldpsim.transcript": text.encode()}))


def test_tampered_ledger_amount(tmp_path, clean_runs) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    table = pq.read_table(run / "ledger.parquet")
    amount = table["amount"].to_numpy().copy()
    amount[7] += 0.25
    _rewrite(run / "ledger.parquet", table.set_column(table.column_names.index("amount"), "amount", pa.array(amount)))
    record = audit.audit(run)
    assert record["verdict"] == "failed"
    # the device now spends more than summary.json's max spend says any device spent (and the mean moved)
    assert kinds(record) == {"charge_amount", "spend_total", "summary_claim", "ledger_digest"}
    assert {ex["key"] for ex in record["mismatches"]["summary_claim"]["examples"]} == {
        "privacy.max_spend", "epsilon.max", "epsilon.mean", "privacy.within_pattern_spend.max"}
    ex = record["mismatches"]["charge_amount"]["examples"][0]
    assert ex["device"] == int(table["device"][7].as_py()) and ex["ledger"] == pytest.approx(ex["reference"] + 0.25)


def test_tampered_ledger_rows(tmp_path, clean_runs) -> None:
    """A charge removed and one added to another device."""
    run = _copy(clean_runs["thresh_stable"], tmp_path / "run")
    table = pq.read_table(run / "ledger.parquet")
    extra = table.slice(0, 1).set_column(0, "device", pa.array([int(table["device"][0].as_py()) + 1], pa.int64()))
    _rewrite(run / "ledger.parquet", pa.concat_tables([table.slice(1), extra.cast(table.schema)]))
    record = audit.audit(run, write=False)
    assert {"charge_missing", "charge_unexpected"} <= kinds(record)


def test_a_ledger_row_retimed_fails_and_reordered_rows_pass(tmp_path, clean_runs) -> None:
    """A charge's time is read by no replay check; the rows digest catches it. The digest is canonical:
    the same rows in another order (as another cohort split writes them) audit clean."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    table = pq.read_table(run / "ledger.parquet")
    when = table["time"].to_numpy().copy()
    when[5] += 1.0
    _rewrite(run / "ledger.parquet", table.set_column(table.column_names.index("time"), "time", pa.array(when)))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"ledger_digest"}
    assert record["mismatches"]["ledger_digest"]["examples"][0]["summary"] == record["ledger_digest"]["summary"]

    order = np.random.default_rng(1).permutation(table.num_rows)
    _rewrite(run / "ledger.parquet", table.take(pa.array(order)))
    record = audit.audit(run, write=False)
    assert record["verdict"] == "clean", record["mismatches"]

    summary = json.loads((run / "summary.json").read_text())
    del summary["digests"]["ledger_rows"]
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"ledger_digest"}
    assert "no digests.ledger_rows" in record["mismatches"]["ledger_digest"]["examples"][0]["problem"]


def test_tampered_transcript_bit(tmp_path, clean_runs) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    table = pq.read_table(run / "transcript.parquet")
    bits = table["bit"].to_numpy().copy()
    bits[11] ^= 1
    _rewrite(run / "transcript.parquet", table.set_column(table.column_names.index("bit"), "bit",
                                                          pa.array(bits, pa.uint8())))
    record = audit.audit(run)
    assert kinds(record) == {"report_value", "transcript_digest"}
    assert record["mismatches"]["report_value"]["count"] == 1
    checked = record["reports_checked"]  # the changed row is paired with its reference report, but not equal to it
    assert checked["equal"] == checked["matched"] - 1
    ex = record["mismatches"]["report_value"]["examples"][0]
    assert (ex["device"], ex["round"]) == (table["device"][11].as_py(), table["round"][11].as_py())
    assert ex["transcript"] != ex["reference"]
    code = cli.main(["audit", str(run)])
    assert code == 1


def test_tampered_transcript_float_and_rows(tmp_path, clean_runs) -> None:
    """ToPL: one HM value nudged by 1e-6 (beyond the 1e-9 tolerance), one row removed, one duplicated."""
    run = _copy(clean_runs["topl_pos"], tmp_path / "run")
    table = pq.read_table(run / "transcript.parquet")
    stage = np.asarray(table["stage"].cast(pa.string()).to_pylist())
    j = int(np.flatnonzero(stage == "report")[3])
    y = table["y"].to_numpy(zero_copy_only=False).copy()
    y[j] += 1e-6
    table = table.set_column(table.column_names.index("y"), "y", pa.array(y, pa.float64()))
    k = int(np.flatnonzero(stage == "holdout")[0])
    table = pa.concat_tables([table.slice(0, k), table.slice(k + 1), table.slice(j, 1)])
    _rewrite(run / "transcript.parquet", table)
    record = audit.audit(run, write=False)
    assert {"report_value", "missing_report", "duplicate_report", "transcript_digest"} <= kinds(record)


def test_device_side_undercharging_memo_reveals_is_caught(tmp_path, monkeypatch) -> None:
    """A 1bitrrpm device side that books eps/2 per memo reveal: the ledger no longer matches the reference."""
    def half_price(guard, params, round_, now, rows, new):
        if new is None:
            return original(guard, params, round_, now, rows, new)
        charges = [guard.charge(round_, now, MEMO_REVEAL, params.epsilon / 2, rows[new])]
        if params.gamma > 0:
            charges.append(Charge(round_, now, ROUND_GUARANTEE, params.round_epsilon, guard.device_ids[rows],
                                  cumulative=False))
        return charges

    original = onebit.report_charges
    monkeypatch.setattr(onebit, "report_charges", half_price)
    run = make_run(tmp_path / "run", "quickstart")
    record = audit.audit(run)
    assert kinds(record) == {"charge_amount"}
    ex = record["mismatches"]["charge_amount"]["examples"][0]
    assert ex["reason"] == MEMO_REVEAL and ex["ledger"] == pytest.approx(ex["reference"] / 2)
    assert record["mismatches"]["charge_amount"]["count"] == record["charges_checked"]["ledger_rows"]


def test_thresh_without_the_vote_cap_is_caught(tmp_path, monkeypatch) -> None:
    """A THRESH device side that never adds a to c_V: devices go on voting yes past the cap, so their vote
    bits and vote reserves disagree with the reference's (the collector, forced to update, makes every
    change count)."""
    original = thresh.ThreshDevices._vote

    def no_cap(self, t, rows, now):
        before = self.cV.copy()
        out = original(self, t, rows, now)
        self.cV = before  # the cap increment removed
        return out

    monkeypatch.setattr(thresh.ThreshDevices, "_vote", no_cap)
    # low thresholds: many yes votes, so caps close within the run (and tau_L < 1: a forced first yes)
    run = make_run(tmp_path / "run", "thresh_stable", ['collector.behavior="always_update"', "protocol.tau_scale=0.02"])
    record = audit.audit(run)
    assert record["verdict"] == "failed"
    assert "report_value" in kinds(record)
    assert {ex["stage"] for ex in record["mismatches"]["report_value"]["examples"]} == {"vote"}
    # the forced first yes no longer counted: the reserve is 2a K_V instead of 2a (K_V - 1), past the guarantee
    assert {"charge_amount", "over_guarantee"} <= kinds(record)


# ------------------------------------------------------------------------------------------- devices, shards
def test_device_sample(tmp_path, clean_runs) -> None:
    record = audit.audit(clean_runs["quickstart"], devices=37, write=False)
    assert record["devices"]["checked"] == 37 and record["verdict"] == "clean"
    assert record["devices"]["chosen"] == "keyed sample of 37"
    ids, how = audit.choose_devices(250_000, 5, None)
    assert ids.size == audit.DEFAULT_DEVICES and np.all(np.diff(ids) > 0) and how.startswith("keyed sample")
    again, _ = audit.choose_devices(250_000, 5, None)
    assert np.array_equal(ids, again)
    assert audit.choose_devices(10, 5, "all")[0].size == 10 and audit.choose_devices(10, 5, 50)[1] == "all"


@pytest.mark.parametrize("key, value", [("guarantee", 3.0), ("guarantee", 1000.0), ("max_spend", 0.1),
                                        ("guarantee", float("inf")), ("max_spend", float("-inf")),
                                        ("within_guarantee", False), ("round_epsilon", 9.0), ("budget", 100.0)])
def test_forged_privacy_claims_in_summary_json_fail(tmp_path, clean_runs, key, value) -> None:
    """summary.json's privacy figures are recomputed (guarantee, budget, per-report epsilon from scenario.json;
    max spend and the verdicts from the ledger), not believed: a lowered or raised guarantee, a smaller max
    spend, a verdict turned around or a budget the scenario does not set is a summary_claim mismatch."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"][key] = value
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim"}
    (ex,) = record["mismatches"]["summary_claim"]["examples"]
    assert ex["key"] == f"privacy.{key}" and ex["summary"] in (value, str(value))  # audit.json: "inf", strict JSON


@pytest.mark.parametrize("name,extra", [
    ("quickstart", ['collector.behavior="bad_threshold"', "privacy.budget=1.5", "network.downlink_loss=0.2"]),
    ("topl_pos", ['collector.behavior="replay"', "privacy.budget=6", "network.downlink_loss=0.3"]),
    ("thresh_stable", ['collector.behavior="far_future"', "privacy.budget=1.2"]),
])
def test_refusals_and_ignored_messages_are_recounted(tmp_path, name, extra) -> None:
    """privacy.refusals and privacy.ignored_messages are recounted by the reference devices when every device
    is replayed: the run's figures (both non-zero: a budget below the guarantee, a hostile collector) audit
    clean, a figure one off is a summary_claim naming it, and a sampled audit records its sample's counts as
    not checked. The messages the devices cannot decode (bad_threshold's theta = -1) are not ignored ones."""
    run = make_run(tmp_path / "run", name, extra)
    summary = json.loads((run / "summary.json").read_text())
    record = audit.audit(run, write=False)
    assert record["verdict"] == "clean", record["mismatches"]
    for key in ("refusals", "ignored_messages"):
        assert record["counters"][key] == {"summary": summary["privacy"][key], "reference": summary["privacy"][key],
                                           "checked": True}
        assert summary["privacy"][key] > 0
    for key in ("refusals", "ignored_messages"):
        forged = _copy(run, tmp_path / key)
        edited = json.loads((forged / "summary.json").read_text())
        edited["privacy"][key] -= 1
        (forged / "summary.json").write_text(json.dumps(edited))
        record = audit.audit(forged, write=False)
        assert kinds(record) == {"summary_claim"}
        (ex,) = record["mismatches"]["summary_claim"]["examples"]
        assert ex == {"key": f"privacy.{key}", "summary": summary["privacy"][key] - 1,
                      "recomputed": summary["privacy"][key]}
        sampled = audit.audit(forged, devices=25, write=False)
        assert sampled["verdict"] == "clean" and sampled["counters"][key]["checked"] is False


def test_bounds_hold_over_the_whole_ledger_when_the_audit_replays_a_sample(tmp_path, clean_runs) -> None:
    """A sampled audit replays some devices, but checks every device's ledger total against the guarantee and
    spend.parquet: a device outside the sample charged past the guarantee still fails the audit, and the max
    spend reported is the whole ledger's."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    sample, _ = audit.choose_devices(json.loads((run / "scenario.json").read_text())["population"]["devices"],
                                     json.loads((run / "summary.json").read_text())["seed"], 5)
    table = pq.read_table(run / "ledger.parquet")
    device = table["device"].to_numpy()
    outside = next(int(d) for d in device if d not in set(sample.tolist()))
    amount = table["amount"].to_numpy().copy()
    amount[device == outside] = 50.0
    _rewrite(run / "ledger.parquet", table.set_column(table.column_names.index("amount"), "amount", pa.array(amount)))
    record = audit.audit(run, devices=5, write=False)
    assert record["devices"]["checked"] == 5 and outside not in sample
    assert {"over_guarantee", "spend_total", "summary_claim"} <= kinds(record)
    assert record["mismatches"]["over_guarantee"]["examples"][0]["device"] == outside
    assert record["max_spend"] == pytest.approx(50.0 * np.count_nonzero(device == outside))


def test_device_shard_ledgers(tmp_path, clean_runs) -> None:
    """--ledger: the ledgers of device shards replace the run's; a shard left out leaves charges missing."""
    run = _copy(clean_runs["thresh_stable"], tmp_path / "run")
    table = pq.read_table(run / "ledger.parquet")
    odd = pa.compute.equal(pa.compute.bit_wise_and(table["device"], 1), 1)
    paths = [tmp_path / "shard-1.parquet", tmp_path / "shard-2.parquet"]
    pq.write_table(table.filter(odd), paths[0])
    pq.write_table(table.filter(pa.compute.invert(odd)), paths[1])
    (run / "ledger.parquet").unlink()
    assert cli.main(["audit", str(run)]) == 1  # summary.json says the run wrote it: the directory was changed
    record = audit.audit(run, ledgers=paths, write=False)
    assert record["verdict"] == "clean" and record["charges_checked"]["source"] == "2 device shard ledger(s)"
    record = audit.audit(run, ledgers=paths[:1], write=False)
    assert kinds(record) == {"charge_missing"}


@pytest.mark.parametrize("name,extra", [
    ("quickstart", ["network.downlink_loss=0.3", 'collector.behavior="replay"']),
    ("thresh_drift", ['collector.behavior="always_update"']),
])
def test_live_runs_audit_clean(tmp_path, name, extra) -> None:
    """The live runtime over loopback TCP: no simulated loss or downlink loss (the scenario's are not applied
    there), so the audit replays every broadcast to every device and recomputes no network fate."""
    from collector.server import LiveSettings
    from scenarios import live

    sc = schema.load(name, SMALL[name] + extra)
    run = tmp_path / "live"
    run.mkdir()
    with open(run / "events.jsonl", "w", encoding="utf-8") as events:
        result = asyncio.run(live.run_embedded(sc, connections=2, events=events, settings=LiveSettings(
            stage_timeout=2.0, read_timeout=0.3, startup_timeout=10.0)))
    output.write_run_dir(result, run, transcript="always")
    record = audit.audit(run)
    assert record["runtime"] == "live"
    assert record["verdict"] == "clean", record["mismatches"]
    assert record["reports_checked"]["matched"] == record["reports_checked"]["reference_reports"] > 0


def _drop_rows_keep_digest(run: Path, drop: int) -> None:
    """Remove ``drop`` transcript rows of one round and put the digest of what is left in summary.json (the
    recomputation the README offers anyone), so that the transcript digest alone cannot tell."""
    table = pq.read_table(run / "transcript.parquet")
    rows = np.flatnonzero(table["round"].to_numpy() == 3)[:drop]
    kept = table.filter(pa.array(~np.isin(np.arange(table.num_rows), rows)))
    _rewrite(run / "transcript.parquet", kept.replace_schema_metadata(table.schema.metadata))
    summary = json.loads((run / "summary.json").read_text())
    summary["digests"]["transcript"] = tables.transcript_digest_of_table(kept)
    (run / "summary.json").write_text(json.dumps(summary))


def test_reports_deleted_from_a_live_transcript_fail(tmp_path) -> None:
    """A live run's missing reports are unverified, not lost: rows deleted from its transcript (digest
    recomputed) would pass as such, but the collector's count of accepted reports no longer matches."""
    run = tmp_path / "live"
    assert cli.main(["live", "quickstart", *(f"--set={kv}" for kv in SMALL["quickstart"]), "--out", str(run),
                     "--quiet"]) == 0
    assert audit.audit(run, write=False)["verdict"] == "clean"
    _drop_rows_keep_digest(run, 40)
    record = audit.audit(run, write=False)
    assert record["reports_checked"]["not_delivered"]["unverified"] == 40
    assert kinds(record) == {"summary_claim"}
    assert record["mismatches"]["summary_claim"]["examples"][0]["key"] == "reports.accepted"


def test_a_live_claim_needs_an_event_log_that_says_so_throughout(tmp_path, clean_runs, capsys) -> None:
    """A run that says it is live without an events.jsonl cannot be audited (exit 2, naming the file); an
    event log tagged live on its first line only is "mixed", not live."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    (run / "events.jsonl").unlink(missing_ok=True)
    _edit_json(run / "summary.json", runtime="live")
    assert cli.main(["audit", str(run)]) == 2
    assert "events.jsonl: missing or unreadable; a live run's event log" in capsys.readouterr().err
    (run / "events.jsonl").write_text('{"event": "run_start", "runtime": "live"}\n{"event": "round_closed"}\n')
    record = audit.audit(run, write=False)
    assert {"key": "runtime", "summary": "live", "recomputed": "mixed"} in \
        record["mismatches"]["summary_claim"]["examples"]


def test_a_boolean_does_not_stand_in_for_a_number_or_a_number_for_a_verdict(tmp_path, clean_runs) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"]["within_guarantee"] = 1  # was true
    summary["privacy"]["round_epsilon"] = True  # was 1.0
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert {ex["key"] for ex in record["mismatches"]["summary_claim"]["examples"]} == {
        "privacy.within_guarantee", "privacy.round_epsilon"}


def test_a_simulated_run_relabelled_live_fails(tmp_path, clean_runs) -> None:
    """Relabelling a simulated run as live (where a missing report is unverifiable) to hide deleted reports:
    the event log says which runtime wrote the run."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    (run / "events.jsonl").write_text('{"event": "run_start"}\n{"event": "round_closed"}\n')  # a simulated run's
    _drop_rows_keep_digest(run, 40)
    summary = json.loads((run / "summary.json").read_text())
    summary["runtime"] = "live"
    summary["reports"]["accepted"] -= 40
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim"}
    (ex,) = record["mismatches"]["summary_claim"]["examples"]
    assert ex == {"key": "runtime", "summary": "live", "recomputed": "simulated"}


# ------------------------------------------------------------------------------- found by an attacker
def test_a_summary_that_says_its_ledger_is_elsewhere_still_has_its_spend_checked(tmp_path, clean_runs) -> None:
    """privacy.ledger = "device shards" in summary.json turned off every spend claim and spend.parquet: a run
    claiming, in summary.json and spend.parquet alike, a max spend of 0.5 against the ledger's 3 audited
    clean. The audit now checks them whenever it read this directory's ledger.parquet."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    summary["privacy"].update(ledger="device shards", max_spend=0.5, within_guarantee=True)
    summary["epsilon"]["max"] = 0.5
    (run / "summary.json").write_text(json.dumps(summary))
    table = pq.read_table(run / "spend.parquet")
    _rewrite(run / "spend.parquet", table.set_column(2, "spend", pa.compute.min_element_wise(table["spend"], 0.5)))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim", "spend_total"}
    keys = {ex["key"] for ex in record["mismatches"]["summary_claim"]["examples"]}
    assert {"privacy.ledger", "privacy.max_spend"} <= keys


def test_every_published_privacy_figure_is_recomputed(tmp_path, clean_runs) -> None:
    """The worst-case loss (the number memoized protocols' users are sent to), the within-pattern max, the
    horizon, the guarantee's derivation, round_epsilon_max and the spend's mean and p99 were never checked:
    each forged one is now a summary_claim naming it."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    p = summary["privacy"]
    assert p["worst_case_loss"]["value"] > 1.0  # 1BitRRPM: memoized, so it has one
    p["worst_case_loss"]["value"] = 1.0
    p["within_pattern_spend"]["max"] = 0.1
    p["horizon"] = 2
    p["derivation"] = "trust me"
    summary["round_epsilon_max"] = 0.01
    summary["epsilon"]["p99"] = 0.5
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim"}
    assert record["mismatches"]["summary_claim"]["count"] == 6


@pytest.mark.parametrize("edit, key", [
    (lambda s: s["parameters"].update(epsilon=0.5), "parameters.epsilon"),  # found by a new user: it passed
    (lambda s: s["parameters"].update(granularity=60.0), "parameters.granularity"),
    (lambda s: s["parameters"].update(sneaky=1), "parameters.sneaky"),
    (lambda s: s.update(devices=5), "devices"),
    (lambda s: s.update(rounds=2), "rounds"),
    (lambda s: s.update(scenario="another"), "scenario"),
    (lambda s: s.update(unit="hours"), "unit"),
    (lambda s: s.update(errors_of="of each bucket's frequency"), "errors_of"),
])
def test_what_summary_json_says_of_the_scenario_is_checked(tmp_path, clean_runs, edit, key) -> None:
    """summary.json's parameters and identity against scenario.json: an edited one is a summary_claim."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    summary = json.loads((run / "summary.json").read_text())
    edit(summary)
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, devices=50, sample_seed=1)
    assert record["verdict"] == "failed"
    assert [e["key"] for e in record["mismatches"]["summary_claim"]["examples"]] == [key]


def test_audit_json_lists_what_the_audit_does_not_check(tmp_path, clean_runs) -> None:
    """The utility figures (errors, messages, timings) and the convenience files are not checked: audit.json
    says which, so that "clean" is not read as covering them; a sample leaves the devices' counters unchecked."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    whole = audit.audit(run, devices="all")["not_checked"]
    assert {"error", "messages", "wall_seconds", "digests.estimates", "reports.lost"} <= set(whole["summary"])
    assert not {"parameters", "privacy", "epsilon", "devices", "digests.transcript"} & set(whole["summary"])
    assert {"estimates.csv", "spend_over_time.csv"} <= set(whole["files"])
    assert not {"ledger.parquet", "transcript.parquet", "summary.json"} & set(whole["files"])
    sample = audit.audit(run, devices=20, sample_seed=3)["not_checked"]
    assert set(sample["summary"]) - set(whole["summary"]) == {"privacy.refusals", "privacy.ignored_messages"}


def test_forged_eps_delta_figures_fail(tmp_path) -> None:
    """(eps, delta) of a fresh-report protocol (1BitMean): recomputed by the same accountant, not believed."""
    sc = _with_protocol("quickstart", {"name": "1bitmean", "epsilon": 1.0, "max_value": 86400}, [])
    output.write_run_dir(runner.run(sc), tmp_path / "run", transcript="always")
    run = tmp_path / "run"
    assert audit.audit(run, write=False)["verdict"] == "clean"
    summary = json.loads((run / "summary.json").read_text())
    entry = summary["privacy"]["eps_delta"]
    assert entry["applies"], entry  # dp-accounting is a test dependency
    entry["seconds"] = 123.0  # how long the accountant took: not a claim
    for row in entry["deltas"].values():
        row["epsilon"] = 0.5
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim"}
    assert {ex["key"] for ex in record["mismatches"]["summary_claim"]["examples"]} == {
        f"privacy.eps_delta.deltas.{d}.epsilon" for d in entry["deltas"]}


def test_the_audit_sample_is_the_auditors_not_the_runs(tmp_path, clean_runs, capsys) -> None:
    """The sample was keyed by the run's own seed, so whoever wrote the directory knew which devices would be
    replayed. Now a fresh random seed keys it (recorded in audit.json), or --sample-seed to repeat one."""
    run = clean_runs["quickstart"]
    a = audit.audit(run, devices=37, write=False)
    b = audit.audit(run, devices=37, write=False)
    assert a["verdict"] == b["verdict"] == "clean"
    assert a["devices"]["sample_seed"] != b["devices"]["sample_seed"]
    same = audit.audit(run, devices=37, write=False, sample_seed=a["devices"]["sample_seed"])
    assert same["devices"] == a["devices"]
    ids, _ = audit.choose_devices(400, a["devices"]["sample_seed"], 37)
    assert not np.array_equal(ids, audit.choose_devices(400, json.loads((run / "summary.json").read_text())["seed"],
                                                        37)[0])
    assert audit.audit(run, write=False)["devices"]["sample_seed"] is None  # every device: no sample
    out = tmp_path / "cli"
    shutil.copytree(run, out)
    assert cli.main(["audit", str(out), "--devices", "37", "--sample-seed", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["devices"]["sample_seed"] == 12
    assert cli.main(["audit", str(out), "--sample-seed", "-1"]) == 2
    assert "--sample-seed -1: must be in [0, 2^63)" in capsys.readouterr().err


def test_a_report_or_charge_of_a_round_never_broadcast_fails(tmp_path, clean_runs) -> None:
    """A transcript row moved from device 11 to device 10 at round 3 + 2^32 (a key that collides with round 3
    of the next device), its digest recomputed, audited clean. Rows and charges of every device, sampled or
    not, must belong to a round the collector broadcast."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    t = pq.read_table(run / "transcript.parquet")
    dev, rnd = t["device"].to_numpy().copy(), t["round"].to_numpy().copy()
    j = int(np.flatnonzero((dev == 11) & (rnd == 3))[0])
    dev[j], rnd[j] = 10, 3 + 2**32
    t = t.set_column(t.schema.get_field_index("device"), "device", pa.array(dev)).set_column(
        t.schema.get_field_index("round"), "round", pa.array(rnd)).replace_schema_metadata(t.schema.metadata)
    _rewrite(run / "transcript.parquet", t)
    summary = json.loads((run / "summary.json").read_text())
    summary["digests"]["transcript"] = tables.transcript_digest_of_table(t)
    (run / "summary.json").write_text(json.dumps(summary))
    led = pq.read_table(run / "ledger.parquet")
    r = led["round"].to_numpy().copy()
    r[0] = 99
    _rewrite(run / "ledger.parquet", led.set_column(led.schema.get_field_index("round"), "round", pa.array(r)))
    record = audit.audit(run, devices=5, write=False, sample_seed=1)
    assert {"report_round", "charge_round"} <= kinds(record)
    ex = record["mismatches"]["report_round"]["examples"][0]
    assert (ex["device"], ex["round"]) == (10, 3 + 2**32)
    assert record["mismatches"]["charge_round"]["examples"][0]["round"] == 99


@pytest.mark.parametrize("damage", ["duplicate", "stranger", "round_epsilon", "group", "missing"])
def test_spend_parquet_is_checked_whole(tmp_path, clean_runs, damage) -> None:
    """Each passed: a second row for a device (a reader taking the last finds 0), a row for a device outside
    the population, per-report epsilons lowered, a device's group changed, the file deleted."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    path = run / "spend.parquet"
    t = pq.read_table(path)
    if damage == "missing":
        path.unlink()
    elif damage in ("duplicate", "stranger"):
        row = t.slice(10, 1)
        extra = row.set_column(2, "spend", pa.array([0.0])) if damage == "duplicate" else \
            row.set_column(0, "device", pa.array([123456], pa.int64())).set_column(2, "spend", pa.array([999.0]))
        parts = [t.slice(0, 11), extra, t.slice(11)] if damage == "duplicate" else [t, extra]
        _rewrite(path, pa.concat_tables(parts))
    elif damage == "round_epsilon":
        _rewrite(path, t.set_column(3, "round_epsilon", pa.array(np.full(t.num_rows, 0.001))))
    else:
        groups = t["group"].cast(pa.string()).to_pylist()
        groups[0] = next(g for g in set(groups) if g != groups[0])
        _rewrite(path, t.set_column(1, "group", pa.array(groups)))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"spend_table"}, record["mismatches"]


def test_a_live_run_must_say_how_many_reports_it_accepted(tmp_path) -> None:
    """Deleting reports.accepted from a live run's summary.json, with rows deleted and the digest recomputed,
    passed as unverified: a live run without the count now fails."""
    run = tmp_path / "live"
    assert cli.main(["live", "quickstart", *(f"--set={kv}" for kv in SMALL["quickstart"]), "--out", str(run),
                     "--quiet"]) == 0
    _drop_rows_keep_digest(run, 40)
    summary = json.loads((run / "summary.json").read_text())
    del summary["reports"]["accepted"]
    (run / "summary.json").write_text(json.dumps(summary))
    record = audit.audit(run, write=False)
    assert kinds(record) == {"summary_claim"}
    (ex,) = record["mismatches"]["summary_claim"]["examples"]
    assert ex["key"] == "reports.accepted" and ex["summary"] is None


# ------------------------------------------------------------------------------------------- the command
def test_cli_json_and_exit_codes(tmp_path, clean_runs, capsys) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    assert cli.main(["audit", str(run), "--json", "--devices", "all"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "clean" and out["devices"]["chosen"] == "all"
    assert cli.main(["audit", str(run), "--devices", "zero"]) == 2
    assert "--devices" in capsys.readouterr().err
    assert cli.main(["audit", str(run), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("audit clean:") and err == ""  # the one line, no progress bar


@pytest.mark.parametrize("damage,needle", [
    (lambda r: (r / "summary.json").unlink(), "summary.json: missing"),
    (lambda r: (r / "scenario.json").write_text("{"), "scenario.json: not valid JSON"),
    (lambda r: (r / "downlink.jsonl").unlink(), "downlink.jsonl: missing"),
    (lambda r: (r / "downlink.jsonl").write_text('{"time": 0, "type": "collect"}\n'), "downlink.jsonl:1: malformed"),
    (lambda r: (r / "transcript.parquet").write_bytes(b"not parquet"), "transcript.parquet: not a readable"),
    (lambda r: (r / "scenario.json").write_text(json.dumps({"name": "x"})), "scenario.json: rounds: required"),
    (lambda r: (r / "summary.json").write_text(json.dumps({"protocol": "1bitrrpm"})), "no privacy.guarantee"),
    # found by a hostile-input pass: each was a traceback
    (lambda r: (r / "downlink.jsonl").write_bytes(b"\xff\xfe" + (r / "downlink.jsonl").read_bytes()),
     "downlink.jsonl: not UTF-8 text"),
    (lambda r: _edit_json(r / "summary.json", digests=5), "no digests.transcript"),
    (lambda r: _retype(r / "transcript.parquet", "round", pa.string()), "column 'round' must hold integers"),
    (lambda r: _retype(r / "ledger.parquet", "amount", pa.string()), "column 'amount' must hold numbers"),
    (lambda r: _retype(r / "ledger.parquet", "device", pa.string()), "column 'device' must hold integers"),
    (lambda r: _retype(r / "spend.parquet", "spend", pa.string()), "column 'spend' must hold numbers"),
    (lambda r: _retype(r / "ledger.parquet", "time", pa.string()), "column 'time' must hold numbers"),
    (lambda r: _null_at(r / "ledger.parquet", "reason", 3), "column 'reason' has 1 missing (null) value(s)"),
    (lambda r: _null_at(r / "ledger.parquet", "device", 0), "column 'device' has 1 missing (null) value(s)"),
    (lambda r: _null_at(r / "transcript.parquet", "round", 9), "column 'round' has 1 missing (null) value(s)"),
    (lambda r: _drop_column(r / "transcript.parquet", "bit"), "no column 'bit' (its metadata lists it)"),
    # found by an attacker: a traceback each (audit._close, tables._column_values)
    (lambda r: _listify(r / "transcript.parquet", "bit"), "column 'bit' must hold one number a row"),
    (lambda r: _transcript_meta(r, _widened_meta(r, "bit", 2)), "column 'bit' must hold lists of 2 numbers"),
    (lambda r: _transcript_meta(r, "[1, 2]"), "metadata must be a JSON object"),
    (lambda r: _transcript_meta(r, f'{{{META}, "stages": []}}'), "devices must be"),
    (lambda r: _transcript_meta(r, f'{{{META}, "devices": 5, "stages": [{{"name": "x"}}]}}'),
     "stage 'x' needs a name and columns"),
])
def test_bad_run_directories_exit_2(tmp_path, clean_runs, capsys, damage, needle) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    damage(run)
    assert cli.main(["audit", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert not (run / "audit.json").exists()


@pytest.mark.parametrize("name", ["ledger.parquet", "transcript.parquet"])
def test_a_table_the_run_wrote_that_is_gone_fails_the_audit(tmp_path, clean_runs, capsys, name) -> None:
    """A table summary.json says the run wrote, deleted: the audit fails (exit 1: the directory was changed),
    naming the rows it had. It said "missing (the run was written with --no-ledger-rows)" and exit 2, as if
    the run had not written it."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    rows = json.loads((run / "summary.json").read_text())["files"][name]["rows"]
    (run / name).unlink()
    assert cli.main(["audit", str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"ldpsim: error: {run / name}: missing, although summary.json says the run wrote it ({rows:,} "
                   "rows): the run directory was changed after the run"), err


def test_a_table_the_run_did_not_write_cannot_be_audited(tmp_path, capsys) -> None:
    """Without its ledger rows (--no-ledger-rows), as summary.json says: the audit cannot run (exit 2), and
    says why."""
    run = tmp_path / "run"
    assert cli.main(["run", "quickstart", "--set", "population.devices=300", "--set", "rounds=2", "--quiet",
                     "--no-ledger-rows", "--transcript", "always", "--out", str(run)]) == 0
    capsys.readouterr()
    assert cli.main(["audit", str(run)]) == 2
    assert "ledger.parquet: missing (the run was written with --no-ledger-rows)" in capsys.readouterr().err


def test_a_run_directory_naming_code_is_not_loaded_without_allow_code(tmp_path, clean_runs, capsys) -> None:
    """A scenario.json that names a module to import (a behavior "module:name") would run that code when
    loaded: the audit refuses it (one line, exit 2) and nothing runs; with --allow-code it loads it (here the
    class is no behavior, which the loader refuses before constructing it: the marker file never appears)."""
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    marker = tmp_path / "pwned"
    raw = json.loads((run / "scenario.json").read_text())
    raw["population"]["groups"][0].update(behavior="subprocess:Popen", params={"args": ["touch", str(marker)]})
    (run / "scenario.json").write_text(json.dumps(raw))
    assert cli.main(["audit", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names code to import (population.groups[0].behavior = 'subprocess:Popen')" in err[0]
    assert cli.main(["audit", str(run), "--allow-code"]) == 2
    assert "is a class whose instances are not callable" in capsys.readouterr().err
    assert not marker.exists()


def test_not_a_directory(tmp_path, capsys) -> None:
    assert cli.main(["audit", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_audit_json_is_replaced_atomically(tmp_path, clean_runs) -> None:
    run = _copy(clean_runs["quickstart"], tmp_path / "run")
    (run / "audit.json").write_text("stale")
    audit.audit(run, devices=10)
    assert json.loads((run / "audit.json").read_text())["devices"]["checked"] == 10
    assert not [p for p in run.iterdir() if p.name.startswith(".audit")]


def test_reference_models_are_independent() -> None:
    """The reference models import nothing from the device sides but keys, messages and parameters."""
    import ast
    import inspect

    from protocols import reference

    tree = ast.parse(inspect.getsource(reference))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "math", "functools", "typing", "protocols.keyed", "protocols.messages"}
