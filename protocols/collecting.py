"""The collector side shared by every single-message-per-round protocol: rounds, batch validation, storage
of one report per device and round, and the canonical transcript (DESIGN.md sections 5-6).

A protocol declares its report columns (:class:`Column`: name, dtype, width, value range) and how a round's
reports become an estimate; everything a hostile or broken batch can get wrong is checked here, and a
batch is taken whole or not at all (:class:`~protocols.base.ProtocolError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from protocols import transcript as canonical
from protocols.base import ProtocolError, RoundResult
from protocols.messages import CollectionRequest, ReportBatch

SPILL_BYTES = 256 << 20  # in-memory transcript beyond which round records go to ``spill_to``
#: Where round records go once a collector's transcript passes SPILL_BYTES: a callable taking a (devices, bytes)
#: record and returning an object with ``shape`` and ``rows(lo, hi)``. The runtime installs one (e.g.
#: collector.spill.TempFileSpill); None keeps everything in memory. protocols/ itself does no I/O.
spill_to: "Callable[[np.ndarray], Any] | None" = None


@dataclass(frozen=True)
class Column:
    """One report column: ``width`` values of ``dtype`` per device (width 1: a plain array), each in
    [low, high] (``None``: no bound beyond the dtype; floats are already finite from the wire)."""

    name: str
    dtype: np.dtype
    width: int = 1
    low: float | None = None
    high: float | None = None

    def check(self, col: np.ndarray) -> np.ndarray:
        want = np.dtype(self.dtype)
        if col.dtype.kind != want.kind or col.dtype.itemsize > want.itemsize:
            raise ProtocolError(f"column {self.name!r} must be {want.kind}{want.itemsize}, got {col.dtype}")
        shape_ok = (col.ndim == 2 and col.shape[1] == self.width) or (col.ndim == 1 and self.width == 1)
        if not shape_ok:
            raise ProtocolError(f"column {self.name!r} must have {self.width} value(s) per device")
        if col.size:
            if self.low is not None and col.min() < self.low:
                raise ProtocolError(f"column {self.name!r} holds {col.min()} < {self.low}")
            if self.high is not None and col.max() > self.high:
                raise ProtocolError(f"column {self.name!r} holds {col.max()} > {self.high}")
        return col.astype(want, copy=False).reshape(col.shape[0], self.width)


class ReportCollector:
    """Base collector side: subclasses set ``name`` and ``columns`` and implement :meth:`estimate`."""

    name: str = ""
    columns: tuple[Column, ...] = ()

    def __init__(self, n_devices: int) -> None:
        self.n_devices = int(n_devices)
        self.round = 0
        self._present: np.ndarray | None = None
        self._data: dict[str, np.ndarray] = {}
        self.transcript: list[tuple[int, np.ndarray]] = []  # (round, uint8 record per device)
        self.report_counts: list[int] = []  # reports delivered in each transcript round
        self._names = {c.name for c in self.columns}
        self._bits_only = all(np.dtype(c.dtype) == np.uint8 and c.high == 1 for c in self.columns)
        self._kept_bytes = 0

    # -------------------------------------------------------------------------------- protocol
    def validate(self, columns: dict[str, np.ndarray]) -> None:
        """Protocol-specific checks of a batch's columns (raise ProtocolError); none by default."""

    def estimate(self, reports: dict[str, np.ndarray]) -> float | np.ndarray:
        """The round's estimate from the reports that arrived: each column as (reports, width)."""
        raise NotImplementedError

    # -------------------------------------------------------------------------------- rounds
    def request(self, round_: int, deadline: float) -> CollectionRequest:
        if round_ <= self.round:
            raise ValueError("rounds must increase")
        self.round = round_
        self._present = np.zeros(self.n_devices, dtype=bool)
        self._data = {c.name: np.zeros((self.n_devices, c.width), dtype=c.dtype) for c in self.columns}
        return CollectionRequest(round=round_, protocol=self.name, deadline=deadline)

    def receive(self, batch: ReportBatch) -> int:
        """Take a batch for the open round whole, or raise ProtocolError and take none of it."""
        if self._present is None or batch.round != self.round:
            raise ProtocolError(f"batch for round {batch.round}, but the open round is {self.round or 'none'}")
        if batch.protocol != self.name:
            raise ProtocolError(f"batch for protocol {batch.protocol!r}, this collector runs {self.name!r}")
        if set(batch.columns) != self._names:
            raise ProtocolError(f"a {self.name} batch has exactly the columns {sorted(self._names)}, "
                                f"got {sorted(batch.columns)}")
        cols = {c.name: c.check(batch.columns[c.name]) for c in self.columns}
        self.validate(cols)
        ids = batch.devices
        if ids.size == 0:
            return 0
        lo, hi = int(ids[0]), int(ids[-1])
        if hi >= self.n_devices:
            raise ProtocolError(f"device id {hi} is not registered (population {self.n_devices})")
        where = slice(lo, hi + 1) if hi - lo + 1 == ids.size else ids  # contiguous ids (cohorts): a view
        if np.any(self._present[where]):
            raise ProtocolError("batch repeats a device that already reported this round")
        self._present[where] = True
        for name, col in cols.items():
            self._data[name][where] = col
        return int(ids.size)

    def close_round(self) -> RoundResult:
        if self._present is None:
            raise ValueError("no open round")
        present = self._present
        if present.all():
            reports = self._data
        else:
            idx = np.flatnonzero(present)
            reports = {k: v[idx] for k, v in self._data.items()}
        count = int(np.count_nonzero(present))
        est = self.estimate(reports) if count else self.empty_estimate()
        record = np.concatenate([present.view(np.uint8)[:, None]]
                                + [v.astype(v.dtype.newbyteorder("<"), copy=False).view(np.uint8)
                                   .reshape(self.n_devices, -1) for v in self._data.values()], axis=1)
        if self._bits_only:  # every byte is 0 or 1: pack across devices (16x less memory for 1-bit reports)
            record = np.packbits(record, axis=0)
        elif spill_to is not None and self._kept_bytes + record.nbytes > SPILL_BYTES:
            record = spill_to(record)
        self._kept_bytes += record.nbytes if isinstance(record, np.ndarray) else 0
        self.transcript.append((self.round, record))
        self.report_counts.append(count)
        self._present, self._data = None, {}
        return RoundResult(round=self.round, estimate=est, reports=count)

    def advance(self, deadline: float) -> None:
        """Single-stage protocols: nothing more to ask for before the round closes."""
        return None

    def empty_estimate(self) -> float | np.ndarray:
        return float("nan")

    def stages(self) -> list[tuple[str, "ReportCollector"]]:
        """The collector's report stages in protocol order, each with its stored transcript: one, "report"."""
        return [("report", self)]

    def transcript_digest(self) -> str:
        """The canonical transcript digest of :meth:`stages` (protocols.transcript): per stage its name, row
        count and column schema, then every delivered report in (device, round) order."""
        return canonical.digest(self.stages())

    def bits_packed(self, record: Any) -> bool:
        """Whether a stored round record is bit-packed across devices ((ceil(n/8), 1 + widths) uint8)."""
        return self._bits_only and isinstance(record, np.ndarray)

    def record_rows(self, record: Any, lo: int, hi: int) -> np.ndarray:
        """Devices lo..hi-1 of a stored round record as (devices, 1 + payload) uint8: a presence byte, then the
        report's column values (little-endian, in column order; zeros when absent). ``lo`` a multiple of 8."""
        return self._rows(record, lo, hi)

    def _rows(self, record: Any, lo: int, hi: int) -> np.ndarray:
        """Devices lo..hi-1 of a stored round record, unpacked (lo a multiple of 8 when packed)."""
        if not isinstance(record, np.ndarray):  # spilled by the runtime
            return record.rows(lo, hi)
        if not self._bits_only:
            return record[lo:hi]
        return np.unpackbits(record[lo // 8:(hi + 7) // 8], axis=0, count=hi - lo)

    def received(self, name: str) -> list[tuple[int, np.ndarray]]:
        """(round, values) of a width-1 integer column for every device, -1 where nothing arrived."""
        out = []
        for rnd, _ in self.transcript:
            col = np.full(self.n_devices, -1, dtype=np.int64)
            out.append((rnd, col))
        for device_round, (rnd, rec) in enumerate(self.transcript):
            rec = self._rows(rec, 0, self.n_devices)
            at = 1
            for c in self.columns:
                size = np.dtype(c.dtype).itemsize * c.width
                if c.name == name:
                    vals = rec[:, at:at + size].copy().view(np.dtype(c.dtype).newbyteorder("<"))[:, 0]
                    present = rec[:, 0].astype(bool)
                    out[device_round][1][present] = vals[present]
                at += size
        return out

    def device_reports(self, device: int) -> list[tuple[int, dict[str, np.ndarray] | None]]:
        """One device's received reports by round (None where nothing arrived): for audits."""
        out = []
        for rnd, rec in self.transcript:
            row = self._rows(rec, device - device % 8, device - device % 8 + 8)[device % 8] if self._bits_only \
                else self._rows(rec, device, device + 1)[0]
            if not row[0]:
                out.append((rnd, None))
                continue
            values, at = {}, 1
            for c in self.columns:
                size = np.dtype(c.dtype).itemsize * c.width
                values[c.name] = row[at:at + size].view(np.dtype(c.dtype).newbyteorder("<"))
                at += size
            out.append((rnd, values))
        return out
