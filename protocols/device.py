"""The device-side template of protocols that send one report per collection round.

:class:`OneReportDevices` owns ``respond``: before a subclass computes anything it checks the runtime's input
(one value per device: local misuse otherwise, :class:`~protocols.base.MisuseError`) and applies the
acceptance rule every device enforces whatever the collector asks (:func:`protocols.base.accepts`, the
device's :class:`~protocols.guard.Guard`): a collection request of this protocol, for the devices' current day,
inside the horizon, each round once and in order; anything else is ignored and counted. Only then does it ask
the subclass for the round's batch (:meth:`OneReportDevices.report_batch`), whose every charge goes through
the same guard, which refuses a report the budget cannot pay. 1BitMean/1BitRRPM, the dBitFlip family, KFlip,
Laplace and 1BitMulti are written on it; a plugin with one report a round can be too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.base import MisuseError, accepts
from protocols.guard import Guard
from protocols.ledger import Charge
from protocols.messages import CollectorMessage, ReportBatch
from protocols.snapshot import GuardedSnapshot

__all__ = ["OneReportDevices"]


class OneReportDevices(GuardedSnapshot):
    """A cohort's device side for a one-report-a-round protocol (module docstring). Subclasses set ``params``,
    ``seed``, ``device_ids`` (uint64) and ``guard`` and implement :meth:`report_batch`."""

    params: Any
    seed: int
    device_ids: np.ndarray
    guard: Guard

    def check_values(self, values: np.ndarray) -> None:
        """The runtime hands one value per device (override for several counters per device)."""
        if values.shape != self.device_ids.shape:
            raise MisuseError("one value per device is required")

    def respond(self, request: CollectorMessage, day: int, values: np.ndarray, now: float,
                present: np.ndarray | None = None) -> tuple[ReportBatch | None, list[Charge]]:
        """Answer a collection request for the current ``day`` with the devices ``present`` (default all), or
        ignore the message (and count it) when the acceptance rule refuses it."""
        self.check_values(values)
        if not accepts(self, request, day):
            return None, []
        rows = np.arange(self.device_ids.size) if present is None else np.flatnonzero(present)
        return self.report_batch(request.round, values, rows, now)

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The batch of the devices at ``rows`` for an accepted ``round_`` and its charges (through the guard,
        which refuses what the budget cannot pay)."""
        raise NotImplementedError
