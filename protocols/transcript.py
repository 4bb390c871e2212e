"""The canonical transcript digest: one definition, computed by the collector from its stored round records and
by an auditor from transcript.parquet (scenarios.tables.transcript_digest_of_table). Sans-IO: numpy and hashlib.

A transcript is a list of stages in protocol order (``collector.stages()``: single-stage protocols have one,
``"report"``; THRESH ``"vote"``, ``"estimate"``; ToPL ``"holdout"``, ``"report"``). Each stage has columns
(name, dtype, width) and rows: one per delivered report, (device, round, its column values).

    digest = sha256( MAGIC
                     for each stage, in order:
                       "stage=<name>;rows=<n>;columns=<c1>:<dtype1>:<width1>,<c2>:<dtype2>:<width2>...\\n"   (UTF-8)
                       for each of its n rows in (device, round) order:
                         device as <i8, round as <i8, then each column's width value(s) in column order,
                         little-endian in the column's dtype )

with MAGIC = b"ldpsim-transcript/1\\n" and dtype the numpy name ("uint8", "uint32", "float64"). Rows are packed
(no padding); absent reports contribute nothing. The digest depends only on what the collector accepted, not
on cohort split, arrival order or runtime (simulated or live).
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

import numpy as np

MAGIC = b"ldpsim-transcript/1\n"
BLOCK_BYTES = 32 << 20  # row bytes built at a time while hashing (bounded memory whatever the population)


def column_spec(columns: Iterable[Any]) -> list[tuple[str, str, int]]:
    """(name, dtype name, width) of each protocol Column (or of such triples)."""
    out = []
    for c in columns:
        name, dtype, width = (c.name, c.dtype, c.width) if hasattr(c, "name") else c
        out.append((str(name), np.dtype(dtype).name, int(width)))
    return out


def stage_header(name: str, columns: Sequence[tuple[str, str, int]], rows: int) -> bytes:
    cols = ",".join(f"{c}:{d}:{w}" for c, d, w in columns)
    return f"stage={name};rows={int(rows)};columns={cols}\n".encode()


def row_dtype(payload: int) -> np.dtype:
    """One packed row: device <i8, round <i8, then ``payload`` bytes of column values."""
    return np.dtype([("device", "<i8"), ("round", "<i8"), ("values", "u1", (payload,))])


def payload_bytes(columns: Sequence[tuple[str, str, int]]) -> int:
    return sum(np.dtype(d).itemsize * w for _, d, w in columns)


class TranscriptHasher:
    """Feed stages in order: :meth:`stage` (header), then :meth:`rows` in (device, round) order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(MAGIC)
        self._left = 0
        self._payload = 0

    def stage(self, name: str, columns: Sequence[tuple[str, str, int]], rows: int) -> None:
        if self._left:
            raise ValueError(f"previous stage is {self._left} row(s) short")
        self._h.update(stage_header(name, columns, rows))
        self._left, self._payload = int(rows), payload_bytes(columns)

    def rows(self, device: np.ndarray, round_: np.ndarray, values: np.ndarray) -> None:
        """Rows given as device ids, rounds and their column values as bytes ((rows, payload) uint8)."""
        n = len(device)
        if n > self._left:
            raise ValueError("more rows than the stage header announced")
        out = np.empty(n, row_dtype(self._payload))
        out["device"], out["round"] = device, round_
        if self._payload:
            out["values"] = np.asarray(values, np.uint8).reshape(n, self._payload)
        self._h.update(out.view(np.uint8).data if n else b"")
        self._left -= n

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"last stage is {self._left} row(s) short")
        return self._h.hexdigest()


def stage_rows(stage: Any) -> int:
    """Delivered reports of a collector stage (a protocols.collecting.ReportCollector)."""
    return int(sum(stage.report_counts))


def hash_stage(hasher: TranscriptHasher, name: str, stage: Any) -> None:
    """One collector stage's header and rows, a block of devices at a time: every stored round record (in
    memory, bit-packed or spilled) is read for the block, and the present reports are emitted device-major."""
    cols = column_spec(stage.columns)
    hasher.stage(name, cols, stage_rows(stage))
    records = [rec for _, rec in stage.transcript]
    if not records:
        return
    rounds = np.array([r for r, _ in stage.transcript], dtype=np.int64)
    payload = payload_bytes(cols)
    per_device = len(records) * (1 + payload + row_dtype(payload).itemsize)
    block = max(8, (BLOCK_BYTES // per_device) // 8 * 8)  # a multiple of 8 (bit-packed records)
    n = stage.n_devices
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        rows = np.stack([stage.record_rows(rec, lo, hi) for rec in records], axis=1)  # (devices, rounds, 1 + payload)
        d, r = np.nonzero(rows[:, :, 0])  # row-major: device first, then round
        if d.size:
            hasher.rows(d.astype(np.int64) + lo, rounds[r], rows[d, r, 1:])


def digest(stages: Sequence[tuple[str, Any]]) -> str:
    """The canonical digest of a collector's ``stages()`` (module docstring)."""
    hasher = TranscriptHasher()
    for name, stage in stages:
        hash_stage(hasher, name, stage)
    return hasher.hexdigest()
