"""The canonical transcript digest: one definition, computed by the collector from its stored round records and
by an auditor from transcript.parquet (scenarios.tables.transcript_digest_of_table). Sans-IO: numpy and hashlib.

A transcript is a list of stages in protocol order (``collector.stages()``: single-stage protocols have one,
``"report"``; THRESH ``"vote"``, ``"estimate"``; ToPL ``"holdout"``, ``"report"``). Each stage has columns
(name, dtype, width; a *bit column* is a uint8 column whose values are 0 or 1) and rows: one per delivered
report, (device, round, its column values).

    digest = sha256( "ldpsim-transcript/2\\n" "devices=<N>\\n"
                     for each stage, in order:
                       "stage=<name>;rows=<n>;columns=<c>:<dtype>:<width>[:bits],...\\n"
                       for each round with at least one row, in increasing order:
                         "round=<r>;rows=<k>\\n"
                         the presence bitmap over the N devices (numpy packbits: big-endian bits, zero-padded)
                         for each column, for each position p < width: the values at p of the present devices
                           in device order: packed bits for a bit column, else little-endian bytes )

All strings are UTF-8 and dtype is the numpy name ("uint8", "uint32", "float64"). Round-major with bit
columns packed, it hashes about two bits per one-bit report (a device-major form with 64-bit keys hashed 17
bytes), and a collector computes it one stored round record at a time. The digest depends only on what the
collector accepted, not on cohort split, arrival order or runtime (simulated or live).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

MAGIC = b"ldpsim-transcript/2\n"
#: bytes of bit-packed records per stage whose digest inputs :func:`prepare_ahead` prepares (and keeps)
AHEAD_BYTES = 64 << 20


def column_spec(columns: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(name, dtype name, width) of each protocol Column (or of such triples)."""
    out = []
    for c in columns:
        name, dtype, width = (c.name, c.dtype, c.width) if hasattr(c, "name") else c
        out.append((str(name), np.dtype(dtype).name, int(width)))
    return out


def bit_columns(columns: Iterable[Any]) -> set[str]:
    """Names of the protocol Columns that hold bits (uint8 with values in [0, 1])."""
    return {c.name for c in columns if np.dtype(c.dtype) == np.uint8 and c.high == 1}


def stage_header(name: str, columns: Sequence[tuple[str, str, int]], bits: set[str], rows: int) -> bytes:
    cols = ",".join(f"{c}:{d}:{w}" + (":bits" if c in bits else "") for c, d, w in columns)
    return f"stage={name};rows={int(rows)};columns={cols}\n".encode()


class TranscriptHasher:
    """Feed :meth:`stage` headers in order, each followed by its :meth:`round` records in increasing order."""

    def __init__(self, devices: int) -> None:
        self.devices = int(devices)
        self._h = hashlib.sha256(MAGIC + f"devices={self.devices}\n".encode())
        self._left = 0
        self._columns: list[tuple[str, str, int]] = []
        self._bits: set[str] = set()
        self._round = 0

    def stage(self, name: str, columns: Sequence[tuple[str, str, int]], bits: set[str], rows: int) -> None:
        if self._left:
            raise ValueError(f"previous stage is {self._left} row(s) short")
        self._h.update(stage_header(name, columns, bits, rows))
        self._left, self._columns, self._bits, self._round = int(rows), list(columns), set(bits), 0

    def round(self, round_: int, present: np.ndarray, values: Mapping[str, np.ndarray]) -> None:
        """One round: ``present`` (N bools, or N bits already packed: uint8 of length ceil(N/8)) and each
        column's values of the present devices in device order, as (k, width) arrays of its dtype, or for a
        bit column optionally pre-packed per position as (width, ceil(k/8)) uint8 (``packed_<name>``)."""
        if round_ <= self._round:
            raise ValueError("rounds must increase within a stage")
        packed = present if present.dtype == np.uint8 and present.size == (self.devices + 7) // 8 \
            else np.packbits(np.asarray(present, dtype=bool))
        k = int(np.bitwise_count(packed).sum())
        if k == 0:
            return
        if k > self._left:
            raise ValueError("more rows than the stage header announced")
        self._round = round_
        self._h.update(f"round={int(round_)};rows={k}\n".encode())
        self._h.update(packed.data)
        for name, dtype, width in self._columns:
            if f"packed_{name}" in values:
                for p in range(width):
                    self._h.update(np.ascontiguousarray(values[f"packed_{name}"][p]).data)
                continue
            vals = np.asarray(values[name]).reshape(k, width)
            for p in range(width):
                col = vals[:, p]
                if name in self._bits:
                    self._h.update(np.packbits(col.astype(bool)).data)
                else:
                    self._h.update(np.ascontiguousarray(col.astype(np.dtype(dtype).newbyteorder("<"))).data)
        self._left -= k

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"last stage is {self._left} row(s) short")
        return self._h.hexdigest()


def stage_rows(stage: Any) -> int:
    """Delivered reports of a collector stage (a protocols.collecting.ReportCollector)."""
    return int(sum(stage.report_counts))


def hash_stage(hasher: TranscriptHasher, name: str, stage: Any) -> None:
    """One collector stage: its header, then each stored round record (in memory, bit-packed or spilled).
    A bit-packed record of a round every device answered is hashed as stored, with no unpacking; the input of
    one whose stage holds it computed ahead (:func:`prepare_ahead`, the same record) is taken from there."""
    cols = column_spec(stage.columns)
    bits = bit_columns(stage.columns)
    hasher.stage(name, cols, bits, stage_rows(stage))
    n = stage.n_devices
    ahead = getattr(stage, "digest_ahead", None) or {}
    for i, (rnd, record) in enumerate(stage.transcript):
        if stage.bits_packed(record):  # (ceil(n/8), 1 + widths): presence, then each bit position, packed
            job = ahead.get(i)
            presence, packed = job[1].result() if job is not None and job[0] is record else \
                _packed_round(record, cols, n)
            hasher.round(rnd, presence, packed)
            continue
        rows = stage.record_rows(record, 0, n)  # (n, 1 + payload) bytes
        present = rows[:, 0].astype(bool)
        sel = rows[present]
        values = {}
        for (c, dtype, w), at in zip(cols, _offsets(cols, 1)):
            size = np.dtype(dtype).itemsize * w
            values[c] = np.ascontiguousarray(sel[:, at:at + size]).view(np.dtype(dtype).newbyteorder("<"))
        hasher.round(rnd, present, values)


def _packed_round(record: np.ndarray, cols: Sequence[tuple[str, str, int]], n: int
                  ) -> tuple[np.ndarray, dict[str, Any]]:
    """A bit-packed round record's input to :meth:`TranscriptHasher.round`: its packed presence, and each bit
    position of each column packed over the present devices (the record's own bytes when everyone answered)."""
    presence = np.ascontiguousarray(record[:, 0])
    everyone = int(np.bitwise_count(presence).sum()) == n
    present = None if everyone else np.unpackbits(presence, count=n).view(bool)
    packed: dict[str, Any] = {}
    for (c, _, w), at in zip(cols, _offsets(cols, 1, packed=True)):
        if everyone:  # the stored bits are the present devices' bits, packed: hash them as they are
            packed[f"packed_{c}"] = record[:, at:at + w].T
        else:
            packed[f"packed_{c}"] = [np.packbits(np.unpackbits(record[:, at + p], count=n).view(bool)[present])
                                     for p in range(w)]
    return presence, packed


def prepare_ahead(stages: Sequence[tuple[str, Any]], submit: Callable[[Callable[[], Any]], Any]) -> None:
    """Start computing the digest input of each stored bit-packed round record not prepared yet, as a job given
    to ``submit`` (an executor's: another core), kept on its stage's ``digest_ahead`` (the record's position in
    the stage's transcript -> (record, job)) for :func:`hash_stage`: a runtime calls it after each round, so
    the digest at the end of a run mostly hashes. An input is about the size of its record and is kept with
    the collector, so a stage prepares records up to :data:`AHEAD_BYTES` of them; the rest are computed at the
    end. Records are not changed once stored; a record replaced (a restore) is prepared again or computed at
    the end. Stages without ``digest_ahead`` are left alone."""
    for _, stage in stages:
        ahead = getattr(stage, "digest_ahead", None)
        if ahead is None:
            continue
        cols, n, kept = column_spec(stage.columns), int(stage.n_devices), 0
        for i, (_, record) in enumerate(stage.transcript):
            if not stage.bits_packed(record):
                continue
            kept += record.nbytes
            if kept > AHEAD_BYTES:
                break
            job = ahead.get(i)
            if job is None or job[0] is not record:
                ahead[i] = (record, submit(functools.partial(_packed_round, record, cols, n)))


def _offsets(cols: Sequence[tuple[str, str, int]], start: int, packed: bool = False) -> list[int]:
    """Where each column starts in a record row (bytes; in a packed record, one position per column)."""
    out, at = [], start
    for _, dtype, w in cols:
        out.append(at)
        at += w if packed else np.dtype(dtype).itemsize * w
    return out


def digest(stages: Sequence[tuple[str, Any]]) -> str:
    """The canonical digest of a collector's ``stages()`` (module docstring)."""
    n = int(stages[0][1].n_devices) if stages else 0
    hasher = TranscriptHasher(n)
    for name, stage in stages:
        hash_stage(hasher, name, stage)
    return hasher.hexdigest()
