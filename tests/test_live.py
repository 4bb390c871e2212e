"""The live runtime over 127.0.0.1: digests equal to simulation for every protocol, and faults survived."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import numpy as np
import pytest

from collector.server import LiveSettings
from protocols import wire
from protocols.framing import frame
from protocols.ledger import Ledger
from scenarios import live, output, runner, schema
from tests.support import live_scenarios, protocol_scenario

FAST = LiveSettings(stage_timeout=2.0, read_timeout=0.3, startup_timeout=10.0)


SCENARIOS = live_scenarios()


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_live_and_simulated_runs_give_identical_digests(name: str) -> None:
    sc = SCENARIOS[name]
    sim = output.summary(runner.run(sc))
    got = output.summary(await live.run_embedded(sc, connections=3, settings=FAST))
    assert got["digests"] == sim["digests"]
    assert got["reports"]["accepted"] == sim["reports"]["accepted"]


async def _hostile(port: int, payload: bytes, then_sleep: float = 0.0) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    await asyncio.sleep(then_sleep)
    writer.close()


@pytest.mark.asyncio
async def test_hostile_clients_are_dropped_and_honest_reports_land() -> None:
    """While honest clients run, four hostile ones connect: random bytes, an oversized frame, a frame of the
    wrong wire version, and a frame that stalls halfway. Each is dropped and counted; the honest run's
    digests equal the simulated run's."""
    sc = SCENARIOS["1bitrrpm"]
    sim = output.summary(runner.run(sc))
    ledger = Ledger(sc.devices)
    server, book, _ = live.build_server(sc, ledger, None, FAST)
    port = await server.start("127.0.0.1", 0)
    clients = [live.build_client(sc, live.shard(sc.devices, i, 2), ledger, "127.0.0.1", port) for i in range(2)]
    tasks = [asyncio.create_task(c.run()) for c in clients]
    wrong_version = wire.encode(wire.decode(wire.encode(
        __import__("protocols.messages", fromlist=["End"]).End(1, "x"))))
    doc = msgpack.unpackb(wrong_version)
    doc["v"] = 2
    attacks = [
        _hostile(port, frame(np.random.default_rng(1).bytes(300))),
        _hostile(port, struct.pack(">I", wire.MAX_MESSAGE_BYTES + 1) + b"x" * 10),
        _hostile(port, frame(msgpack.packb(doc))),
        _hostile(port, struct.pack(">I", 100) + b"y" * 10, then_sleep=1.0),  # stalls past the read timeout
    ]
    await asyncio.gather(server.run(), *attacks)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await server.close()
    assert server.dropped == 4
    got = output.summary(live.live_result(sc, server, book, ledger, 0.0, sum(c.rejected for c in clients)))
    assert got["digests"] == sim["digests"]


@pytest.mark.asyncio
async def test_a_client_that_drops_mid_run_reconnects_with_its_state() -> None:
    """Client 0 loses its connection at the start of round 3 and reconnects by itself (backoff). Client 1's
    devices report every round; client 0's miss at most round 3; every report that was sent equals the
    simulated run's (memo state kept), and no device spends more than in the simulated run."""
    sc = SCENARIOS["1bitrrpm"]
    sim_result = runner.run(sc)
    sim = dict(sim_result.collector.protocol.received("bit"))
    ledger = Ledger(sc.devices)
    server, book, _ = live.build_server(sc, ledger, None, FAST)
    port = await server.start("127.0.0.1", 0)
    clients = [live.build_client(sc, live.shard(sc.devices, i, 2), ledger, "127.0.0.1", port) for i in range(2)]
    start = server.on_round_start

    def drop_at_3(t: int) -> None:
        start(t)
        if t == 3:
            clients[0].disconnect()

    server.on_round_start = drop_at_3
    tasks = [asyncio.create_task(c.run()) for c in clients]
    await server.run()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await server.close()
    assert clients[0].connections >= 2
    got = dict(server.protocol.received("bit"))
    half = sc.devices // 2
    for r, bits in got.items():
        assert np.all(bits[half:] >= 0)  # the honest client's devices always report
        if r != 3:
            assert np.all(bits[:half] >= 0)
        sent = bits >= 0
        np.testing.assert_array_equal(bits[sent], sim[r][sent])
    assert np.all(ledger.spend <= sim_result.ledger.spend + 1e-12)


@pytest.mark.asyncio
async def test_port_0_on_every_interface_is_one_port_for_every_address_family() -> None:
    """Host "" binds every interface (IPv4 and, where the machine has it, IPv6); port 0 must give them all the
    one port the serving line prints, else a device whose host name resolves to the other family finds
    nothing there."""
    server, _, _ = live.build_server(SCENARIOS["1bitrrpm"], Ledger(SCENARIOS["1bitrrpm"].devices), None, FAST)
    port = await server.start("", 0)
    try:
        assert {s.getsockname()[1] for s in server.server.sockets} == {port}
        families = {s.family for s in server.server.sockets}
        for family, loopback in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            if family in families:
                _, writer = await asyncio.open_connection(loopback, port)
                writer.close()
                await writer.wait_closed()
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_collector_restart_between_rounds() -> None:
    """The collector stops after round 2 and a new one (fresh collector state) serves rounds 3..6 on the same
    port: the clients reconnect, their devices' memo state and caps carry over (every round's bits equal the
    simulated run's), and no device is charged twice for a memo value."""
    sc = SCENARIOS["1bitrrpm"]
    sim_result = runner.run(sc)
    sim = dict(sim_result.collector.protocol.received("bit"))
    ledger = Ledger(sc.devices)
    first, book1, _ = live.build_server(sc, ledger, None, FAST)
    port = await first.start("127.0.0.1", 0)
    clients = [live.build_client(sc, live.shard(sc.devices, i, 2), ledger, "127.0.0.1", port) for i in range(2)]
    tasks = [asyncio.create_task(c.run()) for c in clients]
    await first.run(last_round=2, end=False)
    await first.close()
    for c in clients:
        c.disconnect()
    second, book2, _ = live.build_server(sc, ledger, None, FAST)
    for d in range(1, 3):  # the new collector's world catches up with the days already run
        book2.advance_day(d)
    await second.start("127.0.0.1", port)
    await second.run(first_round=3)
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await second.close()
    assert all(c.connections >= 2 for c in clients)
    rounds = {**dict(first.protocol.received("bit")), **dict(second.protocol.received("bit"))}
    assert sorted(rounds) == list(range(1, sc.rounds + 1))
    for r, bits in rounds.items():
        np.testing.assert_array_equal(bits, sim[r])
    np.testing.assert_allclose(ledger.spend, sim_result.ledger.spend)


@pytest.mark.asyncio
async def test_one_device_per_connection() -> None:
    """40 devices over 40 connections (one device each, cohorts of one) give the simulated digests."""
    sc = schema.parse(protocol_scenario("1bitrrpm", **{"population.devices": 40, "simulation.cohort_size": 1,
                                               "network.loss": 0, "network.jitter": 0}).raw)
    sim = output.summary(runner.run(sc))
    got = output.summary(await live.run_embedded(sc, connections=40, settings=FAST))
    assert got["digests"] == sim["digests"]


def test_serve_with_devices_missing_warns_and_records_it_and_with_none_exits_2(tmp_path) -> None:
    """Only shard 1 of 2 comes: after --startup-timeout the rounds run with its devices, a warning line says
    how many are missing, summary.json live.devices_at_start records them and the last line repeats it. With
    no device at all, serve exits 2 with one line and leaves no run files behind."""
    import json
    import subprocess
    import sys

    sets = ["--set", "population.devices=200", "--set", "rounds=3", "--set", "network.loss=0"]
    cmd = [sys.executable, "-m", "scenarios.cli"]
    server = subprocess.Popen(cmd + ["serve", "quickstart", "--port", "0", "--startup-timeout", "6", "--quiet",
                                     "--out", str(tmp_path / "srv")] + sets,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    serving = server.stderr.readline().decode()
    port = int(serving.split("127.0.0.1:")[1].split(";")[0])
    # shard 1 first: it must be in within the startup timeout however slowly its interpreter starts
    shard = subprocess.Popen(cmd + ["devices", "quickstart", "--connect", f"127.0.0.1:{port}", "--shard", "1/2"]
                             + sets, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # devices of another scenario (--set differs) are refused with the reason and exit 2 at once
        other = subprocess.run(cmd + ["devices", "quickstart", "--connect", f"127.0.0.1:{port}", "--shard", "2/2",
                                      "--set", "protocol.epsilon=2", "--out", str(tmp_path / "other")] + sets,
                               capture_output=True, text=True, timeout=30)
        assert other.returncode == 2 and other.stderr.strip().splitlines()[-1] == (
            f"ldpsim: error: the collector at 127.0.0.1:{port} refused the devices: the devices run another "
            "scenario than this collector (its file or --set options differ)"), other.stderr
        # ... after writing what its devices spent (nothing: refused at the Hello) and saying it stopped
        assert other.stdout.startswith("shard 2/2: stopped; per-device spend (epsilon) max 0;"), other.stdout
        assert (tmp_path / "other" / "ledger-shard-2-of-2.parquet").is_file()
        for p in (shard, server):
            assert p.wait(timeout=60) == 0, p.stderr.read().decode()[-2000:]
    finally:
        for p in (shard, server):
            p.kill()
    err = server.stderr.read().decode()
    assert "ldpsim: warning: 100 of 200 devices connected within 6 s; the rounds run without the other 100" in err
    assert "served 3 rounds with 100 of 200 devices" in server.stdout.read().decode()
    got = json.loads((tmp_path / "srv" / "summary.json").read_text())
    assert got["live"]["devices_at_start"] == 100 and got["reports"]["accepted"] == 300

    none = subprocess.run(cmd + ["serve", "quickstart", "--port", "0", "--startup-timeout", "1", "--out",
                                 str(tmp_path / "empty")] + sets, capture_output=True, text=True, timeout=60)
    assert none.returncode == 2
    assert none.stderr.strip().splitlines()[-1].endswith("no device connected within 1 s (--startup-timeout); "
                                                         "nothing to collect")
    assert list((tmp_path / "empty").iterdir()) == []  # no event log or journal of a run that never started


@pytest.mark.asyncio
async def test_a_resumed_collector_whose_rounds_all_closed_does_not_wait_for_devices() -> None:
    """serve --resume after a crash between the last round and the run directory: nothing is left to collect,
    so it neither waits out the startup timeout nor fails for want of devices (they finished and left)."""
    import dataclasses
    import time

    sc = SCENARIOS["1bitrrpm"]
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, startup_timeout=30.0))
    await server.start("127.0.0.1", 0)
    t = time.monotonic()
    try:
        await asyncio.wait_for(server.run(first_round=sc.rounds + 1), 10)
    finally:
        await server.close()
    assert time.monotonic() - t < 5 and server.devices_at_start is None


def test_the_scenario_fingerprint_covers_what_devices_and_collector_must_share() -> None:
    base = protocol_scenario("1bitrrpm")
    same = [{"simulation.cohort_size": 7}, {"simulation.threads": 2}, {"analysis.attacks": "false"},
            {"name": '"renamed"'}, {"collector.behavior": '"replay"'}, {"protocol.epsilon": 1}]  # 1 is 1.0
    other = [{"protocol.epsilon": 2.0}, {"seed": 8}, {"privacy.budget": 3}, {"population.devices": 1201},
             {"network.deadline": 4.0}, {"rounds": 7}, {"simulation.round_seconds": 50}]
    fp = live.scenario_fingerprint(base)
    assert len(fp) == 32
    assert all(live.scenario_fingerprint(protocol_scenario("1bitrrpm", **o)) == fp for o in same)
    assert all(live.scenario_fingerprint(protocol_scenario("1bitrrpm", **o)) != fp for o in other)


def test_serve_and_device_shards_in_separate_processes(tmp_path) -> None:
    """`ldpsim serve` and two `ldpsim devices --shard I/2` processes over 127.0.0.1: the server's run directory
    has the simulated run's transcript and estimates digests, and the shards' ledgers add up to the
    simulated ledger's spend."""
    import json

    import pandas as pd
    import subprocess
    import sys

    sets = ["--set", "population.devices=600", "--set", "rounds=4", "--set", "network.loss=0"]
    cmd = [sys.executable, "-m", "scenarios.cli"]
    # port 0: the system picks a free one, and the "serving" line names it (no race for a port chosen here)
    server = subprocess.Popen(cmd + ["serve", "quickstart", "--port", "0", "--out", str(tmp_path / "srv")] + sets,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    serving = server.stderr.readline().decode()
    assert serving.startswith("ldpsim: serving quickstart on 127.0.0.1:") and "waiting up to 30 s for 600 devices" \
        in serving, serving
    port = int(serving.split("127.0.0.1:")[1].split(";")[0])
    shards = [subprocess.Popen(cmd + ["devices", "quickstart", "--connect", f"127.0.0.1:{port}", "--shard", f"{i}/2",
                                      "--connections", "3", "--out", str(tmp_path / "dev")] + sets,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (1, 2)]
    try:
        for p in [*shards, server]:
            assert p.wait(timeout=60) == 0, p.stderr.read().decode()[-2000:]
    finally:
        for p in [*shards, server]:
            p.kill()
    shards_out = [p.stdout.read().decode() for p in shards]
    for i, p in enumerate(shards, 1):  # each device process says what it hosts and where it connects
        first = p.stderr.read().decode().splitlines()[0]
        assert first.startswith(f"ldpsim: shard {i}/2: 300 devices connecting to 127.0.0.1:{port} over 3 "
                                "connection(s) (giving up after 60 s"), first
    got = json.loads((tmp_path / "srv" / "summary.json").read_text())
    sc = schema.load("quickstart", ["population.devices=600", "rounds=4", "network.loss=0"])
    sim_result = runner.run(sc)
    sim = output.summary(sim_result)
    assert got["digests"]["transcript"] == sim["digests"]["transcript"]
    assert got["digests"]["estimates"] == sim["digests"]["estimates"]
    spend = np.zeros(sc.devices)
    shards = sorted((tmp_path / "dev").glob("ledger-shard-*.parquet"))
    assert len(shards) == 2
    for f in shards:
        table = pd.read_parquet(f)
        np.add.at(spend, table["device"].to_numpy(), table["amount"].to_numpy())
    np.testing.assert_allclose(spend, sim_result.ledger.spend)
    # the collector-only run directory says where the ledger is, and shows no spend it does not have
    assert got["privacy"]["ledger"] == "device shards"
    assert got["epsilon"] is None and got["privacy"]["max_spend"] is None
    assert got["digests"]["ledger"] is None and got["digests"]["ledger_rows"] is None  # it never kept one
    assert got["live"]["devices_at_start"] == 600
    # what the devices sent is theirs to know: the collector's counts say so instead of showing a number
    assert got["reports"]["sent"] is got["reports"]["lost"] is got["reports"]["delivered"] is None
    assert got["reports"]["accepted"] == sim["reports"]["accepted"] and "unknown" in got["reports"]
    assert got["messages"]["rejected_by_devices"] is None and "ldpsim devices" in got["messages"]["unknown"]
    for i, p in enumerate(shards_out, 1):  # ... and each device process prints its own view of the collector
        assert f"shard {i}/2: done; per-device spend (epsilon) max " in p and "reports refused for the budget 0, " \
            "collector messages ignored 0 (per device), undecodable collector frames 0" in p, p
    assert not (tmp_path / "srv" / "spend.png").exists()
    assert not list((tmp_path / "srv").glob("spend*")) and not list((tmp_path / "srv").glob("ledger*"))


def test_shard_size_is_the_size_of_the_shard() -> None:
    from scenarios.live import shard, shard_size

    for n, count in [(1, 1), (7, 3), (1000, 7), (12345, 10), (5, 8)]:
        sizes = [shard_size(n, i, count) for i in range(count)]
        assert sizes == [shard(n, i, count).size for i in range(count)] and sum(sizes) == n
