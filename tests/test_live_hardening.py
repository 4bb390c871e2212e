"""The live runtime under attack on 127.0.0.1 (issue 10): impersonation with and without a deployment secret,
duplicate shards, out-of-range ids, a reader that never reads, trickled and oversized frames, a buffer budget,
a connection flood, deep nesting, TLS, and `ldpsim serve` exiting with an idle connection open.

Every test runs honest device clients beside the attackers and checks that the honest run's digests equal a
clean simulated run's (scenarios.runner.run + scenarios.output.summary, as tests/test_live.py does) and that
each attack is counted under its cause. Every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import io
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from collector import server as server_module
from collector.server import LiveSettings
from protocols import auth, wire
from protocols.framing import frame
from protocols.ledger import Ledger
from protocols.messages import Challenge, CollectionRequest, Hello, Refusal, ReportBatch
from scenarios import live, output, runner
from tests.support import protocol_scenario

HOST = "127.0.0.1"
FAST = LiveSettings(stage_timeout=2.0, read_timeout=0.3, startup_timeout=10.0, hello_timeout=5.0,
                    write_timeout=0.5)
SECRET = b"correct horse battery staple, 32"
PROTOCOL = "1bitrrpm"


def scenario(devices: int = 400, rounds: int = 6, cohort: int = 100):
    return protocol_scenario(PROTOCOL, **{"population.devices": devices, "rounds": rounds,
                                          "simulation.cohort_size": cohort, "network.loss": 0, "network.jitter": 0})


@functools.lru_cache(maxsize=None)
def simulated(devices: int = 400, rounds: int = 6, cohort: int = 100) -> dict:
    return output.summary(runner.run(scenario(devices, rounds, cohort)))["digests"]


# ----------------------------------------------------------------------------------------------- harness
class Harness:
    """A collector with honest device clients (shards of the population), its event log kept."""

    def __init__(self, sc, settings: LiveSettings, connections: int = 2, client_tls=None) -> None:
        self.sc, self.settings, self.connections, self.client_tls = sc, settings, connections, client_tls
        self.events = io.StringIO()
        self.ledger = Ledger(sc.devices)
        self.server, self.book, _ = live.build_server(sc, self.ledger, self.events, settings)
        self.tasks: list[asyncio.Task] = []
        self.run_task: asyncio.Task | None = None

    async def listen(self) -> int:
        self.port = await self.server.start(HOST, 0)
        return self.port

    def start_clients(self) -> None:
        days = live.process_days(self.sc)
        self.clients = [live.build_client(self.sc, live.shard(self.sc.devices, i, self.connections), self.ledger,
                                          HOST, self.port, days, self.settings.secret, self.client_tls)
                        for i in range(self.connections)]
        self.tasks = [asyncio.create_task(c.run()) for c in self.clients]

    def start_run(self) -> None:
        self.run_task = asyncio.create_task(self.server.run())

    async def registered(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self.server._registered.wait(), timeout)

    async def finish(self, timeout: float = 60.0) -> dict:
        try:
            await asyncio.wait_for(self.run_task, timeout)
            await asyncio.wait_for(asyncio.gather(*self.tasks), 15)
        finally:
            for task in self.tasks:
                task.cancel()
            await self.server.close()
        return output.summary(live.live_result(self.sc, self.server, self.book, self.ledger, 0.0,
                                                        sum(c.rejected for c in self.clients)))

    def log(self) -> list[dict]:
        return [json.loads(line) for line in self.events.getvalue().splitlines() if line.strip()]


async def started(sc=None, settings: LiveSettings = FAST, connections: int = 2, client_tls=None) -> Harness:
    h = Harness(sc or scenario(), settings, connections, client_tls)
    await h.listen()
    h.start_clients()
    h.start_run()
    return h


async def connect(port: int):
    return await asyncio.open_connection(HOST, port)


async def read_frame(reader: asyncio.StreamReader, timeout: float = 5.0):
    (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), timeout))
    return wire.decode(await asyncio.wait_for(reader.readexactly(n), timeout))


async def closed_by_server(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    """Read (and ignore broadcasts) until the server closes the connection; False if it is still open."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            data = await asyncio.wait_for(reader.read(1 << 16), left)
        except ConnectionError:
            return True
        except asyncio.TimeoutError:
            return False
        if not data:
            return True
    return False


async def send_and_expect_close(port: int, payload: bytes, challenge: bool = False) -> None:
    reader, writer = await connect(port)
    try:
        if challenge:
            assert isinstance(await read_frame(reader), Challenge)
        writer.write(payload)
        await writer.drain()
        assert await closed_by_server(reader), "the server kept the connection"
    finally:
        writer.close()


def hello(ids, dtype=np.uint32, mac: bytes | None = None, round_: int = 1) -> bytes:
    return frame(wire.encode(Hello(round=round_, protocol=PROTOCOL, devices=np.asarray(ids, dtype=dtype), mac=mac)))


def signed_hello(ids, nonce: bytes, secret: bytes = SECRET, signed_ids=None) -> bytes:
    ids = np.asarray(ids, dtype=np.uint32)
    signed = ids if signed_ids is None else np.asarray(signed_ids, dtype=np.uint32)
    mac = auth.hello_mac(auth.device_keys(secret, signed), nonce, 1, PROTOCOL, signed)
    return hello(ids, mac=mac)


def no_stage_timeouts(h: Harness) -> bool:
    return not [e for e in h.log() if e.get("event") == "stage_timeout"]


# ----------------------------------------------------------------------------------------------- auth unit
def test_device_keys_are_hmac_of_the_secret_and_id() -> None:
    ids = np.array([0, 1, 7, 2**32 - 1], dtype=np.int64)
    keys = auth.device_keys(SECRET, ids)
    assert keys == b"".join(auth.device_key(SECRET, int(d)) for d in ids)
    long_secret = bytes(range(200))
    assert auth.device_keys(long_secret, ids[:2]) == b"".join(auth.device_key(long_secret, d) for d in (0, 1))


def test_hello_mac_binds_nonce_ids_round_and_protocol() -> None:
    ids = np.arange(10, 20)
    nonce = bytes(32)
    mac = auth.hello_mac(auth.device_keys(SECRET, ids), nonce, 1, PROTOCOL, ids)
    assert auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, mac)
    assert not auth.verify_hello(SECRET, b"\x01" + bytes(31), 1, PROTOCOL, ids, mac)  # another nonce: replay
    assert not auth.verify_hello(SECRET, nonce, 2, PROTOCOL, ids, mac)
    assert not auth.verify_hello(SECRET, nonce, 1, "kflip", ids, mac)
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, np.arange(10, 21), mac)  # one more device
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, np.arange(11, 20), mac)  # one fewer
    assert not auth.verify_hello(b"another secret of enough bytes", nonce, 1, PROTOCOL, ids, mac)
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, None)
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, np.arange(0), mac)


def test_a_forged_hello_costs_one_derivation_however_many_ids_it_names(monkeypatch) -> None:
    """The probe (one credential, the device at a position the nonce and the ids choose) is checked first: a
    forged Hello naming 200,000 devices is refused after deriving one key (it derived all 200,000, about
    0.3 s, an attacker's note). Each half of the MAC is checked: a right probe with a wrong full MAC fails,
    and so does the reverse."""
    derived: list[int] = []
    real_keys = auth.device_keys

    def counting_keys(secret, ids):
        derived.append(len(ids))
        return real_keys(secret, ids)

    monkeypatch.setattr(auth, "device_keys", counting_keys)
    nonce = bytes(range(32))
    many = np.arange(200_000)
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, many, bytes(64))
    assert derived == [1]
    ids = np.arange(40, 60)
    good = auth.hello_mac(real_keys(SECRET, ids), nonce, 1, PROTOCOL, ids)
    assert len(good) == wire.MAC_BYTES and auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, good)
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, bytes(32) + good[32:])
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, good[:32] + bytes(32))
    assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, good[:32])
    # the probe's device moves with the nonce: a peer holding one device's credential cannot choose it
    positions = {auth.probe_index(auth.hello_message(bytes([k]) * 32, 1, PROTOCOL, ids), ids.size) for k in range(64)}
    assert len(positions) > 10


def test_a_peer_holding_half_the_credentials_cannot_make_the_collector_derive_them_all(monkeypatch) -> None:
    """An attacker's finding: with one probe credential, a peer holding the credentials of half the ids it
    names landed the probe on its own device by grinding rounds offline (2 tries), and each such Hello made
    the collector derive all n keys. The sample MAC, keyed by 64 credentials drawn from the message, stops it
    after 65 derivations: over 2,000 ground Hellos the probe lands on the peer's devices about half the time,
    the sample never lies wholly among them (probability 2^-64 a Hello), and no Hello costs more than 65."""
    ids = np.arange(0, 2000)
    mine = ids[ids % 2 == 0]  # the credentials the peer holds
    keys = dict(zip(mine.tolist(), (auth.device_keys(SECRET, mine[i:i + 1]) for i in range(mine.size))))
    derived: list[int] = []
    real_keys = auth.device_keys
    monkeypatch.setattr(auth, "device_keys", lambda secret, some: (derived.append(len(some)), real_keys(secret, some))[1])
    nonce, landed, whole_sample = bytes(range(32)), 0, 0
    for round_ in range(1, 2001):  # the peer grinds the round (any knob of the message would do)
        message = auth.hello_message(nonce, round_, PROTOCOL, ids)
        j = auth.probe_index(message, ids.size)
        if int(ids[j]) not in keys:
            continue
        landed += 1
        whole_sample += all(int(ids[s]) in keys for s in auth.sample_indices(message, ids.size))
        probe = hmac.digest(keys[int(ids[j])], auth.PROBE_CONTEXT + message, "sha256")[:auth.CHECK_BYTES]
        derived.clear()
        assert not auth.verify_hello(SECRET, nonce, round_, PROTOCOL, ids, probe + bytes(48))
        assert derived == [1, auth.SAMPLE]  # the probe passed, the sample did not: 65 keys, not 2,000
    assert 900 < landed < 1100 and whole_sample == 0


def test_a_hello_of_many_ids_is_verified_in_chunks_with_the_same_answer(monkeypatch) -> None:
    """verify_hello hashes the credentials as it derives them (a 16M-id Hello held 4 GB of keys at once): across
    chunk boundaries and for the short keys of one or two devices it agrees with the MAC of the whole key."""
    monkeypatch.setattr(auth, "VERIFY_CHUNK", 7)
    nonce = bytes(range(32))
    for n in (1, 2, 3, 7, 8, 50):
        ids = np.arange(3, 3 + n)
        mac = auth.hello_mac(auth.device_keys(SECRET, ids), nonce, 1, PROTOCOL, ids)
        assert auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids, mac), n
        assert not auth.verify_hello(SECRET, nonce, 1, PROTOCOL, ids + 1, mac), n


def test_read_secret(tmp_path) -> None:
    (tmp_path / "s").write_bytes(SECRET + b"\n")
    assert auth.read_secret(tmp_path / "s") == SECRET
    (tmp_path / "short").write_bytes(b"too short\n")
    with pytest.raises(auth.SecretError, match="at least 16 bytes"):
        auth.read_secret(tmp_path / "short")
    with pytest.raises(auth.SecretError, match="cannot read"):
        auth.read_secret(tmp_path / "missing")


def test_a_secret_file_that_never_ends_or_blocks_is_refused(tmp_path) -> None:
    """--secret-file /dev/zero read 6 GB in 10 s, and a FIFO blocked for ever: a regular file of at most 4 KB."""
    with pytest.raises(auth.SecretError, match="must be a regular file"):
        auth.read_secret("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(auth.SecretError, match="must be a regular file"):
        auth.read_secret(tmp_path / "fifo")  # no writer: opening it for reading would wait for one
    (tmp_path / "big").write_bytes(b"k" * (auth.MAX_SECRET_FILE + 1))
    with pytest.raises(auth.SecretError, match="larger than 4,096 bytes"):
        auth.read_secret(tmp_path / "big")
    (tmp_path / "edge").write_bytes(b"k" * auth.MAX_SECRET_FILE)
    assert len(auth.read_secret(tmp_path / "edge")) == auth.MAX_SECRET_FILE


# ----------------------------------------------------------------------------------------------- impersonation
@pytest.mark.asyncio
async def test_impersonators_without_a_secret_are_refused_and_the_holders_keep_their_devices() -> None:
    """Once the honest shards hold their devices, a second Hello for held ids (one shard's, every id, a partial
    overlap) is refused and counted; the intruders leaving does not mark the honest devices as gone (no stage
    waits out its timeout), and the run's digests equal the simulated run's."""
    h = await started()
    await h.registered()
    n = h.sc.devices
    for ids in (live.shard(n, 0, 2), np.arange(n), [n // 2 - 1, n // 2]):
        await send_and_expect_close(h.port, hello(ids))
    assert h.server.connected.all()  # the intruders left; the honest connections still hold every device
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"ids_held": 3}
    assert got["live"]["dropped"] == {"ids_held": 3}
    assert no_stage_timeouts(h)


@pytest.mark.asyncio
async def test_an_impersonator_that_leaves_closes_the_start_gate_again() -> None:
    """Without a secret, a Hello naming every id before the real devices connect is accepted (nothing tells it
    apart), but a second Hello on its connection is refused, and once it is gone the start gate is closed again:
    the run starts only when the real devices hold every id, and its digests equal the simulated run's."""
    sc = scenario()
    h = Harness(sc, FAST)
    await h.listen()
    reader, writer = await connect(h.port)
    writer.write(hello(np.arange(sc.devices)))
    await writer.drain()
    for _ in range(500):
        if h.server._registered.is_set():
            break
        await asyncio.sleep(0.01)
    assert h.server._registered.is_set()
    writer.write(hello([0]))  # a second hello on the connection
    assert await closed_by_server(reader)
    writer.close()
    assert not h.server._registered.is_set() and h.server._held == 0
    h.start_run()
    await asyncio.sleep(0.2)
    assert h.server.current_round == 0  # still waiting for the devices
    h.start_clients()
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"second_hello": 1}
    assert no_stage_timeouts(h)


@pytest.mark.asyncio
async def test_with_a_secret_forged_and_replayed_hellos_are_refused() -> None:
    """With a deployment secret: before the honest devices connect, a Hello naming every id with a forged MAC
    does not open the start gate; a Hello without a MAC, one under another secret, one that adds a device to
    what was signed, and one captured on another connection (replayed against a new nonce) are refused. The
    honest run's digests equal the simulated run's."""
    sc = scenario()
    h = Harness(sc, dataclasses.replace(FAST, secret=SECRET))
    await h.listen()
    h.start_run()
    n, shard0 = sc.devices, live.shard(sc.devices, 0, 2)
    await send_and_expect_close(h.port, hello(np.arange(n), mac=bytes(64)), challenge=True)
    assert not h.server._registered.is_set() and h.server._held == 0
    await send_and_expect_close(h.port, hello(shard0), challenge=True)  # no mac
    # another secret
    reader, writer = await connect(h.port)
    nonce = (await read_frame(reader)).nonce
    writer.write(signed_hello(shard0, nonce, secret=b"not the deployment secret at all"))
    assert await closed_by_server(reader)
    writer.close()
    # signed for shard 0, naming one device more
    reader, writer = await connect(h.port)
    nonce = (await read_frame(reader)).nonce
    writer.write(signed_hello(np.append(shard0, shard0[-1] + 1), nonce, signed_ids=shard0))
    assert await closed_by_server(reader)
    writer.close()
    # a valid Hello captured on connection A, replayed on connection B
    reader_a, writer_a = await connect(h.port)
    captured = signed_hello(shard0, (await read_frame(reader_a)).nonce)
    reader_b, writer_b = await connect(h.port)
    assert isinstance(await read_frame(reader_b), Challenge)
    writer_b.write(captured)
    assert await closed_by_server(reader_b)
    writer_a.close()
    writer_b.close()
    assert h.server._held == 0 and not h.server._registered.is_set()
    h.start_clients()
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"auth": 5}
    assert got["live"]["authenticated"] is True
    assert no_stage_timeouts(h)


@pytest.mark.asyncio
async def test_devices_of_another_protocol_or_scenario_are_refused_with_the_reason() -> None:
    """Before the honest shards connect: a Hello of another protocol, one of another scenario (its fingerprint
    differs) and one naming ids outside the population each get a Refusal frame saying why, then the close,
    and are counted by cause; a device client of another scenario (epsilon 2) stops at once with that reason
    instead of reconnecting. A Hello without a fingerprint (an older client) is served. The honest run's
    digests equal the simulated run's."""
    from agents.client import CollectorRefused

    sc = scenario()
    h = Harness(sc, FAST)
    await h.listen()
    h.start_run()
    n = sc.devices
    for msg, needle in ((Hello(1, "kflip", np.arange(5, dtype=np.uint32)), "protocol 'kflip'"),
                        (Hello(1, PROTOCOL, np.arange(5, dtype=np.uint32), scenario=bytes(32)), "another scenario"),
                        (Hello(1, PROTOCOL, np.array([n], np.uint32)), f"outside the population of {n}")):
        reader, writer = await connect(h.port)
        writer.write(frame(wire.encode(msg)))
        refusal = await read_frame(reader)
        assert isinstance(refusal, Refusal) and needle in refusal.reason, refusal
        assert await closed_by_server(reader)
        writer.close()
    eps2 = protocol_scenario(PROTOCOL, **{"population.devices": n, "rounds": 6, "simulation.cohort_size": 100,
                                          "network.loss": 0, "network.jitter": 0, "protocol.epsilon": 2.0})
    other = live.build_client(eps2, live.shard(n, 0, 2), Ledger(n), HOST, h.port)
    with pytest.raises(CollectorRefused, match="another scenario"):
        await asyncio.wait_for(other.run(), 10)
    assert other.connections == 1  # it did not try again
    h.start_clients()
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"protocol": 1, "scenario": 2, "ids_out_of_range": 1}
    assert no_stage_timeouts(h)


@pytest.mark.asyncio
async def test_a_hello_outside_the_population_is_refused_as_a_forged_one_and_tells_nothing_of_it(monkeypatch) -> None:
    """With a secret, a Hello naming ids beyond the population (millions of them would take seconds of key
    derivation) takes a forged Hello's path: refused after one derivation (the probe), on a worker thread, and
    told what a bad MAC is told (not the population size); the counter says out of range. It used to be refused
    before any derivation, 2.7 times faster than a forged Hello of ids in range, which told an attacker the
    population size by timing (an attacker's finding). An honest Hello's MAC is checked on a worker thread, not
    on the event loop that serves every connection. The honest run is the simulated run."""
    import threading

    derived: list[int] = []
    threads: list[int] = []
    real_keys = auth.device_keys

    def counting_keys(secret, ids):
        derived.append(len(ids))
        return real_keys(secret, ids)

    def recording(check):
        def recorded(*args):
            threads.append(threading.get_ident())
            return check(*args)
        return recorded

    monkeypatch.setattr(auth, "device_keys", counting_keys)
    monkeypatch.setattr(auth, "check_sample", recording(auth.check_sample))
    monkeypatch.setattr(auth, "check_full", recording(auth.check_full))
    h = await started(settings=dataclasses.replace(FAST, secret=SECRET))
    await h.registered()
    n = h.sc.devices
    derived.clear()
    before = len(threads)
    reader, writer = await connect(h.port)
    challenge = await read_frame(reader)
    assert isinstance(challenge, Challenge)
    writer.write(hello(np.arange(n - 10, n + 5000), mac=bytes(64)))
    refusal = await read_frame(reader)
    while not isinstance(refusal, Refusal):  # (the round's broadcasts go to every connection)
        refusal = await read_frame(reader)
    assert isinstance(refusal, Refusal) and refusal.reason == "hello without a valid mac for its devices"
    assert str(n) not in refusal.reason
    assert await closed_by_server(reader)
    writer.close()
    assert derived == [1] and len(threads) == before + 1  # the probe's key, derived off the event loop
    got = await h.finish()
    assert got["digests"] == simulated() and h.server.drops == {"ids_out_of_range": 1}
    assert threads and threading.get_ident() not in threads  # the honest Hellos: verified off the loop's thread


@pytest.mark.asyncio
async def test_a_device_client_under_another_secret_stops_with_the_reason() -> None:
    """A shard whose credentials come from another secret stops with a reason, instead of reconnecting twenty
    times a second for ever: the collector's Challenge names the key id of its secret, so the client says both
    key ids and sends no Hello (before, it learnt only that its Hello's MAC was not valid, as a shard with
    another shard's keys does); the honest shards' run is the simulated run."""
    import hmac

    from agents.client import CollectorRefused

    h = await started(settings=dataclasses.replace(FAST, secret=SECRET))
    await h.registered()
    n = h.sc.devices
    other = b"not the deployment secret at all"
    stranger = live.build_client(h.sc, np.arange(n, dtype=np.int64)[:1], Ledger(n), HOST, h.port, secret=other)
    ours, theirs = (hmac.digest(s, b"ldpsim/key-id/v1", "sha256")[:8].hex() for s in (SECRET, other))
    with pytest.raises(CollectorRefused, match=f"authenticates devices under key id {ours}, and these devices' "
                                               f"credentials are of key id {theirs}: another deployment's"):
        await asyncio.wait_for(stranger.run(), 10)
    assert stranger.connections == 1, (h.server.drops, h.log()[-8:])
    got = await h.finish()
    assert got["digests"] == simulated() and "auth" not in h.server.drops, h.server.drops


@pytest.mark.asyncio
async def test_a_challenge_without_a_key_id_is_answered() -> None:
    """An older collector's Challenge names no key id: a client holding credentials answers it with its Hello,
    as before (a collector of another deployment then refuses the MAC)."""
    hello_seen = asyncio.get_running_loop().create_future()

    async def older_collector(reader, writer):
        writer.write(frame(wire.encode(Challenge(1, PROTOCOL, b"\x01" * 32))))
        await writer.drain()
        hello_seen.set_result(wire.decode((await reader.readexactly(
            int.from_bytes(await reader.readexactly(4), "big")))))
        writer.write(frame(wire.encode(Refusal(1, PROTOCOL, "hello without a valid mac for its devices"))))
        await writer.drain()
        writer.close()

    from agents.client import CollectorRefused

    server = await asyncio.start_server(older_collector, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    sc = scenario()
    client = live.build_client(sc, np.arange(2, dtype=np.int64), Ledger(sc.devices), HOST, port,
                               secret=b"not the deployment secret at all")
    try:
        with pytest.raises(CollectorRefused, match="without a valid mac"):
            await asyncio.wait_for(client.run(), 10)
        got = await hello_seen
        assert isinstance(got, Hello) and got.mac is not None and list(got.devices) == [0, 1]
    finally:
        server.close()
        await server.wait_closed()


def test_a_collector_cannot_choose_the_times_in_the_devices_ledger() -> None:
    """A device's charge time comes from the collector's deadline (the simulator's answer time), so a hostile
    collector wrote 1e308 and -3600 into the device ledger; the client keeps it inside the round's nominal
    window [start, start + MAX_STAGES deadlines + latency], and an honest deadline is kept as it is."""
    from agents import client as client_module

    sc = scenario()
    start = lambda t: (t - 1) * sc.simulation.round_seconds  # noqa: E731
    window = client_module.MAX_STAGES * sc.network.deadline + sc.network.latency
    for t, deadline in ((1, 1e308), (2, 0.0), (3, start(3) + sc.network.deadline)):
        ledger = Ledger(sc.devices)
        c = live.build_client(sc, live.shard(sc.devices, 0, 2), ledger, HOST, 1)
        c.answer(CollectionRequest(round=t, protocol=PROTOCOL, deadline=deadline))
        times = ledger.snapshot()["time"]
        assert times.size and np.all(times >= start(t)) and np.all(times <= start(t) + window), (t, times)
        if t == 3:  # honest: the simulator's answer time, deadline - deadline + latency after the round's start
            assert np.all(times == start(3) + sc.network.latency)


@pytest.mark.asyncio
async def test_a_client_leaves_a_collector_that_stalls_mid_frame() -> None:
    """A hostile collector that reads the Hello, then sends 3 bytes of a frame header and nothing more, held a
    device client for ever; now the frame must end within the client's frame timeout, after which it drops the
    connection and connects again."""
    sc = scenario()
    hellos: list[bytes] = []

    async def stall(reader, writer):
        hellos.append(await reader.read(1 << 16))
        writer.write(b"\x00\x00\x01")  # the start of a 4-byte length, never finished
        await writer.drain()
        await asyncio.sleep(30)

    server = await asyncio.start_server(stall, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    client = live.build_client(sc, live.shard(sc.devices, 0, 2), Ledger(sc.devices), HOST, port)
    client.frame_timeout = 0.3
    task = asyncio.create_task(client.run())
    try:
        for _ in range(300):
            if client.connections >= 3:
                break
            await asyncio.sleep(0.02)
        assert client.connections >= 3 and not task.done()  # it left the stalled frames and came back
        assert len(hellos) >= 2
    finally:
        task.cancel()
        server.close()


@pytest.mark.asyncio
async def test_a_client_whose_hellos_keep_being_closed_backs_off() -> None:
    """A shard whose devices another connection holds is closed right after every Hello (no reason is sent:
    the holder may be a dead connection the collector has not noticed yet). It keeps trying, but backs off
    exponentially (up to 2 s) instead of reconnecting twenty times a second; the run is unharmed."""
    h = await started(settings=dataclasses.replace(FAST, round_pause=0.6))  # the run outlasts the wait below
    await h.registered()
    dup = live.build_client(h.sc, live.shard(h.sc.devices, 0, 2), Ledger(h.sc.devices), HOST, h.port)
    task = asyncio.create_task(dup.run())
    await asyncio.sleep(2.0)
    assert not task.done() and 3 <= dup.connections <= 7  # 0.1 + 0.2 + 0.4 + 0.8 s of backoff, not 40 attempts
    task.cancel()
    got = await h.finish()
    assert got["digests"] == simulated()


@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
async def test_a_duplicate_shard_is_refused(secret) -> None:
    """A second client for shard 0 (the same devices; with the secret, valid credentials too) keeps being
    refused while the first holds them; the first one's run is the simulated run."""
    sc = scenario()
    h = await started(settings=dataclasses.replace(FAST, secret=secret))
    await h.registered()
    dup = live.build_client(sc, live.shard(sc.devices, 0, 2), Ledger(sc.devices), HOST, h.port, secret=secret)
    dup_task = asyncio.create_task(dup.run())
    try:
        got = await h.finish()
    finally:
        dup_task.cancel()
    assert got["digests"] == simulated()
    assert h.server.drops.get("ids_held", 0) >= 1 and set(h.server.drops) == {"ids_held"}
    assert no_stage_timeouts(h)


@pytest.mark.asyncio
async def test_out_of_range_ids_are_refused_without_wraparound() -> None:
    """Hello ids of 2^63, 2^64 - 1, the population size, a negative id (hand-made msgpack: an i8 array, a plain
    list, an int) and a duplicate id are refused and counted, never an IndexError or a wrapped index; a report
    batch naming 2^63 sent before any Hello drops its connection. Honest digests are unaffected."""
    h = await started()
    await h.registered()
    n = h.sc.devices
    for ids, dtype in (([2**63], np.uint64), ([2**64 - 1], np.uint64), ([0, 2**63], np.uint64), ([n], np.uint32),
                       ([n], np.uint64)):
        await send_and_expect_close(h.port, hello(ids, dtype))
    body = {"v": 1, "type": "hello", "round": 1, "protocol": PROTOCOL}
    negative_i8 = msgpack.ExtType(wire.ARRAY_EXT, struct.pack("<BI", 5, 1) + struct.pack("<q", -1))
    duplicate = msgpack.ExtType(wire.ARRAY_EXT, struct.pack("<BI", 2, 2) + struct.pack("<II", 3, 3))
    for devices in (negative_i8, [-1], -1, duplicate):
        await send_and_expect_close(h.port, frame(msgpack.packb({**body, "devices": devices}, use_bin_type=True)))
    # a batch without a hello, naming device 2^63: a peer that holds no device has nothing to send but a Hello
    batch = ReportBatch(1, PROTOCOL, np.array([2**63], np.uint64), {"bit": wire.bits(np.ones(1))})
    await send_and_expect_close(h.port, frame(wire.encode(batch)))
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"ids_out_of_range": 5, "malformed": 4, "no_hello": 1}
    assert no_stage_timeouts(h)


# ----------------------------------------------------------------------------------------------- resources
@pytest.mark.asyncio
async def test_a_registered_reader_whose_socket_stops_taking_broadcasts_is_dropped_at_the_write_timeout() -> None:
    """A broadcast waits for a registered connection's full socket at most the write timeout, then drops it
    (counted as write_timeout, its devices freed): a reader that stops reading never holds up a stage. (The
    collector's own _broadcast with a connection whose transport never drains.)"""
    sc = scenario(devices=40, rounds=2, cohort=40)
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, write_timeout=0.2))

    class Full:  # a transport whose send buffer never empties
        def is_closing(self):
            return False

        def get_write_buffer_size(self):
            return 1 << 20

        def abort(self):
            pass

    class Stuck:
        transport = Full()

        def write(self, data):
            pass

        async def drain(self):
            await asyncio.sleep(3600)

    conn = server_module.Connection(Stuck(), serial=1, devices=np.arange(20), hello=True, ready=True)
    server.connections.add(conn)
    t0 = time.perf_counter()
    await server._broadcast(CollectionRequest(round=1, protocol=PROTOCOL, deadline=1.0))
    assert time.perf_counter() - t0 < 2 and conn.closed and conn not in server.connections
    assert server.drops == {"write_timeout": 1}


@pytest.mark.asyncio
async def test_a_stopped_client_is_dropped_and_a_new_one_takes_its_devices() -> None:
    """A client that registered shard 1 and then stops (SIGSTOP, a dead host: the socket stays open) held its
    devices to the end of the run, every later Hello for them refused as held. After unresponsive_stages (3)
    stage timeouts without its acknowledgement it is dropped (``unresponsive``), a client started for the same
    shard is admitted, and that shard's reports land again."""
    settings = dataclasses.replace(FAST, stage_timeout=0.3, round_pause=0.05)
    h = Harness(scenario(rounds=10), settings, connections=2)
    await h.listen()
    sc, days = h.sc, live.process_days(h.sc)
    honest = live.build_client(sc, live.shard(sc.devices, 0, 2), h.ledger, HOST, h.port, days)
    reader, writer = await connect(h.port)  # shard 1's client: says Hello, then never answers
    writer.write(hello(live.shard(sc.devices, 1, 2)))
    await writer.drain()
    h.clients, h.tasks = [honest], [asyncio.create_task(honest.run())]
    h.start_run()
    await h.registered()
    while h.server.drops.get("unresponsive", 0) == 0 and not h.run_task.done():
        await asyncio.sleep(0.02)
    assert h.server.drops == {"unresponsive": 1}, h.server.drops
    stand_in = live.build_client(sc, live.shard(sc.devices, 1, 2), Ledger(sc.devices), HOST, h.port,
                                 live.process_days(sc))
    h.clients.append(stand_in)
    h.tasks.append(asyncio.create_task(stand_in.run()))
    await h.finish()
    writer.close()
    per_round = [r.reports for r in h.book.records]
    assert per_round[:3] == [200] * 3 and per_round[-1] == 400, per_round  # 3 strikes, then shard 1 is back


@pytest.mark.asyncio
async def test_trickled_oversized_and_budget_busting_frames_are_dropped() -> None:
    """A frame sent one byte every 50 ms is dropped once the read timeout has passed since its first byte (each
    byte does not restart the clock); a frame announcing more than the limit is dropped before its body; two
    incomplete frames above the buffer budget get the second one dropped. Honest digests are unaffected."""
    settings = dataclasses.replace(FAST, buffer_budget=100_000, read_timeout=0.5)
    h = await started(settings=settings)
    await h.registered()

    async def trickle() -> float:
        reader, writer = await connect(h.port)
        t0 = time.monotonic()
        payload = hello([0])
        try:
            for i in range(len(payload)):  # 40-odd bytes: 2 s at 50 ms each, if it were never dropped
                writer.write(payload[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
        except ConnectionError:
            pass
        assert await closed_by_server(reader)
        writer.close()
        return time.monotonic() - t0

    took = await trickle()
    assert took < 1.5
    await send_and_expect_close(h.port, struct.pack(">I", wire.MAX_MESSAGE_BYTES + 1) + b"x" * 10)
    # before its Hello a connection sends no frame longer than a Hello of the whole population (400 ids)
    limit = server_module.hello_frame_limit(h.sc.devices)
    assert limit < 100_000
    await send_and_expect_close(h.port, struct.pack(">I", limit + 1) + b"x" * 10)
    reader_a, writer_a = await connect(h.port)
    writer_a.write(struct.pack(">I", 60_000) + b"a" * 55_000)
    await writer_a.drain()
    await asyncio.sleep(0.05)
    await send_and_expect_close(h.port, struct.pack(">I", 60_000) + b"b" * 55_000)  # 110,000 > 100,000
    assert await closed_by_server(reader_a)  # then the first one's read timeout
    writer_a.close()
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"read_timeout": 2, "oversized": 2, "buffer_budget": 1}
    assert h.server.registered_pool.total == 0 and h.server.unregistered_pool.total == 0


@pytest.mark.asyncio
async def test_peers_without_a_hello_cannot_spend_a_registered_connection_s_buffer_budget() -> None:
    """An unregistered peer holding most of the buffer budget in an incomplete frame: a registered connection's
    own incomplete frame of the same size is not dropped (the peers before their Hello have a pool of their own;
    before, whichever connection crossed the shared line was dropped, so a peer without credentials could cost
    honest shards their report batches)."""
    settings = dataclasses.replace(FAST, buffer_budget=100_000, read_timeout=2.0)
    h = Harness(scenario(), settings)
    await h.listen()
    reader_r, writer_r = await connect(h.port)
    writer_r.write(hello(range(h.sc.devices)))  # this connection registers the whole population
    await h.registered()
    reader_u, writer_u = await connect(h.port)
    writer_u.write(struct.pack(">I", 60_000) + b"u" * 55_000)
    await writer_u.drain()
    await asyncio.sleep(0.1)
    writer_r.write(struct.pack(">I", 60_000) + b"r" * 55_000)  # 110,000 bytes held in all, 55,000 in each pool
    await writer_r.drain()
    await asyncio.sleep(0.1)
    try:
        assert "buffer_budget" not in h.server.drops, h.server.drops
        assert h.server.registered_pool.total >= 55_000 and h.server.unregistered_pool.total >= 55_000
        assert not reader_r.at_eof()
    finally:
        writer_r.close()
        writer_u.close()
        await h.server.close()


@pytest.mark.asyncio
async def test_peers_filling_the_unregistered_pool_from_other_hosts_lose_their_own_connections() -> None:
    """Four peers, on four hosts (127.0.0.2-5), hold 98,600 bytes of incomplete frames in the unregistered pool
    (budget 100,000); an honest Hello of the whole population from 127.0.0.1 then crosses the line. Before, the
    connection that crossed it was dropped, so peers without credentials kept honest clients out for as long as
    they refilled the pool (two 50,000-device shards: 8.5 s instead of 0.8). Now the host holding the most gives
    way: one peer is dropped (``buffer_budget``), the honest connection registers every device and is kept."""
    settings = dataclasses.replace(FAST, buffer_budget=100_000, read_timeout=5.0)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, settings)
    port = await server.start(HOST, 0)
    peers = []
    try:
        for i in range(4):
            reader, writer = await asyncio.open_connection(HOST, port, local_addr=(f"127.0.0.{2 + i}", 0))
            writer.write(struct.pack(">I", 60_000) + bytes([i]) * (24_500 + 100 * i))  # the last host holds most
            await writer.drain()
            peers.append((reader, writer))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server.unregistered_pool.total >= 98_616:
                break
        assert server.unregistered_pool.total == 4 * (4 + 24_500) + 600, server.unregistered_pool.total  # headers too
        reader, writer = await connect(port)
        writer.write(hello(range(sc.devices)))  # 1,600-odd bytes of frame and of ids: over the budget
        await writer.drain()
        await asyncio.wait_for(server._registered.wait(), 5)
        assert server.drops == {"buffer_budget": 1}, server.drops
        assert await closed_by_server(peers[3][0], 2)  # the host holding the most
        assert not any([await closed_by_server(r, 0.05) for r, _ in peers[:3]])
        assert not await closed_by_server(reader, 0.05)
        writer.close()
    finally:
        for _, w in peers:
            w.close()
        await server.close()


def test_buffer_pool_drops_from_the_host_holding_the_most() -> None:
    """collector/shares.py: bytes counted by connection and host, never below none; over budget, the connection
    that crossed the line is the victim when its host holds the most (ties included), else the largest
    connection of the host that does."""
    from collector.shares import BufferPool

    pool: BufferPool[str] = BufferPool(100)
    pool.add("a1", "A", 30)
    pool.add("a2", "A", 25)
    pool.add("b1", "B", 40)
    assert (pool.total, pool.host_bytes("A"), pool.host_bytes("B"), pool.over) == (95, 55, 40, False)
    pool.add("b1", "B", 10)
    assert pool.over and pool.victim("b1", "B") == ("a1", "A")  # A holds 55, B 50: A's largest gives way
    pool.add("b2", "B", 5)
    assert pool.victim("b2", "B") == ("b2", "B")  # B holds 55 too: the one that crossed
    assert pool.remove("a1", "A") == 30 and pool.held("a1", "A") == 0
    pool.add("a2", "A", -1_000)  # never below none, and an empty host is forgotten
    assert (pool.total, pool.host_bytes("A"), pool.held("a2", "A")) == (55, 0, 0)
    assert pool.victim("b2", "B") == ("b2", "B")
    pool.add("c1", "C", 0)
    assert pool.host_bytes("C") == 0 and pool.total == 55


@pytest.mark.asyncio
async def test_a_connection_flood_beyond_the_limit() -> None:
    """With a limit of 20 connections, 60 idle connections from one host arrive with the honest clients (the
    same host): beyond half the limit the host's idle connections are closed at once and counted (``host_limit``),
    the honest clients get in by taking the places of idle ones open for more than half the hello timeout
    (``evicted``), the rest of the idle ones are dropped at the hello timeout, and the run's digests equal the
    simulated run's. The log holds at most one line per drop cause per round (plus the counts)."""
    settings = dataclasses.replace(FAST, max_connections=20, hello_timeout=1.0)
    h = Harness(scenario(), settings, connections=4)
    await h.listen()
    opened = await asyncio.gather(*(asyncio.wait_for(asyncio.open_connection(HOST, h.port), 5) for _ in range(60)),
                                  return_exceptions=True)
    flood = [c for c in opened if isinstance(c, tuple)]
    assert len(flood) == 60
    h.start_clients()
    h.start_run()
    got = await h.finish(timeout=60)
    for _, writer in flood:
        writer.close()
    assert got["digests"] == simulated()
    drops = h.server.drops
    assert drops.get("host_limit", 0) >= 50, drops  # 60 - 10 at once, and honest attempts before any was old
    assert 1 <= drops.get("evicted", 0) <= 4 + 10, drops
    assert set(drops) <= {"host_limit", "evicted", "hello_timeout"}, drops
    lines = [e for e in h.log() if e.get("event") == "connection_dropped"]
    assert len(lines) == len({(e["cause"], e["round"]) for e in lines}) < 10
    counts = [e for e in h.log() if e.get("event") == "connections_dropped"]
    assert sum(e["counts"].get("host_limit", 0) for e in counts) == drops["host_limit"]


@pytest.mark.asyncio
async def test_at_the_limit_only_the_oldest_idle_connection_past_the_eviction_age_makes_room() -> None:
    """Limit 2, one registered connection and one idle: a newcomer while the idle one is younger than the
    eviction age (half the hello timeout here) is closed (``connection_limit``), so an honest client
    mid-handshake is never pushed out; once it is older, a newcomer takes its place (``evicted``), never that of
    the registered connection, older as it is."""
    settings = dataclasses.replace(FAST, max_connections=2, max_pending_per_host=10, hello_timeout=1.0)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, settings)
    port = await server.start(HOST, 0)
    try:
        r1, w1 = await connect(port)
        w1.write(hello(range(5)))
        await w1.drain()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if server._held == 5:
                break
        await asyncio.sleep(0.6)  # the registered connection is past the eviction age
        r2, w2 = await connect(port)
        await asyncio.sleep(0.05)
        r3, w3 = await connect(port)
        assert await closed_by_server(r3, 1.0) and server.drops == {"connection_limit": 1}, server.drops
        await asyncio.sleep(0.6)  # the idle one is past min(EVICT_AGE, hello_timeout / 2) too
        r4, w4 = await connect(port)
        assert await closed_by_server(r2, 1.0), server.drops
        assert server.drops == {"connection_limit": 1, "evicted": 1}, server.drops
        assert server._held == 5 and not await closed_by_server(r4, 0.1)
        for w in (w1, w2, w3, w4):
            w.close()
    finally:
        await server.close()


async def _keep_idle(port: int, source: str, stop: asyncio.Event, opened: list[int]) -> None:
    """An idle peer from ``source`` that says nothing and reconnects as soon as it is closed or refused."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(HOST, port, local_addr=(source, 0)), 5)
        except (OSError, asyncio.TimeoutError):
            await asyncio.sleep(0.01)
            continue
        opened.append(1)
        try:
            while not stop.is_set():
                try:
                    if not await asyncio.wait_for(reader.read(1 << 16), 0.1):
                        break
                except asyncio.TimeoutError:
                    continue
                except OSError:
                    break
        finally:
            writer.close()
        await asyncio.sleep(0.001)


async def run_among_idle_peers(h: Harness, sources: list[str], fill: int, check=lambda: True) -> dict:
    """Idle peers from ``sources`` (one each, reconnecting at once: :func:`_keep_idle`) until ``fill``
    connections are open (and ``check()`` holds), then the harness's honest clients and run; its summary."""
    await h.listen()
    stop, opened = asyncio.Event(), []
    peers = [asyncio.create_task(_keep_idle(h.port, source, stop, opened)) for source in sources]
    try:
        for _ in range(200):
            await asyncio.sleep(0.05)
            if len(h.server.connections) >= fill:
                break
        assert len(h.server.connections) == fill and check(), len(h.server.connections)
        h.start_clients()
        h.start_run()
        return await h.finish(timeout=90)
    finally:
        stop.set()
        await asyncio.gather(*peers, return_exceptions=True)


@pytest.mark.asyncio
@pytest.mark.parametrize("hosts, peers", [(20, 20), (1, 40)], ids=["one-idle-peer-on-each-of-20-hosts",
                                                                      "40-idle-peers-on-one-host"])
async def test_idle_peers_reconnecting_at_once_cannot_keep_honest_clients_out(hosts, peers) -> None:
    """Idle peers (no Hello, hello timeout 30 s) that reconnect as soon as they are closed, first to connect and
    enough to fill the limit of 20: before, they held every slot for the whole startup wait and the honest
    clients never got in. Now a newcomer takes the place of a connection without a Hello open for a second
    (``evicted``), and one host holds at most half the slots without a Hello (``host_limit``): every honest
    device is in at the start and the digests equal the simulated run's. The peers come from 127.0.0.2 and up
    (loopback addresses), the honest clients from 127.0.0.1."""
    settings = dataclasses.replace(FAST, max_connections=20, hello_timeout=30.0, startup_timeout=25.0)
    h = Harness(scenario(), settings, connections=4)
    # the limit filled (or the host's half) before the honest clients come
    got = await run_among_idle_peers(h, [f"127.0.0.{2 + i % hosts}" for i in range(peers)], min(20, 10 * hosts))
    assert got["live"]["devices_at_start"] == h.sc.devices, h.server.drops
    assert got["digests"] == simulated()
    drops = h.server.drops
    assert set(drops) <= {"evicted", "host_limit", "connection_limit"}, drops
    if hosts > 1:  # the honest clients took the places of idle peers
        assert drops.get("evicted", 0) >= 1 and "host_limit" not in drops, drops
    else:  # the peers' host was held to its half: the honest clients found free slots
        assert drops.get("host_limit", 0) > 0, drops


@pytest.mark.asyncio
async def test_a_crowded_host_gives_way_to_a_host_with_fewer_connections_at_once(monkeypatch) -> None:
    """40 idle peers on 4 hosts (127.0.0.2-5) that reconnect as soon as they are closed fill the limit of 20,
    and no connection ever reaches the eviction age (60 s here): before, a newcomer at the limit could only take
    the place of a connection past that age, so the honest clients (127.0.0.1) never got in. Now the host with
    the most connections without a Hello loses its oldest to a newcomer from a host with at least two fewer,
    whatever its age: every honest device is in at the start and the digests equal the simulated run's."""
    monkeypatch.setattr(server_module, "EVICT_AGE", 60.0)
    settings = dataclasses.replace(FAST, max_connections=20, hello_timeout=150.0, startup_timeout=10.0)
    h = Harness(scenario(), settings, connections=4)
    got = await run_among_idle_peers(h, [f"127.0.0.{2 + i % 4}" for i in range(40)], 20,
                                     lambda: h.server.pending.crowded()[1] >= 5)
    assert got["live"]["devices_at_start"] == h.sc.devices, h.server.drops
    assert got["digests"] == simulated()
    assert h.server.drops.get("evicted", 0) >= 4 and set(h.server.drops) <= {"evicted", "connection_limit"}


def test_pending_connections_know_the_most_crowded_host() -> None:
    """collector/shares.py: connections without a Hello, oldest first, in all and by host; the host with the
    most (the first to reach that many) in constant time, kept right as connections come and go."""
    from collector.shares import Pending

    pending: Pending[str] = Pending()
    assert pending.crowded() is None and len(pending) == 0
    for conn, host in [("a1", "A"), ("b1", "B"), ("b2", "B"), ("a2", "A"), ("c1", "C"), ("a3", "A")]:
        pending.add(conn, host)
    assert pending.crowded() == ("A", 3) and list(pending.all) == ["a1", "b1", "b2", "a2", "c1", "a3"]
    assert list(pending.of("A")) == ["a1", "a2", "a3"] and pending.count("C") == 1 and pending.count("D") == 0
    pending.discard("a1", "A")
    assert pending.crowded() == ("B", 2)  # B reached 2 before A came back down to it
    pending.discard("b1", "B")
    pending.discard("b1", "B")  # twice: nothing
    assert pending.crowded() == ("A", 2) and len(pending) == 4
    for conn, host in [("a2", "A"), ("a3", "A"), ("b2", "B"), ("c1", "C")]:
        pending.discard(conn, host)
    assert pending.crowded() is None and len(pending) == 0 and pending.of("A") == {}


@pytest.mark.asyncio
async def test_deep_nesting_is_a_wire_error_and_the_run_is_unaffected() -> None:
    """A Hello whose protocol field is nested 1,000 arrays deep, and a frame of a million empty arrays: each is a
    WireError (no RecursionError, no gigabytes of objects); the connection is dropped and counted (the second,
    5 MB before any Hello, as oversized: longer than a Hello of the population)."""
    deep = b"\x91" * 1000 + b"\x01"
    doc = (b"\x84" + msgpack.packb("v") + b"\x01" + msgpack.packb("type") + msgpack.packb("hello")
           + msgpack.packb("round") + b"\x01" + msgpack.packb("protocol") + deep)
    wide = b"\xdd" + struct.pack(">I", 1_000_000) + b"\x90" * 1_000_000
    for raw in (doc, wide):
        with pytest.raises(wire.WireError):
            wire.decode(raw)
    h = await started()
    await h.registered()
    for raw in (doc, wide):
        await send_and_expect_close(h.port, frame(raw))
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"malformed": 1, "oversized": 1}


# ----------------------------------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def self_signed():
    """A self-signed certificate for 127.0.0.1 shipped with the tests (tests/data/tls: test use only)."""
    d = Path(__file__).parent / "data" / "tls"
    return str(d / "cert.pem"), str(d / "key.pem")


@pytest.mark.asyncio
async def test_tls_with_device_authentication(self_signed) -> None:
    """Over TLS with a secret: the honest run equals the simulated run; a plaintext client is dropped (tls) and a
    client that does not trust the certificate cannot connect."""
    import ssl

    cert, key = self_signed
    settings = dataclasses.replace(FAST, secret=SECRET, tls=live.server_tls(cert, key))
    h = await started(settings=settings, client_tls=live.client_tls(cert))
    await h.registered()
    await send_and_expect_close(h.port, hello([0]))  # plaintext
    with pytest.raises(ssl.SSLError):
        await asyncio.wait_for(asyncio.open_connection(HOST, h.port, ssl=ssl.create_default_context()), 5)
    got = await h.finish()
    assert got["digests"] == simulated()
    assert got["live"]["tls"] is True
    assert set(h.server.drops) == {"tls"} and h.server.drops["tls"] == 2


# ----------------------------------------------------------------------------------------------- processes
def test_serve_exits_with_an_idle_connection_open(tmp_path) -> None:
    """`ldpsim serve` and `ldpsim devices` with --secret-file, and one idle connection that never says hello: the
    server finishes the run and exits (on Python 3.12.1+ Server.wait_closed() waits for every client: the
    connections are closed first). Its summary.json has the live section."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    (tmp_path / "secret").write_bytes(SECRET)
    sets = ["--set", "population.devices=300", "--set", "rounds=3", "--set", "network.loss=0"]
    cmd = [sys.executable, "-m", "scenarios.cli"]
    common = ["--secret-file", str(tmp_path / "secret")]
    server = subprocess.Popen(cmd + ["serve", "quickstart", "--port", str(port), "--out", str(tmp_path / "srv"),
                                     "--hello-timeout", "300"] + common + sets,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    idle = socket.socket()
    shard = None
    try:
        for _ in range(300):  # up to 30 s for the server to listen
            try:
                idle.connect((HOST, port))
                break
            except OSError:
                idle.close()
                idle = socket.socket()
                time.sleep(0.1)
        shard = subprocess.Popen(cmd + ["devices", "quickstart", "--connect", f"{HOST}:{port}", "--connections", "2"]
                                 + common + sets, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert shard.wait(timeout=60) == 0, shard.stderr.read().decode()[-2000:]
        # a device process given the secret itself is told that it could speak for every device
        assert "warning: --secret-file gives this process every device's credential" in shard.stderr.read().decode()
        assert server.wait(timeout=60) == 0, server.stderr.read().decode()[-2000:]
    finally:
        idle.close()
        for p in (server, shard):
            if p is not None:
                p.kill()
    summary = json.loads((tmp_path / "srv" / "summary.json").read_text())
    assert summary["live"]["authenticated"] is True
    assert summary["reports"]["accepted"] == 300 * 3


async def announcing_collector(length: int, body: int, hold: float = 0.0):
    """A hostile collector that announces a frame of ``length`` bytes, sends ``body`` of them, waits ``hold``
    seconds and closes; returns its server, port and a one-item list counting the connections it accepted."""
    accepted = [0]

    async def hostile(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        writer.write(struct.pack(">I", length) + b"x" * body)
        await writer.drain()
        await asyncio.sleep(hold)
        writer.close()

    server = await asyncio.start_server(hostile, HOST, 0)
    return server, server.sockets[0].getsockname()[1], accepted


@pytest.mark.asyncio
async def test_a_device_client_takes_no_collector_frame_longer_than_a_collector_message_can_be() -> None:
    """A collector announcing a 100 KB frame (every collector message is a few hundred bytes; the limit is
    wire.MAX_DOWNLINK_BYTES) is left at the frame's header and tried again, instead of being buffered up to
    64 MiB per connection while it trickles."""
    sc = protocol_scenario(PROTOCOL, **{"population.devices": 50, "rounds": 2})
    server, port, accepted = await announcing_collector(100_000, 70_000, hold=5.0)  # the rest never comes
    client = live.build_client(sc, live.shard(sc.devices, 0, 1), Ledger(sc.devices), HOST, port)
    client.backoff = (0.01, 0.02)
    task = asyncio.create_task(client.run())
    try:
        for _ in range(200):  # 2 s: a client that buffered the frame would wait for it (the frame timeout, 30 s)
            if accepted[0] >= 2:
                break
            await asyncio.sleep(0.01)
        assert accepted[0] >= 2 and client.connections >= 2, (accepted, client.connections)
    finally:
        task.cancel()
        server.close()
    assert wire.MAX_DOWNLINK_BYTES >= 1024 and client.max_frame == wire.MAX_DOWNLINK_BYTES


@pytest.mark.asyncio
async def test_a_collector_sending_an_oversized_frame_is_left_and_tried_again() -> None:
    """A collector whose first bytes announce a frame over the limit: the device client drops the connection
    and connects again (it used to end in a FrameTooLarge traceback); it never reports, so nothing is charged,
    and with no collector left it stops with the one ConnectionError `ldpsim devices` turns into one line."""
    sc = protocol_scenario(PROTOCOL, **{"population.devices": 50, "rounds": 2})
    server, port, accepted = await announcing_collector(0xFFFFFFF0, 64)
    ledger = Ledger(sc.devices)
    client = live.build_client(sc, live.shard(sc.devices, 0, 1), ledger, HOST, port)
    client.backoff, client.give_up_after = (0.01, 0.02), 0.3
    task = asyncio.create_task(client.run())
    for _ in range(500):  # 5 s at most: a client that died at the first frame never comes back
        if accepted[0] >= 3 or task.done():
            break
        await asyncio.sleep(0.01)
    assert accepted[0] >= 3 and not task.done(), task.exception() if task.done() else accepted
    server.close()
    await server.wait_closed()
    with pytest.raises(ConnectionError, match="no collector at"):
        await asyncio.wait_for(task, 10)
    assert client.connections >= 3 and not ledger.spend.any()


@pytest.mark.asyncio
async def test_a_client_counts_the_collector_frames_it_cannot_decode() -> None:
    """Frames a device client cannot decode are skipped and counted (summary.json
    ``messages.rejected_by_devices`` of a live run; `ldpsim devices` prints them), never silently dropped: a
    collector sends two such frames, then a proper End, and the client finishes with 2 counted."""
    from protocols.messages import End

    sc = scenario()

    async def junk_then_end(reader, writer):
        await reader.read(1 << 16)  # the Hello
        writer.write(frame(b"\xc1 not msgpack") + frame(msgpack.packb({"type": "no such message"})))
        writer.write(frame(wire.encode(End(round=1, protocol=sc.protocol.name))))
        await writer.drain()
        await asyncio.sleep(1)
        writer.close()

    server = await asyncio.start_server(junk_then_end, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    client = live.build_client(sc, live.shard(sc.devices, 0, 1), Ledger(sc.devices), HOST, port)
    try:
        await asyncio.wait_for(client.run(), 10)
    finally:
        server.close()
    assert client.done and client.rejected == 2



@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
async def test_a_connection_that_has_not_said_hello_is_sent_no_broadcast(secret) -> None:
    """A peer that connects and never says Hello holds no device: the rounds' broadcasts (requests, the End)
    are not written to it (with a secret it gets its Challenge and nothing more); the run is unharmed."""
    from protocols.framing import FrameDecoder

    h = await started(settings=dataclasses.replace(FAST, secret=secret, round_pause=0.4))
    await h.registered()
    reader, writer = await asyncio.open_connection(HOST, h.port)
    got = b""
    try:
        while True:
            got += await asyncio.wait_for(reader.read(1 << 16), 2.0)
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
    frames = [wire.decode(raw) for raw in FrameDecoder(1 << 20).feed(got)]
    assert [type(m) for m in frames] == ([Challenge] if secret else []), frames
    assert (await h.finish())["digests"] == simulated()


@pytest.mark.asyncio
async def test_a_late_answer_costs_its_own_round_only() -> None:
    """One shard (a device process of its own) answers round 1 after the stage timeout (a cold JIT, a GC
    pause): its round-1 reports are late and refused, but its late acknowledgement must not close round 2's
    stage (it did, and every later round then closed before that shard's answers: 0 reports from it to the
    end). From round 2 on every device's report lands."""
    from agents.client import DeviceClient

    settings = dataclasses.replace(FAST, stage_timeout=0.5)
    h = Harness(scenario(), settings, connections=2)
    await h.listen()
    sc = h.sc
    h.clients = [live.build_client(sc, live.shard(sc.devices, i, 2), h.ledger, HOST, h.port, live.process_days(sc))
                 for i in range(2)]  # days of their own: two device processes
    slow, real = h.clients[1], DeviceClient._on_message

    async def late_in_round_1(msg, writer):
        if isinstance(msg, CollectionRequest):  # round 1 past the timeout, the others a little after the rest
            await asyncio.sleep(0.8 if msg.round == 1 else 0.05)
        return await real(slow, msg, writer)

    slow._on_message = late_in_round_1  # type: ignore[method-assign]
    h.tasks = [asyncio.create_task(c.run()) for c in h.clients]
    h.start_run()
    got = await h.finish()
    per_round = [r.reports for r in h.book.records]
    assert per_round == [200] + [400] * 5, per_round
    assert got["reports"]["accepted"] == 2200 and got["messages"]["late"] == 2  # its two round-1 batches


@pytest.mark.asyncio
async def test_devices_refused_mid_run_keep_what_they_spent() -> None:
    """A collector that asks for round 1, takes the answer, then refuses the devices: live.devices returns the
    ledger with round 1's charges and the refusal's reason (`ldpsim devices` writes that ledger, then exits 2
    with the reason) instead of raising past it and losing the spend."""
    from protocols.framing import FrameDecoder
    from protocols.messages import Refusal

    sc = scenario()

    async def ask_then_refuse(reader, writer):
        decoder = FrameDecoder(1 << 24)
        frames: list = []
        while not frames:
            frames = decoder.feed(await reader.read(1 << 16))  # the Hello
        writer.write(frame(wire.encode(CollectionRequest(round=1, protocol=PROTOCOL, deadline=sc.network.deadline))))
        await writer.drain()
        acked = False
        while not acked:
            for raw in decoder.feed(await reader.read(1 << 16)):
                msg = wire.decode(raw)
                acked = acked or (isinstance(msg, ReportBatch) and len(msg) == 0)
        writer.write(frame(wire.encode(Refusal(round=1, protocol=PROTOCOL, reason="go away"))))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(ask_then_refuse, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    try:
        outcome = await asyncio.wait_for(live.devices(sc, HOST, port, 0, 1), 20)
    finally:
        server.close()
    assert outcome.error is not None and outcome.error.endswith("refused the devices: go away")
    assert (outcome.ledger.spend > 0).all()  # every device answered round 1, and was charged for it


async def knock_with_a_bad_mac(port: int, ids, source: str | None = None, timeout: float = 5.0) -> bool:
    """Connect (from the loopback address ``source``, if given), answer the challenge with a Hello for ``ids``
    and a wrong MAC; whether the server closed the connection within ``timeout`` (refused, not registered)."""
    reader, writer = await (asyncio.open_connection(HOST, port, local_addr=(source, 0)) if source else connect(port))
    try:
        challenge = await read_frame(reader)
        writer.write(hello(ids, mac=b"\0" * 64, round_=challenge.round))
        await writer.drain()
        return await closed_by_server(reader, timeout=timeout)
    finally:
        writer.close()


@pytest.mark.asyncio
async def test_a_hello_queued_behind_slow_verifications_waits_at_most_the_hello_timeout(monkeypatch) -> None:
    """MACs are checked one Hello at a time: a Hello queued behind another's check is refused once it has
    waited the hello timeout (``hello_timeout``) rather than holding its connection and its bytes for as long
    as the queue takes (a flood of full-population Hellos held hundreds of MB)."""
    monkeypatch.setattr(server_module.auth, "check_sample", lambda *args: (time.sleep(1.0), False)[1])
    sc = scenario()
    settings = dataclasses.replace(FAST, secret=SECRET, hello_timeout=0.4)
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, settings)
    port = await server.start(HOST, 0)
    try:
        first = asyncio.ensure_future(knock_with_a_bad_mac(port, [1, 2, 3]))
        await asyncio.sleep(0.1)  # the first Hello's check has begun
        assert await knock_with_a_bad_mac(port, [1, 2, 3]) and await first
    finally:
        await server.close()
    assert server.drops == {"auth": 1, "hello_timeout": 1}, server.drops


@pytest.mark.asyncio
async def test_hellos_waiting_for_their_mac_check_count_against_the_buffer_budget(monkeypatch) -> None:
    """A Hello waiting for (or in) its MAC check holds its frame and its decoded ids: they count in the pool of
    the connections without an accepted Hello, so a queue of large Hellos is bounded by the buffer budget
    (``buffer_budget``) instead of growing with the connections (911 MB at 20,000 of them). The pool is empty
    again once the Hellos are refused."""
    monkeypatch.setattr(server_module.auth, "check_sample", lambda *args: (time.sleep(0.5), False)[1])
    sc = scenario(devices=20_000)
    settings = dataclasses.replace(FAST, secret=SECRET, buffer_budget=100_000, hello_timeout=5.0)
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, settings)
    port = await server.start(HOST, 0)
    try:
        first = asyncio.ensure_future(knock_with_a_bad_mac(port, range(10_000)))  # 40 KB of ids, twice
        await asyncio.sleep(0.2)  # the first Hello's check has begun
        held = server.unregistered_pool.total
        assert 80_000 <= held <= 100_000, held  # its frame (40 KB) and its ids (40 KB) are counted
        assert await knock_with_a_bad_mac(port, range(10_000)) and await first
    finally:
        await server.close()
    assert server.drops == {"auth": 1, "buffer_budget": 1}, server.drops
    assert server.unregistered_pool.total == 0


@pytest.mark.asyncio
async def test_a_collector_that_no_device_reached_says_which_connections_it_dropped() -> None:
    """serve with no device registered at the startup timeout fails with one line; peers that did connect and
    were dropped (here one sending garbage) are named in it, not lost."""
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, startup_timeout=0.5))
    port = await server.start(HOST, 0)
    try:
        await send_and_expect_close(port, frame(b"\xc1garbage"))
        with pytest.raises(ConnectionError, match=r"nothing to collect \(connections dropped: malformed 1\)$"):
            await server.run()
    finally:
        await server.close()


def test_serve_warns_of_rounds_that_closed_without_a_report(tmp_path, monkeypatch, capsys) -> None:
    """`ldpsim serve` whose rounds got no report (devices that always answered too late) says how many, above
    its last line, instead of only "mean |error| n/a"."""
    from scenarios import cli

    async def no_reports(sc, *args, **kwargs):
        result = runner.run(sc)
        result.extra["live"] = {"dropped": {}}
        return result

    monkeypatch.setattr(live, "serve", no_reports)
    argv = ["serve", "quickstart", "--port", "0", "--quiet", "--out", str(tmp_path / "srv"), "--set",
            "population.devices=200", "--set", "rounds=3", "--set", "network.loss=0.9999999"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "ldpsim: warning: 3 of 3 rounds closed without a report" in err, err


@pytest.mark.asyncio
async def test_an_embedded_live_run_lets_all_its_own_connections_in_at_once() -> None:
    """`ldpsim live` connects every client from one address at once: the per-address limit of connections
    without a Hello (by default half the connection limit, 82 of 164 here) is raised to the client count, so
    that none of its own 100 connections is refused and counted as dropped."""
    sc = scenario(devices=100, rounds=2, cohort=10)
    result = await live.run_embedded(sc, connections=100, settings=FAST)
    assert result.extra["live"]["dropped"] == {} and result.extra["live"]["connections"] == 100


def count_derivations(monkeypatch) -> list[int]:
    """The number of ids of each later auth.device_keys call (the collector's key derivations)."""
    derived: list[int] = []
    real_keys = auth.device_keys
    monkeypatch.setattr(auth, "device_keys", lambda secret, some: (derived.append(len(some)),
                                                                     real_keys(secret, some))[1])
    return derived


async def send_valid_hello(port: int, keys: bytes, ids, protocol: str = PROTOCOL, fingerprint: bytes | None = None):
    """Connect and send a Hello for ``ids`` with the valid MAC from their credentials ``keys`` (a leaked
    shard's), naming ``protocol`` and the scenario ``fingerprint``; the connection's reader and writer."""
    reader, writer = await connect(port)
    challenge = await read_frame(reader)
    mac = auth.hello_mac(keys, challenge.nonce, challenge.round, protocol, ids)
    writer.write(frame(wire.encode(Hello(round=challenge.round, protocol=protocol, devices=np.asarray(ids, np.uint32),
                                         mac=mac, scenario=fingerprint))))
    return reader, writer


@pytest.mark.asyncio
async def test_hellos_with_valid_credentials_for_registered_devices_cost_the_sample_not_the_full_mac(
        monkeypatch) -> None:
    """An attacker's finding: a taken-over shard (valid credentials) sending Hello after Hello for its own
    devices, already registered by its honest connection, made the collector derive every one of their keys
    each time (the full MAC came before the holder check): 50,000-device Hellos delayed another shard's
    registration from 1.2 s to 11 s. The holder is now checked after the probe and the sample, before the full
    MAC: each such Hello is refused (``ids_held``) after 65 derivations. The honest run is the simulated run."""
    sc = scenario()
    h = Harness(sc, dataclasses.replace(FAST, secret=SECRET))
    await h.listen()
    h.start_clients()
    await h.registered()  # the run starts after the knocks: the honest connections hold their devices meanwhile
    shard0 = live.shard(sc.devices, 0, 2)
    keys, derived = auth.device_keys(SECRET, shard0), count_derivations(monkeypatch)
    for _ in range(5):
        reader, writer = await send_valid_hello(h.port, keys, shard0)
        assert await closed_by_server(reader)
        writer.close()
    h.start_run()
    got = await h.finish()
    assert got["digests"] == simulated()
    assert h.server.drops == {"ids_held": 5}, h.server.drops
    assert derived == [1, auth.SAMPLE] * 5, derived  # the probe and the sample; never the shard's 200 keys


@pytest.mark.asyncio
async def test_a_flood_of_hellos_from_one_host_delays_another_host_s_hello_by_one_check(monkeypatch) -> None:
    """MACs are checked one Hello at a time, and each host has at most one Hello queued for that check: six
    Hellos from 127.0.0.2, each check taking 0.3 s, then one from 127.0.0.3. The second host's Hello is checked
    right after the one in progress, not after the other five (a flood of them from one host, say a shard
    whose credentials leaked, held every other host's registration behind the whole flood)."""
    checked: list[int] = []

    def slow_check(*args):
        checked.append(int(args[4][0]))
        time.sleep(0.3)
        return False

    monkeypatch.setattr(server_module.auth, "check_sample", slow_check)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    port = await server.start(HOST, 0)

    def knock(source: str, first: int):
        return knock_with_a_bad_mac(port, [first, first + 1], source, timeout=10)

    try:
        flood = [asyncio.ensure_future(knock("127.0.0.2", 1)) for _ in range(6)]
        await asyncio.sleep(0.15)  # the first check has begun; the other five wait
        assert await knock("127.0.0.3", 100)
        assert all(await asyncio.gather(*flood))
    finally:
        await server.close()
    assert sorted(checked) == [1] * 6 + [100] and checked.index(100) <= 1, checked
    assert server.drops == {"auth": 7}, server.drops
    assert server._lanes == {}  # no host's turn left behind


async def full_checks_recorded(monkeypatch, failing: tuple[int, ...], timeout: float):
    """A started collector whose sample check passes every Hello and whose full MAC check takes 0.2 s, records
    (first id, size) of each Hello it checks, and fails those whose first id is in ``failing``; with the list of
    checks and a ``knock(source, ids)`` that says whether the Hello was refused (rather than registered)."""
    checked: list[tuple[int, int]] = []

    def slow_full(*args):
        ids = args[4]
        checked.append((int(ids[0]), ids.size))
        time.sleep(0.2)
        return int(ids[0]) not in failing

    monkeypatch.setattr(server_module.auth, "check_sample", lambda *args: True)
    monkeypatch.setattr(server_module.auth, "check_full", slow_full)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    port = await server.start(HOST, 0)

    def knock(source: str, ids):
        return knock_with_a_bad_mac(port, ids, source, timeout=timeout)

    return server, checked, knock


@pytest.mark.asyncio
async def test_first_registrations_are_checked_before_hellos_of_suspect_devices_or_hosts(monkeypatch) -> None:
    """A peer holding a shard's credentials sends them with a few foreign ids (the sample passes, the full MAC
    fails: 0.2 s each here). Its devices, and its host, are then suspect: its Hellos from other hosts, and any
    from its host, wait behind a first registration that came later. Before, the MAC check was first come first
    served across hosts, so such a peer on 100 hosts held a 50,000-device shard's registration behind 100 full
    MACs (3.6 s instead of 0.4). Order of the full checks: the first failure, the one in progress, then the
    honest Hello, then the suspect ones in their order."""
    # the leaked shard's Hellos (0-99, and 300-349) fail
    server, checked, knock = await full_checks_recorded(monkeypatch, failing=(0, 300), timeout=3)
    try:
        assert await knock("127.0.0.2", range(100))  # fails: 0-99 and 127.0.0.2 are suspect now
        assert server.suspect[:100].all() and not server.suspect[100:].any()
        later = []
        for source, ids in [("127.0.0.3", range(100)), ("127.0.0.2", range(300, 350)), ("127.0.0.4", range(50)),
                            ("127.0.0.1", range(100, 300))]:
            later.append(asyncio.ensure_future(knock(source, ids)))
            await asyncio.sleep(0.05)  # in this order; the first is being checked
        assert await asyncio.gather(*later) == [True, True, True, False]  # the honest Hello registered
    finally:
        await server.close()
    assert checked == [(0, 100), (0, 100), (100, 200), (300, 50), (0, 50)], checked
    assert server.drops == {"auth": 4}, server.drops


@pytest.mark.asyncio
async def test_a_demoted_shard_waits_one_check_of_a_peer_flooding_from_another_network(monkeypatch) -> None:
    """An attacker's finding: a peer holding a shard's credentials can demote another shard, by naming a different
    1% of it in each of its failed Hellos (here one failed Hello names all of it). The demoted shard's Hello then
    waited behind every Hello the peer had queued from its 100 addresses (3.3 s). The hosts of a network whose
    Hellos failed now take their turns at the check as one (an IPv4 /24, LiveCollector._turn_group): after
    the first failure from 127.0.1.2, five failing Hellos from 127.0.1.3-7, then the
    demoted shard's from 127.0.0.1, which is checked after the one in progress and at most one more of the
    flood's (whose network was in turn first), not after all five."""
    server, checked, knock = await full_checks_recorded(monkeypatch, failing=(0,), timeout=5)  # the peer's fail
    try:
        assert await knock("127.0.1.2", range(300))  # fails: devices 0-299 are suspect now, 100-299 demoted
        flood = []
        for i in range(5):
            flood.append(asyncio.ensure_future(knock(f"127.0.1.{3 + i}", range(100))))
            await asyncio.sleep(0.02)  # in this order; the first is being checked
        assert not await knock("127.0.0.1", range(100, 300))  # the demoted shard registers
        assert all(await asyncio.gather(*flood))
    finally:
        await server.close()
    assert checked[0] == (0, 300) and checked.index((100, 200)) <= 3, checked
    assert len(checked) == 7 and server.drops == {"auth": 6}, (checked, server.drops)


def test_hosts_of_a_network_take_turns_as_one_once_a_hello_from_it_failed() -> None:
    """Whom a Hello takes its MAC-check turn with (LiveCollector._turn_group): the host alone, until a Hello
    from its network (an IPv4 /24, an IPv6 /48; a 6to4 address counted as the IPv4 address it embeds) fails a
    MAC check; then the network. IPv4-mapped and 6to4 addresses are their IPv4 hosts; anything unparsed is
    itself."""
    key, prefix = server_module.peer_key, server_module.peer_prefix
    assert prefix(key("203.0.113.77")) == prefix(key("203.0.113.1")) == "203.0.113.0/24"
    assert prefix(key("203.0.114.77")) == "203.0.114.0/24"
    assert key("::ffff:203.0.113.9") == "203.0.113.9" and key("2002:cb00:7109::1") == "203.0.113.9"
    assert prefix(key("2002:cb00:710a:5::1")) == "203.0.113.0/24"  # 6to4 of 203.0.113.10: not a /48 of its own
    assert prefix(key("2001:db8:1:2::5")) == prefix(key("2001:db8:1:ffff::9")) == "2001:db8:1::/48"
    assert prefix(key("2001:db8:2::1")) == "2001:db8:2::/48"
    assert prefix("?") == "?"
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    assert [server._turn_group(h) for h in ("203.0.113.1", "203.0.113.2", "2001:db8:1::/64")] == [
        "203.0.113.1", "203.0.113.2", "2001:db8:1::/64"]
    server._failed_network("203.0.113.77")
    server._failed(key("2001:db8:1:7::1"), np.array([1], dtype=np.uint64))
    assert [server._turn_group(h) for h in ("203.0.113.1", "203.0.113.2", "203.0.114.1", "2001:db8:1::/64")] == [
        "203.0.113.0/24", "203.0.113.0/24", "203.0.114.1", "2001:db8:1::/48"]


@pytest.mark.asyncio
async def test_honest_hosts_of_one_network_keep_their_turns_under_a_forged_flood_from_others(monkeypatch) -> None:
    """An attacker's finding: when every host of a /24 took its turns with the others of its network, six honest
    first registrations from 127.0.0.0/24 shared one turn against a flood of forged Hellos from three other /24s,
    each waiting three forged checks (60 honest hosts against a peer without credentials on 16 addresses: 23
    refused for the Hello timeout, none before). A network takes turns as one only once a Hello from it failed:
    the flood's three networks have one turn each, the honest hosts one each, so few forged Hellos are checked
    between the first honest Hello's arrival and the last one's check."""
    seq: list[str] = []

    def sample(*args):
        forged = int(args[4][0]) == 0
        seq.append("F" if forged else "H")
        time.sleep(0.03 if forged else 0.0)
        return not forged

    def full(*args):
        time.sleep(0.02)
        return True

    monkeypatch.setattr(server_module.auth, "check_sample", sample)
    monkeypatch.setattr(server_module.auth, "check_full", full)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    port = await server.start(HOST, 0)
    stop = asyncio.Event()

    async def flood(source: str) -> None:
        while not stop.is_set():
            await knock_with_a_bad_mac(port, range(10), source, timeout=3)

    floods = [asyncio.ensure_future(flood(f"127.0.{10 + net}.{2 + host}")) for net in range(3) for host in range(2)]
    try:
        await asyncio.sleep(0.4)  # the flood under way, its networks marked
        joined = len(seq)
        honest = [asyncio.ensure_future(knock_with_a_bad_mac(port, range(100 + 20 * i, 110 + 20 * i),
                                                             f"127.0.0.{2 + i}", timeout=3)) for i in range(6)]
        assert not any(await asyncio.gather(*honest))  # all six registered
    finally:
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)
        await server.close()
    last = len(seq) - 1 - seq[::-1].index("H")
    between = seq[joined:last].count("F")  # one per network of the flood: 3 (5 with its 6 hosts apart)
    assert seq.count("H") == 6 and between <= 4, (between, "".join(seq[joined:last + 1]))


@pytest.mark.asyncio
async def test_turns_rotate_over_groups_within_a_class() -> None:
    """collector/shares.py's Turns with groups (a host, or a network): within a class the groups take turns, each
    group first come first served, so that a later group's waiter goes after one of an earlier group's, not
    after all of them; the urgent class still comes first, and a promoted waiter joins its own group there."""
    from collector.shares import Turns

    turns, order = Turns(), []

    async def take(name: str, urgent: bool, group: str) -> None:
        await turns.acquire(urgent, None, group)
        order.append(name)
        await asyncio.sleep(0.005)
        turns.release()

    await turns.acquire(False)  # held: everyone below waits
    tasks = []
    for spec in [("a1", False, "a"), ("a2", False, "a"), ("a3", False, "a"), ("b1", False, "b"), ("b2", False, "b"),
                 ("c1", False, "c"), ("urgent a1", True, "a"), ("urgent a2", True, "a"), ("urgent d1", True, "d")]:
        tasks.append(asyncio.ensure_future(take(*spec)))
        await asyncio.sleep(0)  # queued in this order
    await asyncio.sleep(0.01)
    assert turns.waiting == 9
    turns.release()
    await asyncio.gather(*tasks)
    assert order == ["urgent a1", "urgent d1", "urgent a2", "a1", "b1", "c1", "a2", "b2", "a3"], order
    assert turns.waiting == 0 and turns._classes == ({}, {})
    order.clear()  # a waiter of the lower class past its promotion time joins its own group's urgent waiters
    await turns.acquire(True)

    async def promoted(name: str) -> None:
        await turns.acquire(False, 0.02, "x")
        order.append(name)
        turns.release()

    tasks = [asyncio.ensure_future(take("urgent x0", True, "x")), asyncio.ensure_future(promoted("x1")),
             asyncio.ensure_future(promoted("x2"))]
    await asyncio.sleep(0.06)
    tasks.append(asyncio.ensure_future(take("urgent y1", True, "y")))
    await asyncio.sleep(0.01)
    turns.release()
    await asyncio.gather(*tasks)
    assert order == ["urgent x0", "urgent y1", "x1", "x2"], order
    assert turns._classes == ({}, {})


@pytest.mark.asyncio
async def test_turns_serve_the_urgent_first_and_pass_a_cancelled_turn_on() -> None:
    """collector/shares.py's Turns: one holder; urgent waiters before others, each class in arrival order, but
    no more than ``burst`` urgent turns in a row while another waits; a waiter cancelled while waiting leaves
    its queue, and one cancelled as its turn came passes it on; a waiter of the lower class past its promotion
    time goes before urgent ones that came after that."""
    from collector.shares import Turns

    turns, order, holding = Turns(), [], [0]

    async def take(name: str, urgent: bool, hold: float = 0.01, promote_after: float | None = None) -> None:
        await turns.acquire(urgent, promote_after)
        holding[0] += 1
        order.append((name, holding[0]))
        await asyncio.sleep(hold)
        holding[0] -= 1
        turns.release()

    turns.burst = 2  # at most two urgent turns in a row while another waits
    await turns.acquire(False)  # held: everyone below waits
    tasks = [asyncio.ensure_future(take(n, u)) for n, u in [("low1", False), ("high1", True), ("low2", False),
                                                             ("high2", True), ("high3", True), ("high4", True)]]
    doomed = asyncio.ensure_future(take("cancelled", True))
    await asyncio.sleep(0.01)
    assert turns.waiting == 7
    doomed.cancel()
    await asyncio.sleep(0)
    assert turns.waiting == 6
    turns.release()
    await asyncio.gather(*tasks)
    assert [name for name, _ in order] == ["high1", "high2", "low1", "high3", "high4", "low2"]
    assert all(holders == 1 for _, holders in order)  # one holder at a time
    turns.burst = 4
    await turns.acquire(True)  # free again: taken at once
    handed = asyncio.ensure_future(turns.acquire(False))
    await asyncio.sleep(0)
    turns.release()  # handed to the waiter, which is cancelled before it runs: it passes the turn on
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    await asyncio.wait_for(turns.acquire(False), 1)  # not stuck
    order.clear()  # held: a waiter of the lower class joins the urgent queue after its promotion time
    slow = asyncio.ensure_future(take("low, promoted", False, promote_after=0.05))
    await asyncio.sleep(0.15)
    late = asyncio.ensure_future(take("urgent, later", True))
    await asyncio.sleep(0.01)
    turns.release()
    await asyncio.gather(slow, late)
    assert order == [("low, promoted", 1), ("urgent, later", 1)]


@pytest.mark.asyncio
async def test_a_waiter_cancelled_as_it_is_handed_the_turn_never_loses_it() -> None:
    """An attacker's finding: a waiter of the lower class (waiting for its promotion) whose task was cancelled
    in the loop pass that handed it the turn lost the turn for good (its promotion's inner wait_for swallowed the
    cancellation; the caller's wait_for raised it): no Hello was ever checked again. Now either the caller gets
    the turn (and releases it) or the turn goes on to the next waiter."""
    from collector.shares import Turns

    for promote_after in (5.0, None):
        turns = Turns()
        await turns.acquire(True)  # held
        waiter = asyncio.ensure_future(asyncio.wait_for(turns.acquire(False, promote_after, "g"), 10))
        await asyncio.sleep(0.01)
        turns.release()  # handed to the waiter ...
        waiter.cancel()  # ... as it is cancelled
        try:
            await waiter
            turns.release()  # it got the turn: its caller holds it, and releases it
        except asyncio.CancelledError:
            pass  # it did not: the turn went on
        await asyncio.wait_for(turns.acquire(True), 1)  # not stuck
        assert turns.waiting == 0 and turns._classes == ({}, {})


def test_with_a_secret_the_first_frame_limit_tells_the_population_within_a_factor_of_two() -> None:
    """An attacker's finding: the first-frame limit (a Hello of the whole population: 8 bytes an id and room)
    refused frame headers above it at once, so a binary search on bare headers gave the exact population in 31
    probes. With a secret the limit is rounded up to a power of two; without one the exact limit stays (out of
    range Hellos are told the population there anyway)."""
    limit = server_module.hello_frame_limit
    assert limit(400) == 8 * 400 + server_module.HELLO_OVERHEAD
    assert limit(400, True) == limit(1000, True) == limit(8000, True) == 1 << 17
    for n in (1, 400, 8192, 10**6, 123_457, 10**8):
        got = limit(n, True)
        assert got & (got - 1) == 0 and limit(n) <= got < 2 * limit(n), n


def test_peers_are_counted_by_ipv4_address_and_ipv6_64() -> None:
    """The per-host limits (lanes of the MAC check, max_pending_per_host) key IPv6 peers by their /64: a peer
    holding a /64 (2^64 addresses) counted as one host per address before, which multiplied its share at will
    (an attacker's note). IPv4-mapped IPv6 addresses count as their IPv4 address."""
    key = server_module.peer_key
    assert key("192.0.2.7") == "192.0.2.7"
    assert key("::ffff:192.0.2.7") == "192.0.2.7"
    assert key("2001:db8:1:2:aaaa::1") == key("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert key("2001:db8:1:3::1") != key("2001:db8:1:2::1")
    assert key("fe80::1%eth0") == "fe80::/64"
    assert key("?") == "?"


@pytest.mark.asyncio
@pytest.mark.parametrize("wrong", ["protocol", "scenario"])
async def test_valid_hellos_for_another_run_are_refused_before_the_full_mac(monkeypatch, wrong) -> None:
    """An attacker's finding: Hellos with valid credentials (a leaked shard's) naming another protocol or
    scenario fingerprint were refused only after the full MAC, one key derivation per device each, so a flood
    of them from many addresses kept an honest shard from registering for 30 s. The run's checks now come after
    the probe and the sample: 65 derivations each, and the peer is told why."""
    sc = scenario()
    h = Harness(sc, dataclasses.replace(FAST, secret=SECRET))
    await h.listen()
    shard0 = live.shard(sc.devices, 0, 2)
    keys, derived = auth.device_keys(SECRET, shard0), count_derivations(monkeypatch)
    for _ in range(3):
        reader, writer = await send_valid_hello(h.port, keys, shard0, "kflip" if wrong == "protocol" else PROTOCOL,
                                                os.urandom(32) if wrong == "scenario" else None)
        refusal = await read_frame(reader)
        assert isinstance(refusal, Refusal) and wrong in refusal.reason, refusal
        writer.close()
    assert derived == [1, auth.SAMPLE] * 3, derived  # never the shard's 200 keys
    assert h.server.drops == {wrong: 3}, h.server.drops
    monkeypatch.undo()
    h.start_clients()
    h.start_run()
    got = await h.finish()
    assert got["digests"] == simulated()


@pytest.mark.asyncio
async def test_a_hello_whose_peer_left_before_its_check_is_not_verified(monkeypatch) -> None:
    """An attacker's finding: Hellos sent and their connections closed at once stayed queued for the MAC check
    and were each checked in full (and could register devices on a dead socket) while honest Hellos waited
    behind them. A Hello whose peer has closed is now refused (``abandoned``) without a MAC check."""
    started_check = asyncio.Event()
    release = asyncio.Event()
    real_sample = auth.check_sample
    loop = asyncio.get_running_loop()
    calls: list[int] = []

    def gated_sample(*args):  # the first check waits until the second peer has gone
        calls.append(int(args[4][0]))
        if len(calls) == 1:
            loop.call_soon_threadsafe(started_check.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
        return real_sample(*args)

    monkeypatch.setattr(server_module.auth, "check_sample", gated_sample)
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    port = await server.start(HOST, 0)
    try:
        first = asyncio.ensure_future(knock_with_a_bad_mac(port, [1, 2, 3]))
        await asyncio.wait_for(started_check.wait(), 5)
        reader, writer = await connect(port)  # the second Hello queues behind the first check, then leaves
        challenge = await read_frame(reader)
        writer.write(hello([7, 8], mac=b"\0" * 64, round_=challenge.round))
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.sleep(0.1)
        release.set()
        assert await first
        for _ in range(50):
            if sum(server.drops.values()) == 2:
                break
            await asyncio.sleep(0.05)
    finally:
        await server.close()
    assert calls == [1], calls  # the abandoned Hello never reached a MAC check
    assert server.drops == {"auth": 1, "abandoned": 1}, server.drops


@pytest.mark.asyncio
async def test_with_a_secret_a_first_frame_header_between_the_exact_and_the_rounded_limit_is_not_refused_at_once(
        ) -> None:
    """The collector's first-frame limit is the rounded one: a header announcing 100,000 bytes (above a
    400-device Hello's 68,736, below 2^17) waits for its bytes (read timeout), where the exact limit refused it at
    once as oversized; 2^17 + 1 is refused at once."""
    sc = scenario()
    server, _, _ = live.build_server(sc, Ledger(sc.devices), None, dataclasses.replace(FAST, secret=SECRET))
    port = await server.start(HOST, 0)
    try:
        for length in (100_000, (1 << 17) + 1):
            reader, writer = await connect(port)
            await read_frame(reader)
            writer.write(struct.pack(">I", length))
            await writer.drain()
            assert await closed_by_server(reader)
            writer.close()
    finally:
        await server.close()
    assert server.drops == {"read_timeout": 1, "oversized": 1}, server.drops
