"""Transcript records kept on disk instead of in memory: the spill store the runtimes hand to every report
stage of a collector side (:func:`attach`; protocols.collecting.ReportCollector.spill).

Large runs with non-bit reports (ToPL's floats: 13 bytes a device-round) would otherwise keep every round's
record in RAM for the device-major transcript digest. Records past protocols.collecting.SPILL_BYTES go to
files in a temporary directory and are read back a block of devices at a time with plain reads, so the
process's resident memory stays small. Each collector side gets its own store; the directory is made at the
first spill and removed when the store goes away, that is with the collector side whose stages hold it.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from protocols.base import CollectorSide


@dataclass(frozen=True)
class SpilledRecord:
    path: str
    n_rows: int
    width: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.width

    def rows(self, lo: int, hi: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(lo * self.width)
            data = f.read((hi - lo) * self.width)
        return np.frombuffer(data, np.uint8).reshape(hi - lo, self.width)


class TempFileSpill:
    """A spill store (protocols.collecting.Spill): each record to a file of its own in a temporary directory,
    made at the first record and removed with the store."""

    def __init__(self) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._names = itertools.count()

    def __call__(self, record: np.ndarray) -> SpilledRecord:
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="ldpsim-transcript-")
        path = os.path.join(self._dir.name, f"record-{next(self._names)}.bin")
        with open(path, "wb") as f:
            f.write(np.ascontiguousarray(record).data)
        return SpilledRecord(path, record.shape[0], record.shape[1])


def attach(collector: CollectorSide) -> TempFileSpill:
    """Send the large transcripts of ``collector`` (every stage of it) to a new temporary-directory store, and
    return the store. Call before the first round or restore."""
    store = TempFileSpill()
    for _, stage in collector.stages():
        stage.spill = store
    return store
