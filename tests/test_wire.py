"""The wire format (protocols.wire): round trips, every malformed case named, and fuzzing of untrusted bytes."""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocols import wire
from protocols.messages import CollectionRequest, ReportBatch
from protocols.wire import WireError, decode, encode

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

HEADER = struct.Struct("<BI")
CODE = {"bit": 0, "u1": 1, "u4": 2, "u8": 3, "i4": 4, "i8": 5, "f4": 6, "f8": 7}


# ----------------------------------------------------------------------------------------------- helpers
def ext(code: int, count: int, payload: bytes = b"") -> msgpack.ExtType:
    """The array extension by hand: code 1, '<BI' (dtype code, element count) + raw little-endian bytes."""
    return msgpack.ExtType(wire.ARRAY_EXT, HEADER.pack(code, count) + payload)


def arr(dtype: str, values) -> msgpack.ExtType:
    a = np.asarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
    return ext(CODE[np.dtype(dtype).str[1:]], a.size, a.tobytes())


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def collect_body(**over) -> dict:
    body = {"v": 1, "type": "collect", "round": 3, "protocol": "1bitrrpm", "deadline": 7200.5}
    body.update(over)
    return {k: v for k, v in body.items() if v is not _DROP}


def reports_body(**over) -> dict:
    body = {"v": 1, "type": "reports", "round": 3, "protocol": "1bitrrpm",
            "devices": arr("u4", [1, 5, 9]), "columns": {"bit": ext(0, 3, bytes([0b10100000]))}}
    body.update(over)
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


def assert_same(a, b) -> None:
    """Equal messages: same type and fields; arrays equal in dtype and values."""
    assert type(a) is type(b)
    assert a.round == b.round and a.protocol == b.protocol
    if isinstance(a, CollectionRequest):
        assert a.deadline == b.deadline and type(b.deadline) is float
        return
    assert a.devices.dtype == b.devices.dtype
    np.testing.assert_array_equal(a.devices, b.devices)
    assert list(a.columns) == list(b.columns)
    for name in a.columns:
        x, y = np.asarray(a.columns[name]), np.asarray(b.columns[name])
        assert x.dtype == y.dtype, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y)


def sample_batch(rng: np.random.Generator, n: int = 37) -> ReportBatch:
    devices = np.sort(rng.choice(10_000, size=n, replace=False)).astype(np.uint32)
    return ReportBatch(round=12, protocol="1bitrrpm", devices=devices, columns={
        "bit": wire.bits(rng.integers(0, 2, n)),
        "grid": rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32),
        "big": rng.integers(0, 2**63, n, dtype=np.uint64),
        "delta": rng.integers(-2**62, 2**62, n, dtype=np.int64),
        "value": rng.normal(size=n),
    })


# ----------------------------------------------------------------------------------------------- round trips
def test_collection_request_round_trip():
    msg = CollectionRequest(round=7, protocol="1bitrrpm", deadline=12345.25)
    raw = encode(msg)
    assert isinstance(raw, bytes)
    out = decode(raw)
    assert out == msg
    assert_same(msg, out)
    # the documented layout: a msgpack map with v, type and the fields
    assert msgpack.unpackb(raw) == {"v": 1, "type": "collect", "round": 7, "protocol": "1bitrrpm",
                                    "deadline": 12345.25}


def test_collection_request_integer_deadline_decodes_as_float():
    out = decode(pack(collect_body(deadline=60)))
    assert out.deadline == 60.0 and type(out.deadline) is float


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 37, 1000])
def test_report_batch_round_trip(n):
    msg = sample_batch(np.random.default_rng(n), n)
    out = decode(encode(msg))
    assert isinstance(out, ReportBatch)
    assert_same(msg, out)
    assert out.columns["bit"].dtype == np.uint8
    assert out.columns["grid"].dtype == np.dtype("<u4")
    assert out.columns["big"].dtype == np.dtype("<u8")
    assert out.columns["delta"].dtype == np.dtype("<i8")
    assert out.columns["value"].dtype == np.dtype("<f8")
    assert len(out) == n


def test_bits_are_bit_packed_and_other_dtypes_raw():
    n = 1000
    rng = np.random.default_rng(1)
    b = rng.integers(0, 2, n)
    devices = np.arange(n, dtype=np.uint32)
    packed = encode(ReportBatch(1, "x", devices, {"bit": wire.bits(b)}))
    plain = encode(ReportBatch(1, "x", devices, {"bit": b.astype(np.uint8)}))
    assert_same(decode(packed), decode(plain))
    ext_bits, ext_u1 = (msgpack.unpackb(raw)["columns"]["bit"] for raw in (packed, plain))
    assert ext_bits.code == ext_u1.code == 1
    assert HEADER.unpack_from(ext_bits.data) == (0, n)  # eight reports a byte
    assert ext_bits.data[HEADER.size:] == np.packbits(b.astype(np.uint8)).tobytes()
    assert len(ext_bits.data) == HEADER.size + (n + 7) // 8
    assert HEADER.unpack_from(ext_u1.data) == (1, n)
    assert ext_u1.data[HEADER.size:] == b.astype(np.uint8).tobytes()


def test_big_endian_input_arrays_travel_little_endian():
    devices = np.array([3, 4, 300], dtype=">u8")
    out = decode(encode(ReportBatch(2, "p", devices, {"v": np.array([1.5, -2, 3], dtype=">f8")})))
    assert out.devices.dtype == np.dtype("<u8") and out.devices.tolist() == [3, 4, 300]
    assert out.columns["v"].tolist() == [1.5, -2.0, 3.0]


def test_decode_accepts_bytearray_and_memoryview():
    raw = encode(CollectionRequest(1, "p", 1.0))
    assert decode(bytearray(raw)) == decode(memoryview(raw)) == CollectionRequest(1, "p", 1.0)


@pytest.mark.parametrize("bad", [np.zeros((2, 2, 2), np.uint8), np.array([1, 2], dtype=np.int16),
                                 np.array(["a"], dtype=object)])
def test_encode_refuses_non_wire_arrays(bad):
    with pytest.raises((ValueError, TypeError)):
        encode(ReportBatch(1, "p", np.arange(len(bad), dtype=np.uint32), {"c": bad}))


def reference_encoding(msg: ReportBatch) -> bytes:
    """The encoding by a fresh msgpack packer per message (what wire.encode's reused packers must match)."""
    body = {"v": wire.VERSION, "type": msg.TYPE, "round": msg.round, "protocol": msg.protocol,
            "devices": msg.devices, "columns": msg.columns}
    return msgpack.packb(body, default=wire._default, use_bin_type=True)


def test_reused_packer_after_a_failed_encoding_starts_clean():
    """A message that fails half-way (its second column is not a wire array) leaves nothing in the thread's
    packer: the next message is exactly what a fresh packer makes."""
    good = sample_batch(np.random.default_rng(5), 300)
    encode(good)
    bad = ReportBatch(1, "p", np.arange(3, dtype=np.uint32), {"a": np.ones(3, np.uint8), "b": np.ones(3, np.int16)})
    with pytest.raises(ValueError):
        encode(bad)
    assert encode(good) == reference_encoding(good)
    assert_same(decode(encode(good)), good)


def test_encoding_from_several_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor

    msgs = [sample_batch(np.random.default_rng(i), 2000 + i) for i in range(16)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: [encode(m) for _ in range(5)], msgs))
    for msg, encodings in zip(msgs, got):
        assert encodings == [reference_encoding(msg)] * 5


def test_thread_keeps_no_packer_after_a_message_that_failed_to_encode():
    """The failed message's bytes may have grown the buffer already: the packer goes with them."""
    encode(sample_batch(np.random.default_rng(1), 3))
    bad = ReportBatch(1, "p", np.arange(3, dtype=np.uint32), {"a": np.ones(3, np.uint8), "b": object()})
    with pytest.raises(TypeError):
        encode(bad)
    assert getattr(wire._packers, "packer", None) is None
    small = sample_batch(np.random.default_rng(2), 5)
    assert encode(small) == reference_encoding(small)


def test_thread_keeps_no_packer_after_a_very_large_message(monkeypatch):
    monkeypatch.setattr(wire, "KEEP_PACKER_BYTES", 1000)
    small, large = sample_batch(np.random.default_rng(1), 3), sample_batch(np.random.default_rng(2), 500)
    encode(small)
    assert getattr(wire._packers, "packer", None) is not None
    assert encode(large) == reference_encoding(large)
    assert getattr(wire._packers, "packer", None) is None
    assert encode(small) == reference_encoding(small)


# ----------------------------------------------------------------------------------------------- malformed
MALFORMED = [
    # size and framing
    ("empty", b"", "empty message"),
    ("not msgpack", b"\xc1", "not valid msgpack"),
    ("truncated msgpack", encode(CollectionRequest(1, "p", 1.0))[:-3], "not valid msgpack"),
    ("trailing bytes", encode(CollectionRequest(1, "p", 1.0)) + b"\x00", "trailing bytes"),
    ("bin not allowed", pack({"v": 1, "type": "collect", "round": 1, "protocol": "p", "deadline": b"x"}),
     "not valid msgpack"),
    ("non-string map key", pack({1: 1}), "not valid msgpack"),
    ("top level array", pack([1, "collect"]), "message must be a map, got list"),
    ("top level int", pack(5), "message must be a map, got int"),
    ("top level string", pack("collect"), "message must be a map, got str"),
    # version
    ("version 2", pack(collect_body(v=2)), "unsupported wire version 2"),
    ("version missing", pack(collect_body(v=_DROP)), "unsupported wire version None"),
    ("version string", pack(collect_body(v="1")), "unsupported wire version '1'"),
    ("version true", pack(collect_body(v=True)), "unsupported wire version True"),
    ("version float", pack(collect_body(v=1.0)), "unsupported wire version 1.0"),
    ("version array of one", pack(collect_body(v=arr("u4", [1]))), "unsupported wire version"),
    ("version array of two", pack(collect_body(v=arr("u4", [1, 1]))), "unsupported wire version"),
    ("version empty array", pack(collect_body(v=arr("u4", []))), "unsupported wire version"),
    # type
    ("unknown type", pack(collect_body(type="greeting")), "unknown message type 'greeting'"),
    ("type missing", pack(collect_body(type=_DROP)), "unknown message type None"),
    ("type is a list", pack(collect_body(type=["collect"])), "unknown message type"),
    ("type is a map", pack(collect_body(type={"a": 1})), "unknown message type"),
    ("type is an array", pack(collect_body(type=arr("u1", [1, 2]))), "unknown message type"),
    # fields
    ("unknown field", pack(collect_body(extra=1)), "unknown field 'extra' in a 'collect' message"),
    ("reports field in collect", pack(collect_body(devices=arr("u4", [1]))), "unknown field 'devices'"),
    ("missing deadline", pack(collect_body(deadline=_DROP)), "missing field 'deadline' in a 'collect'"),
    ("missing round", pack(collect_body(round=_DROP)), "missing field 'round'"),
    ("missing columns", pack(reports_body(columns=_DROP)), "missing field 'columns' in a 'reports'"),
    ("missing devices", pack(reports_body(devices=_DROP)), "missing field 'devices'"),
    # round
    ("round 0", pack(collect_body(round=0)), "field 'round' = 0 is out of range"),
    ("round negative", pack(collect_body(round=-1)), "field 'round' = -1 is out of range"),
    ("round 2**31", pack(collect_body(round=2**31)), f"field 'round' = {2**31} is out of range"),
    ("round 2**64-1", pack(reports_body(round=2**64 - 1)), "is out of range"),
    ("round bool", pack(collect_body(round=True)), "field 'round' must be an integer, got bool"),
    ("round string", pack(collect_body(round="1")), "field 'round' must be an integer, got str"),
    ("round float", pack(collect_body(round=1.0)), "field 'round' must be an integer, got float"),
    ("round nil", pack(reports_body(round=None)), "field 'round' must be an integer, got NoneType"),
    # protocol name
    ("protocol uppercase", pack(collect_body(protocol="OneBit")), "field 'protocol' must be a short lowercase"),
    ("protocol empty", pack(collect_body(protocol="")), "field 'protocol' must be a short lowercase"),
    ("protocol too long", pack(collect_body(protocol="a" * 65)), "field 'protocol' must be a short lowercase"),
    ("protocol leading dash", pack(collect_body(protocol="-x")), "field 'protocol' must be a short lowercase"),
    ("protocol space", pack(reports_body(protocol="1bit rrpm")), "field 'protocol' must be a short lowercase"),
    ("protocol trailing newline", pack(collect_body(protocol="1bitrrpm\n")),
     "field 'protocol' must be a short lowercase"),
    ("protocol not a string", pack(collect_body(protocol=5)), "field 'protocol' must be a short lowercase"),
    # deadline
    ("deadline negative", pack(collect_body(deadline=-0.5)), "field 'deadline' must be finite and >= 0"),
    ("deadline negative int", pack(collect_body(deadline=-1)), "field 'deadline' must be finite and >= 0"),
    ("deadline NaN", pack(collect_body(deadline=math.nan)), "field 'deadline' must be finite and >= 0, got nan"),
    ("deadline inf", pack(collect_body(deadline=math.inf)), "field 'deadline' must be finite and >= 0, got inf"),
    ("deadline -inf", pack(collect_body(deadline=-math.inf)), "field 'deadline' must be finite"),
    ("deadline bool", pack(collect_body(deadline=False)), "field 'deadline' must be a number, got bool"),
    ("deadline string", pack(collect_body(deadline="1")), "field 'deadline' must be a number, got str"),
    # devices
    ("devices list", pack(reports_body(devices=[1, 5, 9])), "field 'devices' must be a typed array, got list"),
    ("devices int", pack(reports_body(devices=1)), "field 'devices' must be a typed array, got int"),
    ("devices i8", pack(reports_body(devices=arr("i8", [1, 5, 9]))), "field 'devices' must be u4 or u8, got int64"),
    ("devices f8", pack(reports_body(devices=arr("f8", [1, 5, 9]))),
     "field 'devices' must be u4 or u8, got float64"),
    ("devices u1", pack(reports_body(devices=arr("u1", [1, 5, 9]))), "field 'devices' must be u4 or u8, got uint8"),
    ("devices bits", pack(reports_body(devices=ext(0, 3, b"\xff"))), "field 'devices' must be u4 or u8"),
    ("devices repeated", pack(reports_body(devices=arr("u4", [1, 5, 5]))), "field 'devices' must be strictly incr"),
    ("devices decreasing", pack(reports_body(devices=arr("u8", [9, 5, 1]))), "field 'devices' must be strictly incr"),
    # columns
    ("columns not a map", pack(reports_body(columns=[ext(0, 3, b"\x00")])), "field 'columns' must be a map"),
    ("column length mismatch", pack(reports_body(columns={"bit": ext(0, 2, b"\x00")})),
     "column 'bit' has 2 entries for 3 devices"),
    ("second column length mismatch", pack(reports_body(columns={"bit": ext(0, 3, b"\x00"),
                                                                "grid": arr("u4", [1, 2, 3, 4])})),
     "column 'grid' has 4 entries for 3 devices"),
    ("column name uppercase", pack(reports_body(columns={"Bit": ext(0, 3, b"\x00")})),
     "column name 'Bit' is not a short lowercase name"),
    ("column name empty", pack(reports_body(columns={"": ext(0, 3, b"\x00")})), "column name '' is not"),
    ("column name too long", pack(reports_body(columns={"b" * 65: ext(0, 3, b"\x00")})), "column name 'bbbb"),
    ("column name trailing newline", pack(reports_body(columns={"bit\n": ext(0, 3, b"\x00")})),
     "column name 'bit\\n' is not"),
    ("column not an array", pack(reports_body(columns={"bit": [0, 1, 0]})),
     "column 'bit' must be a typed array, got list"),
    ("too many columns", pack(reports_body(columns={f"c{i}": ext(0, 3, b"\x00") for i in range(17)})),
     "17 columns exceed the limit 16"),
    # the array extension
    ("array dtype code 8", pack(reports_body(devices=ext(8, 0))), "array dtype code 8 is not allowed"),
    ("array dtype code 255", pack(reports_body(columns={"bit": ext(255, 3, b"\x00" * 3)})),
     "array dtype code 255 is not allowed"),
    ("array header empty", pack(reports_body(devices=msgpack.ExtType(1, b""))), "array header truncated"),
    ("array header truncated", pack(reports_body(devices=msgpack.ExtType(1, b"\x02\x03\x00\x00"))),
     "array header truncated"),
    ("array payload short", pack(reports_body(devices=ext(2, 3, b"\x00" * 8))),
     "u4 array of 3 elements needs 12 bytes, got 8"),
    ("array payload long", pack(reports_body(devices=ext(3, 3, b"\x00" * 25))),
     "u8 array of 3 elements needs 24 bytes, got 25"),
    ("bit payload short", pack(reports_body(columns={"bit": ext(0, 9, b"\x00")})),
     "bit array of 9 elements needs 2 bytes, got 1"),
    ("array too long", pack(reports_body(devices=ext(1, wire.MAX_ELEMENTS + 1))), "exceeds the limit"),
    ("f8 NaN", pack(reports_body(columns={"bit": ext(0, 3, b"\x00"), "v": arr("f8", [1, math.nan, 2])})),
     "array holds a non-finite float"),
    ("f8 inf", pack(reports_body(columns={"v": arr("f8", [1, 2, math.inf])})), "array holds a non-finite float"),
    ("f4 -inf", pack(reports_body(columns={"v": arr("f4", [-math.inf, 0, 0])})), "array holds a non-finite float"),
    ("unknown ext code", pack(reports_body(devices=msgpack.ExtType(2, b"\x02\x00\x00\x00\x00"))),
     "unknown msgpack extension type 2"),
    ("unknown ext code in a field", pack(collect_body(deadline=msgpack.ExtType(99, b""))),
     "unknown msgpack extension type 99"),
]


@pytest.mark.parametrize("data,problem", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_raises_wire_error_naming_the_problem(data, problem):
    with pytest.raises(WireError) as info:
        decode(data)
    assert problem in str(info.value)
    assert not str(info.value).rstrip().endswith(":"), info.value  # a reason, not "not valid msgpack: "


def test_malformed_cases_are_otherwise_valid():
    """The hand-built bodies decode when nothing is wrong, so each case above fails for its own reason."""
    assert decode(pack(collect_body())) == CollectionRequest(3, "1bitrrpm", 7200.5)
    out = decode(pack(reports_body()))
    assert out.devices.tolist() == [1, 5, 9] and out.devices.dtype == np.uint32
    assert out.columns["bit"].tolist() == [1, 0, 1]
    assert decode(pack(reports_body(devices=arr("u8", [1, 5, 9])))).devices.dtype == np.uint64
    assert decode(pack(collect_body(round=2**31 - 1))).round == 2**31 - 1
    assert decode(pack(collect_body(protocol="a" * 64, deadline=0))).protocol == "a" * 64
    sixteen = decode(pack(reports_body(columns={f"c{i}": ext(0, 3, b"\x00") for i in range(16)})))
    assert len(sixteen.columns) == 16


@pytest.mark.parametrize("data,problem", [
    (None, "expected bytes, got NoneType"),
    ("abc", "expected bytes, got str"),
    (12, "expected bytes, got int"),
    ([1, 2], "expected bytes, got list"),
    ({"v": 1}, "expected bytes, got dict"),
])
def test_non_bytes_input(data, problem):
    with pytest.raises(WireError, match=problem):
        decode(data)


def test_oversized():
    raw = encode(sample_batch(np.random.default_rng(0), 100))
    with pytest.raises(WireError, match=rf"message of {len(raw)} bytes exceeds the limit of 64"):
        decode(raw, max_bytes=64)
    assert isinstance(decode(raw, max_bytes=len(raw)), ReportBatch)  # the limit is inclusive
    with pytest.raises(WireError, match="exceeds the limit of"):
        decode(raw, max_bytes=len(raw) - 1)


def test_wire_error_is_a_value_error():
    assert issubclass(WireError, ValueError)


# ----------------------------------------------------------------------------------------------- fuzzing
def assert_reencodes(msg) -> None:
    """(c) a decoded message encodes again and decodes to the same thing."""
    again = decode(encode(msg))
    assert_same(msg, again)
    assert_same(again, decode(encode(again)))


def decode_or_wire_error(data: bytes):
    try:
        msg = decode(data)
    except WireError as exc:
        assert str(exc)  # a named problem
        event("rejected: " + str(exc).split(" ")[0])
        return None
    event("decoded")
    assert isinstance(msg, (CollectionRequest, ReportBatch))
    return msg


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data):
    msg = decode_or_wire_error(data)
    if msg is not None:
        assert_reencodes(msg)


# msgpack documents built from the message's own vocabulary, so fuzzing reaches the field checks
_KEYS = st.sampled_from(["v", "type", "round", "protocol", "deadline", "devices", "columns", "bit", "x"])
_EXT = st.builds(lambda code, dcode, count, payload: msgpack.ExtType(code, HEADER.pack(dcode, count) + payload),
                 st.sampled_from([1, 1, 1, 2]), st.integers(0, 9), st.integers(0, 40), st.binary(max_size=40))
_SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
            | st.sampled_from(["collect", "reports", "1bitrrpm", "bit", ""]) | st.text(max_size=8) | _EXT
            | st.just(b""))
_DOCS = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=6),
                     max_leaves=12)
def _mostly(valid):
    """``valid`` nine times in ten, else an arbitrary document."""
    return st.sampled_from([True] * 9 + [False]).flatmap(lambda ok: valid if ok else _DOCS)


_SMALL_IDS = st.lists(st.integers(0, 5), max_size=3, unique=True).map(sorted)
_SMALL_ARRAY = st.builds(lambda dcode, ids: arr(dcode, ids) if dcode != "bit" else
                         ext(0, len(ids), np.packbits(np.array(ids, np.uint8) & 1).tobytes()),
                         st.sampled_from(["u4", "u8", "bit", "f8", "i8"]), _SMALL_IDS)
_COLLECT_LIKE = st.fixed_dictionaries({
    "v": _mostly(st.just(1)), "type": _mostly(st.just("collect")), "round": _mostly(st.integers(1, 3)),
    "protocol": _mostly(st.sampled_from(["1bitrrpm", "x", "X"])), "deadline": _mostly(st.floats(-1, 1e9))},
    optional={"extra": _DOCS})
_REPORTS_LIKE = st.fixed_dictionaries({
    "v": _mostly(st.just(1)), "type": _mostly(st.just("reports")), "round": _mostly(st.integers(1, 3)),
    "protocol": _mostly(st.sampled_from(["1bitrrpm", "x", "X"])),
    "devices": _mostly(_SMALL_IDS.map(lambda ids: arr("u4", ids)) | _SMALL_ARRAY),
    "columns": _mostly(st.dictionaries(st.sampled_from(["bit", "grid", "Bad"]), _mostly(_SMALL_ARRAY), max_size=3))},
    optional={"extra": _DOCS})
_MESSAGE_LIKE = st.one_of(_COLLECT_LIKE, _REPORTS_LIKE)


@FUZZ
@given(_DOCS | _MESSAGE_LIKE | _MESSAGE_LIKE)
def test_fuzz_structured_documents(doc):
    msg = decode_or_wire_error(pack(doc))
    if msg is not None:
        assert_reencodes(msg)


_BASE = [encode(sample_batch(np.random.default_rng(5), 20)),
         encode(ReportBatch(4, "1bitrrpm", np.arange(100, 140, dtype=np.uint32),
                            {"bit": wire.bits(np.random.default_rng(6).integers(0, 2, 40))})),
         encode(CollectionRequest(9, "1bitrrpm", 1e6))]

_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**20), st.integers(1, 255)),
    st.tuples(st.just("set"), st.integers(0, 2**20), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 2**20)),
    st.tuples(st.just("insert"), st.integers(0, 2**20), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 2**20), st.integers(1, 8)),
    st.tuples(st.just("splice"), st.integers(0, 2**20), st.integers(0, 2), st.integers(0, 2**20),
              st.integers(0, 64)),
)


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op in ops:
        at = op[1] % (len(b) + 1)
        if op[0] == "flip" and b:
            b[at % len(b)] ^= op[2]
        elif op[0] == "set" and b:
            b[at % len(b)] = op[2]
        elif op[0] == "truncate":
            del b[at:]
        elif op[0] == "insert":
            b[at:at] = op[2]
        elif op[0] == "delete":
            del b[at:at + op[2]]
        elif op[0] == "splice":  # a piece of another valid message, overwriting from `at`
            donor = _BASE[op[2]]
            start = op[3] % len(donor)
            b[at:at + op[4]] = donor[start:start + op[4]]
    return bytes(b)


@FUZZ
@given(st.integers(0, len(_BASE) - 1), st.lists(_MUTATION, min_size=1, max_size=4))
def test_fuzz_mutated_valid_messages(base, ops):
    msg = decode_or_wire_error(mutate(_BASE[base], ops))
    if msg is not None:
        assert_reencodes(msg)


def test_mutation_fuzz_reaches_deep_checks():
    """The mutations are not all rejected at the first byte: a seeded sweep hits field- and array-level
    problems and also yields mutated messages that still decode (guards the fuzz test from going vacuous)."""
    rng = np.random.default_rng(2024)
    reasons, decoded = set(), 0
    for _ in range(2000):
        base = _BASE[int(rng.integers(len(_BASE)))]
        ops = [("flip", int(rng.integers(2**20)), int(rng.integers(1, 256)))]
        try:
            decode(mutate(base, ops))
            decoded += 1
        except WireError as exc:
            reasons.add(str(exc).split(" ")[0])
    assert decoded > 0
    assert {"not", "field", "array"} <= reasons


_DTYPES = st.sampled_from(["<u1", "<u4", "<u8", "<i4", "<i8", "<f4", "<f8", "bit"])
_NAMES = st.from_regex(r"\A[a-z0-9][a-z0-9_\-]{0,63}\Z")


@st.composite
def valid_messages(draw):
    if draw(st.booleans()):
        return CollectionRequest(round=draw(st.integers(1, 2**31 - 1)), protocol=draw(_NAMES),
                                 deadline=draw(st.floats(0, 1e300) | st.integers(0, 2**64 - 1).map(float)))
    n = draw(st.integers(0, 40))
    ids = sorted(draw(st.sets(st.integers(0, 2**64 - 1 if draw(st.booleans()) else 2**32 - 1),
                              min_size=n, max_size=n)))
    devices = np.array(ids, dtype=np.uint64 if ids and ids[-1] >= 2**32 else draw(st.sampled_from([np.uint32,
                                                                                                    np.uint64])))
    columns = {}
    for name in draw(st.lists(_NAMES, max_size=wire.MAX_COLUMNS, unique=True)):
        dt = draw(_DTYPES)
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if dt == "bit":
            columns[name] = wire.bits(rng.integers(0, 2, n))
        elif dt[1] == "f":
            columns[name] = rng.normal(scale=1e6, size=n).astype(dt)
        else:
            info = np.iinfo(dt)
            columns[name] = rng.integers(info.min, info.max, n, dtype=np.dtype(dt), endpoint=True)
    return ReportBatch(round=draw(st.integers(1, 2**31 - 1)), protocol=draw(_NAMES), devices=devices,
                       columns=columns)


@FUZZ
@given(valid_messages())
def test_fuzz_valid_messages_round_trip(msg):
    out = decode(encode(msg))
    assert_same(msg, out)
    assert_reencodes(out)


@pytest.mark.parametrize("rows,cols", [(0, 3), (1, 1), (5, 3), (9, 8), (37, 5)])
def test_matrix_columns_round_trip(rows, cols):
    """Per-device fixed-width columns (d buckets, d bits) travel as matrices, bits packed row-major."""
    rng = np.random.default_rng(rows * 31 + cols)
    devices = np.arange(rows, dtype=np.uint32)
    cols_in = {"j": rng.integers(0, 200, (rows, cols)).astype(np.uint8),
               "b": wire.bits(rng.integers(0, 2, (rows, cols))),
               "x": rng.normal(size=(rows, cols))}
    out = decode(encode(ReportBatch(1, "dbitflip", devices, cols_in)))
    for name, arr in cols_in.items():
        assert out.columns[name].shape == (rows, cols)
        np.testing.assert_array_equal(out.columns[name], np.asarray(arr))
    raw = msgpack.unpackb(encode(ReportBatch(1, "p", devices, {"b": cols_in["b"]})), raw=False)
    ext = raw["columns"]["b"]
    assert ext.code == 3 and len(ext.data) == 9 + (rows * cols + 7) // 8


@pytest.mark.parametrize("payload,needle", [
    (struct.pack("<BII", 2, 2, 3) + b"\x00" * 23, "needs 24 bytes"),
    (struct.pack("<BI", 2, 2), "matrix header truncated"),
    (struct.pack("<BII", 9, 1, 1) + b"\x00", "dtype code 9"),
    (struct.pack("<BII", 7, 1, 1) + struct.pack("<d", float("nan")), "non-finite"),
    (struct.pack("<BII", 1, 1 << 20, 1 << 20), "exceeds the limit"),
])
def test_malformed_matrices(payload, needle):
    body = {"v": 1, "type": "reports", "round": 1, "protocol": "p",
            "devices": msgpack.ExtType(1, struct.pack("<BI", 2, 2) + b"\x00" * 8),
            "columns": {"m": msgpack.ExtType(3, payload)}}
    with pytest.raises(WireError, match=needle):
        decode(msgpack.packb(body, use_bin_type=True))


def test_devices_may_not_be_a_matrix():
    body = {"v": 1, "type": "reports", "round": 1, "protocol": "p",
            "devices": msgpack.ExtType(3, struct.pack("<BII", 2, 1, 1) + b"\x00" * 4), "columns": {}}
    with pytest.raises(WireError, match="one-dimensional"):
        decode(msgpack.packb(body, use_bin_type=True))


# ----------------------------------------------------------------------------------------------- live messages
def test_hello_and_challenge_round_trip():
    from protocols.messages import Challenge, Hello

    ids = np.array([3, 9, 2**32 - 1], np.uint32)
    for mac in (None, bytes(range(64))):
        out = decode(encode(Hello(4, "1bitrrpm", ids, mac)))
        assert isinstance(out, Hello) and out.mac == mac and out.round == 4
        np.testing.assert_array_equal(out.devices, ids)
    out = decode(encode(Hello(4, "1bitrrpm", ids, None, bytes(range(32, 64)))))
    assert isinstance(out, Hello) and out.scenario == bytes(range(32, 64)) and out.mac is None
    from protocols.messages import Refusal

    assert decode(encode(Refusal(3, "1bitrrpm", "the devices run another scenario"))) == Refusal(
        3, "1bitrrpm", "the devices run another scenario")
    with pytest.raises(ValueError, match="at most 200 characters"):
        encode(Refusal(1, "1bitrrpm", "x" * 201))
    ch = decode(encode(Challenge(1, "1bitrrpm", b"\xff" * 32)))
    assert isinstance(ch, Challenge) and ch.nonce == b"\xff" * 32 and ch.key_id is None
    with pytest.raises(ValueError, match="32 bytes"):
        encode(Challenge(1, "1bitrrpm", b"short"))
    ch = decode(encode(Challenge(2, "1bitrrpm", b"\x01" * 32, bytes(range(8)))))
    assert ch == Challenge(2, "1bitrrpm", b"\x01" * 32, bytes(range(8)))
    with pytest.raises(ValueError, match="8 bytes"):
        encode(Challenge(1, "1bitrrpm", b"\x01" * 32, b"\x01" * 9))
    challenge = {"v": 1, "type": "challenge", "round": 1, "protocol": "1bitrrpm", "nonce": arr("u1", range(32))}
    for key_id, problem in ((arr("u1", range(7)), "must be a u1 array of 8 bytes"),
                            (arr("u4", range(2)), "must be a u1 array of 8 bytes"),
                            ("0001020304050607", "must be a typed array, got str")):
        with pytest.raises(WireError, match=f"field 'key_id' {problem}"):
            decode(pack({**challenge, "key_id": key_id}))


HELLO = {"v": 1, "type": "hello", "round": 1, "protocol": "1bitrrpm", "devices": arr("u4", [1, 2])}


@pytest.mark.parametrize("body,problem", [
    ({**HELLO, "mac": arr("u1", range(32))}, "field 'mac' must be a u1 array of 64 bytes"),
    ({**HELLO, "mac": arr("u4", range(16))}, "field 'mac' must be a u1 array of 64 bytes"),
    ({**HELLO, "mac": "x" * 32}, "field 'mac' must be a typed array, got str"),
    ({**HELLO, "nonce": arr("u1", range(32))}, "unknown field 'nonce' in a 'hello' message"),
    ({**HELLO, "devices": arr("i8", [-1])}, "field 'devices' must be a one-dimensional u4 or u8 array"),
    ({**HELLO, "devices": arr("u4", [2, 2])}, "field 'devices' must be strictly increasing"),
    ({**HELLO, "scenario": arr("u1", range(16))}, "field 'scenario' must be a u1 array of 32 bytes"),
    ({"v": 1, "type": "refused", "round": 1, "protocol": "p", "reason": 5},
     "field 'reason' must be a printable string of at most 200 characters"),
    ({"v": 1, "type": "refused", "round": 1, "protocol": "p", "reason": "x" * 201},
     "field 'reason' must be a printable string of at most 200 characters"),
    ({"v": 1, "type": "refused", "round": 1, "protocol": "p", "reason": "\x1b[2J\nldpsim: done"},
     "field 'reason' must be a printable string of at most 200 characters"),
    ({"v": 1, "type": "refused", "round": 1, "protocol": "p"}, "missing field 'reason' in a 'refused'"),
    ({"v": 1, "type": "challenge", "round": 1, "protocol": "p"}, "missing field 'nonce' in a 'challenge'"),
    ({"v": 1, "type": "challenge", "round": 1, "protocol": "p", "nonce": arr("u1", range(33))},
     "field 'nonce' must be a u1 array of 32 bytes"),
    ({"v": 1, "type": "challenge", "round": 1, "protocol": "p", "nonce": arr("u1", range(32)), "mac": 1},
     "unknown field 'mac' in a 'challenge'"),
])
def test_malformed_live_messages(body, problem):
    with pytest.raises(WireError) as info:
        decode(pack(body))
    assert problem in str(info.value)


def _nested(depth: int, leaf: bytes = b"\x01", opener: bytes = b"\x91") -> bytes:
    return opener * depth + leaf


def _collect_with_protocol(raw_value: bytes) -> bytes:
    return (b"\x85" + pack("v") + b"\x01" + pack("type") + pack("collect") + pack("round") + b"\x01"
            + pack("deadline") + pack(1.0) + pack("protocol") + raw_value)


@pytest.mark.parametrize("depth", [3, 10, 511, 1000, 1023, 1024, 100_000])
def test_deep_nesting_is_a_wire_error(depth):
    """Nested arrays or maps in a field: a WireError at any depth (1,000 used to escape as a RecursionError from
    the repr in the error message), before msgpack builds them."""
    for opener in (b"\x91", b"\x81\xa1k"):  # [[[...]]], {"k": {"k": ...}}
        with pytest.raises(WireError, match="nested deeper than"):
            decode(_collect_with_protocol(_nested(depth, opener=opener)))
    with pytest.raises(WireError, match="nested deeper than"):
        decode(_nested(depth + 1))


def test_schema_depth_still_names_the_field():
    """A container one level below the schema's deepest (a list in a column) still gets the field's own error."""
    with pytest.raises(WireError, match="column 'bit' must be a typed array, got list"):
        decode(pack(reports_body(columns={"bit": [0, 1, 0]})))
    with pytest.raises(WireError, match="nested deeper than 3"):
        decode(pack(reports_body(columns={"bit": [[0], 1, 0]})))


@pytest.mark.parametrize("raw", [
    b"\xdd" + struct.pack(">I", 1_000_000) + b"\x90" * 1_000_000,  # a million empty arrays
    b"\xdf" + struct.pack(">I", 500_000) + b"\xa0\x80" * 500_000,  # half a million {"": {}}
    b"\x81\xa1a\xdd" + struct.pack(">I", 5000) + b"\x01" * 5000,  # 5,000 small ints in a field
])
def test_object_bombs_are_refused_before_they_are_built(raw):
    with pytest.raises(WireError, match="more than 4096 msgpack objects"):
        decode(raw)


# ----------------------------------------------------------------------------------------------- structure-aware fuzzing
# A seeded generator of hostile-but-plausible inputs: valid messages of every type with fields deleted, added,
# retyped and set to boundary values; broken array headers; nesting and object bombs; byte-level mutations on
# top. Used here (a few thousand inputs) and by benchmarks/bench_live_soak.py (100,000+).
_BOUNDARY = [0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -2**63, math.nan, math.inf,
             -math.inf, -0.0, 1e308, 5e-324, None, True, False, "", "x" * 64, "x" * 65, "1bitrrpm\n", "\u00e9",
             "collect", "hello", b"", b"x"]
_TYPES = ["collect", "reports", "decision", "threshold", "hello", "end", "challenge"]
_FIELD_NAMES = ["v", "type", "round", "protocol", "deadline", "devices", "columns", "update", "theta", "version",
                "mac", "nonce", "extra"]


def _rand_array(rng: np.random.Generator) -> msgpack.ExtType:
    """An array extension, often broken: wrong code, dtype, count or payload length."""
    code = int(rng.choice([1, 1, 1, 3, 2, 99]))
    dcode = int(rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 8, 255]))
    count = int(rng.choice([0, 1, 3, 32, 2**25, 2**25 + 1, 2**32 - 1])) if rng.random() < 0.3 else int(rng.integers(0, 40))
    itemsize = {0: 0, 1: 1, 2: 4, 3: 8, 4: 4, 5: 8, 6: 4, 7: 8}.get(dcode, 1)
    n = (min(count, 64) + 7) // 8 if itemsize == 0 else min(count, 64) * itemsize
    n = max(0, n + int(rng.choice([0, 0, 0, -1, 1])))
    payload = rng.bytes(n)
    if code == 3:
        return msgpack.ExtType(3, struct.pack("<BII", dcode, count, int(rng.integers(0, 4))) + payload)
    header = struct.pack("<BI", dcode, count & 0xFFFFFFFF)
    return msgpack.ExtType(code, header[:int(rng.integers(0, 6))] if rng.random() < 0.05 else header + payload)


def _rand_value(rng: np.random.Generator, depth: int = 0):
    r = rng.random()
    if r < 0.45:
        return _BOUNDARY[int(rng.integers(len(_BOUNDARY)))]
    if r < 0.7:
        return _rand_array(rng)
    if r < 0.8 and depth < 5:
        return [_rand_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
    if r < 0.9 and depth < 5:
        return {str(rng.choice(_FIELD_NAMES)): _rand_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))}
    return int(rng.integers(-2**63, 2**63 - 1, dtype=np.int64))


def _valid_doc(rng: np.random.Generator) -> dict:
    kind = str(rng.choice(_TYPES))
    doc: dict = {"v": 1, "type": kind, "round": int(rng.integers(1, 1000)), "protocol": "1bitrrpm"}
    if kind in ("collect", "decision", "threshold"):
        doc["deadline"] = float(rng.uniform(0, 1e6))
    if kind == "decision":
        doc["update"] = bool(rng.integers(2))
    if kind == "threshold":
        doc["theta"], doc["version"] = float(rng.uniform(0, 100)), int(rng.integers(1, 10))
    n = int(rng.integers(0, 20))
    ids = np.sort(rng.choice(1000, n, replace=False))
    if kind in ("reports", "hello"):
        doc["devices"] = arr(str(rng.choice(["u4", "u8"])), ids)
    if kind == "reports":
        doc["columns"] = {"bit": ext(0, n, np.packbits(rng.integers(0, 2, n).astype(np.uint8)).tobytes()),
                          "grid": arr("u4", rng.integers(0, 2**32, n, dtype=np.uint64))}
    if kind == "hello" and rng.random() < 0.5:
        doc["mac"] = arr("u1", np.frombuffer(rng.bytes(64), np.uint8))
    if kind == "challenge":
        doc["nonce"] = arr("u1", np.frombuffer(rng.bytes(32), np.uint8))
    return doc


_BOMBS = [_nested(1000), _nested(5, opener=b"\x81\xa1k"), b"\xdd\x00\x01\x00\x00" + b"\x90" * 65536,
          b"\xc1", b"\xdc\xff\xff", b"\xc7\xff\x01", b"\xdb\xff\xff\xff\xff"]


def fuzz_input(rng: np.random.Generator) -> bytes:
    """One structure-aware fuzz input (a message's bytes, not framed)."""
    doc = _valid_doc(rng)
    for _ in range(int(rng.integers(0, 4))):
        op = rng.random()
        keys = list(doc)
        if op < 0.25 and keys:
            del doc[keys[int(rng.integers(len(keys)))]]
        elif op < 0.5:
            doc[str(rng.choice(_FIELD_NAMES))] = _rand_value(rng)
        elif op < 0.65:
            doc["type"] = str(rng.choice(_TYPES))
        elif op < 0.8 and isinstance(doc.get("columns"), dict):
            doc["columns"][str(rng.choice(["bit", "grid", "Bad", "x" * 65]))] = _rand_value(rng)
        elif keys:
            doc[keys[int(rng.integers(len(keys)))]] = _rand_array(rng)
    try:
        raw = bytearray(pack(doc))
    except (ValueError, OverflowError, TypeError):  # not representable in msgpack: a bomb instead
        raw = bytearray(_BOMBS[int(rng.integers(len(_BOMBS)))])
    if rng.random() < 0.3:  # byte-level damage on top
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(len(raw) + 1))
            op = int(rng.integers(5))
            if op == 0 and raw:
                raw[at % len(raw)] ^= int(rng.integers(1, 256))
            elif op == 1:
                del raw[at:]
            elif op == 2:
                raw[at:at] = rng.bytes(int(rng.integers(1, 9)))
            elif op == 3:
                raw[at:at] = _BOMBS[int(rng.integers(len(_BOMBS)))]
            else:
                del raw[at:at + int(rng.integers(1, 9))]
    return bytes(raw)


def fuzz_stream(rng: np.random.Generator, max_frame: int = 4096) -> tuple[bytes, list[int]]:
    """A byte stream of frames (some with a lying or oversized length prefix) and the chunk sizes it arrives in."""
    from protocols.framing import frame

    out = bytearray()
    for _ in range(int(rng.integers(1, 6))):
        body = fuzz_input(rng)
        r = rng.random()
        if r < 0.1:
            out += struct.pack(">I", int(rng.choice([max_frame + 1, 2**32 - 1, len(body) + 1]))) + body
        elif r < 0.15:
            out += struct.pack(">I", len(body))[:int(rng.integers(0, 4))]
        else:
            out += frame(body)
    cuts = []
    left = len(out)
    while left > 0:
        cuts.append(min(left, int(rng.choice([1, 2, 3, 7, 64, 4096]))))
        left -= cuts[-1]
    return bytes(out), cuts


def check_decode(raw: bytes) -> bool:
    """decode() gives a message that re-encodes to itself, or a WireError; anything else propagates."""
    try:
        msg = decode(raw)
    except WireError as exc:
        assert str(exc)
        return False
    again = decode(encode(msg))
    assert type(again) is type(msg) and again.round == msg.round and again.protocol == msg.protocol
    return True


def check_stream(data: bytes, cuts: list[int], max_frame: int = 4096) -> int:
    """Feed ``data`` to a FrameDecoder in ``cuts``-sized pieces and decode every frame; returns frames seen. A
    frame over the limit ends the stream with a WireError, as it ends a connection."""
    from protocols.framing import FrameDecoder

    decoder, at, frames = FrameDecoder(max_frame), 0, 0
    try:
        for n in cuts:
            for raw in decoder.feed(data[at:at + n]):
                frames += 1
                check_decode(raw)
            at += n
    except WireError:
        pass
    assert decoder.pending <= max_frame + 4
    return frames


def test_structure_aware_fuzz_of_decode():
    """3,000 structure-aware inputs: every one decodes (and round-trips) or is a WireError; both outcomes occur,
    and every message type decodes at least once (the generator is not vacuous)."""
    rng = np.random.default_rng(10)
    decoded = set()
    for _ in range(3000):
        raw = fuzz_input(rng)
        if check_decode(raw):
            decoded.add(decode(raw).TYPE)
    assert decoded == set(_TYPES)


def test_structure_aware_fuzz_of_framing():
    """600 frame streams cut at random places: frames come out whole, bad ones are WireErrors."""
    rng = np.random.default_rng(11)
    frames = sum(check_stream(*fuzz_stream(rng)) for _ in range(600))
    assert frames > 600


@pytest.mark.parametrize("column, wrong", [
    (np.zeros((4, 2, 2), np.uint8), "3 dimensions (4, 2, 2); the wire carries one value or a row of values a device"),
    (np.zeros(wire.MAX_ELEMENTS + 1, np.uint8), f"{wire.MAX_ELEMENTS + 1:,} values exceed the wire's "
                                                f"{wire.MAX_ELEMENTS:,} a message (send smaller cohorts: "
                                                "[simulation] cohort_size)"),
    (np.zeros(4, np.uint16), "dtype uint16 does not travel on the wire (one of f4, f8, i4, i8, u1, u4, u8; "
                             "wire.bits for bits)"),
])
def test_a_device_side_column_the_wire_cannot_carry_is_named_before_packing(column, wrong):
    """A plugin's device side building a column of a dtype, a shape or a size the wire does not carry gets one
    DefinitionError naming the protocol and the column (3-D and oversized columns were the encoder's ValueError)."""
    from protocols.base import DefinitionError

    with pytest.raises(DefinitionError) as err:
        encode(ReportBatch(1, "myproto", np.arange(4, dtype=np.uint64), {"y": column}))
    assert str(err.value) == f"myproto: the device side's report column 'y': {wrong}"


def test_a_map_that_repeats_a_key_is_refused():
    """msgpack keeps the last of a repeated key, where another reader may keep the first and read another
    message (an attacker's note: a Hello padded with a second "devices", or a second "round"): refused."""
    good = wire.encode(CollectionRequest(round=3, protocol="1bitmean", deadline=10.0))
    body = msgpack.unpackb(good, raw=False, strict_map_key=False, ext_hook=lambda code, data: msgpack.ExtType(code, data))
    assert wire.decode(good) == CollectionRequest(round=3, protocol="1bitmean", deadline=10.0)
    items = list(body.items())
    pairs = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in items + [("round", 9)])
    forged = bytes([0x80 | (len(items) + 1)]) + pairs  # a fixmap of one more entry: "round" twice
    with pytest.raises(wire.WireError, match="a map repeats a key"):
        wire.decode(forged)
