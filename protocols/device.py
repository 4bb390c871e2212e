"""The device-side template every protocol is written on: the acceptance rule first, then the reports.

:class:`GuardedDevices` owns ``respond``. Before a subclass computes anything it checks the runtime's input
(one value per device: local misuse otherwise, :class:`~protocols.base.MisuseError`) and applies the rule
every device enforces whatever the collector asks, through the device's :class:`~protocols.guard.Guard`:

1. a message of a type this protocol answers (``answers``), naming this protocol;
2. a collection request: for the devices' current round (:meth:`GuardedDevices.current_round`: the day, or
   the epoch just completed), inside the horizon, each round once and in order (``Guard.admit``); a later
   stage's message (THRESH's decision, ToPL's threshold): the protocol's own rule for it
   (:meth:`GuardedDevices.admit_stage`, which refuses by default);
3. only the devices present and able to answer at all (:meth:`GuardedDevices.eligible`: THRESH's devices
   that observed the whole epoch).

Anything refused is ignored and counted. Only then does the subclass answer (:meth:`GuardedDevices.answer`),
every charge going through the same guard, which refuses a report the budget cannot pay.
:class:`OneReportDevices` is the template of one report a round (1BitMean/1BitRRPM, the dBitFlip family,
KFlip, Laplace, 1BitMulti, ToPS, and a plugin's); :class:`OneEpochReportDevices` of the naive per-epoch
baselines (EpochRR, EpochKRR); THRESH, HeavyTHRESH and ToPL subclass :class:`GuardedDevices`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from protocols.base import MisuseError
from protocols import snapshot as snap
from protocols.guard import Guard, Limits
from protocols.ledger import Charge
from protocols.messages import CollectionRequest, CollectorMessage, ReportBatch
from protocols.snapshot import GuardedSnapshot

__all__ = ["GuardedDevices", "OneEpochReportDevices", "OneReportDevices", "at_rows"]


_EVERYONE = (np.ones(0, dtype=bool), np.arange(0, dtype=np.int64))  # all True, and 0, 1, 2, ...: read-only


def _everyone(n: int) -> tuple[np.ndarray, np.ndarray]:
    """An all-True mask of ``n`` and the rows 0..n-1, read-only views of arrays shared by every cohort (one
    cohort's worth of memory for a run, not one per cohort); grown, never changed, when a cohort is larger."""
    global _EVERYONE
    mask, rows = _EVERYONE
    if rows.size < n:
        mask, rows = np.ones(n, dtype=bool), np.arange(n, dtype=np.int64)
        mask.flags.writeable = rows.flags.writeable = False
        _EVERYONE = (mask, rows)
    return mask[:n], rows[:n]


def at_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` for ``rows`` strictly increasing indices into ``a`` (or a mask); ``a`` itself when the
    indices are all of them (every device of a cohort answering: no copy). The result may be ``a``: read it,
    do not write it."""
    return a if rows.dtype != np.bool_ and rows.size == a.shape[0] else a[rows]


class GuardedDevices(GuardedSnapshot):
    """A cohort's device side (module docstring). Subclasses set ``params``, ``seed``, ``device_ids`` (uint64)
    and ``guard``, and implement :meth:`answer`; a protocol with messages beyond the collection request lists
    them in ``answers`` and admits them in :meth:`admit_stage`."""

    params: Any
    seed: int
    device_ids: np.ndarray
    guard: Guard
    #: the collector messages this protocol answers; any other is ignored and counted
    answers: ClassVar[tuple[type, ...]] = (CollectionRequest,)

    def everyone(self) -> tuple[np.ndarray, np.ndarray]:
        """A read-only all-True mask over the cohort and the rows 0..n-1 it selects, made once (views of arrays
        that every cohort shares): :meth:`respond` hands the mask to :meth:`answer` when every device is present
        and eligible, and an answer that finds it there (``here is everyone()[0]``) takes the rows as they are
        instead of searching the mask."""
        every = getattr(self, "_everyone", None)
        if every is None or every[0].shape != self.device_ids.shape:
            every = self._everyone = _everyone(self.device_ids.size)
        return every

    def rows_of(self, here: np.ndarray) -> np.ndarray:
        """The rows (strictly increasing indices) that mask ``here`` selects: the cohort's own 0..n-1 (read-only)
        for :meth:`everyone`'s mask, else ``np.flatnonzero(here)``."""
        mask, rows = self.everyone()
        return rows if here is mask else np.flatnonzero(here)

    def wire_ids(self, rows: np.ndarray) -> np.ndarray:
        """The ids of the devices at ``rows`` (strictly increasing indices) as a report batch carries them
        (uint32); the whole cohort's are made once and kept read-only."""
        ids = getattr(self, "_wire_ids", None)
        if ids is None or ids.shape != self.device_ids.shape:
            ids = self.device_ids.astype(np.uint32)
            ids.flags.writeable = False
            self._wire_ids = ids
        return at_rows(ids, rows)

    def check_values(self, values: np.ndarray) -> None:
        """The runtime hands one value per device (override for several counters per device)."""
        if values.shape != self.device_ids.shape:
            raise MisuseError("one value per device is required")

    def current_round(self, day: int) -> int:
        """The only round a collection request may name on ``day`` (default the day itself)."""
        return day

    def admit_stage(self, msg: CollectorMessage, day: int) -> bool:
        """Whether to answer a message of a later stage of the round (none by default)."""
        return False

    def eligible(self) -> np.ndarray | None:
        """The devices able to answer at all (a mask; None: all)."""
        return None

    def respond(self, msg: CollectorMessage, day: int, values: np.ndarray, now: float,
                present: np.ndarray | None = None) -> tuple[ReportBatch | None, list[Charge]]:
        """Answer ``msg`` on ``day`` with the devices ``present`` (default all), or ignore it (and count it)
        when the acceptance rule refuses it."""
        self.check_values(values)
        guard = self.guard
        if not isinstance(msg, self.answers) or msg.protocol != self.params.name:
            guard.ignore()
            return None, []
        if isinstance(msg, CollectionRequest):
            if not guard.admit(msg.round, self.current_round(day)):
                return None, []
        elif not self.admit_stage(msg, day):
            guard.ignore()
            return None, []
        able = self.eligible()
        if present is None and able is None:  # every device: the cohort's one read-only mask (no pass over it)
            return self.answer(msg, values, self.everyone()[0], now)
        here = np.ones(self.device_ids.size, dtype=bool) if present is None else np.asarray(present, dtype=bool)
        return self.answer(msg, values, here if able is None else here & able, now)

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The batch of the devices in mask ``here`` for an accepted ``msg``, and its charges (through the
        guard, which refuses what the budget cannot pay). ``here`` is read, never written (it may be
        :meth:`everyone`'s read-only mask)."""
        raise NotImplementedError(f"{type(self).__name__}.answer")


class OneReportDevices(GuardedDevices):
    """The template of a protocol with one report a round: subclasses implement :meth:`report_batch`."""

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        return self.report_batch(msg.round, values, self.rows_of(here), now)

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The batch of the devices at ``rows`` (indices) for an accepted ``round_`` and its charges (through
        the guard, which refuses what the budget cannot pay). ``rows`` is read, never written: with every
        device answering it is the cohort's read-only 0..n-1 (:meth:`GuardedDevices.everyone`)."""
        raise NotImplementedError(f"{type(self).__name__}.report_batch")


class OneEpochReportDevices(GuardedDevices):
    """The template of a naive per-epoch baseline (EpochRR, EpochKRR): epoch state kept on the device by a
    mixin (:meth:`init_state`, :meth:`state_snapshot`, :meth:`state_restore`; it sets ``current``, ``valid``
    and ``complete_epoch``), requests naming only the epoch just completed, and only the devices that observed
    the whole epoch answering. Subclasses implement :meth:`answer`: one fresh report of the epoch."""

    complete_epoch: int
    valid: np.ndarray

    def __init__(self, params: Any, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.init_state()
        self.guard = Guard(self.device_ids, limits)

    def init_state(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.init_state")

    def state_snapshot(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__}.state_snapshot")

    def state_restore(self, state: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__}.state_restore")

    def snapshot(self) -> dict:
        """The guard and the epoch state (protocols.snapshot)."""
        return {**snap.header(self), "guard": self.guard.snapshot(), "epochs": self.state_snapshot()}

    def restore(self, state: dict) -> None:
        snap.check_header(state, self)
        self.guard.restore(snap.field(state, "guard", dict))
        self.state_restore(snap.field(state, "epochs", dict))

    def current_round(self, day: int) -> int:
        """A request may name only the epoch just completed."""
        return self.complete_epoch

    def eligible(self) -> np.ndarray:
        """The devices that observed the whole epoch."""
        return self.valid
