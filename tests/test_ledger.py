"""The ledger: totals, interval storage, and a digest independent of how charges were chunked."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.ledger import MEMO_REVEAL, ROUND_GUARANTEE, Charge, Ledger


def _charges(split: list[int]) -> list[Charge]:
    """The same charges for devices 0..99, cut into cohorts at ``split``."""
    out = []
    bounds = [0, *split, 100]
    for rnd in (1, 2):
        for lo, hi in zip(bounds, bounds[1:]):
            ids = np.arange(lo, hi)
            out.append(Charge(rnd, 0.05, MEMO_REVEAL, 1.0, ids[(ids % 3 == 0) | (rnd == 1)]))
            out.append(Charge(rnd, 0.05, ROUND_GUARANTEE, 0.7, ids, cumulative=False))
    return out


def _chunked_ledgers() -> list[Ledger]:
    """The same charges recorded in three cohort splits."""
    ledgers = []
    for split in ([], [1, 2, 3, 50], list(range(1, 100, 7))):
        led = Ledger(100)
        for c in _charges(split):
            led.record(c)
        ledgers.append(led)
    return ledgers


def test_digest_and_totals_do_not_depend_on_chunking() -> None:
    ledgers = _chunked_ledgers()
    assert len({led.digest() for led in ledgers}) == 1
    for led in ledgers[1:]:
        np.testing.assert_array_equal(led.spend, ledgers[0].spend)
    expected = 1.0 + (np.arange(100) % 3 == 0)
    np.testing.assert_array_equal(ledgers[0].spend, expected)
    np.testing.assert_array_equal(ledgers[0].round_epsilon, np.full(100, 0.7))


def test_digest_changes_with_any_charge() -> None:
    base = Ledger(100)
    for c in _charges([]):
        base.record(c)
    for change in (Charge(2, 0.05, MEMO_REVEAL, 1.0, np.array([1])),  # one more device charged
                   Charge(3, 0.05, MEMO_REVEAL, 1.0, np.array([0]))):  # another round
        other = Ledger(100)
        for c in _charges([]):
            other.record(c)
        other.record(change)
        assert other.digest() != base.digest()


def test_rows_digest_covers_the_cumulative_rows_only_and_does_not_depend_on_chunking() -> None:
    ledgers = _chunked_ledgers()
    assert len({led.rows_digest() for led in ledgers}) == 1
    base = ledgers[0]
    for change, rows_change in ((Charge(2, 0.05, MEMO_REVEAL, 1.0, np.array([1])), True),  # one more row
                                (Charge(2, 0.06, MEMO_REVEAL, 0.0, np.array([0])), True),  # another time
                                (Charge(2, 0.05, ROUND_GUARANTEE, 0.9, np.array([4]), cumulative=False), False)):
        other = Ledger(100)
        for c in _charges([]):
            other.record(c)
        other.record(change)
        assert (other.rows_digest() != base.rows_digest()) == rows_change
        assert other.digest() != base.digest()


@pytest.mark.parametrize("shuffle", [False, True])
def test_rows_digest_recomputes_from_the_written_ledger_file(tmp_path, shuffle) -> None:
    """The digest of the charges kept equals the one recomputed from ledger.parquet alone, with contiguous
    and listed ids, a device charged twice with the same key, and the file's rows in any order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scenarios import tables

    rng = np.random.default_rng(3)
    led = Ledger(20_000)
    for rnd in range(1, 4):
        led.record(Charge(rnd, rnd * 0.5, MEMO_REVEAL, 1.0, np.arange(0, 5_000)))
        led.record(Charge(rnd, rnd * 0.5, MEMO_REVEAL, 1.0, np.arange(5_000, 9_000)))  # touches the first
        led.record(Charge(rnd, rnd * 0.5, MEMO_REVEAL, 1.0, np.flatnonzero(rng.random(20_000) < 0.3)))  # overlaps
        led.record(Charge(rnd, rnd * 0.5, MEMO_REVEAL, 0.5, np.flatnonzero(rng.random(20_000) < 0.1)))
        led.record(Charge(rnd, rnd * 0.5, ROUND_GUARANTEE, 0.7, np.arange(20_000), cumulative=False))
    path = tmp_path / "ledger.parquet"
    tables.write_ledger(path, led.rows())
    table = pq.read_table(path)
    if shuffle:  # many short stretches of equal keys: sorted first
        table = table.take(pa.array(rng.permutation(table.num_rows)))
    assert tables.ledger_rows_digest_of_table(table) == led.rows_digest()
    assert tables.ledger_rows_digest_of_table(table.slice(1)) != led.rows_digest()


def test_rows_expand_to_one_row_per_device_and_charge() -> None:
    led = Ledger(10)
    led.record(Charge(1, 0.0, MEMO_REVEAL, 0.5, np.arange(10)))
    led.record(Charge(2, 1.0, MEMO_REVEAL, 0.5, np.array([2, 5])))
    rows = list(led.rows())
    assert [r["devices"].tolist() for r in rows] == [list(range(10)), [2, 5]]
    assert led.device_charges(5) == [(1, 0.0, MEMO_REVEAL, 0.5, True), (2, 1.0, MEMO_REVEAL, 0.5, True)]
    assert led.device_charges(4) == [(1, 0.0, MEMO_REVEAL, 0.5, True)]


@pytest.mark.parametrize("bad", [np.array([3, 2]), np.array([1, 1]), np.array([10]), np.array([-1, 0])])
def test_bad_device_sets_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        Ledger(10).record(Charge(1, 0.0, MEMO_REVEAL, 1.0, bad))


def test_negative_or_nan_amounts_are_refused() -> None:
    for amount in (-0.1, float("nan")):
        with pytest.raises(ValueError):
            Charge(1, 0.0, MEMO_REVEAL, amount, np.array([0]))


def test_spilled_transcripts_give_the_same_digest(monkeypatch) -> None:
    """With a tiny spill threshold every round record of a float-report protocol goes to the temporary
    directory; digests and per-device reads are unchanged."""
    from collector import spill
    from protocols import collecting
    from scenarios import output, runner, schema

    sc = schema.load("topl_pos", ["population.devices=3000", "rounds=6", "protocol.rethreshold_every=3",
                                  "simulation.cohort_size=1000"])
    kept = runner.run(sc)  # far below SPILL_BYTES: every record in memory
    assert not any(isinstance(r, spill.SpilledRecord) for _, r in kept.collector.protocol.reports.transcript)
    base = output.summary(kept)["digests"]
    monkeypatch.setattr(collecting, "SPILL_BYTES", 0)
    spilled = runner.run(sc)  # the runner hands the collector a spill store (collector.spill.attach)
    assert any(isinstance(r, spill.SpilledRecord) for _, r in spilled.collector.protocol.reports.transcript)
    assert output.summary(spilled)["digests"] == base
    for device in (0, 1234, 2999):
        a = spilled.collector.protocol.reports.device_reports(device)
        b = kept.collector.protocol.reports.device_reports(device)
        assert [(r, None if v is None else {k: x.tolist() for k, x in v.items()}) for r, v in a] == \
               [(r, None if v is None else {k: x.tolist() for k, x in v.items()}) for r, v in b]


def test_the_spill_store_is_passed_to_each_collector_and_goes_with_it(monkeypatch) -> None:
    """No module-level spill: a collector side keeps its records in memory unless the runtime hands its stages
    a store (collector.spill.attach, one per collector side, every stage of a multi-stage one); the store makes
    its directory at the first record and removes it when the collector side holding it goes away."""
    import gc
    import os

    from collector import spill
    from protocols import collecting
    from scenarios import schema

    monkeypatch.setattr(collecting, "SPILL_BYTES", 0)
    sc = schema.load("topl_pos", ["population.devices=100", "rounds=2"])
    alone, held = sc.protocol.make_collector(100), sc.protocol.make_collector(100)
    store = spill.attach(held)
    assert [s.spill for _, s in alone.stages()] == [None, None]
    assert [s.spill for _, s in held.stages()] == [store, store]
    for collector in (alone, held):
        collector.request(1, 1.0)
        collector.advance(2.0)
        collector.close_round()
    assert all(isinstance(r, np.ndarray) for _, s in alone.stages() for _, r in s.transcript)
    records = [r for _, s in held.stages() for _, r in s.transcript]
    assert records and all(isinstance(r, spill.SpilledRecord) for r in records)
    assert held.transcript_digest() == alone.transcript_digest()
    folder = os.path.dirname(records[0].path)
    assert os.path.isdir(folder)
    del held, collector, store, records
    gc.collect()
    assert not os.path.exists(folder)


def test_the_spend_distribution_kept_in_order_equals_numpy_quantiles_round_after_round():
    """The ledger keeps the spend as a sorted multiset across rounds that charge few devices
    (protocols.ledger._SpendOrder): every round's min, max and quantiles equal numpy's on the spend, including
    devices charged twice a round and rounds that charge everyone (where the multiset is dropped and rebuilt)."""
    from protocols.ledger import QUANTILES, Charge, Ledger

    rng = np.random.default_rng(1)
    kept = 0
    for _ in range(20):
        n = int(rng.integers(50, 3000))
        ledger, spend = Ledger(n), np.zeros(n)
        for r in range(1, 12):
            for _ in range(int(rng.integers(1, 4))):
                m = n if r in (1, 6) else int(rng.integers(0, n // 10 + 1))
                ids = np.sort(rng.choice(n, size=m, replace=False))
                amount = float(rng.choice([0.5, 0.25, 1 / 3, 0.1]))
                ledger.record(Charge(r, 0.0, "x", amount, ids))
                spend[ids] += amount
            h = ledger.close_round(r, 0.0)
            assert [h["p50"], h["p90"], h["p99"]] == np.quantile(spend, QUANTILES).tolist()
            assert (h["min"], h["max"]) == (spend.min(), spend.max())
            assert h["mean"] == spend.mean()
            kept += ledger._order.values is not None
    assert kept > 100  # the kept order was exercised, not only numpy's fallback


def test_distinct_counts_is_numpys_unique_in_one_pass():
    """protocols.ledger.distinct_counts (the spend multiset's rebuild) equals np.unique with counts, merges -0.0
    with 0.0, and gives up (None) past its limit or on a NaN."""
    from protocols.ledger import distinct_counts

    rng = np.random.default_rng(3)
    cases = [np.zeros(0), np.array([2.5]), rng.choice([0.0, 0.5, 1 / 3, 2.0], 5000),
             np.repeat(rng.random(300), rng.integers(1, 20, 300)), rng.random(1000) * 1e-300]
    for x in cases:
        got = distinct_counts(x, 1 << 16)
        assert got is not None
        values, counts = np.unique(x, return_counts=True)
        assert np.array_equal(got[0], values) and np.array_equal(got[1], counts)
    got = distinct_counts(np.array([0.0, -0.0, 1.0, -0.0]), 8)
    assert got is not None and got[0].tolist() == [0.0, 1.0] and got[1].tolist() == [3, 1]
    for limit in (41, 200):  # tables at most half full: 128 and 512 slots, many collisions and wrap-arounds
        x = rng.choice(np.arange(limit) / 7, 20 * limit)
        got = distinct_counts(x, limit)
        values, counts = np.unique(x, return_counts=True)
        assert got is not None and np.array_equal(got[0], values) and np.array_equal(got[1], counts)
        assert distinct_counts(x, limit - 1) is None
    assert distinct_counts(np.array([1.0, np.nan]), 8) is None


def test_a_round_that_charges_everyone_rebuilds_the_spend_multiset_at_its_close():
    """The multiset is dropped while a round charges more than an eighth of the devices and rebuilt at that
    round's close, so the next round's figures come from it (not from numpy's selection on the spend)."""
    from protocols.ledger import Charge, Ledger

    ledger = Ledger(1000)
    ledger.record(Charge(1, 0.0, "x", 0.5, np.arange(1000)))
    assert ledger._order.values is None
    h = ledger.close_round(1, 0.0)
    assert ledger._order.values is not None and ledger._order.values.tolist() == [0.5] and h["p50"] == 0.5


@pytest.mark.parametrize("limit", [1 << 16, 3])
def test_the_end_of_run_summary_equals_numpys_figures_on_the_spend(monkeypatch, limit):
    """Ledger.summary (summary.json's epsilon) reads the kept multiset where it is up to date, else the spend
    itself (limit 3: given up for numpy): the same max, mean, p50 and p99 as numpy's, bit for bit."""
    from protocols.ledger import Charge, Ledger, _SpendOrder

    monkeypatch.setattr(_SpendOrder, "LIMIT", limit)
    rng = np.random.default_rng(11)
    n = 3001
    ledger, spend = Ledger(n), np.zeros(n)
    for r in range(1, 9):
        m = n if r == 1 else int(rng.integers(1, n // 10))
        ids = np.sort(rng.choice(n, size=m, replace=False))
        amount = float(rng.choice([0.5, 1 / 3, 0.1]))
        ledger.record(Charge(r, 0.0, "x", amount, ids))
        spend[ids] += amount
        ledger.close_round(r, 0.0)
    assert (ledger._order.values is not None) == (limit > 3)
    p50, p99 = np.quantile(spend, (0.5, 0.99))
    selections: list[int] = []  # sizes of the arrays the ledger hands to np.quantile
    quantile = np.quantile
    with monkeypatch.context() as m:
        m.setattr(np, "quantile", lambda a, *args, **kw: (selections.append(np.size(a)), quantile(a, *args, **kw))[1])
        assert ledger.summary() == {"max": spend.max(), "mean": spend.mean(), "p50": p50, "p99": p99}
    assert (max(selections) == n) == (limit == 3)
    restored = Ledger(n)  # no kept multiset after a restore: the same figures from the spend itself
    restored.restore(ledger.snapshot())
    assert restored._order.current() is None and restored.summary() == ledger.summary()  # the kept multiset's figures: no selection over the devices
    top = np.sort(np.argsort(spend)[-40:])  # charged since the last close (the max and p99 move): not up to date
    ledger.record(Charge(9, 0.0, "x", 5.0, top))
    spend[top] += 5.0
    p50, p99 = np.quantile(spend, (0.5, 0.99))
    assert ledger.summary() == {"max": spend.max(), "mean": spend.mean(), "p50": p50, "p99": p99}


class _Deferred:
    """A job handed to ``submit`` that runs when its result is first asked for, keeping the spend it saw:
    shows when the ledger waits for the job, not only what the job returns."""

    def __init__(self, ledger, job) -> None:
        self.ledger, self.job, self.value, self.saw = ledger, job, None, None

    def result(self):
        if self.saw is None:
            self.saw = self.ledger.spend.copy()
            self.value = self.job()
        return self.value


def test_the_spend_distribution_computed_ahead_is_the_one_computed_at_close():
    """Ledger.distribution_ahead (the runtime starts it once a broadcast's charges are in, on another core):
    every round's figures equal a ledger's that never computed ahead, whether or not more charges come after
    the job started (those wait for the job, drop it, and the close computes again), and across a restore."""
    from concurrent.futures import ThreadPoolExecutor

    from protocols.ledger import Charge, Ledger

    rng = np.random.default_rng(3)
    later = 0
    with ThreadPoolExecutor(1) as pool:
        for _ in range(10):
            n = int(rng.integers(50, 2000))
            ahead, plain = Ledger(n), Ledger(n)
            pending = False
            for r in range(1, 12):
                for _ in range(int(rng.integers(1, 4))):
                    m = n if r in (1, 5) else int(rng.integers(0, n // 10 + 1))
                    charge = Charge(r, 0.0, "x", float(rng.choice([0.5, 0.25, 0.1])),
                                    np.sort(rng.choice(n, size=m, replace=False)))
                    ahead.record(charge)
                    plain.record(charge)
                    later += pending  # a charge after the job started
                    pending = rng.random() < 0.5
                    if pending:
                        ahead.distribution_ahead(pool.submit)
                if r == 8:
                    ahead.restore(ahead.snapshot())  # waits for a job still running; its order is rebuilt
                assert ahead.close_round(r, float(r)) == plain.close_round(r, float(r))
                pending = False
            assert ahead.history == plain.history
    assert later > 30


def test_a_distribution_job_still_queued_at_the_close_is_cancelled_and_computed_by_the_close():
    """When the round closes before its side thread took the distribution job (the thread busy with other side
    work), the close cancels the job and computes the figures itself instead of waiting behind that work."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from protocols.ledger import Charge, Ledger

    ahead, plain = Ledger(500), Ledger(500)
    for ledger in (ahead, plain):
        ledger.record(Charge(1, 0.0, "x", 0.5, np.arange(0, 500, 3)))
    gate = threading.Event()
    timer = threading.Timer(30.0, gate.set)  # frees the thread in the end: a close that waited would see the job run
    timer.start()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # the side thread is busy
        ahead.distribution_ahead(pool.submit)
        job = ahead._ahead
        assert ahead.close_round(1, 1.0) == plain.close_round(1, 1.0)
        assert job.cancelled()  # never ran: the close did not wait for it
        gate.set()
    timer.cancel()


def test_a_charge_after_the_distribution_started_waits_for_it_and_the_close_counts_the_charge():
    from protocols.ledger import Charge, Ledger

    ledger = Ledger(100)
    ledger.record(Charge(1, 0.0, "x", 1.0, np.arange(100)))
    jobs: list[_Deferred] = []
    ledger.distribution_ahead(lambda job: jobs.append(_Deferred(ledger, job)) or jobs[-1])
    assert jobs[0].saw is None  # nothing waited for it yet
    ledger.record(Charge(1, 0.0, "x", 2.0, np.arange(10)))
    assert jobs[0].saw is not None and jobs[0].saw.max() == 1.0  # it ran before the spend changed
    snap = ledger.close_round(1, 1.0)
    assert snap["max"] == 3.0 and snap["mean"] == 1.2  # computed again: the later charge counts
    ledger.distribution_ahead(lambda job: jobs.append(_Deferred(ledger, job)) or jobs[-1])
    assert ledger.close_round(2, 2.0)["max"] == 3.0 and jobs[1].saw is not None  # used at the close


def test_the_spend_multiset_gives_way_to_numpy_past_its_limit_and_stays_exact(monkeypatch):
    """With more distinct spend values than the multiset's limit (continuous charge amounts), the ledger drops
    the multiset for the run and its quantiles are numpy's own; before and after, they equal numpy's."""
    from protocols.ledger import QUANTILES, Charge, Ledger, _SpendOrder

    monkeypatch.setattr(_SpendOrder, "LIMIT", 40)
    rng = np.random.default_rng(7)
    n = 2000
    ledger, spend = Ledger(n), np.zeros(n)
    states = []
    for r in range(1, 30):
        ids = np.sort(rng.choice(n, size=int(rng.integers(1, n // 10)), replace=False))
        amount = float(rng.choice([0.5, 0.25])) if r < 10 else float(rng.random())  # continuous from round 10
        ledger.record(Charge(r, 0.0, "x", amount, ids))
        spend[ids] += amount
        h = ledger.close_round(r, 0.0)
        assert [h["p50"], h["p90"], h["p99"]] == np.quantile(spend, QUANTILES).tolist()
        assert (h["min"], h["max"]) == (spend.min(), spend.max())
        states.append(ledger._order.values is not None)
    assert states[3] and not states[-1] and ledger._order.too_many


def test_many_values_passing_through_one_round_rebuild_the_spend_multiset_instead_of_giving_it_up(monkeypatch):
    """Devices charged twice in a round pass through values that stand in the multiset at no close; more of
    them than the limit makes the round's tally give up, and the multiset is rebuilt from the spend (two
    values here), not abandoned for the rest of the run."""
    from protocols.ledger import Charge, Ledger, _SpendOrder

    monkeypatch.setattr(_SpendOrder, "LIMIT", 8)
    ledger = Ledger(400)
    ledger.record(Charge(1, 0.0, "x", 0.5, np.arange(400)))
    ledger.close_round(1, 1.0)
    for k in range(1, 11):  # device k: 0.5 -> 0.5 + k/16 -> 1.5, ten values in between
        ledger.record(Charge(2, 0.0, "x", k / 16, np.array([k])))
        ledger.record(Charge(2, 0.0, "x", 1 - k / 16, np.array([k])))
    h = ledger.close_round(2, 2.0)
    assert not ledger._order.too_many and ledger._order.values.tolist() == [0.5, 1.5]
    assert (h["min"], h["max"], h["p99"]) == (0.5, 1.5, float(np.quantile(ledger.spend, 0.99)))


def test_the_spend_multiset_refuses_to_lose_a_device():
    """Asked to take out a value no device holds (a charge not seen by the multiset), it raises instead of
    reporting quantiles of a population that does not exist."""
    from protocols.ledger import _SpendOrder

    order = _SpendOrder(100)
    spend = np.zeros(100)
    assert order.sorted(spend) is not None
    order.charged(spend, slice(0, 3), 3, 1.0)
    spend[:3] += 1.0
    order.old[0] = np.array([5.0, 5.0, 5.0])  # a value never held
    with pytest.raises(ValueError, match="lost track"):
        order.sorted(spend)


def test_a_charge_must_name_strictly_increasing_devices_even_when_first_and_last_span_its_size():
    """[1, 1, 3, 4] has as many ids as 1..4 but is not that range: refused, as is any repeat or disorder,
    and nothing of a refused charge is recorded."""
    from protocols.ledger import Charge, Ledger

    ledger = Ledger(10)
    for ids in ([1, 1, 3, 4], [1, 3, 2, 4], [4, 3], [2, 2]):
        with pytest.raises(ValueError, match="strictly increasing"):
            ledger.record(Charge(1, 0.0, "x", 1.0, np.array(ids)))
    with pytest.raises(ValueError, match="one-dimensional"):
        ledger.record(Charge(1, 0.0, "x", 1.0, np.array([[1, 2]])))
    assert not ledger.spend.any() and ledger.rows is not None and not list(ledger.rows())
    ledger.record(Charge(1, 0.0, "x", 0.5, np.array([1, 3, 4], dtype=np.uint64)))
    ledger.record(Charge(1, 0.0, "g", 0.7, np.array([3, 9]), cumulative=False))
    assert ledger.spend.tolist() == [0, 0.5, 0, 0.5, 0.5, 0, 0, 0, 0, 0]
    assert ledger.round_epsilon.tolist() == [0, 0, 0, 0.7, 0, 0, 0, 0, 0, 0.7]


def test_checking_a_charge_changes_nothing_and_adding_the_checked_entries_is_recording() -> None:
    """Ledger.check (run on the thread that answered a cohort) reads nothing the ledger changes and refuses what
    record refuses; adding its entries in order gives the ledger that recording the charges gives."""
    rng = np.random.default_rng(3)
    charges = []
    for r in range(1, 6):
        listed = np.flatnonzero(rng.random(500) < 0.3)
        charges += [Charge(r, 86400.0 * r, MEMO_REVEAL, 1.0, listed),
                    Charge(r, 86400.0 * r, ROUND_GUARANTEE, 0.7, np.arange(100, 400), cumulative=False),
                    Charge(r, 86400.0 * r, MEMO_REVEAL, 0.5, np.arange(0, 0))]
    recorded, added = Ledger(500), Ledger(500)
    entries = [added.check(c) for c in charges]  # all checked before any is added
    assert not added.spend.any() and not added.round_epsilon.any() and added.digest() == Ledger(500).digest()
    assert entries[2] is None  # a charge of no device adds nothing
    for c, e in zip(charges, entries):
        recorded.record(c)
        if e is not None:
            added.add(e)
    assert added.digest() == recorded.digest()
    assert np.array_equal(added.spend, recorded.spend) and np.array_equal(added.round_epsilon, recorded.round_epsilon)
    for bad in (np.array([3, 2]), np.array([1, 1, 3, 4]), np.array([0, 500]), np.array([[1, 2]])):
        with pytest.raises(ValueError):
            added.check(Charge(1, 0.0, MEMO_REVEAL, 1.0, bad))


@pytest.mark.parametrize("size", [2, 3, 1000, 4099])
def test_a_fault_anywhere_in_a_long_charge_is_found(size: int) -> None:
    """The increasing check reads a charge whole in one pass (no early exit): a repeat or a step back at the
    first pair, in the middle or at the last pair is refused for every length (vector bodies and remainders)."""
    ledger = Ledger(10_000)
    for at in sorted({1, size // 2, size - 1}):
        for fault in ("repeat", "back"):
            ids = np.arange(10, 10 + 2 * size, 2, dtype=np.int64)
            ids[at] = ids[at - 1] if fault == "repeat" else ids[at - 1] - 1
            with pytest.raises(ValueError, match="strictly increasing"):
                ledger.check(Charge(1, 0.0, MEMO_REVEAL, 1.0, ids))
            with pytest.raises(ValueError, match="strictly increasing"):
                ledger.check(Charge(1, 0.0, MEMO_REVEAL, 1.0, ids.astype(np.uint32)))
    assert ledger.check(Charge(1, 0.0, MEMO_REVEAL, 1.0, np.arange(0, 2 * size, 2))) is not None


def test_a_per_report_guarantee_charged_again_to_the_same_devices_keeps_every_device_at_its_largest() -> None:
    """The same guarantee charged to the same cohort every round is skipped once every device holds it; a larger
    one still raises them all, a listed device above it keeps its own, and a restored ledger forgets what it
    skipped (its guarantees are the snapshot's)."""
    ledger = Ledger(10)
    g = lambda amount, ids: Charge(1, 0.0, ROUND_GUARANTEE, amount, np.asarray(ids), cumulative=False)  # noqa: E731
    ledger.record(g(0.5, np.arange(0, 10)))
    ledger.record(g(0.9, [2, 7]))
    ledger.record(g(0.5, np.arange(0, 10)))
    assert ledger.round_epsilon.tolist() == [0.5, 0.5, 0.9, 0.5, 0.5, 0.5, 0.5, 0.9, 0.5, 0.5]
    ledger.record(g(0.7, np.arange(0, 10)))
    ledger.record(g(0.6, np.arange(0, 10)))
    assert ledger.round_epsilon.tolist() == [0.7, 0.7, 0.9, 0.7, 0.7, 0.7, 0.7, 0.9, 0.7, 0.7]
    ledger.record(g(0.8, np.arange(3, 6)))
    assert ledger.round_epsilon.tolist() == [0.7, 0.7, 0.9, 0.8, 0.8, 0.8, 0.7, 0.9, 0.7, 0.7]
    ledger.restore(Ledger(10).snapshot())
    ledger.record(g(0.7, np.arange(0, 10)))
    fresh = Ledger(10)
    fresh.record(g(0.7, np.arange(0, 10)))
    assert ledger.round_epsilon.tolist() == [0.7] * 10 and ledger.digest() == fresh.digest()


def test_spend_counts_are_the_distinct_spend_values_and_their_devices():
    """Ledger.spend_counts (what spend.png draws): np.unique of the spend, from the kept order right after a
    close, and from the spend itself when charges came after the close or after a restore."""
    from protocols.ledger import Charge, Ledger

    rng = np.random.default_rng(11)
    ledger = Ledger(500)
    for r in range(1, 8):
        ledger.record(Charge(r, 0.0, "x", float(rng.choice([0.5, 0.25])),
                             np.sort(rng.choice(500, size=40 if r > 1 else 500, replace=False))))
        ledger.close_round(r, 0.0)
        assert ledger._order.values is not None or r == 1
        got, want = ledger.spend_counts(), np.unique(ledger.spend, return_counts=True)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    ledger.record(Charge(9, 0.0, "x", 0.1, np.arange(7)))
    assert all(np.array_equal(a, b) for a, b in zip(ledger.spend_counts(), np.unique(ledger.spend, return_counts=True)))
    ledger.restore(ledger.snapshot())
    assert all(np.array_equal(a, b) for a, b in zip(ledger.spend_counts(), np.unique(ledger.spend, return_counts=True)))
