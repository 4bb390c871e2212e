"""The collector side shared by every single-message-per-round protocol: rounds, batch validation, storage
of one report per device and round, and the canonical transcript (docs/design.md sections 5 and 8).

A protocol declares its report columns (:class:`Column`: name, dtype, width, value range) and how a round's
reports become an estimate; everything a hostile or broken batch can get wrong is checked here, and a
batch is taken whole or not at all (:class:`~protocols.base.ProtocolError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numba as nb
import numpy as np
from numpy.typing import DTypeLike

from protocols import snapshot as snap
from protocols import transcript as canonical
from protocols.base import DefinitionError, Estimate, MisuseError, ProtocolError, RoundResult
from protocols.messages import CollectionRequest, ReportBatch
from protocols.wire import WIRE_DTYPES

SPILL_BYTES = 256 << 20  # in-memory transcript beyond which round records go to ``ReportCollector.spill``

#: A spill store: takes a (devices, bytes) uint8 round record and returns an object with ``shape`` and
#: ``rows(lo, hi)`` that stands for it (collector.spill.TempFileSpill keeps it in a temporary file).
Spill = Callable[[np.ndarray], Any]


@dataclass(frozen=True)
class Column:
    """One report column: ``width`` values of ``dtype`` per device (width 1: a plain array), each in
    [low, high] (``None``: no bound beyond the dtype; floats are already finite from the wire)."""

    name: str
    dtype: DTypeLike
    width: int = 1
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        try:
            dtype: np.dtype | None = np.dtype(self.dtype).newbyteorder("<")
        except TypeError:
            dtype = None
        if dtype not in WIRE_DTYPES:
            shown = dtype.name if dtype is not None else repr(self.dtype)
            raise DefinitionError(f"report column {self.name!r}: dtype {shown} does not travel on the wire "
                                  f"(one of {', '.join(sorted(d.str[1:] for d in WIRE_DTYPES))}; u1 for bits)")

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


@nb.njit(cache=True, nogil=True)
def _claim(present, ids):  # pragma: no cover (compiled)
    """Mark devices ``ids`` present and return 0; or mark none and return 1 if one of them already is, 2 if the
    ids are not strictly increasing within [0, len(present))."""
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= present.shape[0] or (i > 0 and ids[i] <= ids[i - 1]):
            return 2
        if present[ids[i]]:
            return 1
    for i in range(ids.shape[0]):
        present[ids[i]] = True
    return 0


@nb.njit(cache=True, nogil=True)
def _scatter(data, ids, col):  # pragma: no cover (compiled)
    """data[ids[i], :] = col[i, :]; one value per device (the usual report) as a loop over 1-d views, 3-4x
    faster than the same loop with an inner loop of one."""
    if col.shape[1] == 1:
        target, source = data[:, 0], col[:, 0]
        for i in range(ids.shape[0]):
            target[ids[i]] = source[i]
        return
    for i in range(ids.shape[0]):
        for j in range(col.shape[1]):
            data[ids[i], j] = col[i, j]


class ReportCollector:
    """Base collector side: subclasses set ``name`` and ``columns`` and implement :meth:`estimate`.

    ``spill``: where this stage's round records go once its in-memory transcript passes :data:`SPILL_BYTES`
    (non-bit reports only; bit reports are packed instead). The runtime sets it on every stage of a collector
    side (collector.spill.attach) before the first round or restore; None, the default, keeps everything in
    memory. protocols/ itself does no I/O."""

    name: str = ""
    columns: tuple[Column, ...] = ()

    def __init__(self, n_devices: int) -> None:
        self.spill: Spill | None = None
        self.n_devices = int(n_devices)
        self.round = 0
        self._present: np.ndarray | None = None
        self._data: dict[str, np.ndarray] = {}
        self.transcript: list[tuple[int, np.ndarray]] = []  # (round, uint8 record per device)
        self.report_counts: list[int] = []  # reports delivered in each transcript round
        self._names = {c.name for c in self.columns}
        self._bits_only = all(np.dtype(c.dtype) == np.uint8 and c.high == 1 for c in self.columns)
        self._kept_bytes = 0
        #: digest inputs of stored round records computed ahead by a runtime (transcript.prepare_ahead), by
        #: position in ``transcript``
        self.digest_ahead: dict[int, tuple[Any, Any]] = {}

    # -------------------------------------------------------------------------------- protocol
    def validate(self, columns: dict[str, np.ndarray]) -> None:
        """Protocol-specific checks of a batch's columns (raise ProtocolError); none by default."""

    def estimate(self, reports: dict[str, np.ndarray]) -> Estimate:
        """The round's estimate from the reports that arrived: each column as (reports, width)."""
        raise NotImplementedError(f"{type(self).__name__}.estimate")

    def estimate_stored(self, data: dict[str, np.ndarray], present: np.ndarray, count: int) -> Estimate:
        """The round's estimate from the open round's storage: each column as (devices, width) with zeros where
        no report arrived, ``present`` which devices reported (``count`` of them, at least one). By default
        :meth:`estimate` of the reporting rows; a protocol whose estimate needs no selection (1BitMean's count
        of ones) overrides it."""
        if count == self.n_devices:
            return self.estimate(data)
        # the present rows (a mask on a 1-d view, np.compress on wider columns: 3-8x np.flatnonzero + take)
        return self.estimate({k: v[:, 0][present].reshape(count, 1) if v.shape[1] == 1
                              else np.compress(present, v, axis=0) for k, v in data.items()})

    # -------------------------------------------------------------------------------- rounds
    def request(self, round_: int, deadline: float) -> CollectionRequest:
        if round_ <= self.round:
            raise MisuseError("rounds must increase")
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
        if hi - lo + 1 == ids.size:  # contiguous ids (cohorts): views
            if np.any(self._present[lo:hi + 1]):
                raise ProtocolError("batch repeats a device that already reported this round")
            self._present[lo:hi + 1] = True
            for name, col in cols.items():
                self._data[name][lo:hi + 1] = col
        else:  # one pass each instead of numpy's gather, scatter and scatter (a third of a round's serial work)
            claimed = _claim(self._present, ids)
            if claimed == 2:
                raise ProtocolError("batch devices must be strictly increasing registered ids")
            if claimed == 1:
                raise ProtocolError("batch repeats a device that already reported this round")
            for name, col in cols.items():
                _scatter(self._data[name], ids, col)
        return int(ids.size)

    def close_round(self) -> RoundResult:
        if self._present is None:
            raise MisuseError("no open round")
        present = self._present
        count = int(np.count_nonzero(present))
        est = self.estimate_stored(self._data, present, count) if count else self.empty_estimate()
        if self._bits_only:  # every byte is 0 or 1: pack across devices (16x less memory for 1-bit reports),
            # one contiguous byte column at a time (30x faster than packing the (devices, bytes) record on axis 0)
            parts = [present.view(np.uint8)] + [v[:, j] for v in self._data.values() for j in range(v.shape[1])]
            record = np.stack([np.packbits(part) for part in parts], axis=1)
        else:
            record = np.concatenate([present.view(np.uint8)[:, None]]
                                    + [v.astype(v.dtype.newbyteorder("<"), copy=False).view(np.uint8)
                                       .reshape(self.n_devices, -1) for v in self._data.values()], axis=1)
            if self.spill is not None and self._kept_bytes + record.nbytes > SPILL_BYTES:
                record = self.spill(record)
        self._kept_bytes += record.nbytes if isinstance(record, np.ndarray) else 0
        self.transcript.append((self.round, record))
        self.report_counts.append(count)
        self._present, self._data = None, {}
        return RoundResult(round=self.round, estimate=est, reports=count)

    def is_open(self) -> bool:
        """Whether a round (this stage) is open."""
        return self._present is not None

    def received_any(self) -> bool:
        """Whether the open round has taken any report."""
        return self._present is not None and bool(self._present.any())

    def advance(self, deadline: float) -> None:
        """Single-stage protocols: nothing more to ask for before the round closes."""
        return None

    def empty_estimate(self) -> Estimate:
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

    def record_columns(self, record: Any, lo: int, hi: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Devices lo..hi-1 of a stored round record decoded: presence (bool per device) and each column as
        (devices, width) values in its dtype (zeros when absent). ``lo`` a multiple of 8."""
        rows = self._rows(record, lo, hi)
        columns, at = {}, 1
        for c in self.columns:
            dt = np.dtype(c.dtype).newbyteorder("<")
            size = dt.itemsize * c.width
            columns[c.name] = np.ascontiguousarray(rows[:, at:at + size]).view(dt).reshape(hi - lo, c.width)
            at += size
        return rows[:, 0].astype(bool), columns

    def _rows(self, record: Any, lo: int, hi: int) -> np.ndarray:
        """Devices lo..hi-1 of a stored round record, unpacked (lo a multiple of 8 when packed)."""
        if not isinstance(record, np.ndarray):  # spilled by the runtime
            return record.rows(lo, hi)
        if not self._bits_only:
            return record[lo:hi]
        return np.unpackbits(record[lo // 8:(hi + 7) // 8], axis=0, count=hi - lo)

    # -------------------------------------------------------------------------------- snapshots
    def record_width(self) -> int:
        """Bytes a device takes in a stored round record: the presence byte and the column values."""
        return 1 + sum(np.dtype(c.dtype).itemsize * c.width for c in self.columns)

    def record_array(self, i: int) -> np.ndarray:
        """Stored round record ``i`` as an array (a spilled one read back whole)."""
        rec = self.transcript[i][1]
        return rec if isinstance(rec, np.ndarray) else np.ascontiguousarray(rec.rows(0, rec.shape[0]))

    def stage_snapshot(self, records: bool = True, boundary: bool = False) -> dict:
        """This stage's rounds and stored transcript (protocols.snapshot); taken between rounds only, or with
        ``boundary`` also while the stage is open but has received nothing yet (a multi-stage collector right
        after ``advance`` opened it: restored open, empty). ``records=False`` leaves the records out (a journal
        that stores them apart, once each)."""
        if self._present is not None and (not boundary or self._present.any()):
            raise MisuseError(f"{self.name}: a collector is snapshotted between rounds, not with a stage open")
        out = {"name": self.name, "n_devices": self.n_devices, "round": self.round, "packed": self._bits_only,
               "open": self._present is not None,
               "record_width": self.record_width(),
               "report_counts": np.array(self.report_counts, dtype=np.int64),
               "record_rounds": np.array([r for r, _ in self.transcript], dtype=np.int64)}
        if records:
            out["records"] = [self.record_array(i) for i in range(len(self.transcript))]
        return out

    def stage_restore(self, state: dict) -> None:
        """Restore :meth:`stage_snapshot` (with its records) into a fresh stage of the same protocol."""
        if snap.field(state, "name", str) != self.name or snap.field(state, "n_devices", int) != self.n_devices:
            raise snap.SnapshotError(f"a {state['name']!r} stage of {state['n_devices']} devices does not fit "
                                     f"{self.name!r} of {self.n_devices}")
        if (snap.field(state, "packed", bool) != self._bits_only
                or snap.field(state, "record_width", int) != self.record_width()):
            raise snap.SnapshotError(f"stage {self.name!r}: stored records of another column layout")
        rounds = snap.array(state, "record_rounds", np.int64, (None,))
        counts = snap.array(state, "report_counts", np.int64, rounds.shape)
        records = snap.field(state, "records", list)
        if len(records) != rounds.size or (rounds.size > 1 and np.any(np.diff(rounds) <= 0)):
            raise snap.SnapshotError(f"stage {self.name!r}: {len(records)} records for {rounds.size} rounds")
        rows = (self.n_devices + 7) // 8 if self._bits_only else self.n_devices
        self.transcript, self._kept_bytes, self.digest_ahead = [], 0, {}
        for rnd, rec in zip(rounds.tolist(), records):
            if not isinstance(rec, np.ndarray) or rec.dtype != np.uint8 or rec.shape != (rows, self.record_width()):
                raise snap.SnapshotError(f"stage {self.name!r}: the record of round {rnd} has the wrong shape")
            rec = np.ascontiguousarray(rec)
            if not self._bits_only and self.spill is not None and self._kept_bytes + rec.nbytes > SPILL_BYTES:
                rec = self.spill(rec)
            self._kept_bytes += rec.nbytes if isinstance(rec, np.ndarray) else 0
            self.transcript.append((int(rnd), rec))
        self.report_counts = counts.tolist()
        self.round = snap.field(state, "round", int)
        self._present, self._data = None, {}
        if state.get("open", False):  # taken at a stage boundary: the stage is open and has received nothing
            self._present = np.zeros(self.n_devices, dtype=bool)
            self._data = {c.name: np.zeros((self.n_devices, c.width), dtype=c.dtype) for c in self.columns}

    def snapshot(self, records: bool = True) -> dict:
        """What a resumed collector needs (protocols.snapshot): the stages' transcripts (``stages``: name ->
        stage snapshot, in :meth:`stages` order) and the protocol's own state (:meth:`extra_snapshot`)."""
        return {"protocol": self.name, "stages": {n: s.stage_snapshot(records) for n, s in self.stages()},
                **self.extra_snapshot()}

    def restore(self, state: dict) -> None:
        if snap.field(state, "protocol", str) != self.name:
            raise snap.SnapshotError(f"a {state['protocol']!r} snapshot cannot be restored into {self.name!r}")
        stages = snap.field(state, "stages", dict)
        if list(stages) != [n for n, _ in self.stages()]:
            raise snap.SnapshotError(f"snapshot stages {list(stages)} are not {[n for n, _ in self.stages()]}")
        for n, s in self.stages():
            s.stage_restore(snap.field(stages, n, dict))
        self.extra_restore(state)

    def extra_snapshot(self) -> dict:
        """Protocol state beyond the stored transcript (none by default)."""
        return {}

    def extra_restore(self, state: dict) -> None:
        return None

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
        out: list[tuple[int, dict[str, np.ndarray] | None]] = []
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


class Stage(ReportCollector):
    """One report stage of a collector side with several (THRESH's votes and estimates, ToPL's holdout and
    reports): its name, its columns and its own transcript. A round's result is the reports that arrived,
    column by column (one value per report), for the owning collector side to estimate from."""

    def __init__(self, name: str, columns: tuple[Column, ...], n_devices: int) -> None:
        self.name, self.columns = name, columns
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[:, 0] for k, v in reports.items()}

    def empty_estimate(self) -> dict[str, np.ndarray]:
        return {c.name: np.empty(0, dtype=c.dtype) for c in self.columns}
