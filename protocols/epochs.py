"""Per-device epoch means of daily private bits, kept on the device (Joseph et al. 2018, Algorithm 2, line 1).

Shared by THRESH's device side and its naive per-epoch baseline: each day a device adds its bit to its
epoch sum; at the epoch's last day the mean p_i^t is fixed. A device that was absent on any day of the epoch
(it joined late or left) has no valid mean for it and sits that epoch out.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from protocols.base import MisuseError
from protocols.guard import Guarantee


@nb.njit(cache=True, nogil=True)
def _add_bits(acc, values):
    for i in range(values.shape[0]):
        if values[i] > 0.5:
            acc[i] += 1


class EpochMeans:
    """Mixin: ``observe`` days in order; after each epoch ``current`` holds the means, ``valid`` who has one,
    ``complete_epoch`` the epoch they belong to."""

    def init_epochs(self, n: int, epoch_length: int) -> None:
        self.epoch_length = int(epoch_length)
        self.current = np.zeros(n)  # p_i^t of the last complete epoch
        self.valid = np.zeros(n, dtype=np.bool_)  # observed every day of that epoch
        self.complete_epoch = 0
        self._sum = np.zeros(n, dtype=np.int64)
        self._count = np.zeros(n, dtype=np.int64)  # days observed in the current epoch
        self._day = 0

    def observe(self, day: int, values: np.ndarray, present: np.ndarray | None = None) -> None:
        """Record the day's private bits of the devices ``present`` (days in order, each once)."""
        if day != self._day + 1:
            raise MisuseError(f"days are observed in order: expected {self._day + 1}, got {day}")
        self._day = day
        bits = np.ascontiguousarray(values, dtype=np.float64)
        if present is not None:
            bits = np.where(present, bits, 0.0)
            self._count += present
        else:
            self._count += 1
        _add_bits(self._sum, bits)
        if day % self.epoch_length == 0:
            self.valid = self._count == self.epoch_length
            self.current = np.where(self.valid, self._sum / self.epoch_length, self.current)
            self._sum[:] = 0
            self._count[:] = 0
            self.complete_epoch = day // self.epoch_length

    def epoch_snapshot(self) -> dict:
        """The epoch sums and means (protocols.snapshot)."""
        return {"epoch_length": self.epoch_length, "current": self.current.copy(), "valid": self.valid.copy(),
                "complete_epoch": self.complete_epoch, "sum": self._sum.copy(), "count": self._count.copy(),
                "day": self._day}

    def epoch_restore(self, state: dict) -> None:
        from protocols import snapshot as snap

        if snap.field(state, "epoch_length", int) != self.epoch_length:
            raise snap.SnapshotError(f"epoch length {state['epoch_length']} is not {self.epoch_length}")
        n = self._sum.shape
        self.current = snap.array(state, "current", np.float64, n).copy()
        self.valid = snap.array(state, "valid", np.bool_, n).copy()
        self._sum = snap.array(state, "sum", np.int64, n).copy()
        self._count = snap.array(state, "count", np.int64, n).copy()
        self.complete_epoch = snap.field(state, "complete_epoch", int)
        self._day = snap.field(state, "day", int)


class EpochBudget:
    """Mixin of the naive per-epoch baselines' parameters (EpochRR, EpochKRR): ``epsilon`` is the total over
    ``epochs``, each epoch's one fresh report is charged epsilon/epochs, and T epochs compose to T x eps/T
    (basic composition)."""

    epsilon: float
    epochs: int

    @property
    def epoch_epsilon(self) -> float:
        return self.epsilon / self.epochs

    @property
    def round_epsilon(self) -> float:
        return self.epoch_epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        return Guarantee(horizon * self.epoch_epsilon, f"T x eps/T = {horizon} x {self.epoch_epsilon:.6g}")
