"""Run-directory tables in Apache Parquet (pyarrow): transcript.parquet, ledger.parquet, spend.parquet; the
readers an auditor uses; and the canonical transcript digest recomputed from transcript.parquet alone.

transcript.parquet: one row per delivered (accepted) report, sorted by (stage order, round, device):
``stage`` (string, dictionary-encoded; its dictionary lists the stages in protocol order), ``round`` (int64),
``device`` (int64), then one column per report column of the protocol (width 1: a scalar of its dtype;
width > 1: a fixed_size_list of its dtype), null where the column is not one of the row's stage. The schema
metadata key ``ldpsim.transcript`` holds JSON: format, protocol, devices, and each stage's name and columns
(name, dtype, width), in order. :func:`transcript_digest_of_table` recomputes summary.json's
``digests.transcript`` from it (protocols/transcript.py defines the digest).

ledger.parquet: device, round (int64), time, amount (float64), reason (dictionary-encoded string): one row
per device and cumulative charge, in the order charged. spend.parquet: device, group (dictionary string),
spend, round_epsilon, first_change_round (int32, null for a device no change reached). Every file is written to a temporary name in its directory and moved into place
(os.replace): a reader sees the whole file or none.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from protocols import transcript as canonical
from protocols.ledger import ChargeRows

TRANSCRIPT = "transcript.parquet"
LEDGER = "ledger.parquet"
SPEND = "spend.parquet"
META_KEY = b"ldpsim.transcript"
FORMAT = "ldpsim-transcript/2"
ROW_GROUP = 1 << 20  # rows per Parquet row group (and devices read from a round record at a time)
KEYS = ("stage", "round", "device")
COMPRESSION = "zstd"


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path next to ``path`` (same suffix) to write to; moved onto ``path`` when the block ends
    without an error, removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _numeric(values: np.ndarray) -> pa.Array:
    """A 1-d numpy array of numbers as an Arrow array over the same memory. ``pa.array`` would do the same but
    first imports pandas (when installed) to look for pandas objects: 0.3 s and more of a run's writing."""
    a = np.ascontiguousarray(values)
    if a.ndim != 1 or a.dtype.kind not in "iuf" or not a.dtype.isnative:
        return pa.array(a)
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [None, pa.py_buffer(a)])


def _numeric_or_null(values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """As :func:`_numeric`, with nulls where ``valid`` is False (a validity bitmap, least significant bit
    first, as Arrow lays it out; no pandas either)."""
    a = np.ascontiguousarray(values)
    bitmap = np.packbits(np.asarray(valid, dtype=bool), bitorder="little")
    return pa.Array.from_buffers(pa.from_numpy_dtype(a.dtype), a.size, [pa.py_buffer(bitmap), pa.py_buffer(a)],
                                 null_count=int(a.size - np.count_nonzero(valid)))


def _strings(values: Sequence[str]) -> pa.Array:
    """A short list of strings (a dictionary) as an Arrow string array, without ``pa.array`` (see _numeric)."""
    encoded = [str(v).encode("utf-8") for v in values]
    offsets = np.zeros(len(encoded) + 1, np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets),
                                                             pa.py_buffer(b"".join(encoded))])


def _arrow_type(dtype: str, width: int) -> pa.DataType:
    t = pa.from_numpy_dtype(np.dtype(dtype))
    return t if width == 1 else pa.list_(t, width)


def _stage_dictionary(names: Sequence[str], index: int, n: int) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(_numeric(np.full(n, index, np.int8)), _strings(names))


# ----------------------------------------------------------------------------------------------- transcript
def transcript_schema(protocol: str, devices: int, stages: Sequence[tuple[str, Sequence[tuple[str, str, int]]]],
                      bits: Sequence[set[str]] | None = None) -> pa.Schema:
    """Arrow schema of transcript.parquet for ``stages`` [(name, [(column, dtype, width), ...]), ...]; ``bits``:
    each stage's bit columns (hashed packed by the canonical digest)."""
    bits = bits if bits is not None else [set() for _ in stages]
    fields = [pa.field("stage", pa.dictionary(pa.int8(), pa.string()), nullable=False),
              pa.field("round", pa.int64(), nullable=False), pa.field("device", pa.int64(), nullable=False)]
    seen: dict[str, tuple[str, int]] = {}
    for _, cols in stages:
        for name, dtype, width in cols:
            if name in KEYS:
                raise ValueError(f"report column {name!r} clashes with a key column")
            if name in seen:
                if seen[name] != (dtype, width):
                    raise ValueError(f"report column {name!r} differs between stages")
                continue
            seen[name] = (dtype, width)
            fields.append(pa.field(name, _arrow_type(dtype, width)))
    meta = {"format": FORMAT, "protocol": protocol, "devices": int(devices), "order": list(KEYS),
            "stages": [{"name": s, "columns": [{"name": c, "dtype": d, "width": w, "bits": c in b}
                                               for c, d, w in cols]}
                       for (s, cols), b in zip(stages, bits)]}
    return pa.schema(fields, metadata={META_KEY: json.dumps(meta).encode()})


def transcript_meta(table_or_schema: pa.Table | pa.Schema) -> dict:
    """The ``ldpsim.transcript`` metadata of a transcript table (or its schema)."""
    schema = table_or_schema.schema if isinstance(table_or_schema, pa.Table) else table_or_schema
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError("not an ldpsim transcript table (no ldpsim.transcript schema metadata)")
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"ldpsim.transcript metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError("ldpsim.transcript metadata must be a JSON object")
    if meta.get("format") != FORMAT:
        raise ValueError(f"transcript format {meta.get('format')!r}, this reader knows {FORMAT!r}")
    _check_meta(meta)
    return meta


def _check_meta(meta: dict) -> None:
    """The shape the readers rely on (a damaged file's metadata: a ValueError naming what is wrong)."""
    devices = meta.get("devices")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
        raise ValueError(f"ldpsim.transcript metadata: devices must be a whole number >= 0, got {devices!r:.40}")
    stages = meta.get("stages")
    if not isinstance(stages, list) or not all(isinstance(st, dict) for st in stages):
        raise ValueError("ldpsim.transcript metadata: stages must be a list of objects")
    for st in stages:
        cols = st.get("columns")
        if not isinstance(st.get("name"), str) or not isinstance(cols, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("dtype"), str)
                and isinstance(c.get("width"), int) and not isinstance(c.get("width"), bool) and c["width"] >= 1
                for c in cols):
            raise ValueError(f"ldpsim.transcript metadata: stage {st.get('name')!r:.40} needs a name and columns "
                             "(each with name, dtype and width >= 1)")


def stage_specs(meta: dict) -> list[tuple[str, list[tuple[str, str, int]]]]:
    """Each stage of a transcript's metadata as (name, [(column, dtype, width), ...])."""
    return [(s["name"], [(c["name"], c["dtype"], int(c["width"])) for c in s["columns"]]) for s in meta["stages"]]


def _stage_bits(meta: dict) -> list[set[str]]:
    return [{c["name"] for c in s["columns"] if c.get("bits")} for s in meta["stages"]]


def _column_array(values: np.ndarray, dtype: str, width: int) -> pa.Array:
    flat = _numeric(np.ascontiguousarray(values).reshape(-1))
    return flat if width == 1 else pa.FixedSizeListArray.from_arrays(flat, width)


def write_transcript(path: Path | str, collector: Any, protocol: str) -> dict:
    """transcript.parquet from a collector's ``stages()``, a round and a block of devices at a time (bounded
    memory: works with bit-packed and spilled records). Returns {"rows": n, "bytes": size}."""
    stages = collector.stages()
    specs = [(name, canonical.column_spec(st.columns)) for name, st in stages]
    n_devices = int(stages[0][1].n_devices) if stages else 0
    schema = transcript_schema(protocol, n_devices, specs, [canonical.bit_columns(st.columns) for _, st in stages])
    names = [name for name, _ in specs]
    scalar = [f.name for f in schema if not pa.types.is_floating(f.type) and f.name != "device"]

    def batches() -> Iterator[pa.RecordBatch]:
        for index, ((name, st), (_, cols)) in enumerate(zip(stages, specs)):
            own = {c for c, _, _ in cols}
            for rnd, record in st.transcript:
                for lo in range(0, st.n_devices, ROW_GROUP):
                    hi = min(lo + ROW_GROUP, st.n_devices)
                    block = st.record_rows(record, lo, hi)
                    idx = np.flatnonzero(block[:, 0])
                    if not idx.size:
                        continue
                    k, payload, at = idx.size, block[idx, 1:], 0
                    data: dict[str, pa.Array] = {
                        "stage": _stage_dictionary(names, index, k),
                        "round": _numeric(np.full(k, rnd, np.int64)),
                        "device": _numeric(idx.astype(np.int64) + lo)}
                    for c, dtype, width in cols:
                        size = np.dtype(dtype).itemsize * width
                        vals = np.ascontiguousarray(payload[:, at:at + size]).view(np.dtype(dtype).newbyteorder("<"))
                        data[c] = _column_array(vals.astype(np.dtype(dtype), copy=False), dtype, width)
                        at += size
                    for f in schema:
                        if f.name not in data and f.name not in own:
                            data[f.name] = pa.nulls(k, f.type)
                    yield pa.RecordBatch.from_arrays([data[f.name] for f in schema], schema=schema)

    rows = _write_batches(path, schema, batches(), scalar)
    return {"rows": rows, "bytes": Path(path).stat().st_size}


def _write_batches(path: Path | str, schema: pa.Schema, batches: Iterable[pa.RecordBatch],
                   dictionary: list[str], statistics: bool | list[str] = True) -> int:
    """Record batches to a Parquet file, written atomically in row groups of about ROW_GROUP rows (bounded
    memory); ``dictionary``: the columns to dictionary-encode; ``statistics``: the columns whose min and max
    each row group records (True: all). Returns the row count."""
    rows, pending, pending_rows = 0, [], 0
    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, schema, compression=COMPRESSION, use_dictionary=dictionary,
                              column_encoding={"device": "DELTA_BINARY_PACKED"},
                              write_statistics=statistics) as writer:
            for batch in batches:
                pending.append(batch)
                pending_rows += batch.num_rows
                rows += batch.num_rows
                if pending_rows >= ROW_GROUP:
                    writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=ROW_GROUP)
                    pending, pending_rows = [], 0
            if pending:
                writer.write_table(pa.Table.from_batches(pending, schema), row_group_size=ROW_GROUP)
    return rows


def read_transcript(run_dir: Path | str, columns: list[str] | None = None, filters: Any = None) -> pa.Table:
    """transcript.parquet of a run directory (or the file itself); ``columns``/``filters`` as pyarrow's
    read_table (e.g. filters=[("device", "in", [3, 17])] for a sample of devices)."""
    path = Path(run_dir)
    path = path / TRANSCRIPT if path.is_dir() else path
    return pq.read_table(path, columns=columns, filters=filters)


def transcript_digest_of_table(table: pa.Table) -> str:
    """The canonical transcript digest (protocols/transcript.py) from transcript.parquet alone: for each
    stage of the metadata, in order, its rounds in increasing order, each round's rows in device order.
    Equals summary.json's ``digests.transcript``."""
    import pyarrow.compute as pc  # only the readers use it (~0.1 s to import)

    meta = transcript_meta(table)
    n = int(meta["devices"])
    hasher = canonical.TranscriptHasher(n)
    specs, bits = stage_specs(meta), _stage_bits(meta)
    stage = table["stage"]
    if pa.types.is_dictionary(stage.type):
        stage = stage.cast(pa.string())
    counts = {str(v["values"]): int(v["counts"]) for v in pc.value_counts(stage).to_pylist()}
    if set(counts) - {name for name, _ in specs}:
        raise ValueError(f"rows of stages {sorted(set(counts) - {n for n, _ in specs})} not in the metadata")
    for (name, cols), bit in zip(specs, bits):
        k = counts.get(name, 0)
        sub = table if k == table.num_rows else table.filter(pc.equal(stage, name))
        hasher.stage(name, cols, bit, k)
        if not k:
            continue
        device = sub["device"].to_numpy().astype(np.int64, copy=False)
        rnd = sub["round"].to_numpy().astype(np.int64, copy=False)
        if device.size and (device.min() < 0 or device.max() >= n):
            raise ValueError(f"stage {name!r} names a device outside [0, {n})")
        order = np.lexsort((device, rnd))
        values = {c: _column_values(sub[c], d, w, k)[order] for c, d, w in cols}
        device, rnd = device[order], rnd[order]
        starts = np.flatnonzero(np.r_[True, rnd[1:] != rnd[:-1]])
        for lo, hi in zip(starts, np.r_[starts[1:], k]):
            present = np.zeros(n, dtype=bool)
            present[device[lo:hi]] = True
            if int(present.sum()) != hi - lo:
                raise ValueError(f"stage {name!r} round {int(rnd[lo])} repeats a device")
            hasher.round(int(rnd[lo]), present, {c: v[lo:hi] for c, v in values.items()})
    return hasher.hexdigest()


def _column_values(column: pa.ChunkedArray | pa.Array, dtype: str, width: int, n: int) -> np.ndarray:
    """A stage's column (no nulls) as an (n, width) array of its dtype."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count:
        raise ValueError(f"column {arr.type} has nulls in rows of its own stage")
    if width > 1:
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False).astype(np.dtype(dtype), copy=False).reshape(n, width)


def device_rows(table: pa.Table, devices: int | Iterable[int]) -> pa.Table:
    """The rows of one device, or of a sample of devices (one pass over the table, whatever the sample
    size), in table order. For a large file, read only the sample: ``read_transcript(run, filters=[("device",
    "in", sample)])`` (or read_ledger) does the same while reading."""
    import pyarrow.compute as pc

    ids = [int(devices)] if isinstance(devices, (int, np.integer)) else [int(d) for d in devices]
    return table.filter(pc.is_in(table["device"], value_set=pa.array(ids, pa.int64())))


# --------------------------------------------------------------------------------------- ledger and spend
LEDGER_SCHEMA = pa.schema([pa.field("device", pa.int64(), nullable=False), pa.field("round", pa.int64(), nullable=False),
                           pa.field("time", pa.float64(), nullable=False),
                           pa.field("reason", pa.dictionary(pa.int32(), pa.string()), nullable=False),
                           pa.field("amount", pa.float64(), nullable=False)])
#: ledger.parquet's columns with min/max statistics: not reason, whose string statistics cost a tenth of the
#: writing and would skip no row group (rows in charge order mix the reasons)
LEDGER_STATISTICS = ["device", "round", "time", "amount"]


def write_ledger(path: Path | str, chunks: Iterable[ChargeRows]) -> int:
    """ledger.parquet from Ledger.rows() chunks (one row per device and charge, in the order charged);
    returns the row count."""
    reasons: list[str] = []

    def merged(group: list[tuple[np.ndarray, ChargeRows]], known: int) -> pa.RecordBatch:
        """The chunks of ``group`` as one batch, its reason dictionary the first ``known`` reasons."""
        bounds = np.cumsum([0] + [devices.size for devices, _ in group]).tolist()
        spans = list(zip(bounds, bounds[1:]))

        def column(values: Iterable[Any], dtype: Any) -> np.ndarray:
            # each chunk's value over its rows, slice by slice: a fill per chunk, where np.repeat with counts
            # goes element by element (5-10x slower, holding the GIL)
            out = np.empty(bounds[-1], dtype)
            for (lo, hi), v in zip(spans, values):
                out[lo:hi] = v
            return out

        reason = column((reasons.index(ch["reason"]) for _, ch in group), np.int32)
        return pa.RecordBatch.from_arrays(
            [_numeric(np.concatenate([devices for devices, _ in group])),
             _numeric(column((ch["round"] for _, ch in group), np.int64)),
             _numeric(column((ch["time"] for _, ch in group), np.float64)),
             pa.DictionaryArray.from_arrays(_numeric(reason), _strings(reasons[:known])),
             _numeric(column((ch["amount"] for _, ch in group), np.float64))], schema=LEDGER_SCHEMA)

    def batches() -> Iterator[pa.RecordBatch]:
        # A batch per run of chunks up to where _write_batches writes a row group (ROW_GROUP rows or more) and
        # where the reasons seen so far grow (the batches' dictionaries are those of one batch per chunk, so the
        # file is byte for byte the same): a few numpy calls per million rows rather than a few per chunk, and
        # a background writer rarely waits for the GIL.
        group: list[tuple[np.ndarray, ChargeRows]] = []
        rows = known = 0
        for ch in chunks:
            devices = np.asarray(ch["devices"], dtype=np.int64)
            if not devices.size:
                continue
            if ch["reason"] not in reasons:
                if group:
                    yield merged(group, known)
                    group = []
                reasons.append(ch["reason"])
                known = len(reasons)
            group.append((devices, ch))
            rows += devices.size
            if rows >= ROW_GROUP:
                yield merged(group, known)
                group, rows = [], 0
        if group:
            yield merged(group, known)

    return _write_batches(path, LEDGER_SCHEMA, batches(), ["round", "time", "reason", "amount"], LEDGER_STATISTICS)


def write_spend(path: Path | str, group_index: np.ndarray, group_names: Sequence[str], spend: np.ndarray,
                round_epsilon: np.ndarray, changed_round: np.ndarray | None = None) -> None:
    """spend.parquet: device, group, spend (cumulative epsilon), round_epsilon, and first_change_round (the
    first round at which a scripted change or a behavior changed the device: ``changed_round``, 0 for none,
    written as null; the column is left out when ``changed_round`` is None)."""
    n = spend.size
    group = pa.DictionaryArray.from_arrays(_numeric(np.asarray(group_index, np.int32)), _strings(group_names))
    columns = [_numeric(np.arange(n, dtype=np.int64)), group, _numeric(np.asarray(spend, np.float64)),
               _numeric(np.asarray(round_epsilon, np.float64))]
    names = ["device", "group", "spend", "round_epsilon"]
    if changed_round is not None:
        changed = np.asarray(changed_round, np.int32)
        columns.append(_numeric_or_null(changed, changed != 0))
        names.append("first_change_round")
    table = pa.Table.from_arrays(columns, names=names)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=COMPRESSION, row_group_size=ROW_GROUP,
                       use_dictionary=["group", "spend", "round_epsilon", *names[4:]],
                       column_encoding={"device": "DELTA_BINARY_PACKED"})


def ledger_rows_digest_of_table(table: pa.Table) -> str:
    """The ledger rows digest (protocols.ledger.rows_digest) from ledger rows alone (columns device, round,
    time, reason, amount: ledger.parquet, or device shards' files concatenated). Equals summary.json's
    ``digests.ledger_rows`` for the run's ledger.parquet. Rows of one (round, time, reason, amount) are found
    as the file's stretches of equal keys (a few per cohort and round as written; a file whose rows were
    reordered is sorted first), then each key's devices sorted."""
    import pyarrow.compute as pc

    from protocols.ledger import id_runs, rows_digest

    reason = table["reason"]
    if not pa.types.is_dictionary(reason.type):
        reason = pc.dictionary_encode(reason)
    # one dictionary for all chunks; its entries may repeat (files written apart), so a code is its name
    chunks = reason.unify_dictionaries().chunks if isinstance(reason, pa.ChunkedArray) else [reason]
    names = chunks[0].dictionary.to_pylist() if chunks else []
    code = np.concatenate([np.asarray(c.indices, dtype=np.int64) for c in chunks]) if chunks else np.empty(0, np.int64)

    def column(name: str, dtype: Any) -> np.ndarray:
        return table[name].to_numpy().astype(dtype, copy=False)

    device, rnd = column("device", np.int64), column("round", np.int64)
    when = column("time", np.float64).view(np.int64)  # bits: keys compare exactly
    amount = column("amount", np.float64).view(np.int64)
    keys = (rnd, code, when, amount)

    def stretches() -> np.ndarray:
        changed = np.zeros(max(device.size - 1, 0), dtype=bool)
        for k in keys:
            changed |= k[1:] != k[:-1]
        return np.flatnonzero(np.r_[True, changed]) if device.size else np.empty(0, np.int64)

    starts = stretches()
    if starts.size > 4096 and starts.size > device.size // 64:  # shuffled rows: sort them by key once
        order = np.lexsort((device, amount, when, code, rnd))
        device, rnd, code, when, amount = (a[order] for a in (device, rnd, code, when, amount))
        keys = (rnd, code, when, amount)
        starts = stretches()
    parts: dict[tuple[int, str, str, str], list[np.ndarray]] = {}
    for lo, hi in zip(starts.tolist(), np.r_[starts[1:], device.size].tolist()):
        key = (int(rnd[lo]), float(when[lo:lo + 1].view(np.float64)[0]).hex(), names[code[lo]],
               float(amount[lo:lo + 1].view(np.float64)[0]).hex())
        parts.setdefault(key, []).append(device[lo:hi])
    groups = []
    for key, ids in parts.items():
        starts_, stops = id_runs(np.sort(np.concatenate(ids), kind="stable"))
        groups.append((key, starts_, stops))
    return rows_digest(groups)


def read_ledger(run_dir: Path | str, columns: list[str] | None = None, filters: Any = None) -> pa.Table:
    """ledger.parquet of a run directory (or the file itself)."""
    path = Path(run_dir)
    return pq.read_table(path / LEDGER if path.is_dir() else path, columns=columns, filters=filters)


def read_spend(run_dir: Path | str, columns: list[str] | None = None) -> pa.Table:
    """spend.parquet of a run directory (or the file itself)."""
    path = Path(run_dir)
    return pq.read_table(path / SPEND if path.is_dir() else path, columns=columns)
