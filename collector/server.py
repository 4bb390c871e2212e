"""The live collector: the same sans-IO collector side over real TCP with asyncio (DESIGN.md section 4).

Frames are length-prefixed wire messages (protocols.framing). A device client registers its devices with a
``Hello``; the server then runs the rounds in real time: it broadcasts each stage's message (collection
request, THRESH decision, ToPL threshold), takes report batches until every connection has acknowledged the
stage (an empty batch) or the stage timeout passes, and closes the round. Messages carry the scenario's
nominal times (the simulated timeline), so devices charge and answer exactly as in a simulated run and the
digests agree; real time only paces the exchange.

Hostile input is bounded: a frame over the size limit, bytes that do not decode, a wrong version, or a
client that stalls mid-frame past the read timeout gets its connection dropped and counted; a well-formed
batch the protocol refuses is counted and the connection kept. Honest connections are never affected.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from collector.hostile import Hostility, describe
from collector.process import LOGGED_REJECTIONS_PER_ROUND, CollectorStats
from protocols import wire
from protocols.base import CollectorSide, ProtocolError, RoundResult
from protocols.framing import FrameDecoder, frame
from protocols.messages import End, Hello, Message, ReportBatch


@dataclass(eq=False)  # identity-hashed: connections live in a set
class Connection:
    writer: asyncio.StreamWriter
    devices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    acked: bool = False


@dataclass
class LiveSettings:
    stage_timeout: float = 5.0  # real seconds a stage stays open at most
    read_timeout: float = 5.0  # real seconds a started frame may take
    max_frame: int = wire.MAX_MESSAGE_BYTES
    startup_timeout: float = 30.0  # real seconds to wait for every device to register


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
        self.dropped = 0  # connections dropped for misbehaving
        self.connections: set[Connection] = set()
        self.registered = np.zeros(self.n_devices, dtype=bool)  # ever said hello
        self.connected = np.zeros(self.n_devices, dtype=bool)  # on an open connection now
        self._missing = 0  # registered devices not connected now (kept as a count: checked on every ack)
        self.finished = False
        self._stage_open = False
        self._acked = asyncio.Event()
        self._registered = asyncio.Event()
        self._logged = 0
        self.current_round = 0
        self.frames_sent = 0
        self.server: asyncio.base_events.Server | None = None

    # ------------------------------------------------------------------------------------------ transport
    async def start(self, host: str, port: int) -> int:
        # a deep backlog: a thousand clients connecting at once overflowed the default 100 (1 s TCP retries)
        self.server = await asyncio.start_server(self._handle, host, port, backlog=4096)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(writer)
        self.connections.add(conn)
        decoder = FrameDecoder(self.settings.max_frame)
        reason = "closed"
        try:
            while True:
                timeout = self.settings.read_timeout if decoder.pending else None
                data = await asyncio.wait_for(reader.read(1 << 16), timeout)
                if not data:
                    break
                for raw in decoder.feed(data):
                    self._on_frame(conn, raw)
        except asyncio.TimeoutError:
            reason = "stalled mid-frame"
        except wire.WireError as exc:
            reason = str(exc)
        except (ConnectionError, asyncio.IncompleteReadError):
            reason = "connection lost"
        finally:
            if reason != "closed" and reason != "connection lost":
                self.dropped += 1
                self.stats.rejected += 1
                self.stats.reasons["dropped"] = self.stats.reasons.get("dropped", 0) + 1
                self.log.warning("connection_dropped", reason=reason[:200])
            self.connections.discard(conn)
            self._missing += int(np.count_nonzero(self.connected[conn.devices]))
            self.connected[conn.devices] = False
            writer.close()
            self._check_acks()

    def _on_frame(self, conn: Connection, raw: bytes) -> None:
        self.stats.received += 1
        msg = wire.decode(raw)  # WireError: the connection is dropped by the caller
        if isinstance(msg, Hello):
            ids = msg.devices.astype(np.int64)
            if ids.size and int(ids[-1]) >= self.n_devices:
                raise wire.WireError(f"hello names device {int(ids[-1])} outside the population")
            conn.devices = ids
            self._missing -= int(np.count_nonzero(self.registered[ids] & ~self.connected[ids]))
            self.registered[ids] = True
            self.connected[ids] = True
            self.stats.accepted += 1
            if self.finished:  # a client back after the run ended: tell it so
                conn.writer.write(frame(wire.encode(End(round=self.rounds, protocol=self.protocol.name))))
            if self.registered.all():
                self._registered.set()
            return
        try:
            if not isinstance(msg, ReportBatch):
                raise ProtocolError(f"devices may not send {type(msg).__name__} messages")
            if len(msg) == 0 and not msg.columns:  # the client's acknowledgement: nothing more this stage
                conn.acked = True
                self._check_acks()
                return
            if not self._stage_open:
                self.stats.late += 1
                raise ProtocolError(f"report batch for round {msg.round} arrived after the stage closed")
            ids = msg.devices.astype(np.int64)
            if not np.all(np.isin(ids, conn.devices, assume_unique=True)):
                raise ProtocolError("batch names devices this connection did not register")
            self.stats.reports_accepted += self.protocol.receive(msg)
            self.stats.accepted += 1
        except ProtocolError as exc:
            self.stats.rejected += 1
            self.stats.reasons["protocol"] = self.stats.reasons.get("protocol", 0) + 1
            self._logged += 1
            if self._logged <= LOGGED_REJECTIONS_PER_ROUND:
                self.log.warning("message_rejected", kind="protocol", reason=str(exc)[:200])

    def _check_acks(self) -> None:
        """A stage is complete when every registered device is connected and every connection acknowledged:
        a client that dropped is waited for (up to the stage timeout) rather than forgotten."""
        if (self._stage_open and self._missing == 0
                and all(c.acked for c in self.connections if c.devices.size)):
            self._acked.set()

    async def _broadcast(self, msg: Message, nominal: float | None = None) -> None:
        if nominal is not None:
            self.downlink.append(describe(msg, nominal))  # type: ignore[arg-type]
        data = frame(wire.encode(msg))
        for conn in list(self.connections):
            conn.acked = False
        self._acked.clear()
        for conn in list(self.connections):
            try:
                self.frames_sent += 1
                conn.writer.write(data)
                await conn.writer.drain()
            except (ConnectionError, RuntimeError):
                self.connections.discard(conn)

    # ------------------------------------------------------------------------------------------ rounds
    async def run(self, first_round: int = 1, last_round: int | None = None, end: bool = True) -> None:
        """Run rounds ``first_round``..``last_round`` (default: all), then tell the clients the run is over
        (``end``). A collector that restarts runs the remaining rounds in a new instance."""
        try:
            await asyncio.wait_for(self._registered.wait(), self.settings.startup_timeout)
        except asyncio.TimeoutError:
            self.log.warning("startup_incomplete", registered=int(self.registered.sum()), devices=self.n_devices)
        last = last_round or self.rounds
        extra = self.hostility.extra_rounds(self.rounds) if self.hostility is not None and last == self.rounds else []
        for t in [*range(first_round, last + 1), *extra]:
            honest = t <= self.rounds
            self.current_round, self._logged = t, 0
            if honest and self.on_round_start is not None:
                self.on_round_start(t)
            close_at = self.nominal_start(t) + self.deadline
            msg: Message | None = self.protocol.request(t, close_at)
            for hostile in self.hostility.start_round() if self.hostility is not None else ():
                await self._broadcast(hostile, close_at - self.deadline)
            while msg is not None:
                self._stage_open = True
                await self._broadcast(msg, close_at - self.deadline)
                for hostile in self.hostility.after(msg) if self.hostility is not None else ():
                    await self._broadcast(hostile, close_at - self.deadline)
                self._check_acks()
                try:
                    await asyncio.wait_for(self._acked.wait(), self.settings.stage_timeout)
                except asyncio.TimeoutError:
                    self.log.warning("stage_timeout", round=t)
                self._stage_open = False
                closed_at, close_at = close_at, close_at + self.deadline
                msg = self.protocol.advance(close_at)
            result = self.protocol.close_round()
            if honest and self.on_round_closed is not None:
                self.on_round_closed(t, result, closed_at)
        if end:
            self.finished = True
            await self._broadcast(End(round=self.rounds, protocol=self.protocol.name))

    async def wait_for_clients_to_leave(self, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while self.connections and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for conn in list(self.connections):
            conn.writer.close()
