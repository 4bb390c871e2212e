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
from typing import Any, Callable, Protocol

import math

import numba as nb
import numpy as np
import simpy

from protocols import keyed
from protocols.keyed import Purpose, stream_key


@nb.njit(cache=True, nogil=True)
def _delay(latency, jitter, u):
    """The delay of a report whose keyed latency draw is u: latency - jitter log(1 - u)."""
    return latency - jitter * math.log1p(-u)


@nb.njit(cache=True, nogil=True)
def _on_time_band(latency, jitter, time_left):
    """(u_lo, u_hi): a latency draw u < u_lo is on time and u >= u_hi late, both checked on :func:`_delay`
    itself (which rises with u); only draws in between need the logarithm to be told apart."""
    if not time_left > latency:
        return 0.0, 0.0  # every delay is at least the latency
    u_star = -math.expm1(-(time_left - latency) / jitter)
    u_lo, u_hi = u_star * (1.0 - 1e-9), min(u_star * (1.0 + 1e-9) + 1e-300, 1.0)
    while u_lo > 0.0 and not _delay(latency, jitter, u_lo) < time_left:
        u_lo *= 0.5
    while u_hi < 1.0 and not _delay(latency, jitter, u_hi) >= time_left:
        u_hi = min(u_hi + (1.0 - u_hi) * 0.5 + 1e-300, 1.0)
    return u_lo, u_hi


@nb.njit(cache=True, nogil=True)
def _fate_kernel(ids, loss_key, latency_key, loss, latency, jitter, time_left, on, late, on_ids):
    """Each report's fate (``ids``: its device, an unsigned or non-negative integer) by its keyed loss draw
    (kept when u >= loss) and keyed exponential delay latency - jitter log(1 - u): the indices of the reports
    on time written to ``on`` (and their ids, as they are, to ``on_ids``: the on-time batch's devices without
    a gather) and of those late to ``late``, in batch order; returns their counts and the largest on-time and
    late delays (0 when none).
    The delay rises with u, so the deadline splits the draws at one point and the largest delay is that of the
    largest draw: one logarithm per batch, not one per report, except for draws within 1e-9 of the split."""
    u_lo, u_hi = _on_time_band(latency, jitter, time_left)
    on_u, late_u = -1.0, -1.0
    n_on = n_late = 0
    for i in range(ids.shape[0]):
        device = np.uint64(ids[i])
        if loss > 0.0 and keyed.uniform1(loss_key, device) < loss:
            continue
        u = keyed.uniform1(latency_key, device)
        if u < u_lo or (u < u_hi and _delay(latency, jitter, u) < time_left):
            on[n_on] = i
            on_ids[n_on] = ids[i]
            n_on += 1
            on_u = max(on_u, u)
        else:
            late[n_late] = i
            n_late += 1
            late_u = max(late_u, u)
    on_max = _delay(latency, jitter, on_u) if on_u >= 0.0 else 0.0
    late_max = _delay(latency, jitter, late_u) if late_u >= 0.0 else 0.0
    return n_on, n_late, on_max, late_max


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
    """Per-report outcome: indices into the batch that arrive on time (and when), late, or never;
    ``on_time_devices``: the batch's device ids at ``on_time`` (``device_ids[on_time]``), where the fate kernel
    wrote them as it went (None: not computed)."""

    on_time: np.ndarray
    on_time_delay: float
    late: np.ndarray
    late_delay: float
    lost: int
    on_time_devices: np.ndarray | None = None


class Inbox(Protocol):
    """Where the network delivers a cohort's messages: a SimPy Store, or a sharded run's single inbox that
    stands for ``copies`` cohorts (agents/shard.py)."""

    def put(self, item: bytes, /) -> Any: ...


class Network:
    def __init__(self, env: simpy.Environment | None, params: NetworkParams, seed: int) -> None:
        """``env``: the SimPy environment that carries messages; None for a network that only keys the fates
        of reports (a process shard's devices, which the collector's process delivers)."""
        self.env, self.params, self.seed = env, params, int(seed)
        self.traffic = Traffic()

    def fate(self, device_ids: np.ndarray, round_: int, time_left: float) -> Fate:
        """Split a batch's reports by keyed loss and latency; ``time_left`` is the time until the deadline."""
        p = self.params
        n = device_ids.shape[0]
        if p.jitter > 0:  # one pass over the batch (the kernel above)
            ids = keyed.kernel_ids(device_ids)  # wire ids (uint32) as they are: the kernel widens each one
            on, late, on_ids = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), np.empty(n, dtype=ids.dtype)
            n_on, n_late, on_delay, late_delay = _fate_kernel(
                ids, np.uint64(stream_key(self.seed, Purpose.LOSS, round_)),
                np.uint64(stream_key(self.seed, Purpose.LATENCY, round_)), float(p.loss), float(p.latency),
                float(p.jitter), float(time_left), on, late, on_ids)
            on_idx, late_idx = on[:n_on], late[:n_late]
            lost = n - n_on - n_late
            self.traffic.reports_lost += lost
            devices = on_ids[:n_on] if ids.dtype == np.asarray(device_ids).dtype else None
            return Fate(on_idx, float(on_delay), late_idx, float(late_delay), lost, devices)
        keep = np.ones(n, dtype=bool)
        if p.loss > 0:
            keep = keyed.uniform(stream_key(self.seed, Purpose.LOSS, round_), device_ids) >= p.loss
        idx = np.flatnonzero(keep) if p.loss > 0 else np.arange(n)
        on_idx, late_idx = (idx, idx[:0]) if p.latency < time_left else (idx[:0], idx)
        lost = int(n - idx.size)
        self.traffic.reports_lost += lost
        return Fate(on_idx, p.latency, late_idx, p.latency, lost)

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
        env = self._simulated()
        env.process(self._carry(env, raw, delay, deliver, copies))

    def _simulated(self) -> simpy.Environment:
        """The SimPy environment that carries messages (a Network built without one keys fates only)."""
        if self.env is None:
            raise RuntimeError("this Network has no SimPy environment: it computes keyed fates, it cannot transmit")
        return self.env

    def _carry(self, env: simpy.Environment, raw: bytes, delay: float, deliver: Callable[[bytes], object],
               copies: int = 1):
        yield env.timeout(delay)
        self.traffic.messages_delivered += copies
        deliver(raw)

    def broadcast(self, raw: bytes, inboxes: list[Inbox]) -> None:
        """One message to every cohort, arriving after the base latency (an inbox with ``copies`` stands for
        that many cohorts)."""
        for box in inboxes:
            self.transmit(raw, self.params.latency, box.put, copies=getattr(box, "copies", 1))
