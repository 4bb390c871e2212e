"""Transcript records kept on disk instead of in memory (installed into protocols.collecting.spill_to).

Large runs with non-bit reports (ToPL's floats: 13 bytes a device-round) would otherwise keep every round's
record in RAM for the device-major transcript digest. Records past protocols.collecting.SPILL_BYTES go to
files in a temporary directory and are read back a block of devices at a time with plain reads, so the
process's resident memory stays small; the directory is removed when the spill object goes away.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from protocols import collecting


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
    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="ldpsim-transcript-")
        self._names = itertools.count()

    def __call__(self, record: np.ndarray) -> SpilledRecord:
        path = os.path.join(self._dir.name, f"record-{next(self._names)}.bin")
        with open(path, "wb") as f:
            f.write(np.ascontiguousarray(record).data)
        return SpilledRecord(path, record.shape[0], record.shape[1])


def install() -> TempFileSpill:
    """Send large transcripts of this process to a temporary directory (idempotent)."""
    if not isinstance(collecting.spill_to, TempFileSpill):
        collecting.spill_to = TempFileSpill()
    return collecting.spill_to
