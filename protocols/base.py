"""What every protocol provides: a device side for a cohort and a collector side (sans-IO, DESIGN.md 1-2).

The runtime (SimPy or asyncio) hands the device side each decoded collector message together with the
devices' current private values and ``now``; it gets back the messages to send and the ledger charges.
The collector side opens rounds, takes report batches (raising :class:`ProtocolError` for a batch it must
reject) and closes rounds into estimates. Neither side reads a clock, sleeps or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from protocols.ledger import Charge
from protocols.messages import CollectionRequest, ReportBatch


class ProtocolError(ValueError):
    """A well-formed message the protocol must reject (wrong round, unknown device, bad column...)."""


@dataclass(frozen=True)
class RoundResult:
    """The collector's output for one round."""

    round: int
    estimate: float
    reports: int


class DeviceSide(Protocol):
    device_ids: np.ndarray

    def respond(self, request: CollectionRequest, day: int, values: np.ndarray,
                now: float) -> tuple[ReportBatch | None, list[Charge]]: ...


class CollectorSide(Protocol):
    name: str

    def request(self, round_: int, deadline: float) -> CollectionRequest: ...

    def receive(self, batch: ReportBatch) -> int: ...

    def close_round(self) -> RoundResult: ...

    def transcript_digest(self) -> str: ...
