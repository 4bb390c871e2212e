"""The wire format: versioned msgpack messages with typed binary arrays. Bytes are untrusted.

docs/design.md section 5. A message is a msgpack map ``{"v": 1, "type": <name>, <fields>...}``. Arrays travel as a
msgpack extension (code 1) holding a one-byte dtype code, a little-endian uint32 element count and the raw
little-endian data; booleans/bits are bit-packed. A per-device fixed-width column (d bucket indices, d bits)
travels as a matrix (extension code 3: dtype code, uint32 rows, uint32 columns, row-major data). Only the dtypes in ``DTYPES`` exist: no pickles, no object
arrays. :func:`decode` checks size, version, type, every field's presence, type and range, array lengths and
finiteness, and raises :class:`WireError` naming the first problem it finds.

Bounded work before any object is built: a message is at most ``max_bytes``; an iterative scan of the msgpack
structure (:func:`_scan`, no recursion) refuses containers nested deeper than ``MAX_DEPTH`` (the schema needs
two: the message map and its ``columns`` map; one more level is tolerated so that a wrong container in a field
gets its own error) and more than ``MAX_OBJECTS`` msgpack objects in all, so a frame of a thousand nested
arrays, or of millions of empty ones, is a :class:`WireError` instead of a ``RecursionError`` or gigabytes of
Python objects. Any other exception while decoding is a bug; none is known (the fuzz tests in
tests/test_wire.py and benchmarks/bench_live_soak.py feed structure-aware and random inputs).

Live runtime only: ``Challenge`` (collector -> client: a 32-byte nonce as a u1 array, and optionally the
8-byte ``key_id`` of the collector's secret) and the optional ``mac`` field of ``Hello`` (64 bytes, a u1
array: probe, sample and full MAC) carry device authentication (protocols.auth); the optional ``scenario``
field of ``Hello`` (32 bytes) fingerprints the scenario the devices run, and ``refused`` (collector -> client:
a reason, at most ``MAX_REASON`` characters) says why a collector will not serve them. All are additions to
version 1 that a newer collector takes from older clients (a Hello without ``mac`` or ``scenario``), and a
newer client from older collectors (a Challenge without ``key_id``); an older collector refuses a newer
client's Hello with ``scenario`` as malformed, and an older client drops a Challenge with ``key_id`` as one,
so both ends of a deployment are upgraded together. A client that does not know ``challenge`` or ``refused``
drops it as an undecodable frame.
"""

from __future__ import annotations

import math
import re
import struct
import threading
from typing import Any

import msgpack
import numpy as np

from protocols.messages import (MESSAGE_TYPES, Challenge, CollectionRequest, Decision, End, Hello, Message,
                                Refusal, ReportBatch, Threshold)

VERSION = 1
ARRAY_EXT = 1
MATRIX_EXT = 3
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: the longest frame a device client takes from a collector: every collector message (a request, decision,
#: threshold, challenge, end or refusal) is a few hundred bytes; 64 MiB let a hostile collector make a device
#: process buffer about 110 MB per connection
MAX_DOWNLINK_BYTES = 64 * 1024
MAX_ELEMENTS = 1 << 25
MAX_COLUMNS = 16
MAX_ROUND = 2**31 - 1
MAX_DEPTH = 3  # containers nested at most this deep (the schema needs 2)
MAX_OBJECTS = 4096  # msgpack objects in one message at most (a report batch has about 20)
NONCE_BYTES = 32
KEY_ID_BYTES = 8  # a Challenge's key id (protocols.auth.key_id)
MAC_BYTES = 64  # a Hello's probe, sample and full MAC (protocols.auth)
SCENARIO_BYTES = 32  # a Hello's scenario fingerprint (sha256)
MAX_REASON = 200  # characters of a refusal's reason
_NAME = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,63}\Z")  # \Z: "$" would also match before a trailing newline
_HEADER = struct.Struct("<BI")
_MHEADER = struct.Struct("<BII")

# code -> (name, numpy dtype or None for packed bits)
DTYPES: dict[int, tuple[str, np.dtype | None]] = {
    0: ("bit", None),
    1: ("u1", np.dtype("<u1")),
    2: ("u4", np.dtype("<u4")),
    3: ("u8", np.dtype("<u8")),
    4: ("i4", np.dtype("<i4")),
    5: ("i8", np.dtype("<i8")),
    6: ("f4", np.dtype("<f4")),
    7: ("f8", np.dtype("<f8")),
}
_CODE_OF = {np.dtype(dt): code for code, (_, dt) in DTYPES.items() if dt is not None}
#: the dtypes a report column may have (little-endian; bits travel as u1 marked with :func:`bits`)
WIRE_DTYPES = frozenset(_CODE_OF)


class WireError(ValueError):
    """Malformed, oversized, wrong-version, wrong-type or out-of-range bytes. The message names the problem."""


class Bits(np.ndarray):
    """Marker view: a uint8 0/1 array to be sent bit-packed (8 reports a byte)."""


def bits(a: np.ndarray) -> np.ndarray:
    """Mark a 0/1 array for bit-packed transport."""
    return np.ascontiguousarray(a, dtype=np.uint8).view(Bits)


# ----------------------------------------------------------------------------------------------- encoding
def _pack_array(a: np.ndarray) -> msgpack.ExtType:
    if a.ndim not in (1, 2):
        raise ValueError("only one- and two-dimensional arrays travel on the wire")
    if a.size > MAX_ELEMENTS:
        raise ValueError(f"array of {a.size} elements exceeds the wire limit {MAX_ELEMENTS}")
    if isinstance(a, Bits):
        code, data = 0, np.packbits(np.asarray(a).ravel()).data
    else:
        dt = a.dtype.newbyteorder("<")
        if dt not in _CODE_OF:
            raise ValueError(f"dtype {a.dtype} is not a wire dtype")
        code, data = _CODE_OF[dt], np.ascontiguousarray(a, dtype=dt).reshape(-1).view(np.uint8).data
    # the header and the array's own buffer joined in one copy (not a copy of the array, then of both)
    if a.ndim == 1:
        return msgpack.ExtType(ARRAY_EXT, _HEADER.pack(code, a.shape[0]) + data)
    return msgpack.ExtType(MATRIX_EXT, _MHEADER.pack(code, a.shape[0], a.shape[1]) + data)


def _default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _fixed_bytes(b: bytes, n: int, what: str) -> np.ndarray:
    if not isinstance(b, (bytes, bytearray)) or len(b) != n:
        raise ValueError(f"{what} must be {n} bytes")
    return np.frombuffer(bytes(b), np.uint8)


def _check_columns(batch: ReportBatch) -> None:
    """Refuse a report column the wire does not carry (a dtype outside :data:`WIRE_DTYPES`, an array of other
    than one or two dimensions, more than :data:`MAX_ELEMENTS` values) before packing, naming the protocol and
    the column: an honest device side that builds one (a plugin's uint16 column, say) is its author's to fix."""
    for name, col in batch.columns.items():
        if not isinstance(col, np.ndarray):
            continue
        if not isinstance(col, Bits) and col.dtype.newbyteorder("<") not in _CODE_OF:
            wrong = (f"dtype {col.dtype} does not travel on the wire (one of "
                     f"{', '.join(sorted(d.str[1:] for d in WIRE_DTYPES))}; wire.bits for bits)")
        elif col.ndim not in (1, 2):
            wrong = f"{col.ndim} dimensions {col.shape}; the wire carries one value or a row of values a device"
        elif col.size > MAX_ELEMENTS:
            wrong = (f"{col.size:,} values exceed the wire's {MAX_ELEMENTS:,} a message (send smaller cohorts: "
                     f"[simulation] cohort_size)")
        else:
            continue
        from protocols.base import DefinitionError  # here, not at the top: base imports numba via the ledger

        raise DefinitionError(f"{batch.protocol}: the device side's report column {name!r}: {wrong}")


def encode(msg: Message) -> bytes:
    """Encode a message (the inverse of :func:`decode`)."""
    if isinstance(msg, CollectionRequest):
        body = {"round": msg.round, "protocol": msg.protocol, "deadline": float(msg.deadline)}
    elif isinstance(msg, Decision):
        body = {"round": msg.round, "protocol": msg.protocol, "update": bool(msg.update),
                "deadline": float(msg.deadline)}
    elif isinstance(msg, Hello):
        body = {"round": msg.round, "protocol": msg.protocol, "devices": msg.devices}
        if msg.mac is not None:
            body["mac"] = _fixed_bytes(msg.mac, MAC_BYTES, "mac")
        if msg.scenario is not None:
            body["scenario"] = _fixed_bytes(msg.scenario, SCENARIO_BYTES, "scenario")
    elif isinstance(msg, Refusal):
        if not isinstance(msg.reason, str) or len(msg.reason) > MAX_REASON:
            raise ValueError(f"reason must be a string of at most {MAX_REASON} characters")
        body = {"round": msg.round, "protocol": msg.protocol, "reason": msg.reason}
    elif isinstance(msg, Challenge):
        body = {"round": msg.round, "protocol": msg.protocol, "nonce": _fixed_bytes(msg.nonce, NONCE_BYTES, "nonce")}
        if msg.key_id is not None:
            body["key_id"] = _fixed_bytes(msg.key_id, KEY_ID_BYTES, "key_id")
    elif isinstance(msg, End):
        body = {"round": msg.round, "protocol": msg.protocol}
    elif isinstance(msg, Threshold):
        body = {"round": msg.round, "protocol": msg.protocol, "theta": float(msg.theta), "version": msg.version,
                "deadline": float(msg.deadline)}
    elif isinstance(msg, ReportBatch):
        _check_columns(msg)
        body = {"round": msg.round, "protocol": msg.protocol, "devices": msg.devices, "columns": msg.columns}
    else:
        raise TypeError(f"not a message: {type(msg).__name__}")
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(default=_default, use_bin_type=True)
    try:
        data = packer.pack({"v": VERSION, "type": msg.TYPE, **body})
    except BaseException:
        del _packers.packer  # its buffer may have grown to the failed message's size
        raise
    if len(data) > KEEP_PACKER_BYTES:  # do not hold a buffer this large for the thread's later messages
        del _packers.packer
    return data


#: Each thread's msgpack packer, reused: ``msgpack.packb`` builds a packer per call whose buffer grows by
#: reallocation past glibc's mmap threshold, so every report batch of a few hundred kB cost a few hundred page
#: faults (10x the encoding itself; more with several threads, which share the page tables). A packer resets
#: its buffer after each message, an exception included, and keeps the memory.
_packers = threading.local()
KEEP_PACKER_BYTES = 16 * 1024 * 1024


# ----------------------------------------------------------------------------------------------- decoding
def _unpack_array(code: int, data: bytes) -> np.ndarray:
    if code not in (ARRAY_EXT, MATRIX_EXT):
        raise WireError(f"unknown msgpack extension type {code}")
    header = _HEADER if code == ARRAY_EXT else _MHEADER
    what = "array" if code == ARRAY_EXT else "matrix"
    if len(data) < header.size:
        raise WireError(f"{what} header truncated")
    dcode, *shape = header.unpack_from(data)
    if dcode not in DTYPES:
        raise WireError(f"{what} dtype code {dcode} is not allowed")
    count = shape[0] if code == ARRAY_EXT else shape[0] * shape[1]
    if count > MAX_ELEMENTS:
        raise WireError(f"{what} of {count} elements exceeds the limit {MAX_ELEMENTS}")
    name, dt = DTYPES[dcode]
    payload = memoryview(data)[header.size:]
    expected = (count + 7) // 8 if dt is None else count * dt.itemsize
    if len(payload) != expected:
        raise WireError(f"{name} {what} of {count} elements needs {expected} bytes, got {len(payload)}")
    if dt is None:
        arr = np.unpackbits(np.frombuffer(payload, np.uint8), count=count)
    else:
        arr = np.frombuffer(payload, dt)
        if dt.kind == "f" and not np.all(np.isfinite(arr)):
            raise WireError(f"{what} holds a non-finite float")
    return arr if code == ARRAY_EXT else arr.reshape(shape)


def _ext_hook(code: int, data: bytes) -> np.ndarray:
    return _unpack_array(code, data)


def _int(body: dict, key: str, lo: int, hi: int) -> int:
    v = body[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise WireError(f"field {key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise WireError(f"field {key!r} = {v} is out of range [{lo}, {hi}]")
    return v


def valid_name(name: str) -> bool:
    """Whether a protocol name can travel in a message: a lowercase letter or digit, then up to 63 more of
    a-z, 0-9, _ and -."""
    return bool(_NAME.match(name))


def _name(body: dict, key: str) -> str:
    v = body[key]
    if not isinstance(v, str) or not _NAME.match(v):
        raise WireError(f"field {key!r} must be a short lowercase name, got {v!r:.80}")
    return v


def _float(body: dict, key: str) -> float:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WireError(f"field {key!r} must be a number, got {type(v).__name__}")
    if not math.isfinite(v) or v < 0:
        raise WireError(f"field {key!r} must be finite and >= 0, got {v}")
    return float(v)


def _array(v: object, what: str) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise WireError(f"{what} must be a typed array, got {type(v).__name__}")
    return v


# msgpack first bytes: fixed-size scalars (bytes after the first), length-prefixed payloads (size of the length,
# extra bytes after it: an ext's type byte), containers (size of the count, 2 for a map's key + value)
_SCALAR = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2,
           0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_PAYLOAD = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1), 0xd9: (1, 0),
            0xda: (2, 0), 0xdb: (4, 0)}
_CONTAINER = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}


def _scan(data: bytes | bytearray | memoryview) -> None:
    """Walk the msgpack structure without building it (iteratively: no recursion) and refuse nesting deeper
    than ``MAX_DEPTH`` or more than ``MAX_OBJECTS`` objects. Anything else that is wrong (an invalid byte,
    truncation, trailing bytes) is left to msgpack, which names it."""
    n = len(data)
    pos, objects = 0, 0
    stack = [1]  # objects still to read at each open level (the bottom entry: the message itself)
    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        if pos >= n:
            return  # truncated: msgpack says so
        stack[-1] -= 1
        objects += 1
        if objects > MAX_OBJECTS:
            raise WireError(f"message holds more than {MAX_OBJECTS} msgpack objects")
        b = data[pos]
        pos += 1
        if b <= 0x7f or b >= 0xe0:  # fixint
            continue
        if b <= 0x9f:  # fixmap, fixarray
            count = (b & 0x0f) * (2 if b <= 0x8f else 1)
        elif b <= 0xbf:  # fixstr
            pos += b & 0x1f
            continue
        elif b in _SCALAR:
            pos += _SCALAR[b]
            continue
        elif b in _PAYLOAD:
            size, extra = _PAYLOAD[b]
            if pos + size > n:
                return
            pos += size + extra + int.from_bytes(data[pos:pos + size], "big")
            continue
        elif b in _CONTAINER:
            size, per = _CONTAINER[b]
            if pos + size > n:
                return
            count = per * int.from_bytes(data[pos:pos + size], "big")
            pos += size
        else:  # 0xc1, never used: msgpack names it
            return
        if len(stack) > MAX_DEPTH:
            raise WireError(f"containers nested deeper than {MAX_DEPTH} levels")
        if count:
            stack.append(count)


_FIELDS = {"collect": ("round", "protocol", "deadline"), "reports": ("round", "protocol", "devices", "columns"),
           "decision": ("round", "protocol", "update", "deadline"),
           "threshold": ("round", "protocol", "theta", "version", "deadline"),
           "hello": ("round", "protocol", "devices"), "end": ("round", "protocol"),
           "challenge": ("round", "protocol", "nonce"), "refused": ("round", "protocol", "reason")}
_OPTIONAL = {"hello": ("mac", "scenario"), "challenge": ("key_id",)}


def _bytes_field(body: dict, key: str, n: int) -> bytes:
    v = _array(body[key], f"field {key!r}")
    if v.ndim != 1 or v.dtype != np.uint8 or v.size != n:
        raise WireError(f"field {key!r} must be a u1 array of {n} bytes")
    return v.tobytes()


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode untrusted bytes into a message, or raise :class:`WireError` naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) == 0:
        raise WireError("empty message")
    try:
        return _decode(data, max_bytes)
    except RecursionError:  # cannot happen after _scan; kept so that no input escapes as anything but WireError
        raise WireError("message nested too deeply") from None


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    """A map whose keys are all different: msgpack keeps the last of a repeated key, where another reader may
    keep the first and read another message (a Hello's device list, its round); a repeated key is refused."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise WireError(f"a map repeats a key ({len(pairs)} entries, {len(out)} keys)")
    return out


def _decode(data: bytes, max_bytes: int) -> Message:
    _scan(data)
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_ext_hook, use_list=True,
            max_str_len=1024, max_bin_len=0, max_array_len=1024,
            max_map_len=64, max_ext_len=max_bytes, object_pairs_hook=_unique_keys,
        )
    except WireError:
        raise
    except msgpack.ExtraData:
        raise WireError("trailing bytes after the message") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, UnicodeDecodeError) as exc:
        why = str(exc) or type(exc).__name__  # msgpack says nothing of a reserved byte (0xc1): name the error
        raise WireError(f"not valid msgpack ({len(data)} bytes, starting {data[:8].hex()}): {why}"[:200]) from None
    if not isinstance(obj, dict):
        raise WireError(f"message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if type(version) is not int or version != VERSION:  # not True, 1.0 or an array (no ambiguous truth value)
        raise WireError(f"unsupported wire version {version!r:.40} (this end speaks {VERSION})")
    kind = obj.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:  # an unhashable list/map/array is no type name
        raise WireError(f"unknown message type {kind!r:.40}")
    fields = _FIELDS[kind]
    optional = _OPTIONAL.get(kind, ())
    body = {k: v for k, v in obj.items() if k not in ("v", "type")}
    for key in body:
        if key not in fields and key not in optional:
            raise WireError(f"unknown field {key!r:.40} in a {kind!r} message")
    for key in fields:
        if key not in body:
            raise WireError(f"missing field {key!r} in a {kind!r} message")
    round_ = _int(body, "round", 1, MAX_ROUND)
    protocol = _name(body, "protocol")
    if kind == "collect":
        return CollectionRequest(round=round_, protocol=protocol, deadline=_float(body, "deadline"))
    if kind == "end":
        return End(round=round_, protocol=protocol)
    if kind == "hello":
        devices = _array(body["devices"], "field 'devices'")
        if devices.ndim != 1 or devices.dtype.kind != "u" or devices.dtype.itemsize not in (4, 8):
            raise WireError("field 'devices' must be a one-dimensional u4 or u8 array")
        if devices.size > 1 and not np.all(devices[1:] > devices[:-1]):
            raise WireError("field 'devices' must be strictly increasing")
        mac = _bytes_field(body, "mac", MAC_BYTES) if "mac" in body else None
        scenario = _bytes_field(body, "scenario", SCENARIO_BYTES) if "scenario" in body else None
        return Hello(round=round_, protocol=protocol, devices=devices, mac=mac, scenario=scenario)
    if kind == "refused":
        reason = body["reason"]
        if not isinstance(reason, str) or len(reason) > MAX_REASON or not reason.isprintable():
            # printable: a client prints it, and a hostile collector must not write escape codes or fake lines
            raise WireError(f"field 'reason' must be a printable string of at most {MAX_REASON} characters")
        return Refusal(round=round_, protocol=protocol, reason=reason)
    if kind == "challenge":
        key = _bytes_field(body, "key_id", KEY_ID_BYTES) if "key_id" in body else None
        return Challenge(round=round_, protocol=protocol, nonce=_bytes_field(body, "nonce", NONCE_BYTES), key_id=key)
    if kind == "threshold":
        return Threshold(round=round_, protocol=protocol, theta=_float(body, "theta"),
                         version=_int(body, "version", 1, MAX_ROUND), deadline=_float(body, "deadline"))
    if kind == "decision":
        if not isinstance(body["update"], bool):
            raise WireError(f"field 'update' must be a boolean, got {type(body['update']).__name__}")
        return Decision(round=round_, protocol=protocol, update=body["update"], deadline=_float(body, "deadline"))
    devices = _array(body["devices"], "field 'devices'")
    if devices.ndim != 1:
        raise WireError("field 'devices' must be a one-dimensional array")
    if devices.dtype.kind != "u" or devices.dtype.itemsize not in (4, 8):
        raise WireError(f"field 'devices' must be u4 or u8, got {devices.dtype}")
    if devices.size > 1 and not np.all(devices[1:] > devices[:-1]):
        raise WireError("field 'devices' must be strictly increasing")
    cols = body["columns"]
    if not isinstance(cols, dict):
        raise WireError("field 'columns' must be a map")
    if len(cols) > MAX_COLUMNS:
        raise WireError(f"{len(cols)} columns exceed the limit {MAX_COLUMNS}")
    columns = {}
    for name, col in cols.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise WireError(f"column name {name!r:.40} is not a short lowercase name")
        col = _array(col, f"column {name!r}")
        if col.shape[0] != devices.shape[0]:
            raise WireError(f"column {name!r} has {col.shape[0]} entries for {devices.shape[0]} devices")
        columns[name] = col
    return ReportBatch(round=round_, protocol=protocol, devices=devices, columns=columns)
