"""The simulated network between device cohorts and the collector (SimPy).

Loss and latency are properties of each *device's* report, drawn from keyed randomness (seed, device,
round), never of a cohort's batch: a cohort is a simulation device, so results must not depend on how
devices are grouped (docs/design.md section 2). A cohort's batch is split by fate: the reports that arrive
before the deadline travel together and land when the slowest of them would; late ones travel together
and land after the deadline (the collector rejects them as late); lost ones never leave. Broadcasts from
the collector arrive after the base latency, reliably.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import simpy

from protocols import keyed
from protocols.keyed import Purpose, stream_key


@dataclass(frozen=True)
class NetworkParams:
    """``latency`` base one-way delay (s); ``jitter`` mean of an exponential extra delay (s); ``loss`` the
    probability that a report is lost; ``deadline`` seconds after a round's request until it closes."""

    latency: float = 0.05
    jitter: float = 0.0
    loss: float = 0.0
    deadline: float = 3600.0
    downlink_loss: float = 0.0  # probability that a broadcast does not reach a device


@dataclass
class Traffic:
    """Counters of what crossed the network (messages are wire messages; reports are per device)."""

    messages_sent: int = 0
    messages_delivered: int = 0
    reports_sent: int = 0
    reports_lost: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True)
class Fate:
    """Per-report outcome: indices into the batch that arrive on time (and when), late, or never."""

    on_time: np.ndarray
    on_time_delay: float
    late: np.ndarray
    late_delay: float
    lost: int


class Network:
    def __init__(self, env: simpy.Environment, params: NetworkParams, seed: int) -> None:
        self.env, self.params, self.seed = env, params, int(seed)
        self.traffic = Traffic()

    def fate(self, device_ids: np.ndarray, round_: int, time_left: float) -> Fate:
        """Split a batch's reports by keyed loss and latency; ``time_left`` is the time until the deadline."""
        p = self.params
        n = device_ids.shape[0]
        keep = np.ones(n, dtype=bool)
        if p.loss > 0:
            keep = keyed.uniform(stream_key(self.seed, Purpose.LOSS, round_), device_ids) >= p.loss
        if p.jitter > 0:
            u = keyed.uniform(stream_key(self.seed, Purpose.LATENCY, round_), device_ids)
            delay = p.latency - p.jitter * np.log1p(-u)
            on = keep & (delay < time_left)
            late = keep & ~on
            on_idx, late_idx = np.flatnonzero(on), np.flatnonzero(late)
            on_delay = float(delay[on_idx].max()) if on_idx.size else 0.0
            late_delay = float(delay[late_idx].max()) if late_idx.size else 0.0
        else:
            on_time = p.latency < time_left
            idx = np.flatnonzero(keep) if p.loss > 0 else np.arange(n)
            on_idx, late_idx = (idx, idx[:0]) if on_time else (idx[:0], idx)
            on_delay = late_delay = p.latency
        lost = int(n - int(keep.sum()))
        self.traffic.reports_lost += lost
        return Fate(on_idx, on_delay, late_idx, late_delay, lost)

    def received(self, device_ids: np.ndarray, round_: int, kind: int) -> np.ndarray | None:
        """Which devices a broadcast of ``kind`` for ``round_`` reached (keyed; None: all)."""
        if self.params.downlink_loss <= 0:
            return None
        u = keyed.uniform(stream_key(self.seed, Purpose.DOWNLINK, round_, kind), device_ids)
        return u >= self.params.downlink_loss

    def transmit(self, raw: bytes, delay: float, deliver: Callable[[bytes], object], reports: int = 0,
                 copies: int = 1) -> None:
        """Send encoded bytes; ``deliver`` is called with them after ``delay``. ``copies``: how many recipients
        the one delivery stands for (a sharded run's single inbox for all its cohorts), as counted traffic."""
        self.traffic.messages_sent += copies
        self.traffic.bytes_sent += len(raw) * copies
        self.traffic.reports_sent += reports
        self.env.process(self._carry(raw, delay, deliver, copies))

    def _carry(self, raw: bytes, delay: float, deliver: Callable[[bytes], object], copies: int = 1):
        yield self.env.timeout(delay)
        self.traffic.messages_delivered += copies
        deliver(raw)

    def broadcast(self, raw: bytes, inboxes: list[Any]) -> None:
        """One message to every cohort, arriving after the base latency (an inbox with ``copies`` stands for
        that many cohorts)."""
        for box in inboxes:
            self.transmit(raw, self.params.latency, box.put, copies=getattr(box, "copies", 1))
