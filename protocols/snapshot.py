"""Snapshots of protocol state: a dict of typed arrays and scalars <-> bytes, with a format version and a
checksum. Sans-IO (numpy, msgpack, hashlib): the runtime decides where the bytes go (scenarios/journal.py).

Every device side has ``snapshot() -> dict`` and ``restore(dict)`` covering what carries privacy or protocol
state (the :class:`~protocols.guard.Guard`'s spend and last round, memo reveals, THRESH's caps, ToPL's
thetas...); every collector side the same for what a resumed collector needs (rounds, stored transcript
records, estimates, thresholds). A snapshot is taken *between rounds* (no stage open).

Values: ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included), ``str``, ``bytes``, numpy arrays
(any shape, of the dtypes in :data:`DTYPES`: no object arrays, no pickles), and lists and dicts (string keys)
of these, nested at most :data:`MAX_DEPTH` deep.

File layout::

    b"LDPSIM-SNAPSHOT\\n"                    16 bytes: magic (a foreign file fails here)
    sha256(body)                            32 bytes (a truncated or modified file fails here)
    body: msgpack map {"format": 1, "kind": <str>, "state": <map>}

Arrays are msgpack extension ``ARRAY_EXT`` holding a dtype code (u8), the number of dimensions (u8), each
dimension (little-endian u64) and the raw little-endian data: the wire's typed-array idea (protocols/wire.py)
without its two-dimension and size limits and with the dtypes state needs (bool, NaN floats). Decoding is
strict: anything unexpected is a :class:`SnapshotError` naming the problem.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import msgpack
import numpy as np

MAGIC = b"LDPSIM-SNAPSHOT\n"
FORMAT = 1
ARRAY_EXT = 1
MAX_DEPTH = 32
_HEAD = struct.Struct("<BB")
_DIM = struct.Struct("<Q")

DTYPES: dict[int, np.dtype] = {
    1: np.dtype("bool"), 2: np.dtype("<u1"), 3: np.dtype("<u2"), 4: np.dtype("<u4"), 5: np.dtype("<u8"),
    6: np.dtype("<i1"), 7: np.dtype("<i2"), 8: np.dtype("<i4"), 9: np.dtype("<i8"), 10: np.dtype("<f4"),
    11: np.dtype("<f8"),
}
_CODE_OF = {dt: code for code, dt in DTYPES.items()}


class SnapshotError(ValueError):
    """Bytes that are not a snapshot this build can read: foreign, corrupt, truncated, another format version
    or kind, or a state that does not fit the object it is restored into. The message names the problem."""


# ----------------------------------------------------------------------------------------------- encoding
def _pack_array(a: np.ndarray) -> msgpack.ExtType:
    dt = a.dtype if a.dtype == np.bool_ else a.dtype.newbyteorder("<")
    if dt not in _CODE_OF:
        raise TypeError(f"dtype {a.dtype} cannot be snapshotted")
    if a.ndim > 255:
        raise TypeError("too many dimensions")
    head = _HEAD.pack(_CODE_OF[dt], a.ndim) + b"".join(_DIM.pack(int(d)) for d in a.shape)
    return msgpack.ExtType(ARRAY_EXT, head + np.ascontiguousarray(a, dtype=dt).tobytes())


def _default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot snapshot a {type(obj).__name__}")


def encode(state: dict[str, Any], kind: str) -> bytes:
    """The bytes of ``state`` (see the module docstring for what it may hold), labelled ``kind``."""
    if not isinstance(state, dict):
        raise TypeError("a snapshot state is a dict")
    body = msgpack.packb({"format": FORMAT, "kind": str(kind), "state": state}, default=_default,
                         use_bin_type=True, strict_types=False)
    return MAGIC + hashlib.sha256(body).digest() + body


# ----------------------------------------------------------------------------------------------- decoding
def _unpack_array(code: int, data: bytes) -> np.ndarray:
    if code != ARRAY_EXT:
        raise SnapshotError(f"unknown msgpack extension type {code}")
    if len(data) < _HEAD.size:
        raise SnapshotError("array header truncated")
    dcode, ndim = _HEAD.unpack_from(data)
    if dcode not in DTYPES:
        raise SnapshotError(f"array dtype code {dcode} is not a snapshot dtype")
    at = _HEAD.size + ndim * _DIM.size
    if len(data) < at:
        raise SnapshotError("array shape truncated")
    shape = tuple(_DIM.unpack_from(data, _HEAD.size + i * _DIM.size)[0] for i in range(ndim))
    dt = DTYPES[dcode]
    count = math.prod(shape)
    if len(data) - at != count * dt.itemsize:
        raise SnapshotError(f"{dt} array of shape {shape} needs {count * dt.itemsize} bytes, got {len(data) - at}")
    raw = np.frombuffer(data, np.uint8, offset=at)
    if dt == np.bool_ and raw.size and raw.max() > 1:
        raise SnapshotError("a bool array holds a byte other than 0 and 1")
    return raw.view(dt).reshape(shape).copy()  # writable: restored state is updated in place


def _check(obj: Any, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise SnapshotError(f"snapshot nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise SnapshotError(f"snapshot map key {k!r:.40} is not a string")
            _check(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check(v, depth + 1)
    elif not (obj is None or isinstance(obj, (bool, int, float, str, bytes, np.ndarray))):
        raise SnapshotError(f"snapshot holds a {type(obj).__name__}")


def decode(data: bytes, kind: str | None = None) -> dict[str, Any]:
    """The state of a snapshot written by :func:`encode`; ``kind``: the label it must carry (None: any).
    Raises :class:`SnapshotError` for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise SnapshotError("not an ldpsim snapshot (no LDPSIM-SNAPSHOT header)")
    head = len(MAGIC) + 32
    if len(data) < head:
        raise SnapshotError("snapshot truncated in its header")
    body = data[head:]
    if hashlib.sha256(body).digest() != data[len(MAGIC):head]:
        raise SnapshotError("snapshot is corrupt: checksum mismatch (truncated or modified)")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_unpack_array, use_list=True)
    except SnapshotError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"snapshot body is not valid msgpack: {exc}"[:200]) from None
    if not isinstance(obj, dict) or set(obj) != {"format", "kind", "state"}:
        raise SnapshotError("snapshot body is not a {format, kind, state} map")
    if type(obj["format"]) is not int or obj["format"] != FORMAT:
        raise SnapshotError(f"snapshot format {obj['format']!r:.20} (this build reads format {FORMAT})")
    if kind is not None and obj["kind"] != kind:
        raise SnapshotError(f"a {obj['kind']!r:.60} snapshot, expected {kind!r}")
    if not isinstance(obj["state"], dict):
        raise SnapshotError("snapshot state is not a map")
    _check(obj["state"])
    return obj["state"]


# ----------------------------------------------------------------------------------------------- restore helpers
def field(state: dict[str, Any], key: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``state[key]``, checked to be of ``kind``: SnapshotError naming the key otherwise."""
    if not isinstance(state, dict) or key not in state:
        raise SnapshotError(f"snapshot has no {key!r}")
    v = state[key]
    if kind is not None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise SnapshotError(f"snapshot field {key!r} is a {type(v).__name__}")
    return v


def array(state: dict[str, Any], key: str, dtype: Any, shape: tuple[int | None, ...] | None = None) -> np.ndarray:
    """``state[key]`` as an array of ``dtype`` (same kind and size) and ``shape`` (None: any length there)."""
    v = field(state, key, np.ndarray)
    want = np.dtype(dtype)
    if v.dtype != want:
        raise SnapshotError(f"snapshot array {key!r} is {v.dtype}, expected {want}")
    if shape is not None and (v.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, v.shape))):
        raise SnapshotError(f"snapshot array {key!r} has shape {v.shape}, expected {shape}")
    return v


def put(target: np.ndarray, state: dict[str, Any], key: str) -> None:
    """Copy ``state[key]`` into ``target`` in place (same dtype and shape)."""
    target[...] = array(state, key, target.dtype, target.shape)


def same_devices(state: dict[str, Any], device_ids: np.ndarray) -> None:
    """A device-side snapshot must be restored into a cohort of the very same devices."""
    ids = array(state, "device_ids", np.uint64)
    if ids.shape != device_ids.shape or not np.array_equal(ids, device_ids):
        first = f"{int(ids[0])}..{int(ids[-1])}" if ids.size else "none"
        raise SnapshotError(f"snapshot of devices {first} ({ids.size}) does not fit this cohort")


def header(side: Any) -> dict[str, Any]:
    """What every protocol side's snapshot starts with: its protocol name (and a device side's seed)."""
    out: dict[str, Any] = {"protocol": side.params.name}
    if hasattr(side, "seed"):
        out["seed"] = int(side.seed)
    return out


def check_header(state: dict[str, Any], side: Any) -> None:
    """Refuse a snapshot of another protocol (or another seed) before anything is restored."""
    if not isinstance(state, dict):
        raise SnapshotError("a protocol snapshot is a map")
    name = field(state, "protocol", str)
    if name != side.params.name:
        raise SnapshotError(f"a {name!r} snapshot cannot be restored into {side.params.name!r}")
    if hasattr(side, "seed") and field(state, "seed", int) != int(side.seed):
        raise SnapshotError(f"snapshot of seed {state['seed']}, this side has seed {side.seed}")


class GuardedSnapshot:
    """Mixin for device sides whose only state is ``guard`` (and ``reveals`` when memoized)."""

    def snapshot(self) -> dict[str, Any]:
        out = {**header(self), "guard": self.guard.snapshot()}  # type: ignore[attr-defined]
        if getattr(self, "reveals", None) is not None:
            out["reveals"] = self.reveals.snapshot()  # type: ignore[attr-defined]
        return out

    def restore(self, state: dict[str, Any]) -> None:
        check_header(state, self)
        self.guard.restore(field(state, "guard", dict))  # type: ignore[attr-defined]
        if getattr(self, "reveals", None) is not None:
            self.reveals.restore(field(state, "reveals", dict))  # type: ignore[attr-defined]
