"""Live runs: the collector server and device clients over real TCP (asyncio), writing the run directory a
simulated run writes. ``ldpsim live`` runs both in one process on loopback; ``ldpsim serve`` and
``ldpsim devices --shard I/N`` run them apart.

The live runtime drives the very protocol objects of the simulator; messages carry the scenario's nominal
times, so a live run without loss gives the simulated run's transcript, ledger and estimate digests.
In split mode each device process keeps its own ledger (written beside its shard); the server's run
directory has the collector's view (transcript and estimates), and its ledger holds what the devices of
that process recorded only in embedded mode.

Hardening (collector/server.py, protocols/auth.py): a deployment secret (``LiveSettings.secret``; the device
side gets the same secret and derives its devices' credentials) authenticates every Hello; TLS contexts from
:func:`server_tls` / :func:`client_tls`; the collector's drops by cause are in ``RunResult.extra["live"]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import numpy as np

from agents.client import CollectorRefused, DeviceClient, DeviceDays
from agents.resumable import ResumableClient
from agents.shard import guard_counts
from agents.world import World
from collector import spill
from collector.hostile import Hostility
from collector.network import Traffic
from collector.server import LiveCollector, LiveSettings
from protocols.auth import Credentials
from protocols.ledger import Ledger
from scenarios.runner import RoundBook, RunResult, _event_logger
from scenarios.schema import Scenario, ScenarioError


@dataclass
class NominalClock:
    """The scenario's timeline, for event timestamps (sim_time) in live runs."""

    now: float = 0.0


class _Network:
    def __init__(self) -> None:
        self.traffic = Traffic()


def ignored_network(sc: Scenario) -> dict[str, float]:
    """The scenario's simulated network settings a live run does not apply (over TCP every message arrives or
    its connection fails; real latency is the network's own): loss, downlink_loss and jitter that are not 0."""
    net = sc.network
    return {k: v for k, v in (("loss", net.loss), ("downlink_loss", net.downlink_loss), ("jitter", net.jitter))
            if v}


def build_server(sc: Scenario, ledger: Ledger, events: TextIO | None, settings: LiveSettings,
                 progress: Callable[[int, int], None] | None = None) -> tuple[LiveCollector, RoundBook, NominalClock]:
    """The collector server and its round book; ``progress(done, rounds)`` after every round it closes."""
    clock = NominalClock()
    log = _event_logger(events, clock).bind(run=sc.name, seed=sc.seed, runtime="live")
    protocol = sc.protocol.make_collector(sc.devices)
    spill.attach(protocol)  # large non-bit transcripts go to a temporary directory, not RAM
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    book = RoundBook(sc, world, ledger, protocol, log)
    length = book.epoch_length

    def nominal_start(t: int) -> float:
        return (t * length - 1) * sc.simulation.round_seconds

    def on_round_start(t: int) -> None:
        clock.now = nominal_start(t)
        for d in range((t - 1) * length + 1, t * length + 1):
            book.advance_day(d)
        book.before_collect(t)

    def on_round_closed(t: int, result: Any, close_time: float) -> None:
        clock.now = close_time
        book.close(t, result, close_time, server.stats.rejected)
        if progress is not None:
            progress(t, server.rounds)

    server = LiveCollector(protocol, sc.devices, sc.rounds // length, nominal_start, sc.network.deadline, settings,
                           log, on_round_start, on_round_closed, Hostility(sc.behavior, sc.protocol.max_value))
    server.scenario = scenario_fingerprint(sc)
    return server, book, clock


#: parts of a scenario devices and collector need not share: its name and description, how the run is computed
#: (these [simulation] keys; ``round_seconds`` is shared: behaviors and timed changes depend on it), what is
#: computed after it ([analysis]) and the collector's own behavior ([collector])
NOT_FINGERPRINTED = ("name", "description", "analysis", "collector")
NOT_FINGERPRINTED_SIMULATION = ("cohort_size", "workers", "threads", "engine")


def _canonical(v: Any) -> Any:
    """``v`` with integral floats as integers (``epsilon = 1`` and ``1.0`` are one scenario)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        return {k: _canonical(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_canonical(x) for x in v]
    return v


def scenario_fingerprint(sc: Scenario) -> bytes:
    """sha256 of the scenario as run (scenario.json) without :data:`NOT_FINGERPRINTED` (and the
    :data:`NOT_FINGERPRINTED_SIMULATION` keys), numbers compared by value: what a device client's Hello carries
    and a collector compares with its own, refusing devices of another scenario (another seed, population,
    protocol parameter, budget ...), which would otherwise bias every estimate without a word."""
    agreed = {k: v for k, v in sc.as_run.items() if k not in NOT_FINGERPRINTED}
    if isinstance(agreed.get("simulation"), dict):
        agreed["simulation"] = {k: v for k, v in agreed["simulation"].items() if k not in NOT_FINGERPRINTED_SIMULATION}
    return hashlib.sha256(json.dumps(_canonical(agreed), sort_keys=True, separators=(",", ":")).encode()).digest()


def build_client(sc: Scenario, device_ids: np.ndarray, ledger: Ledger, host: str, port: int,
                 days: DeviceDays | None = None, secret: bytes | None = None, tls: ssl.SSLContext | None = None,
                 credentials: Credentials | None = None) -> DeviceClient:
    """A device client; clients of one process share ``days`` (and its world model of the whole population:
    one per client would cost memory that grows with connections x devices). ``secret``: the deployment
    secret (the client derives its devices' credentials), or ``credentials``, the devices' own (a shard's
    credentials file: the secret stays with the operator); ``tls``: a client TLS context (:func:`client_tls`).
    Its Hellos carry the scenario's fingerprint (:func:`scenario_fingerprint`)."""
    days = days or process_days(sc)
    return ResumableClient(sc.protocol, sc.seed, device_ids, sc.simulation.cohort_size, days.world, ledger,
                           sc.network.deadline, sc.network.latency, host, port, days=days, limits=sc.limits,
                           secret=secret, tls=tls, scenario=scenario_fingerprint(sc),
                           round_seconds=sc.simulation.round_seconds, credentials=credentials)


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """The collector's TLS context: its certificate chain and key (PEM files); TLS 1.2 at least."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


def client_tls(ca: str) -> ssl.SSLContext:
    """A device client's TLS context: the collector's certificate must chain to ``ca`` (a PEM file; a
    self-signed certificate is its own CA) and name the host connected to."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def process_days(sc: Scenario) -> DeviceDays:
    return DeviceDays(World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value))


def shard(n: int, index: int, count: int) -> np.ndarray:
    """Device ids of shard ``index`` (0-based) of ``count`` contiguous shards."""
    first = shard_first(n, index, count)
    return np.arange(first, first + shard_size(n, index, count), dtype=np.int64)


def shard_first(n: int, index: int, count: int) -> int:
    """The first device id of :func:`shard`, without building it."""
    return n * index // count


def shard_size(n: int, index: int, count: int) -> int:
    """How many devices :func:`shard` holds, without building it."""
    return shard_first(n, index + 1, count) - shard_first(n, index, count)


async def run_embedded(sc: Scenario, connections: int = 2, events: TextIO | None = None,
                       settings: LiveSettings | None = None, host: str = "127.0.0.1",
                       client_tls: ssl.SSLContext | None = None,
                       progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Server and ``connections`` device clients in this process on loopback. The clients use the settings'
    secret (one deployment) and ``client_tls`` where the server has TLS; ``progress(done, rounds)`` after
    every round."""
    t0 = time.perf_counter()
    ledger = Ledger(sc.devices)
    settings = settings or LiveSettings()
    if settings.max_pending_per_host is None:  # every client is this process's own, from one address: all of
        # them may connect at once (half the connection limit would refuse some, to be let in on a retry)
        settings = dataclasses.replace(settings, max_pending_per_host=connections)
    server, book, _ = build_server(sc, ledger, events, settings, progress)
    port = await server.start(host, 0)
    days = process_days(sc)
    parts = [shard(sc.devices, i, connections) for i in range(connections)]
    clients = [build_client(sc, part, ledger, host, port, days, settings.secret, client_tls)
               for part in parts if part.size]  # more connections than devices: no empty Hellos
    tasks = [asyncio.create_task(c.run()) for c in clients]
    serving = asyncio.create_task(server.run())
    try:
        while not serving.done():  # a client that fails (a plugin's device side raising) ends the run at once,
            # where the collector would wait out each stage's timeout for its devices and fail later, elsewhere
            running = [t for t in tasks if not t.done()]
            done, _ = await asyncio.wait([serving, *running], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not serving and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        await serving
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
    finally:
        for task in [serving, *tasks]:
            task.cancel()
        await server.close()
    result = live_result(sc, server, book, ledger, time.perf_counter() - t0, sum(c.rejected for c in clients))
    result.guards = guard_counts([cohort for c in clients for cohort in c.cohorts])
    return result


def live_result(sc: Scenario, server: LiveCollector, book: RoundBook, ledger: Ledger, wall: float,
                device_rejected: int | None) -> RunResult:
    """``device_rejected``: the collector frames the device clients could not decode (None where they run in
    other processes, ``ldpsim serve``: each `ldpsim devices` prints its own)."""
    network = _Network()  # its report counts stay 0 and unused: summary.json says they are unknown here
    network.traffic.messages_sent = server.frames_sent + server.stats.received  # both directions
    network.traffic.messages_delivered = network.traffic.messages_sent
    live = {**server.live_summary(), "network_not_applied": ignored_network(sc)}
    return RunResult(sc, book.records, ledger, book.world, server, network, server.protocol.transcript_digest(),
                     wall, device_rejected,
                     extra={"dropped_connections": server.dropped, "runtime": "live", "live": live},
                     true_values=book.true_values)


async def serve(sc: Scenario, host: str, port: int, events: TextIO | None = None,
                settings: LiveSettings | None = None, run_dir: Any = None, resume: bool = False,
                listening: Callable[[int], None] | None = None,
                progress: Callable[[int, int], None] | None = None,
                started: Callable[[int, int], None] | None = None) -> RunResult:
    """The collector alone (devices connect from elsewhere); returns when the run is over. ``run_dir``: keep a
    journal there after every round (scenarios/journal.py); ``resume``: first restore the journal there;
    ``listening(port)``: called once the server is bound (a program's "serving ..." line; ``port`` the one
    bound, which ``port`` 0 leaves to the system); ``started(held, devices)`` as the rounds start, with every
    device connected or the startup wait over (ScenarioError when none connected); ``progress(done, rounds)``
    after every round."""
    from scenarios import journal

    t0 = time.perf_counter()
    ledger = Ledger(sc.devices)  # stays empty: devices keep their ledgers (module docstring)
    server, book, _ = build_server(sc, ledger, events, settings or LiveSettings(), progress)
    server.on_start = started
    bound = await listen(server, host, port)
    if listening is not None:
        listening(bound)
    try:  # journal attached after the bind (no journal left by a port in use); no await in between, so no
        # device is served before it is restored
        first = journal.attach(run_dir, sc, server, book, resume) if run_dir is not None else 1
        try:
            await server.run(first_round=first)
        except ConnectionError as exc:  # no device came
            raise ScenarioError(f"serving on {host}:{bound}: {exc}") from None
        await server.wait_for_clients_to_leave()
    finally:
        await server.close()
    result = live_result(sc, server, book, ledger, time.perf_counter() - t0, None)
    result.extra["ledger"] = "device shards"  # each `ldpsim devices` process keeps its devices' ledger
    return result


async def listen(server: LiveCollector, host: str, port: int) -> int:
    """Bind ``server`` to host:port; an address in use, an unknown host or a port it may not take is a
    ScenarioError naming them (one line, not a traceback)."""
    try:
        return await server.start(host, port)
    except (OSError, OverflowError) as exc:  # socket.gaierror is an OSError; OverflowError: port > 65535
        raise ScenarioError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None


@dataclass
class ShardOutcome:
    """What a device shard (`ldpsim devices`) knows at the end: its devices' ledger, the collector frames they
    could not decode, and their guards' counts (reports refused for the budget, collector messages ignored,
    once per device)."""

    ledger: Ledger
    rejected: int
    guards: dict[str, int]
    error: str | None = None  # why the clients stopped before the collector's End (refused, no collector)


async def devices(sc: Scenario, host: str, port: int, index: int, count: int, connections: int = 1,
                  secret: bytes | None = None, tls: ssl.SSLContext | None = None, state_dir: Any = None,
                  require_state: bool = False, credentials: Credentials | None = None) -> ShardOutcome:
    """Device clients for shard ``index`` of ``count``, over ``connections`` connections; returns their ledger
    and counts. ``credentials``: the shard's devices' credentials (instead of the deployment ``secret``).
    ``state_dir``: save the devices' state there after every answer, and start from it when it is there
    (scenarios/journal.py; ``require_state``: it must be)."""
    ledger = Ledger(sc.devices)
    ids = shard(sc.devices, index, count)
    parts = [ids[len(ids) * k // connections:len(ids) * (k + 1) // connections] for k in range(connections)]
    days = process_days(sc)
    clients = [build_client(sc, part, ledger, host, port, days, secret, tls, credentials)
               for part in parts if part.size]
    store = None
    if state_dir is not None:
        from scenarios import journal

        store = journal.open_device_store(state_dir, sc, index + 1, count, clients, ledger, days, require_state)
    tasks = [asyncio.ensure_future(c.run()) for c in clients]
    error = None
    try:
        await asyncio.gather(*tasks)
    except (ConnectionError, CollectorRefused) as exc:  # what the devices spent until then is theirs to keep
        error = str(exc)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if store is not None and error is None:
        store.save(done=True)
    return ShardOutcome(ledger, sum(c.rejected for c in clients),
                        guard_counts([cohort for c in clients for cohort in c.cohorts]), error)
