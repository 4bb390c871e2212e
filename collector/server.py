"""The live collector: the same sans-IO collector side over real TCP with asyncio (docs/design.md section 4).

Frames are length-prefixed wire messages (protocols.framing). A device client registers its devices with a
``Hello``; the server then runs the rounds in real time: it broadcasts each stage's message (collection
request, THRESH decision, ToPL threshold), takes report batches until every connection has acknowledged the
stage (an empty batch) or the stage timeout passes, and closes the round. Messages carry the scenario's
nominal times (the simulated timeline), so devices charge and answer exactly as in a simulated run and the
digests agree; real time only paces the exchange.

Registration. A device is held by at most one live connection. A Hello is refused (and its connection dropped
and counted) when it names no device, a device outside the population, a device another live connection holds
(the holder keeps it: the first registration wins, and only the holder's own departure frees its devices), or
when the connection already registered. With a deployment secret (``LiveSettings.secret``) the server's first
frame is a ``Challenge`` nonce and a Hello must carry a MAC from its devices' credentials (protocols.auth);
a missing, forged or replayed one is refused. The run starts when every device of the population is held by
a live connection (or at the start timeout).

Hostile input is bounded (every cause counted in ``drops``; summary.json's ``live.dropped``):
- a frame over ``max_frame`` (``oversized``), bytes that do not decode or a wrong version (``malformed``);
- a frame not complete within ``read_timeout`` of its first byte (``read_timeout``: trickling a byte at a time
  does not restart the clock) and no Hello within ``hello_timeout`` of connecting (``hello_timeout``);
- incomplete frames held above ``buffer_budget`` bytes (``buffer_budget``), in two pools of that size: the
  connections whose Hello was accepted, and those that have not said one. A peer without a Hello can fill
  only the second pool, so it never costs a registered connection its report batches. A pool over budget
  drops a connection of the host holding the most in it (collector/shares.py), so a host within its fair
  share is never dropped for the budget whatever other hosts send;
- a Hello waiting for its MAC check holds its bytes in the second pool too: a queue of Hellos is bounded by the
  same budget (``buffer_budget``). MACs are checked one Hello at a time, each host with at most one Hello in
  that queue (an IPv6 host: its /64), and the run's and the holder's checks come before the full MAC
  (:meth:`LiveCollector._admit`): a host flooding Hellos, with valid credentials or without, delays another
  host's by one check; a Hello whose peer closed before its turn is not checked (``abandoned``); first
  registrations are checked before Hellos from a host whose Hello failed the full MAC or naming mostly devices
  registered before or named by such a Hello (:meth:`LiveCollector._first_registration`), so that a flood of
  those from many hosts delays a first registration by one check too; and within each of those two classes
  hosts take turns, the hosts of a network from which a Hello failed its MAC as one (an IPv4 /24, an IPv6 /48:
  :meth:`LiveCollector._turn_group`), so that a peer on many addresses of one network that demotes a shard
  (marking its devices with failed Hellos) delays it by one check per network it floods from, not one per
  address, while honest hosts sharing a clean network keep a turn each;
- connections beyond ``max_connections`` (default: devices + 64, at most RLIMIT_NOFILE - 64): the newcomer takes
  the place of the oldest connection without a Hello of the host with the most such connections when that host
  has at least two more than the newcomer's, else of the oldest connection that has said no Hello and has been
  open at least :data:`EVICT_AGE` seconds (``evicted``; collector/shares.py), and is closed at once when there
  is none (``connection_limit``), so that idle peers reconnecting as fast as they are closed cannot keep honest
  clients out (at once, unless they are spread over about as many hosts as there are slots; then for no longer
  than that age);
- connections of one host that have said no accepted Hello beyond ``max_pending_per_host`` (default: half the
  connection limit) are closed at once (``host_limit``), or take the place of that host's own oldest such
  connection as above: a flood from one address leaves the other half of the slots to every other host;
- a broadcast is written to every connection at once; a connection whose socket has not taken it within
  ``write_timeout`` is dropped (``write_timeout``): a reader that stops reading never holds up a stage;
- a first frame that is not a Hello (``no_hello``), and a connection holding devices that leaves
  ``unresponsive_stages`` stages in a row unacknowledged (``unresponsive``: a stopped or dead client, whose
  devices are then free for a client that reconnects for them);
- a failed TLS handshake (``tls``) and any unexpected exception in a connection's handler (``error``).
A well-formed batch the protocol refuses is counted as a rejected message and the connection kept. The log
gets at most one line per drop cause per round, and one line with the round's counts by cause.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import resource
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from collector.shares import BufferPool, Pending, Turns
from collector.stages import round_stages
from collector.hostile import Hostility, describe
from collector.process import LOGGED_REJECTIONS_PER_ROUND, CollectorStats
from protocols import auth, wire
from protocols.base import CollectorSide, LateBatch, ProtocolError, RoundResult
from protocols.framing import FrameDecoder, FrameTooLarge, frame
from protocols.messages import Challenge, End, Hello, Message, Refusal, ReportBatch

EXTRA_CONNECTIONS = 64  # default connection limit: one per device and this many more
#: seconds a connection without a Hello is open before a newcomer at the connection limit may take its place
#: (an honest client says its Hello within a round trip or two; at most half the hello timeout is used)
EVICT_AGE = 1.0
FAILED_HOSTS = 1 << 16  # hosts whose Hellos failed the full MAC, remembered (the latest) to queue theirs last
# (and as many networks whose Hellos failed any MAC check, whose hosts take their turns as one)
FD_MARGIN = 64  # file descriptors kept free below RLIMIT_NOFILE (listening socket, logs, run files)


def default_max_connections(n_devices: int) -> int:
    """Devices + 64, but never above the process's RLIMIT_NOFILE minus a margin."""
    return min(int(n_devices) + EXTRA_CONNECTIONS, fd_ceiling())


def fd_ceiling() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else max(1, soft - FD_MARGIN)


#: bytes of a Hello beside its ids (type, round, protocol name, mac, fingerprint, msgpack framing), with room
HELLO_OVERHEAD = 64 * 1024


def hello_frame_limit(n_devices: int, secret: bool = False) -> int:
    """The longest first frame a connection may send: a Hello naming the whole population as 64-bit ids; with a
    deployment secret (``secret``), rounded up to a power of two, so that probing the limit with frame headers
    tells a peer without credentials the population only within a factor of two (a binary search on it gave
    the exact size in 31 probes)."""
    limit = 8 * int(n_devices) + HELLO_OVERHEAD
    return 1 << (limit - 1).bit_length() if secret else limit


def peer_key(address: str) -> str:
    """The key the per-host limits count a peer under (lanes of the MAC check, ``max_pending_per_host``): its
    IPv4 address (an IPv4-mapped IPv6 one as IPv4, and a 6to4 one, 2002::/16, as the IPv4 address it embeds,
    whose site holds the whole /48), or its IPv6 /64, the block one subscriber is given, so that a host cannot
    multiply its share by taking addresses of its own block."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None or ip.sixtofour is not None:
            return str(ip.ipv4_mapped or ip.sixtofour)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def peer_prefix(host: str) -> str:
    """The network of a host (a :func:`peer_key`) whose hosts take their turns at the MAC check as one once a
    Hello from it failed (:meth:`LiveCollector._turn_group`): an IPv4 address's /24, an IPv6 /64's /48 (a
    site's allocation). IPv6 networks are much cheaper to hold than IPv4 ones (a tunnel broker gives /48s
    away)."""
    try:
        net = ipaddress.ip_network(host, strict=False)
    except ValueError:
        return host
    width = 24 if net.version == 4 else 48
    return str(net.supernet(new_prefix=width)) if net.prefixlen > width else str(net)


def _remember(latest: dict[str, None], key: str) -> None:
    """Put ``key`` last in ``latest`` (oldest first), forgetting the oldest beyond :data:`FAILED_HOSTS`."""
    latest.pop(key, None)
    latest[key] = None
    if len(latest) > FAILED_HOSTS:
        del latest[next(iter(latest))]


class _PausedProtocol(asyncio.StreamReaderProtocol):
    """A connection that starts with reading paused, so that no byte of the client's TLS handshake lands in the
    plain StreamReader before ``start_tls`` (which resumes reading) takes the transport over. The connection
    limit and the hello timeout then cover TLS handshakes too."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]
        super().connection_made(transport)


class Refused(Exception):
    """A connection the server drops: ``cause`` is the counter, ``detail`` the log line; ``tell``: a refusal
    that trying again cannot cure, whose reason the client is sent (a Refusal frame) before the close."""

    def __init__(self, cause: str, detail: str = "", tell: bool = False, told: str | None = None) -> None:
        super().__init__(detail or cause)
        self.cause, self.detail, self.tell = cause, detail or cause, tell
        self.told = told or self.detail  # what the client is sent (an unauthenticated peer learns less)


@dataclass
class Lane:
    """A host's turn at the MAC check (LiveCollector._verify): the Hellos of that host waiting for it or in it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


@dataclass(eq=False)  # identity-hashed: connections live in a set
class Connection:
    writer: asyncio.StreamWriter
    serial: int = 0  # > 0; the holder id of the devices it registered
    devices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # stage messages written to it and not yet acknowledged: a client acknowledges each in turn (TCP keeps them
    # in order), so a late acknowledgement of an earlier stage does not close the one now open
    owed: int = 0
    strikes: int = 0  # stages in a row it left unacknowledged at their timeout
    hello: bool = False  # registered (one Hello per connection)
    ready: bool = False  # TLS (if any) is up: broadcasts may be written
    verifying: bool = False  # its Hello's MAC is being checked: no broadcast until it is registered or refused
    nonce: bytes | None = None  # the challenge its Hello must answer (with a secret)
    closed: bool = False  # dropped or released
    opened: float = 0.0  # the event loop's time when it was accepted
    host: str = ""  # the peer's address (peer_key: an IPv6 peer's /64)
    reader: asyncio.StreamReader | None = None


@dataclass
class LiveSettings:
    stage_timeout: float = 5.0  # real seconds a stage stays open at most
    read_timeout: float = 5.0  # real seconds a whole frame may take from its first byte
    max_frame: int = wire.MAX_MESSAGE_BYTES
    startup_timeout: float = 30.0  # real seconds to wait for every device to register
    hello_timeout: float = 10.0  # real seconds from connecting to the Hello (TLS handshake included)
    write_timeout: float = 5.0  # real seconds a broadcast waits for one connection's socket to take it
    max_connections: int | None = None  # None: devices + 64, at most RLIMIT_NOFILE - 64
    max_pending_per_host: int | None = None  # connections of one host without an accepted Hello (None: half the
    # connection limit)
    buffer_budget: int = 256 << 20  # bytes of incomplete frames held across registered connections (and again
    # across the connections before their Hello)
    send_buffer: int | None = None  # SO_SNDBUF of accepted sockets (None: the kernel's default)
    secret: bytes | None = None  # deployment secret: Hellos must be authenticated (protocols.auth)
    tls: ssl.SSLContext | None = None  # server-side TLS context
    round_pause: float = 0.0  # real seconds to wait after each round and each later stage (pacing a demo or a test)
    # a connection holding devices that leaves this many stages in a row unacknowledged is dropped (stopped or
    # dead: its devices are free again for a client that reconnects for them)
    unresponsive_stages: int = 3


class LiveCollector:
    def __init__(self, protocol: CollectorSide, n_devices: int, rounds: int, nominal_start: Callable[[int], float],
                 deadline: float, settings: LiveSettings, log: Any,
                 on_round_start: Callable[[int], None] | None = None,
                 on_round_closed: Callable[[int, RoundResult, float], None] | None = None,
                 hostility: Hostility | None = None) -> None:
        self.protocol, self.n_devices, self.rounds = protocol, int(n_devices), int(rounds)
        self.nominal_start, self.deadline, self.settings, self.log = nominal_start, float(deadline), settings, log
        self.on_round_start, self.on_round_closed = on_round_start, on_round_closed
        self.hostility = hostility
        self.downlink: list[dict] = []  # every broadcast, in order, with its nominal time (downlink.jsonl)
        self.stats = CollectorStats()
        self.drops: dict[str, int] = {}  # connections dropped, by cause
        self._round_drops: dict[str, int] = {}  # this round's, for the rate-limited log
        self.connections: set[Connection] = set()
        self.connections_accepted = 0  # every TCP connection the listener accepted
        ceiling = fd_ceiling()
        wanted = settings.max_connections or default_max_connections(self.n_devices)
        self.max_connections = min(int(wanted), ceiling)
        if wanted > ceiling:
            log.warning("max_connections_capped", wanted=int(wanted), cap=ceiling)
        self.max_pending_per_host = int(settings.max_pending_per_host or max(1, self.max_connections // 2))
        # the connections that have said no Hello (nor are having one verified), oldest first, in all and by host
        self.pending: Pending[Connection] = Pending()
        self.registered = np.zeros(self.n_devices, dtype=bool)  # ever registered
        self.holder = np.zeros(self.n_devices, dtype=np.int64)  # serial of the live connection holding it, or 0
        self._held = 0  # devices held by a live connection now
        self.devices_at_start: int | None = None  # devices held when the rounds started (after the startup wait)
        self.scenario: bytes | None = None  # fingerprint of the scenario it runs: Hellos naming another are refused
        self.on_start: Callable[[int, int], None] | None = None  # (devices held, population) as the rounds start
        self._missing = 0  # registered devices not held now (a count: checked on every ack)
        self._waiting: set[Connection] = set()  # device-holding connections yet to acknowledge the stage
        self._serial = 0
        # bytes of incomplete frames held for the connections whose Hello was accepted, and (a pool of its own)
        # for those that have not said one, with their Hellos waiting for the MAC check: each against the budget
        self.registered_pool: BufferPool[Connection] = BufferPool(settings.buffer_budget)
        self.unregistered_pool: BufferPool[Connection] = BufferPool(settings.buffer_budget)
        self._closing = False
        self.finished = False
        self._stage_open = False
        self._stage_frame: bytes | None = None
        self._acked = asyncio.Event()
        self._registered = asyncio.Event()
        self._turns = Turns()  # one Hello's MAC checked at a time (_admit), first registrations first
        self._lanes: dict[str, Lane] = {}  # by host: at most one of its Hellos queued for _turns
        #: devices named by a Hello whose full MAC failed (its peer held nearly all the credentials it named, and
        #: not all): with the devices ever registered, a Hello naming one waits behind first registrations
        self.suspect = np.zeros(self.n_devices, dtype=bool)
        #: the secret's key id, sent with every Challenge (a client of another deployment tells so at once)
        self._key_id = bytes.fromhex(auth.key_id(settings.secret)) if settings.secret is not None else None
        self._failed_hosts: dict[str, None] = {}  # hosts one of whose Hellos failed the full MAC (the latest)
        self._failed_networks: dict[str, None] = {}  # networks one of whose Hellos failed any MAC check (the latest)
        self._logged = 0
        self.current_round = 0
        self.frames_sent = 0
        self.server: asyncio.base_events.Server | None = None
        #: (message, its stage's nominal close) of a stage a resumed collector continues at (scenarios/journal.py):
        #: its round starts there, with that message re-broadcast, instead of at the round's first stage
        self.resume_stage: tuple[Message, float] | None = None

    @property
    def dropped(self) -> int:
        """Connections dropped, all causes."""
        return sum(self.drops.values())

    @property
    def connected(self) -> np.ndarray:
        """Devices on a live connection now."""
        return self.holder != 0

    def live_summary(self) -> dict:
        """The live runtime's counters for summary.json (``live``)."""
        return {"dropped": dict(sorted(self.drops.items())), "connections": self.connections_accepted,
                "max_connections": self.max_connections, "max_pending_per_host": self.max_pending_per_host,
                "authenticated": self.settings.secret is not None,
                "tls": self.settings.tls is not None, "devices_at_start": self.devices_at_start}

    # ------------------------------------------------------------------------------------------ transport
    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        protocol = _PausedProtocol if self.settings.tls is not None else asyncio.StreamReaderProtocol

        def factory() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, TLS-aware
            return protocol(asyncio.StreamReader(limit=1 << 16, loop=loop), self._handle, loop=loop)

        # a deep backlog: a thousand clients connecting at once overflowed the default 100 (1 s TCP retries)
        for attempt in range(3):
            server = await loop.create_server(factory, host, port, backlog=4096)
            chosen = {s.getsockname()[1] for s in server.sockets}
            if port != 0 or len(chosen) == 1:
                break
            # port 0 on a host of several addresses (IPv4 and IPv6) gave each its own: bind them all to one
            first = server.sockets[0].getsockname()[1]
            server.close()
            await server.wait_closed()
            try:
                server = await loop.create_server(factory, host, first, backlog=4096)
                break
            except OSError:  # taken meanwhile in one of the families: again from fresh ports
                if attempt == 2:
                    raise
        self.server = server
        return server.sockets[0].getsockname()[1]

    def _tune(self, writer: asyncio.StreamWriter) -> None:
        """drain() returns only once the socket took every byte (a slow reader is then visible at once);
        optionally a small kernel send buffer."""
        if self.settings.send_buffer:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(self.settings.send_buffer))
        writer.transport.set_write_buffer_limits(high=0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_accepted += 1
        if self._closing:
            writer.transport.abort()
            return
        loop = asyncio.get_running_loop()
        peer = writer.get_extra_info("peername")
        host = peer_key(str(peer[0])) if isinstance(peer, tuple) and peer else "?"
        ours = self.pending.of(host)
        if len(ours) >= self.max_pending_per_host and not self._evict(ours, loop.time(), "host_limit"):
            self._count_drop("host_limit", f"{len(ours)} connections of {host} without a hello (limit "
                                           f"{self.max_pending_per_host})")
            writer.transport.abort()
            return
        if len(self.connections) >= self.max_connections and not self._make_room(host, loop.time()):
            self._count_drop("connection_limit", f"{len(self.connections)} connections open (limit "
                                                 f"{self.max_connections})")
            writer.transport.abort()
            return
        self._serial += 1
        conn = Connection(writer, self._serial, opened=loop.time(), host=host, reader=reader)
        self.connections.add(conn)
        self.pending.add(conn, host)
        settings = self.settings
        # until its Hello is accepted a connection may send no frame longer than a Hello of the whole population:
        # an unauthenticated peer holds no 64 MB frame of the shared buffer budget
        decoder = FrameDecoder(min(settings.max_frame, hello_frame_limit(self.n_devices, settings.secret is not None)))
        counted = 0  # this connection's incomplete frame, counted in its pool of the buffer budget
        known = False  # which pool: the registered connections' (its Hello accepted) or the others'
        cause, detail = None, ""
        try:
            hello_by = loop.time() + settings.hello_timeout
            self._tune(writer)
            if settings.tls is not None:
                try:
                    await asyncio.wait_for(writer.start_tls(settings.tls), max(0.0, hello_by - loop.time()))
                except (asyncio.TimeoutError, ssl.SSLError, OSError) as exc:
                    raise Refused("tls", f"TLS handshake failed: {type(exc).__name__}: {exc}") from None
                self._tune(writer)
            if settings.secret is not None:
                conn.nonce = os.urandom(wire.NONCE_BYTES)
                writer.write(frame(wire.encode(Challenge(max(1, self.current_round), self.protocol.name,
                                                         conn.nonce, self._key_id))))
                self.frames_sent += 1
            conn.ready = True
            frame_started = 0.0
            while True:
                deadline = frame_started + settings.read_timeout if decoder.pending else None
                if not conn.hello:
                    deadline = hello_by if deadline is None else min(deadline, hello_by)
                if deadline is None:
                    data = await reader.read(1 << 16)
                else:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise asyncio.TimeoutError
                    data = await asyncio.wait_for(reader.read(1 << 16), left)
                if not data or conn.closed:  # (closed: dropped meanwhile, its bytes out of the pools)
                    break
                had = decoder.pending
                frames = decoder.feed(data)
                if decoder.pending and (frames or not had):  # a new frame started: its clock starts now
                    frame_started = loop.time()
                pool = self.registered_pool if known else self.unregistered_pool
                pool.add(conn, host, decoder.pending - counted)
                counted = decoder.pending
                self._shed(conn, pool, "incomplete frames of registered connections" if known else
                           "hellos and incomplete frames of unregistered connections")
                for raw in frames:
                    if conn.closed:
                        break
                    hello = self._on_frame(conn, raw)
                    if hello is not None:
                        # the Hello (its frame and its decoded ids) is held until it is admitted or refused, and
                        # may wait for other Hellos' MAC checks: counted in the unregistered connections' pool
                        size = len(raw) + hello.devices.nbytes
                        self.unregistered_pool.add(conn, host, size)
                        try:
                            self._shed(conn, self.unregistered_pool,
                                       "hellos and incomplete frames of unregistered connections")
                            await self._admit(conn, hello)
                        finally:
                            self.unregistered_pool.add(conn, host, -size)
                        decoder.max_frame = settings.max_frame
                if conn.hello and not known:  # admitted: what it holds moves to the registered connections' pool
                    known = True
                    self.registered_pool.add(conn, host, self.unregistered_pool.remove(conn, host))
        except asyncio.TimeoutError:
            cause = "read_timeout" if conn.hello or decoder.pending else "hello_timeout"
            detail = "frame not complete within the read timeout" if cause == "read_timeout" else "no hello in time"
        except FrameTooLarge as exc:
            cause, detail = "oversized", str(exc)
        except wire.WireError as exc:
            cause, detail = "malformed", str(exc)
        except Refused as exc:
            cause, detail = exc.cause, exc.detail
            if exc.tell:  # the reason goes to the client before the close
                self._drop(conn, cause, detail, farewell=Refusal(max(1, self.current_round), self.protocol.name,
                                                                 exc.told[:wire.MAX_REASON]))
        except (OSError, asyncio.IncompleteReadError):
            pass  # the connection is gone (reset, or a TLS error on a closed socket)
        except asyncio.CancelledError:
            pass  # shut down: the task ends normally (asyncio's stream callback logs cancelled handlers)
        except Exception as exc:  # a bug: counted and logged, never an unhandled task error
            cause, detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self.registered_pool.remove(conn, host)
            self.unregistered_pool.remove(conn, host)
            if cause is not None:
                self._drop(conn, cause, detail)
            else:
                self._release(conn)
                writer.close()

    def _shed(self, conn: Connection, pool: BufferPool[Connection], what: str) -> None:
        """Bring ``pool`` back within the buffer budget after ``conn`` added bytes to it: drop connections of
        the host holding the most (collector/shares.py), ``conn`` itself by raising :class:`Refused`."""
        while pool.over:
            victim, host = pool.victim(conn, conn.host)
            detail = (f"{what} hold {pool.total} bytes (budget {pool.budget}); {host} held the most "
                      f"({pool.host_bytes(host)})")
            if victim is conn:
                raise Refused("buffer_budget", detail)
            pool.remove(victim, host)
            self._drop(victim, "buffer_budget", detail)

    def _evict(self, pending: dict[Connection, None], now: float, limit: str) -> bool:
        """Make room for a newcomer at ``limit``: drop the oldest connection in ``pending`` (connections without
        a Hello) if it has been open at least :data:`EVICT_AGE` (at most half the hello timeout); whether it
        did."""
        oldest = next(iter(pending), None)
        if oldest is None or now - oldest.opened < min(EVICT_AGE, self.settings.hello_timeout / 2):
            return False
        self._drop(oldest, "evicted", f"no hello in {now - oldest.opened:.1f} s; its place taken by a newcomer at "
                                      f"the {limit.replace('_', ' ')}")
        return True

    def _make_room(self, host: str, now: float) -> bool:
        """Make room for a newcomer from ``host`` at the connection limit; whether it did. The host with the most
        connections without a Hello loses its oldest, whatever its age, when it has at least two more than
        ``host`` has: peers that keep their connections young by reconnecting as soon as they are closed (from
        20 addresses, they kept honest shards out for 21.6 s instead of 0.3) cannot keep out a host with fewer.
        Else the newcomer takes the place of the oldest connection without a Hello open at least
        :data:`EVICT_AGE` (:meth:`_evict`), so that peers spread over as many hosts as there are slots do not
        hold them for the whole hello timeout either."""
        crowded = self.pending.crowded()
        mine = self.pending.count(host)
        if crowded is not None and crowded[1] >= mine + 2:
            victim = next(iter(self.pending.of(crowded[0])))
            self._drop(victim, "evicted", f"{crowded[1]} connections of {crowded[0]} without a hello; the place of "
                                          f"its oldest taken by a newcomer from a host with {mine}")
            return True
        return self._evict(self.pending.all, now, "connection_limit")

    def _unpend(self, conn: Connection) -> None:
        """``conn`` is no longer waiting to say its Hello (it said one, or it is gone)."""
        self.pending.discard(conn, conn.host)

    def _count_drop(self, cause: str, detail: str) -> None:
        self.drops[cause] = self.drops.get(cause, 0) + 1
        self.stats.reject("dropped", Refused(cause, detail))
        n = self._round_drops[cause] = self._round_drops.get(cause, 0) + 1
        if n == 1:  # one line per cause per round; the round's counts follow at its end (_log_drops)
            self.log.warning("connection_dropped", cause=cause, reason=detail[:200], round=self.current_round)

    def _log_drops(self) -> None:
        if self._round_drops:
            self.log.warning("connections_dropped", round=self.current_round, counts=dict(self._round_drops))
        self._round_drops = {}

    def _drop(self, conn: Connection, cause: str, detail: str, farewell: Message | None = None) -> None:
        """Count ``conn`` as dropped for ``cause`` (once), free its devices and close it at once; with a
        ``farewell`` message (a Refusal), that is written first and the close waits for it to go out."""
        if conn.closed:
            return
        self._count_drop(cause, detail)
        self._release(conn)
        if farewell is None:
            conn.writer.transport.abort()
            return
        conn.writer.write(frame(wire.encode(farewell)))
        self.frames_sent += 1
        conn.writer.close()

    def _release(self, conn: Connection) -> None:
        """``conn`` is gone: its devices (only those it holds) are free again."""
        if conn.closed:
            return
        conn.closed = True
        self.connections.discard(conn)
        self._unpend(conn)
        self._waiting.discard(conn)
        if conn.devices.size:
            self.holder[conn.devices] = 0
            self._held -= conn.devices.size
            self._missing += conn.devices.size
            self._registered.clear()  # the start gate is open only while every device is held
        self._check_acks()

    def _on_frame(self, conn: Connection, raw: bytes) -> Hello | None:
        """Handle one frame; a Hello is returned to the caller, which admits it (:meth:`_admit`)."""
        self.stats.received += 1
        msg = wire.decode(raw, self.settings.max_frame)  # WireError: the connection is dropped by the caller
        if isinstance(msg, Hello):
            return msg
        if not conn.hello and not conn.verifying:  # a peer that holds no device has nothing else to send
            raise Refused("no_hello", f"a {type(msg).__name__} before the connection's Hello")
        try:
            if not isinstance(msg, ReportBatch):
                raise ProtocolError(f"devices may not send {type(msg).__name__} messages")
            if len(msg) == 0 and not msg.columns:  # the client's acknowledgement of its oldest stage message
                conn.owed = max(conn.owed - 1, 0)
                if not conn.owed:  # the open stage's own (a late one of a stage before it closes nothing)
                    conn.strikes = 0
                    self._waiting.discard(conn)
                    self._check_acks()
                return None
            if not self._stage_open or msg.round < self.current_round:
                raise LateBatch(f"report batch for round {msg.round} arrived after its stage closed")
            ids = msg.devices  # unsigned and strictly increasing (wire.decode): the last is the largest
            if ids.size and (int(ids[-1]) >= self.n_devices
                             or not np.all(self.holder[ids.astype(np.int64)] == conn.serial)):
                raise ProtocolError("batch names devices this connection did not register")
            self.stats.reports_accepted += self.protocol.receive(msg)
            self.stats.accepted += 1
        except ProtocolError as exc:
            self.stats.reject("protocol", exc)
            self._logged += 1
            if self._logged <= LOGGED_REJECTIONS_PER_ROUND:
                self.log.warning("message_rejected", kind="protocol", reason=str(exc)[:200])
        return None

    async def _admit(self, conn: Connection, msg: Hello) -> None:
        """Register the Hello's devices on ``conn``, or raise :class:`Refused`: the cheap checks first, then (with
        a secret) the MAC on a worker thread (about 1.5 us an id: the event loop keeps serving every other
        connection), then the checks that tell an authenticated peer about this run.

        MACs are checked one Hello at a time, and each host has at most one Hello in that queue (its others wait
        their turn behind it), so that a flood of Hellos from one host (a taken-over shard holding valid
        credentials, say) delays another host's Hello by at most one check; first registrations go ahead of
        the rest (:meth:`_first_registration`), and within each class hosts take turns, those of a network a
        Hello from which failed its MAC as one (:meth:`_turn_group`). The range, the run's protocol and
        scenario and whether another connection holds the devices are checked after the probe and the sample
        (which a peer without nearly all the credentials it names fails) and before the full MAC, so that Hellos
        for devices that could not register cost 65 derivations each, not one per id."""
        self._check_ids(conn, msg)
        secret = self.settings.secret
        if secret is not None:
            # no stage message meanwhile: its client would answer it, and a refusal that follows could then
            # reset the connection before the client reads why (a registered connection gets the open stage's)
            conn.verifying = True
            self._unpend(conn)  # its Hello is in hand: bounded by the hello timeout and the buffer budget
            try:
                verified = await self._verify(conn, msg, secret)
            finally:
                conn.verifying = False
            if not verified:
                raise Refused("auth", "hello without a valid mac for its devices" if msg.mac is not None
                              else "hello without a mac (the collector requires device authentication)", tell=True)
            if conn.closed:
                return
        self._on_hello(conn, msg)

    async def _verify(self, conn: Connection, msg: Hello, secret: bytes) -> bool:
        """Whether the Hello's MAC is valid (:meth:`_admit`); raises :class:`Refused` when it waited more than
        the hello timeout for its turn, when its peer has gone (``abandoned``), and, once the sample has passed,
        when its ids, protocol or scenario are not this run's or another connection holds its devices."""
        entry = self._lanes.setdefault(conn.host, Lane())
        lane = entry.lock
        entry.users += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.hello_timeout
        try:
            try:  # a Hello queues for its turn at most the hello timeout (a flood of them holds no slot longer)
                await asyncio.wait_for(lane.acquire(), self.settings.hello_timeout)
                try:
                    # (a Hello that is not a first registration waits behind those at most half its time)
                    await asyncio.wait_for(self._turns.acquire(self._first_registration(conn.host, msg.devices),
                                                               self.settings.hello_timeout / 2,
                                                               self._turn_group(conn.host)),
                                           max(0.0, deadline - loop.time()))
                except BaseException:
                    lane.release()
                    raise
            except asyncio.TimeoutError:
                raise Refused("hello_timeout", f"its hello waited more than {self.settings.hello_timeout:g} s "
                                               f"for its turn to be verified") from None
            try:
                args = (secret, conn.nonce or b"", msg.round, msg.protocol, msg.devices.astype(np.uint64), msg.mac)
                self._check_open(conn)
                if not await loop.run_in_executor(None, auth.check_sample, *args):
                    self._failed_network(conn.host)
                    self._check_range(msg)
                    return False
                # the peer holds nearly all the credentials it names: it may be told about this run, before the
                # full MAC (one derivation per id) is paid for devices it could not register anyway
                self._check_range(msg)
                self._check_run(msg)
                self._check_held(msg)
                self._check_open(conn)
                valid = bool(await loop.run_in_executor(None, auth.check_full, *args))
                if not valid:
                    self._failed(conn.host, msg.devices)
                return valid
            finally:
                self._turns.release()
                lane.release()
        finally:
            entry.users -= 1
            if not entry.users:
                del self._lanes[conn.host]

    def _in_range(self, ids: np.ndarray) -> np.ndarray:
        """A Hello's ids (unsigned, increasing) that fall in the population, as indices."""
        return ids[:int(np.searchsorted(ids, self.n_devices))].astype(np.int64)

    def _first_registration(self, host: str, ids: np.ndarray) -> bool:
        """Whether a Hello is checked before the others waiting (:class:`~collector.shares.Turns`): it comes
        from a host none of whose Hellos failed the full MAC, and at most half of its devices were registered
        before or named by a Hello that failed it. A peer holding a shard's credentials that re-registers them,
        or sends them with a few others' ids (passing the sample half the time with 1%) from one host after
        another, then delays a first registration by at most the check in progress, not by one full MAC per
        host it floods from (from 100 hosts, 3.6 s instead of 0.4 for a 50,000-device shard). Only a full
        MAC's failure marks devices (a peer must hold nearly every credential its Hello names to reach it), and
        the half is a majority of the Hello: the few foreign ids of each failed Hello, the devices of the
        first registrations it delays, would take one failed Hello per percent of a shard to demote it (about
        50, each with a different 1%); a demoted shard then waits one check per network the peer floods from
        (:meth:`_turn_group`). A Hello naming no device of the population is none; one that is not waits behind
        first registrations at most half the hello timeout (then among them), so that a stream of them never
        starves it."""
        if host in self._failed_hosts:
            return False
        known = self._in_range(ids)
        familiar = int(np.count_nonzero(self.registered[known] | self.suspect[known]))
        return known.size > 0 and familiar * 2 <= known.size

    def _turn_group(self, host: str) -> str:
        """Whom a Hello from ``host`` takes its turn at the MAC check with (collector/shares.py Turns): its network
        (:func:`peer_prefix`) once a Hello from that network has failed its MAC, else the host alone. A peer on
        many addresses of a few networks then has one turn per network, not one per address (100 addresses of
        one /24 demoting a shard held it behind 100 full MACs: 3.2 s), while honest hosts sharing a clean
        network keep one turn each (grouped by network from the start, 60 honest hosts of one /24 took one
        turn between them, and a forger on 16 addresses had 23 of them refused for the Hello timeout)."""
        network = peer_prefix(host)
        return network if network in self._failed_networks else host

    def _failed_network(self, host: str) -> None:
        """A Hello from ``host`` failed its MAC (any of the three checks): its network takes turns as one."""
        _remember(self._failed_networks, peer_prefix(host))

    def _failed(self, host: str, ids: np.ndarray) -> None:
        """A Hello from ``host`` naming ``ids`` passed the sample and failed the full MAC."""
        self._failed_network(host)
        self.suspect[self._in_range(ids)] = True
        _remember(self._failed_hosts, host)

    def _check_ids(self, conn: Connection, msg: Hello) -> None:
        """The checks that cost nothing per id, before any key is derived: one Hello a connection, at least one
        id, and (without a secret) every id in the population. With a secret the range is checked with the MAC's
        probe (:meth:`_verify`), so that an out-of-range Hello takes the path and the time of a forged one and
        is told what a bad MAC is told: an unauthenticated peer learns nothing of the population (a refusal
        2.7 times faster told it which ids were in range); the counter says which."""
        if conn.hello:
            raise Refused("second_hello", "a connection registers once")
        if msg.devices.size == 0:
            raise Refused("empty_hello", "a hello names at least one device")
        if self.settings.secret is None:
            self._check_range(msg)

    def _check_range(self, msg: Hello) -> None:
        """Refuse (``ids_out_of_range``) a Hello naming a device outside the population."""
        ids = msg.devices  # unsigned and strictly increasing (wire.decode): no duplicates, the last is the largest
        if int(ids[-1]) >= self.n_devices:  # compared as Python ints: no int64 wraparound for ids >= 2^63
            raise Refused("ids_out_of_range", f"hello names device {int(ids[-1])} outside the population of "
                                              f"{self.n_devices}", tell=True,
                          told="hello without a valid mac for its devices" if self.settings.secret else None)

    @staticmethod
    def _check_open(conn: Connection) -> None:
        """Refuse (``abandoned``) a Hello whose peer has closed its connection: no MAC is checked for it (a flood
        of Hellos sent and closed at once had each checked in full while honest ones waited behind them)."""
        if conn.closed or conn.writer.transport.is_closing() or (conn.reader is not None and conn.reader.at_eof()):
            raise Refused("abandoned", "its peer closed the connection before its hello was verified")

    def _on_hello(self, conn: Connection, msg: Hello) -> None:
        """Register a checked Hello's devices on ``conn`` (:meth:`_admit`), or raise :class:`Refused` when they
        run another protocol or scenario, or another connection holds one of them."""
        self._check_run(msg)
        self._check_held(msg)
        ids = msg.devices.astype(np.int64)
        conn.hello = True
        self._unpend(conn)
        conn.devices = ids
        self._waiting.add(conn)
        self._missing -= int(np.count_nonzero(self.registered[ids]))
        self.registered[ids] = True
        self.holder[ids] = conn.serial
        self._held += ids.size
        self.stats.accepted += 1
        if self.finished:  # a client back after the run ended: tell it so
            conn.writer.write(frame(wire.encode(End(round=self.rounds, protocol=self.protocol.name))))
        elif self._stage_open and self._stage_frame is not None:  # back mid-stage: the stage's message
            self.frames_sent += 1  # (devices that already answered it re-send the same reports, or refuse)
            conn.owed += 1
            conn.writer.write(self._stage_frame)
        if self._held == self.n_devices:
            self._registered.set()

    def _check_run(self, msg: Hello) -> None:
        """Refuse a Hello whose devices run another protocol (``protocol``) or scenario (``scenario``)."""
        if msg.protocol != self.protocol.name:
            raise Refused("protocol", f"the devices run protocol {msg.protocol!r}, this collector "
                                      f"{self.protocol.name!r}", tell=True)
        if self.scenario is not None and msg.scenario is not None and msg.scenario != self.scenario:
            raise Refused("scenario", "the devices run another scenario than this collector (its file or --set "
                                      "options differ)", tell=True)

    def _check_held(self, msg: Hello) -> None:
        """Refuse (``ids_held``) a Hello naming a device another live connection holds."""
        ids = msg.devices.astype(np.int64)
        held = int(np.count_nonzero(self.holder[ids]))
        if held:  # not told: the holder may be a connection of the same devices that is about to be dropped
            raise Refused("ids_held", f"{held} of the hello's {ids.size} devices are held by another connection")

    def _strike(self) -> None:
        """A stage timed out: each connection still owing its acknowledgement gets a strike, and one with
        ``unresponsive_stages`` in a row is dropped (``unresponsive``)."""
        limit = self.settings.unresponsive_stages
        for conn in list(self._waiting):
            conn.strikes += 1
            if conn.strikes >= limit:
                self._drop(conn, "unresponsive", f"{limit} stages in a row without an acknowledgement")

    def _check_acks(self) -> None:
        """A stage is complete when every registered device is connected and every connection acknowledged:
        a client that dropped is waited for (up to the stage timeout) rather than forgotten."""
        if self._stage_open and self._missing == 0 and not self._waiting:
            self._acked.set()

    async def _broadcast(self, msg: Message, nominal: float | None = None) -> None:
        """Write ``msg`` to every connection at once; a connection whose socket has not taken it within the write
        timeout is dropped (never waited for again)."""
        if nominal is not None:
            self.downlink.append(describe(msg, nominal))  # type: ignore[arg-type]
        data = frame(wire.encode(msg))
        # registered connections only: one that has not said Hello (or whose Hello is being verified) holds no
        # device and learns nothing of the run; it is sent the open stage's message when it registers
        targets = [c for c in self.connections if c.hello and c.ready and not c.verifying]
        stage = not isinstance(msg, End)  # every message but End is answered, then acknowledged
        self._waiting = {c for c in self.connections if c.devices.size}
        self._acked.clear()
        slow = []
        for conn in targets:
            transport = conn.writer.transport
            if transport.is_closing():
                continue
            self.frames_sent += 1
            conn.owed += stage
            conn.writer.write(data)
            if transport.get_write_buffer_size():
                slow.append(conn)
        if not slow:
            return
        drains = {asyncio.ensure_future(conn.writer.drain()): conn for conn in slow}
        done, pending = await asyncio.wait(drains, timeout=self.settings.write_timeout)
        for task in pending:
            task.cancel()
            self._drop(drains[task], "write_timeout", f"the socket did not take a broadcast within "
                                                      f"{self.settings.write_timeout:g} s")
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                conn = drains[task]
                self._release(conn)
                conn.writer.transport.abort()

    # ------------------------------------------------------------------------------------------ rounds
    async def run(self, first_round: int = 1, last_round: int | None = None, end: bool = True) -> None:
        """Run rounds ``first_round``..``last_round`` (default: all), then tell the clients the run is over
        (``end``). A collector that restarts runs the remaining rounds in a new instance."""
        last = last_round or self.rounds
        extra = self.hostility.extra_rounds(self.rounds) if self.hostility is not None and last == self.rounds else []
        if first_round <= last or extra:  # (a resumed run whose rounds all closed has nothing to wait for)
            try:
                await asyncio.wait_for(self._registered.wait(), self.settings.startup_timeout)
            except asyncio.TimeoutError:
                self.log.warning("startup_incomplete", registered=self._held, devices=self.n_devices)
            self.devices_at_start = self._held
            if not self._held and self.n_devices:
                dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(self.drops.items()))
                raise ConnectionError(f"no device connected within {self.settings.startup_timeout:g} s "
                                      "(--startup-timeout); nothing to collect"
                                      + (f" (connections dropped: {dropped})" if dropped else ""))
            if self.on_start is not None:
                self.on_start(self._held, self.n_devices)
        for t in [*range(first_round, last + 1), *extra]:
            honest = t <= self.rounds
            self._log_drops()
            self.current_round, self._logged = t, 0
            if honest and self.on_round_start is not None:
                self.on_round_start(t)
            resume = None
            if self.resume_stage is not None and t == first_round:  # resumed at a stage boundary of round t
                resume, self.resume_stage = self.resume_stage, None
            machine = round_stages(self.protocol, t, self.nominal_start(t) + self.deadline, self.deadline,
                                   self.hostility, resume)
            closed_at = self.nominal_start(t)
            while True:  # one stage per broadcast (collector/stages.py)
                try:
                    step = next(machine)
                except StopIteration as stop:
                    result = stop.value
                    break
                for hostile in step.before:
                    await self._broadcast(hostile, step.opens_at)
                self._stage_open = True
                self._stage_frame = frame(wire.encode(step.message))  # also sent to one that registers mid-stage
                await self._broadcast(step.message, step.opens_at)
                for hostile in step.after:
                    await self._broadcast(hostile, step.opens_at)
                self._check_acks()
                try:
                    await asyncio.wait_for(self._acked.wait(), self.settings.stage_timeout)
                except asyncio.TimeoutError:
                    self.log.warning("stage_timeout", round=t)
                    self._strike()
                if not step.first and self.settings.round_pause > 0:  # opened by advance: paced like a round
                    await asyncio.sleep(self.settings.round_pause)
                self._stage_open = False
                self._stage_frame = None
                closed_at = step.closes_at
            if honest and self.on_round_closed is not None:
                self.on_round_closed(t, result, closed_at)
            if self.settings.round_pause > 0:
                await asyncio.sleep(self.settings.round_pause)
        if end:
            self.finished = True
            await self._broadcast(End(round=self.rounds, protocol=self.protocol.name))
        self._log_drops()

    async def wait_for_clients_to_leave(self, timeout: float = 5.0) -> None:
        """Wait (at most ``timeout``) for the connections holding devices to close after End; a connection
        that holds none (an idle or hostile one) is not waited for."""
        end = time.monotonic() + timeout
        while any(c.devices.size for c in self.connections) and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop listening and close every connection, then wait for the server to finish. Connections are
        closed first: from Python 3.12.1 on, ``Server.wait_closed()`` waits for every client connection, so
        one idle connection would otherwise keep the server from ever closing. One with unsent bytes (a peer
        that stopped reading) is aborted rather than flushed."""
        self._closing = True
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            transport = conn.writer.transport
            if transport.get_write_buffer_size():
                transport.abort()
            else:
                transport.close()
        if self.server is not None:
            try:
                await asyncio.wait_for(self.server.wait_closed(), timeout)
            except asyncio.TimeoutError:
                for conn in list(self.connections):
                    conn.writer.transport.abort()
                if hasattr(self.server, "abort_clients"):  # Python 3.13+
                    self.server.abort_clients()
                self.log.warning("close_timeout", connections=len(self.connections))
