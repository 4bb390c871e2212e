"""What every protocol provides: a device side for a cohort and a collector side (sans-IO, docs/design.md sections 1-2).

The runtime (SimPy or asyncio) hands the device side each decoded collector message together with the
devices' current private values and ``now``; it gets back the messages to send and the ledger charges.
The collector side opens rounds, takes report batches (raising :class:`ProtocolError` for a batch it must
reject) and closes rounds into estimates. Neither side reads a clock, sleeps or does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from protocols.ledger import Charge
from protocols.messages import CollectionRequest, Decision, ReportBatch


def check_params(epsilon: float, max_value: float, gamma: float = 0.0) -> None:
    """The checks every protocol's parameters share (ValueError naming the scenario key)."""
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"protocol.epsilon must be a positive number, got {epsilon}")
    if not (math.isfinite(max_value) and max_value > 0):
        raise ValueError(f"protocol.max_value must be a positive number, got {max_value}")
    if not 0.0 <= gamma < 0.5:
        raise ValueError(f"protocol.gamma must be in [0, 0.5), got {gamma}")


def accepts(device: object, request: object, day: int) -> bool:
    """The device-side rule every one-report-a-round protocol enforces, whatever the collector asks: answer
    only a collection request for this protocol, for the devices' current ``day``, inside the horizon, and
    never the same round twice (``device.guard``, protocols.guard). Records the round as answered when it
    accepts; counts a refused message as ignored."""
    guard = device.guard  # type: ignore[attr-defined]
    if not isinstance(request, CollectionRequest) or request.protocol != device.params.name:  # type: ignore[attr-defined]
        guard.ignore()
        return False
    return guard.admit(request.round, day)


class ProtocolError(ValueError):
    """A well-formed message the protocol must reject (wrong round, unknown device, bad column...)."""


@dataclass(frozen=True)
class RoundResult:
    """The collector's output for one round."""

    round: int
    estimate: float | np.ndarray  # a mean, or one value per bucket / counter
    reports: int
    info: dict = field(default_factory=dict)  # protocol-specific figures (THRESH: global_update, vote_mean)


class DeviceSide(Protocol):
    device_ids: np.ndarray

    def respond(self, request: CollectionRequest, day: int, values: np.ndarray,
                now: float) -> tuple[ReportBatch | None, list[Charge]]: ...


class CollectorSide(Protocol):
    name: str

    def request(self, round_: int, deadline: float) -> CollectionRequest: ...

    def receive(self, batch: ReportBatch) -> int: ...

    def advance(self, deadline: float) -> Decision | None: ...

    def close_round(self) -> RoundResult: ...

    def transcript_digest(self) -> str: ...


class ProtocolParams(Protocol):
    """A protocol's parameters double as its descriptor for the runtimes.

    ``kind`` is "mean" (one number per round), "histogram" (one frequency per bucket) or "counters"
    (one mean per counter); ``truth`` and ``estimate_sd`` take the round's true (clipped) values.
    """

    name: str
    epsilon: float
    max_value: float
    kind: str

    @property
    def round_epsilon(self) -> float: ...

    def make_devices(self, seed: int, device_ids: np.ndarray) -> DeviceSide: ...

    def make_collector(self, n_devices: int) -> CollectorSide: ...

    def truth(self, values: np.ndarray) -> float | np.ndarray: ...

    def estimate_sd(self, values: np.ndarray, reports: int) -> float | np.ndarray: ...
