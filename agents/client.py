"""A live device client: hosts device cohorts over one TCP connection to the collector (asyncio).

The device-side protocol objects, the world model and the ledger live in the client, not in the connection:
a client that loses its connection reconnects with exponential backoff and keeps every device's memo state,
reveals and privacy caps. Each collector message is answered by every cohort (report batches), followed by
an empty batch that acknowledges the stage. The devices' own day advances with the rounds asked for (each
day observed once, in order), and ``now`` is the scenario's nominal time, as in the simulator.

With its devices' credentials (``credentials``: read from the shard's credentials file; or derived once
from a deployment ``secret``, protocols.auth) the client waits for the collector's ``Challenge`` on every
connection and answers it with an authenticated ``Hello``; a collector that sends none is one that does not
authenticate devices, and the client stops with that reason. With a TLS context it connects over TLS (the
collector's certificate checked against it).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import numpy as np

from agents.world import World
from protocols import auth, wire
from protocols.framing import FrameDecoder, frame
from protocols.base import Observer
from protocols.guard import Limits
from protocols.ledger import Ledger
from protocols.messages import (Challenge, CollectionRequest, Decision, End, Hello, Message, Refusal, ReportBatch,
                                Threshold)


class CollectorRefused(Exception):
    """The collector refused this client's devices for a reason that trying again cannot cure (its Refusal
    message: another protocol or scenario, no valid credential, ids outside its population)."""


class DeviceDays:
    """The devices' days in one process: the world advances one day at a time and every hosted cohort
    observes each day, whether or not its connection is up (devices watch their own counters offline too).
    Clients of a process share it, and with it one world model of the whole population."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.clients: list["DeviceClient"] = []

    def advance(self, day: int) -> None:
        while self.world.day < day:
            d = self.world.day + 1
            self.world.advance_to(d)
            for client in self.clients:
                client.observe(d)


#: real seconds of failed connection attempts after which a client stops (no collector there)
GIVE_UP_AFTER = 60.0
#: seconds a connection may stay silent before a client holding credentials concludes that the collector does
#: not authenticate devices (one that does sends its Challenge as soon as it accepts a connection)
NO_CHALLENGE_AFTER = 5.0
#: stages a round may have, at one deadline each: a charge's time is at most that far into its round (THRESH and
#: ToPL have two or three; a collector's deadline of 1e308 or -3600 put those times in the ledger)
MAX_STAGES = 16
#: real seconds a collector's frame may take from its first bytes to its last; past them the client drops the
#: connection and connects again (a collector stalled mid-frame held a client for ever)
FRAME_TIMEOUT = 30.0


class DeviceClient:
    def __init__(self, params: Any, seed: int, device_ids: np.ndarray, cohort_size: int, world: World,
                 ledger: Ledger, deadline: float, latency: float, host: str, port: int,
                 backoff: tuple[float, float] = (0.05, 2.0), max_frame: int = wire.MAX_DOWNLINK_BYTES,
                 give_up_after: float = GIVE_UP_AFTER, days: "DeviceDays | None" = None,
                 limits: Limits | None = None, secret: bytes | None = None, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, challenge_timeout: float = 30.0,
                 scenario: bytes | None = None, frame_timeout: float = FRAME_TIMEOUT,
                 round_seconds: float | None = None, credentials: auth.Credentials | None = None) -> None:
        self.params, self.world, self.ledger = params, world, ledger
        self.deadline, self.latency = float(deadline), float(latency)
        self.host, self.port, self.backoff, self.max_frame = host, int(port), backoff, max_frame
        self.give_up_after = give_up_after  # seconds of failed connection attempts before the client stops
        self.frame_timeout = float(frame_timeout)  # seconds a collector's frame may take from its first bytes
        # the scenario's round length: a charge's time (the ledger's) is taken from the collector's deadline,
        # clamped to the round's nominal window (None: as the collector says)
        self.round_seconds = None if round_seconds is None else float(round_seconds)
        ids = np.asarray(device_ids, dtype=np.int64)
        self.ids = ids
        # the devices' credentials, concatenated (from the shard's credentials, or derived once from a secret,
        # which is not kept)
        self._keys = (credentials.keys_of(ids) if credentials is not None
                      else auth.device_keys(secret, ids) if secret is not None else None)
        # their key id (hex), checked against the one a collector's Challenge names
        self.key_id = (credentials.key_id if credentials is not None
                       else auth.key_id(secret) if secret is not None else None)
        self.tls, self.server_hostname, self.challenge_timeout = tls, server_hostname, challenge_timeout
        self.scenario = scenario  # the fingerprint its Hellos carry (None: none, as older clients)
        self.limits = limits or Limits()
        self.cohorts = [params.make_devices(seed, ids[i:i + cohort_size], self.limits)
                        for i in range(0, ids.size, cohort_size)]
        self.epoch_length = int(getattr(params, "epoch_length", 1))
        # clients sharing a world share its days (else the first to advance it would leave the others behind)
        self.days = days or world.device_days or DeviceDays(world)
        world.device_days = self.days
        self.days.clients.append(self)
        self.day = 0
        self.done = False
        self.connections = 0  # how many times it connected (reconnects = connections - 1)
        self.rejected = 0  # collector frames these devices could not decode (ignored; the connection kept)
        self.writer: asyncio.StreamWriter | None = None
        self._heard = False  # whether the collector sent anything on the current connection

    def _advance(self, day: int) -> None:
        """Bring the devices' days up to ``day``: the process's days advance (every hosted cohort observes each
        day, connected or not)."""
        self.days.advance(day)

    def observe(self, day: int) -> None:
        """This client's cohorts look at their counters for ``day`` (called by DeviceDays, once a day)."""
        self.day = day
        for cohort in self.cohorts:
            if isinstance(cohort, Observer):
                ids = cohort.device_ids.astype(np.int64)
                cohort.observe(day, self.world.values(ids)[0], self.world.present(ids))

    def answer(self, msg: CollectionRequest | Decision | Threshold) -> list[bytes]:
        """The frames to send for one collector message: each cohort's batch, then the acknowledgement. The
        devices' days advance to the requested round only inside the horizon: a request for a round beyond it
        (2^31 - 1, say) is refused by every device side at once instead of walked to day by day."""
        if msg.round <= self.limits.horizon:
            self._advance(msg.round * self.epoch_length)
        now = msg.deadline - self.deadline + self.latency  # the simulator's answer time for this stage
        if self.round_seconds is not None:  # a time the collector chose: kept inside the round's own window
            start = (msg.round * self.epoch_length - 1) * self.round_seconds
            now = min(max(now, start), start + MAX_STAGES * self.deadline + self.latency)
        out = []
        for cohort in self.cohorts:
            ids = cohort.device_ids.astype(np.int64)
            values, _ = self.world.values(ids)
            batch, charges = cohort.respond(msg, self.day, values, now, self.world.present(ids))
            for charge in charges:
                self.ledger.record(charge)
            if batch is not None and len(batch):
                out.append(frame(wire.encode(batch)))
        out.append(frame(wire.encode(ReportBatch(msg.round, msg.protocol, np.empty(0, np.uint32), {}))))
        return out

    async def run(self) -> None:
        delay = self.backoff[0]
        failing_since: float | None = None
        misframed = 0  # sessions in a row that the collector ended with bytes no frame can hold
        loop = asyncio.get_running_loop()
        while not self.done:
            try:
                if self.tls is not None:
                    reader, writer = await asyncio.wait_for(asyncio.open_connection(
                        self.host, self.port, ssl=self.tls, server_hostname=self.server_hostname or self.host),
                        self.challenge_timeout)
                else:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:  # refused, unreachable, TLS failure (ssl.SSLError), timed out
                failing_since = failing_since if failing_since is not None else loop.time()
                if loop.time() - failing_since > self.give_up_after:
                    raise ConnectionError(f"no collector at {self.host}:{self.port} for {self.give_up_after:g} s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff[1])
                continue
            failing_since = None
            self.connections += 1
            self.writer = writer
            self._heard = False
            try:
                await self._session(reader, writer)
                misframed = 0
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                misframed = 0  # a broken connection: connect again
            except wire.WireError:  # a frame over the limit: leave, and back off as from a refused connection
                misframed += 1
                delay = min(self.backoff[0] * 2 ** min(misframed, 30), self.backoff[1])
            finally:
                writer.close()
                self.writer = None
            if misframed:
                pass  # backed off above
            elif self._heard:  # served: a later drop reconnects at once
                delay = self.backoff[0]
            else:  # closed before any message: a Hello refused without a reason (its devices still held by a
                # connection the collector has not seen die, say): try again, backing off, until it is served
                delay = min(max(delay, self.backoff[0]) * 2, self.backoff[1])
            if not self.done:
                await asyncio.sleep(delay)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder(self.max_frame)
        early: list[Message] = []  # frames that came with the challenge (handled after the Hello)
        nonce = None
        if self._keys is not None:
            loop = asyncio.get_running_loop()
            since = loop.time()
            try:
                challenge = await asyncio.wait_for(self._challenge(reader, decoder, early), self.challenge_timeout)
            except asyncio.TimeoutError:
                challenge = None
            nonce = None if challenge is None else challenge.nonce
            theirs = None if challenge is None or challenge.key_id is None else challenge.key_id.hex()
            if theirs is not None and theirs != self.key_id:
                raise CollectorRefused(
                    f"the collector at {self.host}:{self.port} authenticates devices under key id {theirs}, and "
                    f"these devices' credentials are of key id {self.key_id}: another deployment's secret or "
                    "credentials file")
            if nonce is None:
                if not early and not decoder.pending and loop.time() - since >= NO_CHALLENGE_AFTER:
                    raise CollectorRefused(
                        f"the collector at {self.host}:{self.port} sent no challenge in {loop.time() - since:.0f} s: "
                        "it does not authenticate devices (serve without --secret-file?), and these devices hold "
                        "credentials")
                return
        round_ = self.day // self.epoch_length + 1
        devices = self.ids.astype(np.uint32)
        keys = self._keys
        mac = None if nonce is None or keys is None else auth.hello_mac(keys, nonce, round_, self.params.name, devices)
        writer.write(frame(wire.encode(Hello(round=round_, protocol=self.params.name, devices=devices, mac=mac,
                                             scenario=self.scenario))))
        await writer.drain()
        for msg in early:
            if await self._on_message(msg, writer):
                return
        while True:
            if decoder.pending:  # a frame started: it must end within frame_timeout (TimeoutError: reconnect)
                data = await asyncio.wait_for(reader.read(1 << 16), self.frame_timeout)
            else:  # between frames a collector may be silent for as long as it likes (a round's pause)
                data = await reader.read(1 << 16)
            if not data:
                return
            for raw in decoder.feed(data):
                try:
                    msg = wire.decode(raw)
                except wire.WireError:
                    self.rejected += 1
                    continue
                if await self._on_message(msg, writer):
                    return

    async def _challenge(self, reader: asyncio.StreamReader, decoder: FrameDecoder,
                         early: list[Message]) -> Challenge | None:
        """The collector's challenge (its first frame), or None if the connection closed first."""
        challenge: Challenge | None = None
        while challenge is None:
            data = await reader.read(1 << 16)
            if not data:
                return None
            for raw in decoder.feed(data):
                try:
                    msg = wire.decode(raw)
                except wire.WireError:
                    self.rejected += 1
                    continue
                if challenge is None and isinstance(msg, Challenge):
                    challenge = msg
                elif challenge is not None:
                    early.append(msg)
        return challenge

    async def _on_message(self, msg: Message, writer: asyncio.StreamWriter) -> bool:
        """Answer one collector message; True when the run is over."""
        self._heard = True
        if isinstance(msg, End):
            self.done = True
            return True
        if isinstance(msg, Refusal):
            raise CollectorRefused(f"the collector at {self.host}:{self.port} refused the devices: {msg.reason}")
        if isinstance(msg, (CollectionRequest, Decision, Threshold)):
            for chunk in self.answer(msg):
                writer.write(chunk)
            await writer.drain()
        return False

    def disconnect(self) -> None:
        """Drop the current connection (for fault tests); the client reconnects by itself."""
        if self.writer is not None:
            self.writer.transport.abort()
