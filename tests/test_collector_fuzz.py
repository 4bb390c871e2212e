"""The collector under attack: hostile bytes arrive during a running simulation; honest devices are served as if
nothing happened, every hostile message is rejected and counted, and the log is not flooded."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import simpy

import scenarios.runner as runner
from collector.network import Network, NetworkParams
from collector.process import LOGGED_REJECTIONS_PER_ROUND, CollectorProcess
from protocols import wire
from protocols.messages import CollectionRequest, ReportBatch
from protocols.onebit import OneBitCollector, OneBitParams, estimate_mean
from scenarios.schema import parse

DEVICES, ROUNDS, COHORT = 500, 5, 100
SCENARIO = {
    "name": "collector-fuzz",
    "seed": 11,
    "rounds": ROUNDS,
    "population": {"devices": DEVICES, "groups": [
        {"name": "light", "share": 0.6, "counter": {"dist": "normal", "mean": 1800, "sd": 600},
         "jitter": {"dist": "normal", "sd": 300}},
        {"name": "heavy", "share": 0.4, "counter": {"dist": "uniform", "low": 7200, "high": 21600}},
    ]},
    "changes": [{"round": 3, "group": "light", "counter": {"dist": "normal", "mean": 3600, "sd": 600}}],
    "protocol": {"name": "1bitrrpm", "epsilon": 1.0, "max_value": 86400, "granularity": 3600},
    "network": {"loss": 0.0},
    "simulation": {"cohort_size": COHORT},
}
PROTOCOL = "1bitrrpm"


# ----------------------------------------------------------------------------------------------- the attacker
def mutate(rng: np.random.Generator, data: bytes, donor: bytes) -> bytes:
    """One to three random byte-level mutations: flip, truncate, insert, delete, splice from ``donor``."""
    b = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(5))
        at = int(rng.integers(len(b) + 1))
        if op == 0 and b:
            b[at % len(b)] ^= int(rng.integers(1, 256))
        elif op == 1:
            del b[at:]
        elif op == 2:
            b[at:at] = rng.bytes(int(rng.integers(1, 9)))
        elif op == 3:
            del b[at:at + int(rng.integers(1, 9))]
        else:
            start, n = int(rng.integers(len(donor))), int(rng.integers(1, 33))
            b[at:at + n] = donor[start:start + n]
    return bytes(b)


def wire_garbage_reason(raw: bytes) -> str | None:
    """The WireError message ``raw`` gets, or None if it decodes (then it is not garbage)."""
    try:
        wire.decode(raw)
    except wire.WireError as exc:
        return str(exc)[:200]
    return None


@dataclass
class Sent:
    round: int  # the round window it was sent in ((round - 1) x round_seconds onwards)
    time: float
    kind: str  # "wire" or "protocol": what the collector must call it
    reason: str  # a substring of the reason it must give
    label: str


@dataclass
class Attacker:
    """A SimPy process that, in every round, sends the collector garbage and well-formed batches the protocol must
    reject: some before the honest reports land, some after (while the round is still open), some after close."""

    scenario: object
    seed: int
    sent: list[Sent] = field(default_factory=list)
    honest: list[tuple[float, bytes]] = field(default_factory=list)  # what the network delivered, for replay

    def start(self, env: simpy.Environment, collector: CollectorProcess) -> None:
        self.env, self.collector = env, collector
        self.rng = np.random.default_rng(self.seed)
        env.process(self.run())

    def send(self, round_: int, kind: str, reason: str, label: str, raw: bytes) -> None:
        self.sent.append(Sent(round_, self.env.now, kind, reason, label))
        CollectorProcess.deliver(self.collector, raw)  # straight into the inbox (not recorded as honest)

    def garbage(self, round_: int, n_random: int, n_mutated: int) -> None:
        rng = self.rng
        valid = wire.encode(self.batch(round_, np.arange(COHORT), bits=rng.integers(0, 2, COHORT)))
        donor = wire.encode(CollectionRequest(round_, PROTOCOL, 1e5))
        made = 0
        while made < n_random:
            raw = rng.bytes(int(rng.integers(0, 200)))
            if (reason := wire_garbage_reason(raw)) is not None:
                self.send(round_, "wire", reason, "random bytes", raw)
                made += 1
        made = 0
        while made < n_mutated:
            raw = mutate(rng, valid, donor)
            if (reason := wire_garbage_reason(raw)) is not None:  # a mutant that still decodes is skipped
                self.send(round_, "wire", reason, "mutated batch", raw)
                made += 1

    @staticmethod
    def batch(round_: int, ids, bits=None, protocol: str = PROTOCOL, **extra_columns) -> ReportBatch:
        ids = np.asarray(ids, dtype=np.uint32)
        b = np.zeros(ids.size, np.uint8) if bits is None else bits
        return ReportBatch(round=round_, protocol=protocol, devices=ids,
                           columns={"bit": wire.bits(b), **extra_columns})

    def run(self):
        env, sc, c = self.env, self.scenario, self.collector
        rs, deadline = sc.simulation.round_seconds, sc.network.deadline
        honest_landing = 2 * sc.network.latency  # request out + reports back (no jitter)
        for r in range(1, sc.rounds + 1):
            start = (r - 1) * rs
            # -- before the honest reports land: garbage, and batches naming honest devices that must be refused
            # whole (if any part were taken, the honest reports would later be refused as repeats)
            yield env.timeout(start + honest_landing / 5 - env.now)
            assert c.open_until == start + deadline and c.stats.reports_accepted == (r - 1) * DEVICES
            self.garbage(r, n_random=r, n_mutated=r - 1)
            honest_ids = np.arange(0, DEVICES, 7)
            for label, reason, msg in [
                ("next round", f"batch for round {r + 1}, but the open round is {r}", self.batch(r + 1, honest_ids)),
                ("far round", f"batch for round {2**31 - 1}", self.batch(2**31 - 1, honest_ids)),
                ("unregistered device", f"device id {DEVICES} is not registered",
                 self.batch(r, np.append(np.arange(10), DEVICES))),
                ("huge device id", "is not registered", ReportBatch(r, PROTOCOL, np.array([3, 2**64 - 1], np.uint64),
                                                                    {"bit": wire.bits(np.array([1, 1]))})),
                ("wrong protocol", "batch for protocol '1bitmean'", self.batch(r, honest_ids, protocol="1bitmean")),
                ("extra column", "has exactly the columns ['bit'], got ['bit', 'grid']",
                 self.batch(r, honest_ids, grid=np.zeros(honest_ids.size, np.uint32))),
                ("no bit column", "has exactly the columns ['bit'], got []",
                 ReportBatch(r, PROTOCOL, honest_ids.astype(np.uint32), {})),
                ("bit not bits", "column 'bit' holds 2 > 1",
                 ReportBatch(r, PROTOCOL, honest_ids.astype(np.uint32), {"bit": np.full(honest_ids.size, 2, np.uint8)})),
                ("bit wrong dtype", "column 'bit' must be u1, got uint32",
                 ReportBatch(r, PROTOCOL, honest_ids.astype(np.uint32), {"bit": np.zeros(honest_ids.size, np.uint32)})),
                ("collection request", "devices may not send CollectionRequest",
                 CollectionRequest(r, PROTOCOL, start + deadline)),
            ]:
                self.send(r, "protocol", reason, label, wire.encode(msg))
            # -- after the honest reports landed, before the deadline: repeats of honest reports, more garbage
            yield env.timeout(start + 10 * honest_landing - env.now)
            assert c.open_until is not None and c.stats.reports_accepted == r * DEVICES
            landed = [raw for t, raw in self.honest if start <= t < start + deadline]
            assert len(landed) == math.ceil(DEVICES / COHORT)
            self.send(r, "protocol", "repeats a device", "replayed honest batch", landed[int(self.rng.integers(len(landed)))])
            self.send(r, "protocol", "repeats a device", "forged duplicate", wire.encode(self.batch(r, [123], bits=np.ones(1))))
            self.send(r, "protocol", "repeats a device", "all devices again", wire.encode(self.batch(r, np.arange(DEVICES))))
            self.garbage(r, n_random=1, n_mutated=r)
            yield env.timeout(start + deadline - 1 - env.now)
            self.send(r, "protocol", "repeats a device", "just before the deadline", wire.encode(self.batch(r, [DEVICES - 1])))
            # -- after the round closed (not after the last: the run ends there): late, whatever it says
            if r < sc.rounds:
                yield env.timeout(start + deadline + 1 - env.now)
                assert c.open_until is None
                self.send(r, "protocol", f"batch for round {r} arrived after the round closed", "after close",
                          wire.encode(self.batch(r, [DEVICES - 2])))
                self.send(r, "protocol", f"batch for round {r + 1} arrived after the round closed", "early next round",
                          wire.encode(self.batch(r + 1, [0])))


def run_scenario(attacker: Attacker | None = None, events=None) -> runner.RunResult:
    sc = parse(SCENARIO)
    if attacker is None:
        return runner.run(sc, events=events)
    with pytest.MonkeyPatch.context() as mp:
        attacker.scenario = sc

        class AttackedCollector(CollectorProcess):
            """The runner's collector, with the attacker attached and the honest bytes recorded."""

            def __init__(self, env, *args, **kwargs):
                super().__init__(env, *args, **kwargs)
                attacker.start(env, self)

            def deliver(self, raw: bytes) -> None:
                attacker.honest.append((self.env.now, raw))
                super().deliver(raw)

        mp.setattr(runner, "CollectorProcess", AttackedCollector)  # the runner builds it; the attacker rides along
        return runner.run(sc, events=events)


@pytest.fixture(scope="module")
def clean_run() -> runner.RunResult:
    return run_scenario()


@pytest.fixture(scope="module")
def attacked_run():
    attacker = Attacker(scenario=None, seed=20240601)
    events = io.StringIO()
    result = run_scenario(attacker, events)
    return result, attacker, [json.loads(line) for line in events.getvalue().splitlines()]


# ----------------------------------------------------------------------------------------------- the full run
def test_attack_actually_happened(attacked_run):
    result, attacker, _ = attacked_run
    assert result.collector.__class__.__name__ == "AttackedCollector"
    labels = {s.label for s in attacker.sent}
    assert {"random bytes", "mutated batch", "next round", "unregistered device", "wrong protocol", "extra column",
            "collection request", "replayed honest batch", "forged duplicate", "after close"} <= labels
    assert {s.round for s in attacker.sent} == set(range(1, ROUNDS + 1))
    assert len(attacker.sent) > ROUNDS * LOGGED_REJECTIONS_PER_ROUND  # enough to hit the logging cap


def test_every_hostile_message_rejected_and_counted(attacked_run):
    result, attacker, _ = attacked_run
    stats = result.collector.stats
    wire_sent = sum(s.kind == "wire" for s in attacker.sent)
    protocol_sent = sum(s.kind == "protocol" for s in attacker.sent)
    honest_messages = ROUNDS * math.ceil(DEVICES / COHORT)
    assert stats.rejected == len(attacker.sent)
    assert stats.reasons == {"wire": wire_sent, "protocol": protocol_sent}
    assert stats.late == sum(s.label in ("after close", "early next round") for s in attacker.sent)
    assert stats.received == honest_messages + len(attacker.sent)
    assert stats.accepted == honest_messages
    assert len(attacker.honest) == honest_messages


def test_honest_reports_all_accepted(attacked_run):
    result, _, _ = attacked_run
    assert result.collector.stats.reports_accepted == DEVICES * ROUNDS
    assert [rec.reports for rec in result.rounds] == [DEVICES] * ROUNDS
    assert result.device_rejected == 0
    for _, bits in result.collector.protocol.received("bit"):
        assert bits.min() >= 0  # every device reported in every round


def test_attacked_run_equals_clean_run(attacked_run, clean_run):
    result, _, _ = attacked_run
    assert result.transcript_digest == clean_run.transcript_digest
    assert result.ledger.digest() == clean_run.ledger.digest()
    assert [rec.estimate for rec in result.rounds] == [rec.estimate for rec in clean_run.rounds]
    assert [(rec.round, rec.time, rec.truth, rec.reports) for rec in result.rounds] == \
        [(rec.round, rec.time, rec.truth, rec.reports) for rec in clean_run.rounds]
    assert result.network.traffic == clean_run.network.traffic
    assert clean_run.collector.stats.rejected == 0
    assert all(math.isfinite(rec.estimate) for rec in clean_run.rounds)


def test_rejections_logged_with_reason_and_capped_per_round(attacked_run):
    result, attacker, events = attacked_run
    rs = result.scenario.simulation.round_seconds
    logged = [e for e in events if e["event"] == "message_rejected"]
    assert logged and all(e["level"] == "warning" for e in logged)
    below_cap = above_cap = 0
    for r in range(1, ROUNDS + 1):
        in_round = [e for e in logged if (r - 1) * rs <= e["sim_time"] < r * rs]
        sent = [s for s in attacker.sent if s.round == r]
        assert len(in_round) == min(len(sent), LOGGED_REJECTIONS_PER_ROUND) <= LOGGED_REJECTIONS_PER_ROUND
        below_cap += len(sent) < LOGGED_REJECTIONS_PER_ROUND
        above_cap += len(sent) > LOGGED_REJECTIONS_PER_ROUND
        for event, s in zip(in_round, sent):  # in order of arrival: the first ones of the round are logged
            assert event["sim_time"] == s.time
            assert event["kind"] == s.kind, s.label
            assert s.reason in event["reason"], s.label
    assert below_cap and above_cap  # both sides of the cap were exercised
    closed = [e for e in events if e["event"] == "round_closed"]
    assert [e["rejected"] for e in closed] == [
        sum(s.time < e["sim_time"] for s in attacker.sent) for e in closed]
    assert [e for e in events if e["event"] == "run_finished"][0]["messages_rejected"] == len(attacker.sent)


# ----------------------------------------------------------------------------------------------- unit level
class RecordingLog:
    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.records = env, []

    def warning(self, event: str, **kw) -> None:
        self.records.append((self.env.now, "warning", event, kw))

    def info(self, event: str, **kw) -> None:
        self.records.append((self.env.now, "info", event, kw))


def test_collector_process_unit():
    n, deadline = 20, 100.0
    env = simpy.Environment()
    params = OneBitParams(PROTOCOL, 1.0, 86400.0, 3600.0)
    protocol = OneBitCollector(params, n)
    network = Network(env, NetworkParams(latency=0.05, deadline=deadline), seed=3)
    cohort_inbox = simpy.Store(env)
    log = RecordingLog(env)
    collector = CollectorProcess(env, protocol, network, [cohort_inbox], deadline, log)
    rng = np.random.default_rng(99)
    bits = rng.integers(0, 2, n).astype(np.uint8)
    results = []

    def batch(round_, ids, b=None):
        ids = np.asarray(ids)
        return wire.encode(ReportBatch(round_, PROTOCOL, ids.astype(np.uint32),
                                       {"bit": wire.bits(bits[ids] if b is None else b)}))

    def driver():
        collector.deliver(batch(1, range(n)))  # no round open yet: late
        yield env.timeout(10)
        round1 = env.process(collector.run_round(1, on_close=results.append))
        yield env.timeout(0.5)
        collector.deliver(batch(1, [3, 4, 5]))  # accepted
        collector.deliver(batch(1, [0, 1, 2, 3]))  # repeats device 3: refused whole
        for _ in range(25):
            collector.deliver(b"\xc1" + rng.bytes(int(rng.integers(0, 50))))  # 0xc1 is never valid msgpack
        collector.deliver(None)  # not even bytes
        collector.deliver("text")
        collector.deliver(batch(1, [0, 1, 2]))  # accepted: the refused batch took nothing
        collector.deliver(batch(1, np.arange(6, n, 2)))  # accepted (not contiguous)
        collector.deliver(batch(1, np.arange(7, n, 2)))  # accepted
        yield env.timeout(deadline - 0.5 - 1e-9)
        collector.deliver(batch(1, [0]))  # still open: a repeat
        yield round1
        collector.deliver(batch(1, [0]))  # at the deadline: late
        yield env.timeout(50)
        env.process(collector.run_round(2, on_close=results.append))
        yield env.timeout(1)
        for _ in range(3):
            collector.deliver(b"")
        collector.deliver(batch(2, [5]))
        yield env.timeout(1)  # let the receiver take them

    env.run(until=env.process(driver()))
    stats = collector.stats
    assert [r.reports for r in results] == [n]
    assert stats.accepted == 5 and stats.reports_accepted == n + 1
    assert stats.late == 2
    assert stats.rejected == 1 + 1 + 25 + 2 + 1 + 1 + 3
    assert stats.reasons == {"wire": 30, "protocol": 4}
    assert stats.received == stats.accepted + stats.rejected
    # the round's estimate and transcript are exactly the reports delivered
    assert results[0].estimate == estimate_mean(bits, 1.0, 86400.0)
    np.testing.assert_array_equal(protocol.received("bit")[0][1], bits.astype(np.int64))
    # the request went out to the cohort with the absolute deadline
    assert len(cohort_inbox.items) == 2
    assert wire.decode(cohort_inbox.items[0]) == CollectionRequest(1, PROTOCOL, 10 + deadline)
    assert wire.decode(cohort_inbox.items[1]) == CollectionRequest(2, PROTOCOL, 10 + deadline + 50 + deadline)
    # logging: capped per round, reset when the next round opens
    warnings = [(t, kw) for t, level, event, kw in log.records if level == "warning"]
    assert all(event == "message_rejected" for _, level, event, _ in log.records)
    first = [w for w in warnings if w[0] < 10 + deadline + 50]
    second = [w for w in warnings if w[0] >= 10 + deadline + 50]
    assert len(first) == 1 + LOGGED_REJECTIONS_PER_ROUND  # one before round 1 opened, then the cap
    assert "arrived after the round closed" in first[0][1]["reason"] and first[0][1]["kind"] == "protocol"
    assert "repeats a device" in first[1][1]["reason"]
    assert all(kw["kind"] == "wire" and "not valid msgpack" in kw["reason"] for _, kw in first[2:])
    assert [kw["reason"] for _, kw in second] == ["empty message"] * 3


def test_a_batch_handed_in_without_the_wire_is_checked_whole_before_any_of_it_is_taken():
    """ReportCollector.receive is a trust boundary even for in-process callers that skip the wire decoder (which
    already refuses unordered ids): unordered, repeated or unregistered ids, and a device that already reported,
    are refused whole, leaving the round exactly as it was."""
    from protocols.base import ProtocolError

    p = OneBitParams(PROTOCOL, epsilon=1.0, max_value=86400.0, granularity=3600.0)
    col = OneBitCollector(p, 100)
    col.request(1, 3600.0)

    def batch(ids):
        ids = np.asarray(ids, dtype=np.uint32)
        return ReportBatch(1, PROTOCOL, ids, {"bit": np.ones(ids.size, dtype=np.uint8)})

    assert col.receive(batch([3, 5, 9])) == 3
    for bad, reason in [([10, 2], "strictly increasing"), ([11, 11], "strictly increasing"),
                        ([12, 100], "registered"), ([20, 5], "strictly increasing"), ([9, 21], "repeats a device"),
                        ([5, 6], "repeats a device")]:
        with pytest.raises(ProtocolError, match=reason):
            col.receive(batch(bad))
    assert col.close_round().reports == 3  # nothing of the refused batches was taken


@pytest.mark.parametrize("width", [1, 3])
def test_reports_of_scattered_devices_land_in_their_devices_rows(width):
    """The collector stores a batch of non-contiguous devices row by row (collecting._scatter, a special
    case for one value per device): every listed row holds its report, every other row is untouched."""
    from protocols.collecting import _scatter

    rng = np.random.default_rng(width)
    data = rng.integers(0, 200, (5000, width)).astype(np.uint8)
    ids = np.flatnonzero(rng.random(5000) < 0.3).astype(np.uint32)
    col = rng.integers(0, 200, (ids.size, width)).astype(np.uint8)
    want = data.copy()
    want[ids] = col
    _scatter(data, ids, col)
    assert np.array_equal(data, want)
