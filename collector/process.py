"""The collector as SimPy processes: it runs collection rounds with a deadline, decodes every message it
receives through the wire format, counts and logs what it rejects, and carries on (docs/design.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import simpy

from collector.stages import round_stages
from collector.hostile import Hostility, describe
from collector.network import Inbox, Network
from protocols import wire
from protocols.base import CollectorSide, LateBatch, ProtocolError, RoundResult
from protocols.messages import ReportBatch

LOGGED_REJECTIONS_PER_ROUND = 20  # beyond this, rejections are only counted (a flood must not flood the log)


@dataclass
class CollectorStats:
    received: int = 0
    accepted: int = 0
    rejected: int = 0
    late: int = 0
    reports_accepted: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    #: why the first message was rejected that was neither a late batch nor a dropped connection (a live
    #: server counts those by cause): None where none was. In a run whose devices are all the protocol's own,
    #: any such rejection means its device and collector sides disagree
    first_reason: str | None = None

    def reject(self, kind: str, exc: Exception) -> None:
        """Count one rejected message of ``kind`` (wire, protocol, dropped) for ``exc``."""
        self.rejected += 1
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
        if isinstance(exc, LateBatch):
            self.late += 1
        elif kind != "dropped" and self.first_reason is None:
            self.first_reason = f"{kind}: {str(exc)[:300]}"


class CollectorProcess:
    def __init__(self, env: simpy.Environment, protocol: CollectorSide, network: Network,
                 cohort_inboxes: list[Inbox], deadline: float, log: Any,
                 hostility: Hostility | None = None) -> None:
        self.env, self.protocol, self.network = env, protocol, network
        self.cohort_inboxes, self.deadline, self.log = cohort_inboxes, float(deadline), log
        self.hostility = hostility
        self.inbox: simpy.Store = simpy.Store(env)
        self.stats = CollectorStats()
        self.downlink: list[dict] = []  # every broadcast, in order (downlink.jsonl)
        self.open_until: float | None = None
        self._logged = 0
        env.process(self.receiver())

    def deliver(self, raw: bytes) -> None:
        """Where the network drops bytes addressed to the collector."""
        self.inbox.put(raw)

    def run_round(self, round_: int, on_close: Callable[[RoundResult], None] | None = None):
        """A SimPy process: broadcast the request, wait for the deadline, ask for the next stage while the
        protocol has one, then close the round."""
        self._logged = 0
        machine = round_stages(self.protocol, round_, self.env.now + self.deadline, self.deadline, self.hostility)
        closed: float | None = None
        while True:  # one stage per broadcast (collector/stages.py)
            try:
                step = machine.send(closed) if closed is not None else next(machine)
            except StopIteration as stop:
                result = stop.value
                break
            for extra in step.before:
                self.broadcast(extra)
            self.open_until = step.closes_at
            self.broadcast(step.message)
            for extra in step.after:
                self.broadcast(extra)
            yield self.env.timeout(step.closes_at - self.env.now)
            self.open_until = None
            closed = self.env.now
        if on_close is not None:
            on_close(result)
        return result

    def broadcast(self, message: Any) -> None:
        """Send a collector message to every cohort and keep it for the downlink transcript."""
        self.downlink.append(describe(message, self.env.now))
        self.network.broadcast(wire.encode(message), self.cohort_inboxes)

    def receiver(self):
        while True:
            raw = yield self.inbox.get()
            self.stats.received += 1
            try:
                msg = wire.decode(raw)
                if not isinstance(msg, ReportBatch):
                    raise ProtocolError(f"devices may not send {type(msg).__name__} messages")
                if self.open_until is None or self.env.now >= self.open_until:
                    raise LateBatch(f"report batch for round {msg.round} arrived after the round closed")
                accepted = self.protocol.receive(msg)
            except (wire.WireError, ProtocolError) as exc:
                self._reject(exc)
                continue
            self.stats.accepted += 1
            self.stats.reports_accepted += accepted

    def _reject(self, exc: Exception) -> None:
        kind = "wire" if isinstance(exc, wire.WireError) else "protocol"
        self.stats.reject(kind, exc)
        self._logged += 1
        if self._logged <= LOGGED_REJECTIONS_PER_ROUND:
            self.log.warning("message_rejected", kind=kind, reason=str(exc)[:200])
