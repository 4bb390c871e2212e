"""Results do not depend on how devices are split into cohorts, and one device replays alone.

docs/design.md sections 2-3: with keyed randomness and per-device network fates, cohort size 1 (one SimPy
process per device), 7 and 10,000 must give bit-identical transcripts, ledgers and estimates.
"""

from __future__ import annotations

import numpy as np
import pytest

from agents.world import World
from protocols.messages import CollectionRequest
from protocols.onebit import OneBitDevices
from scenarios import output, runner, schema
from tests.support import PROTOCOL_TABLES, protocol_scenario


@pytest.mark.parametrize("name", sorted(PROTOCOL_TABLES))
def test_every_protocol_runs_end_to_end_and_is_cohort_invariant(name: str) -> None:
    """Each protocol through the full simulation without loss: every report is accepted, every round has
    an estimate, and cohort sizes 1 and 7 give the same digests."""
    digests = []
    for size in (1, 7):
        sc = protocol_scenario("1bitmean", **{"simulation.cohort_size": size, "network.loss": 0, "network.jitter": 0})
        sc = schema.parse({**sc.raw, "protocol": PROTOCOL_TABLES[name]})
        s = output.summary(runner.run(sc))
        assert s["reports"]["accepted"] == sc.devices * sc.rounds
        assert s["messages"]["rejected"] == 0 and s["error"]["rounds_without_estimate"] == 0
        digests.append(s["digests"])
    assert digests[0] == digests[1]


@pytest.mark.parametrize("protocol", ["1bitrrpm", "1bitmean"])
def test_digests_identical_for_cohort_sizes_1_7_10000(protocol: str) -> None:
    summaries = {}
    for size in (1, 7, 10_000):
        result = runner.run(protocol_scenario(protocol, **{"simulation.cohort_size": size}))
        summaries[size] = output.summary(result)
    digests = {size: s["digests"] for size, s in summaries.items()}
    assert digests[1] == digests[7] == digests[10_000]
    s = summaries[1]
    # the case exercises loss and lateness, and the reports that were neither landed
    assert s["reports"]["lost"] > 0 and s["messages"]["late"] > 0
    assert s["reports"]["accepted"] < s["devices"] * s["rounds"]
    assert all(summaries[k]["reports"] == s["reports"] for k in summaries)
    # a different seed changes the transcript and estimates (the digests are not constants); the ledger
    # changes for memoization (which grid values a device reveals is random) but not for naive repetition,
    # whose charges (eps' per round, every device) are data- and seed-independent
    other = output.summary(runner.run(protocol_scenario(protocol, seed=8)))["digests"]
    assert other["transcript"] != s["digests"]["transcript"]
    assert other["estimates"] != s["digests"]["estimates"]
    assert (other["ledger"] != s["digests"]["ledger"]) == (protocol == "1bitrrpm")


def test_one_device_replays_alone_and_matches_transcript_and_ledger() -> None:
    """An auditor replays single devices from (seed, device id, its values): every report that reached the
    collector equals the replayed one, and the replayed charges equal the ledger's."""
    sc = protocol_scenario("1bitrrpm")
    result = runner.run(sc)
    transcript = dict(result.collector.protocol.received("bit"))
    for device in (0, 1, 599, 600, 1199):
        world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
        solo = OneBitDevices(sc.protocol, sc.seed, np.array([device]))
        charges = []
        for r in range(1, sc.rounds + 1):
            world.advance_to(r)
            values, _ = world.values(np.array([device]))
            now = (r - 1) * sc.simulation.round_seconds + sc.network.latency
            batch, ch = solo.respond(CollectionRequest(r, sc.protocol.name, 0.0), r, values, now)
            charges += [(c.round, c.time, c.reason, c.amount, c.cumulative) for c in ch if c.devices.size]
            seen = transcript[r][device]
            assert seen == -1 or seen == batch.columns["bit"][0]
        assert charges == result.ledger.device_charges(device)
        assert result.ledger.spend[device] == pytest.approx(sum(c[3] for c in charges if c[4]))


@pytest.mark.parametrize("name", ["1bitrrpm", "dbitflippm-d1", "kflip"])
def test_churn_is_cohort_invariant_and_absent_devices_are_never_charged(name: str) -> None:
    """Group b is present from round 3 to round 5: its devices report and are charged only then, for any
    cohort split."""
    summaries = []
    for size in (1, 7):
        sc = protocol_scenario("1bitrrpm", **{"simulation.cohort_size": size, "network.loss": 0, "network.jitter": 0})
        raw = sc.raw
        raw["population"]["groups"][1].update(joins=3, leaves=6)
        if name != "1bitrrpm":
            raw = {**raw, "protocol": PROTOCOL_TABLES[name]}
        sc = schema.parse(raw)
        result = runner.run(sc)
        summaries.append(output.summary(result))
        b0 = int(result.world.bounds[1])
        rounds = sorted({c[0] for c in result.ledger.device_charges(b0)} | {c[0] for c in result.ledger.device_charges(sc.devices - 1)})
        assert set(rounds) <= {3, 4, 5} and rounds
        assert [r.reports for r in result.rounds] == [720, 720, 1200, 1200, 1200, 720]
    assert summaries[0]["digests"] == summaries[1]["digests"]


def test_network_fates_are_the_keyed_loss_and_exponential_delay_of_each_report():
    """collector.network's one-pass kernel gives exactly the per-report fates of the formula: kept when the keyed
    loss draw u >= loss, delay latency - jitter log(1 - u') from a second keyed draw, on time when before the
    deadline; and each sub-batch lands with its slowest report. The same for ids as the wire carries them
    (uint32, which the kernel widens one by one) and as int64."""
    from collector.network import Network, NetworkParams
    from protocols import keyed
    from protocols.keyed import Purpose, stream_key

    p = NetworkParams(latency=0.05, jitter=2.0, loss=0.1, deadline=5.0)
    net = Network(None, p, 7)  # type: ignore[arg-type]  (fates need no SimPy environment)
    ids = np.arange(0, 300_000, 3, dtype=np.uint64)
    for r in range(1, 4):
        fate = net.fate(ids, r, 4.0)
        keep = keyed.uniform(stream_key(7, Purpose.LOSS, r), ids) >= p.loss
        delay = p.latency - p.jitter * np.log1p(-keyed.uniform(stream_key(7, Purpose.LATENCY, r), ids))
        on, late = keep & (delay < 4.0), keep & (delay >= 4.0)
        assert np.array_equal(fate.on_time, np.flatnonzero(on)) and np.array_equal(fate.late, np.flatnonzero(late))
        assert (fate.on_time_delay, fate.late_delay) == (delay[on].max(), delay[late].max())
        assert fate.lost == np.count_nonzero(~keep) > 0 and late.any()
        assert fate.on_time_devices is not None and fate.on_time_devices.dtype == ids.dtype
        assert np.array_equal(fate.on_time_devices, ids[fate.on_time])
        for narrow in (ids.astype(np.uint32), ids.astype(np.int64)):
            other = net.fate(narrow, r, 4.0)
            assert np.array_equal(other.on_time, fate.on_time) and np.array_equal(other.late, fate.late)
            assert other.on_time_devices is not None and other.on_time_devices.dtype == narrow.dtype
            assert np.array_equal(other.on_time_devices, narrow[fate.on_time])
            assert (other.on_time_delay, other.late_delay, other.lost) == (fate.on_time_delay, fate.late_delay,
                                                                           fate.lost)


@pytest.mark.parametrize("jitter", [1e-3, 0.5, 50.0])
def test_network_fates_at_a_deadline_that_falls_exactly_on_a_report_are_the_formula_s(jitter):
    """The fate kernel tells draws apart by a precomputed split point and takes the logarithm only near it and
    once for each batch's slowest report: at deadlines exactly on a report's delay, at the base latency and just
    after it, on time and late are still exactly those of the formula, as are the slowest delays."""
    from collector.network import Network, NetworkParams
    from protocols import keyed
    from protocols.keyed import Purpose, stream_key

    p = NetworkParams(latency=0.05, jitter=jitter, loss=0.05)
    net = Network(None, p, 11)  # type: ignore[arg-type]  (fates need no SimPy environment)
    ids = np.arange(5, 60_000, 7, dtype=np.uint64)
    keep = keyed.uniform(stream_key(11, Purpose.LOSS, 2), ids) >= p.loss
    delay = p.latency - p.jitter * np.log1p(-keyed.uniform(stream_key(11, Purpose.LATENCY, 2), ids))
    for time_left in (*np.sort(delay[keep])[[0, 1, 100, 4000, -2, -1]], p.latency, np.nextafter(p.latency, 1.0)):
        fate = net.fate(ids, 2, float(time_left))
        on, late = keep & (delay < time_left), keep & (delay >= time_left)
        assert np.array_equal(fate.on_time, np.flatnonzero(on)) and np.array_equal(fate.late, np.flatnonzero(late))
        assert fate.on_time_delay == (delay[on].max() if on.any() else 0.0)
        assert fate.late_delay == (delay[late].max() if late.any() else 0.0)
