"""Device authentication for the live runtime: per-device credentials derived from one deployment secret.

**Credentials.** A deployment has one secret ``S`` (``--secret-file``: the file's bytes, surrounding whitespace
stripped, at least 16 bytes). Device ``d`` holds the credential

    k_d = HMAC-SHA256(S, "ldpsim/device/v1" || uint64_be(d))

and nothing else: a device (or a client hosting a cohort) can be provisioned with its devices' ``k_d`` alone.
The collector stores no per-device state: it derives ``k_d`` from ``S`` when it needs it.

**Hello.** When the collector has a secret, its first frame on every connection is a ``Challenge`` with a fresh
32-byte random nonce ``N`` and the secret's key id (:func:`key_id`: a client holding credentials of another
secret stops there and says so, rather than sending a Hello that fails). The client's ``Hello`` for devices
``d_1 < d_2 < ... < d_n`` (n >= 1) carries
``mac = probe || sample || full`` (16 + 16 + 32 = 64 bytes), where, with
``M = "ldpsim/hello/v1" || N || uint32_be(round) || protocol || 0x00 || SHA256(uint64_be(d_1..d_n))``,

    probe  = HMAC-SHA256(k_{d_j}, "ldpsim/probe/v1" || M)[:16],
             j = uint64_be(SHA256("ldpsim/probe/v1" || M)[:8]) mod n
    sample = HMAC-SHA256(k_{d_s1} || ... || k_{d_s64}, "ldpsim/sample/v1" || M)[:16],
             s_i = (the i-th big-endian uint64 of SHAKE256("ldpsim/sample/v1" || M, 512 bytes)) mod n
    full   = HMAC-SHA256(k_{d_1} || k_{d_2} || ... || k_{d_n}, M)

``full`` is keyed with the concatenation of the connection's device credentials (HMAC hashes a key longer than
its 64-byte block: the key is then SHA256 of the concatenation), ``sample`` with those of 64 positions drawn
from the message (with repetition). The collector recomputes the three from ``S`` and compares in constant time
(:func:`hmac.compare_digest`), in that order, stopping at the first that differs.

- *Binds the ids:* the key holds every named device's credential, in order, and the message holds their digest;
  a Hello for other or more devices needs their credentials. Knowing some devices' credentials gives nothing
  for a set that includes one device whose credential is unknown (its 256 unknown bits are in the key).
- *No replay:* ``N`` is fresh per connection (``os.urandom``), so a Hello captured on one connection does not
  verify on another; a connection takes one Hello only.
- *Cost:* the collector computes one HMAC per named device (about 1.5 us: 1.5 s for a million devices, once
  per connection's Hello, in constant memory) and the client the same once at start. The collector checks
  the range of the ids with the probe (an out-of-range Hello costs one derivation and is told what a forged one
  is told, in the same time), and refuses a first frame longer than a Hello of its whole population (rounded
  up to a power of two); it verifies one Hello at a time, off its event loop, taking the hosts in turn, and
  checks the run's protocol and scenario and whether another connection holds the devices after the probe and
  the sample but before the full MAC, so that a peer holding valid credentials cannot make it pay the full MAC
  again and again for devices it could not register (collector/server.py).
- *A forged Hello costs little:* without credentials it is refused after one derivation (the probe), however
  many ids it names. A peer holding the credentials of a share f of the ids it names passes the probe with
  probability f and the sample with f^64 (about 5e-20 at f = 1/2). Trying id sets offline against the
  connection's nonce takes about f^-64 tries to find one that passes: out of reach at f = 1/2, but about a
  thousand at f = 0.9 and a million at f = 0.8 (an attacker pass found one with 10% foreign ids in 756 tries).
  So a forged Hello costs the collector 65 derivations, never the n of the full MAC, unless the peer holds
  most of the credentials it names (f = 0.99 passes 1 Hello in 2 without trying: then the n devices are
  nearly all its own).

**Credentials files.** A process hosting a shard of the devices needs their ``k_d`` only, never ``S``: the
operator writes each shard's credentials to a file (``ldpsim credentials``) and the shard reads that
(``ldpsim devices --credentials``), so that a compromised shard can speak for its own devices and no other.
The file is, in order (:func:`pack_credentials`):

    magic "ldpsim/creds/v1\n" (16 bytes) || uint64_be(first id) || uint64_be(count) || key id (8 bytes)
    || k_first || ... || k_(first + count - 1) (32 bytes each) || SHA256(all the bytes before)

The key id, ``HMAC-SHA256(S, "ldpsim/key-id/v1")[:8]``, names the secret without revealing it: ``serve`` and
``devices`` print it, so that credentials of another deployment are told apart from a forged Hello at a glance.
The trailing digest catches a truncated or damaged file (it is not a signature: the collector's MAC check is
what refuses credentials that are not the devices' own).

Without TLS the rest of the connection is not integrity-protected: an on-path attacker could inject frames
into an authenticated connection. Use ``--tls-cert``/``--tls-key`` (server) and ``--tls-ca`` (client) where the
path between devices and collector is not trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

# a Hello's probe || sample || full MAC (16 + 16 + 32 bytes); a key id's bytes (a Challenge carries one)
from protocols.wire import KEY_ID_BYTES, MAC_BYTES

DEVICE_CONTEXT = b"ldpsim/device/v1"  # 16 bytes
HELLO_CONTEXT = b"ldpsim/hello/v1"
PROBE_CONTEXT = b"ldpsim/probe/v1"
SAMPLE_CONTEXT = b"ldpsim/sample/v1"
SAMPLE = 64  # credentials that key the sample MAC
CHECK_BYTES = 16  # the probe's and the sample's MACs, truncated
MIN_SECRET_BYTES = 16
KEY_BYTES = 32


CREDENTIALS_MAGIC = b"ldpsim/creds/v1\n"
KEY_ID_CONTEXT = b"ldpsim/key-id/v1"
#: a credentials file's bytes beside its keys: magic, first id, count, key id, and the trailing SHA256
CREDENTIALS_OVERHEAD = len(CREDENTIALS_MAGIC) + 8 + 8 + KEY_ID_BYTES + 32


class SecretError(ValueError):
    """An unusable secret file (missing, unreadable, too short)."""


class CredentialsError(ValueError):
    """An unusable credentials file (not one, truncated, damaged)."""


#: the largest secret file read (a secret is 16 bytes and up; /dev/zero would be read for ever)
MAX_SECRET_FILE = 4096


@contextmanager
def _regular_file(path: str | Path, what: str, error: type[ValueError]) -> Iterator[tuple[BinaryIO, int]]:
    """``path`` open for reading, with its size, if it is a regular file; else ``error`` naming the ``what`` file.
    Opened without blocking, so that a FIFO, device or directory is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{path}: the {what} file must be a regular file")
            yield f, st.st_size
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} file: {exc.strerror or exc}") from None


def read_secret(path: str | Path) -> bytes:
    """The deployment secret in ``path``, a regular file of at most MAX_SECRET_FILE bytes: its bytes,
    surrounding whitespace stripped (>= 16 bytes). A FIFO, device or directory is refused without blocking."""
    with _regular_file(path, "secret", SecretError) as (f, _):
        secret = f.read(MAX_SECRET_FILE + 1)
    if len(secret) > MAX_SECRET_FILE:
        raise SecretError(f"{path}: the secret file is larger than {MAX_SECRET_FILE:,} bytes")
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(f"{path}: the secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def device_keys(secret: bytes, ids: np.ndarray) -> bytes:
    """``k_d`` for every id in ``ids``, concatenated (32 bytes each): HMAC-SHA256 with the standard construction,
    its inner and outer pads hashed once for all ids."""
    key = secret if len(secret) <= 64 else hashlib.sha256(secret).digest()
    key = key.ljust(64, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
    records = np.empty(len(ids), dtype=[("context", "S16"), ("id", ">u8")])
    records["context"] = DEVICE_CONTEXT
    records["id"] = np.asarray(ids, dtype=np.uint64)
    raw = records.tobytes()
    icopy, ocopy = inner.copy, outer.copy
    out = []
    for at in range(0, len(raw), 24):
        i = icopy()
        i.update(raw[at:at + 24])
        o = ocopy()
        o.update(i.digest())
        out.append(o.digest())
    return b"".join(out)


def device_key(secret: bytes, device: int) -> bytes:
    """``k_d`` of one device (the reference definition: plain :func:`hmac.digest`)."""
    return hmac.digest(secret, DEVICE_CONTEXT + struct.pack(">Q", device), "sha256")


def hello_message(nonce: bytes, round_: int, protocol: str, ids: np.ndarray) -> bytes:
    ids_digest = hashlib.sha256(np.asarray(ids, dtype=">u8").tobytes()).digest()
    return HELLO_CONTEXT + bytes(nonce) + struct.pack(">I", round_) + protocol.encode("utf-8") + b"\0" + ids_digest


def probe_index(message: bytes, n: int) -> int:
    """``j``: the position among the Hello's ``n`` ids of the device whose credential keys the probe, a hash of
    the whole Hello message (nonce and ids digest included), so that a peer cannot choose it."""
    return int.from_bytes(hashlib.sha256(PROBE_CONTEXT + message).digest()[:8], "big") % n


def sample_indices(message: bytes, n: int) -> np.ndarray:
    """The :data:`SAMPLE` positions (with repetition) among the Hello's ``n`` ids whose credentials key the
    sample MAC, drawn from the whole Hello message."""
    return np.frombuffer(hashlib.shake_256(SAMPLE_CONTEXT + message).digest(8 * SAMPLE), dtype=">u8") % np.uint64(n)


def hello_mac(keys: bytes, nonce: bytes, round_: int, protocol: str, ids: np.ndarray) -> bytes:
    """The Hello's MAC, probe || sample || full (:data:`MAC_BYTES`), from the named devices' concatenated
    credentials ``keys`` (see the module docstring)."""
    if not keys:
        raise ValueError("a Hello names at least one device")
    message = hello_message(nonce, round_, protocol, ids)

    def keys_of(positions: np.ndarray) -> bytes:
        return b"".join(keys[int(j) * KEY_BYTES:(int(j) + 1) * KEY_BYTES] for j in positions)

    n = len(keys) // KEY_BYTES
    probe = hmac.digest(keys_of(np.array([probe_index(message, n)])), PROBE_CONTEXT + message, "sha256")
    sample = hmac.digest(keys_of(sample_indices(message, n)), SAMPLE_CONTEXT + message, "sha256")
    return probe[:CHECK_BYTES] + sample[:CHECK_BYTES] + hmac.digest(keys, message, "sha256")


#: ids whose credentials :func:`verify_hello` derives at a time (2 MB of keys)
VERIFY_CHUNK = 1 << 16


def verify_hello(secret: bytes, nonce: bytes, round_: int, protocol: str, ids: np.ndarray,
                 mac: bytes | None) -> bool:
    """Whether ``mac`` is the Hello MAC for these devices under ``secret`` and this connection's ``nonce``:
    :func:`check_sample` (65 derivations), then :func:`check_full` (one per id)."""
    return (check_sample(secret, nonce, round_, protocol, ids, mac)
            and check_full(secret, nonce, round_, protocol, ids, mac))


def _checkable(nonce: bytes, round_: int, protocol: str, ids: np.ndarray,
               mac: bytes | None) -> tuple[bytes, bytes] | None:
    """The Hello message and the MAC to check against it, or None for a MAC that cannot be valid (missing, of
    another length, or for no device)."""
    if mac is None or len(ids) == 0 or len(mac) != MAC_BYTES:
        return None
    return hello_message(nonce, round_, protocol, ids), mac


def check_sample(secret: bytes, nonce: bytes, round_: int, protocol: str, ids: np.ndarray,
                 mac: bytes | None) -> bool:
    """The cheap part of :func:`verify_hello`: the probe, with one credential (a Hello forged without
    credentials is refused after one derivation however many ids it names), then the sample, with 64 (one
    forged by a peer holding some of the credentials is refused there). A Hello that passes comes from a peer
    holding nearly all the credentials it names; the collector may then tell it things about the run (that
    another connection holds its devices) before it pays for :func:`check_full`."""
    ids = np.asarray(ids)
    checkable = _checkable(nonce, round_, protocol, ids, mac)
    if checkable is None:
        return False
    message, mac = checkable
    j = probe_index(message, ids.size)
    probe = hmac.digest(device_keys(secret, ids[j:j + 1]), PROBE_CONTEXT + message, "sha256")[:CHECK_BYTES]
    if not hmac.compare_digest(probe, mac[:CHECK_BYTES]):
        return False
    sample = hmac.digest(device_keys(secret, ids[sample_indices(message, ids.size)]), SAMPLE_CONTEXT + message,
                         "sha256")[:CHECK_BYTES]
    return hmac.compare_digest(sample, mac[CHECK_BYTES:2 * CHECK_BYTES])


def check_full(secret: bytes, nonce: bytes, round_: int, protocol: str, ids: np.ndarray,
               mac: bytes | None) -> bool:
    """The full MAC of :func:`verify_hello` alone (one derivation per id), in constant memory: HMAC replaces a
    key longer than its 64-byte block by the key's SHA256, so the concatenated credentials are hashed as they
    are derived, :data:`VERIFY_CHUNK` ids at a time (a Hello of millions of ids held gigabytes of keys)."""
    ids = np.asarray(ids)
    checkable = _checkable(nonce, round_, protocol, ids, mac)
    if checkable is None:
        return False
    message, mac = checkable
    if ids.size * KEY_BYTES <= 64:  # a short key is used as it is
        keys = device_keys(secret, ids)
    else:
        digest = hashlib.sha256()
        for at in range(0, ids.size, VERIFY_CHUNK):
            digest.update(device_keys(secret, ids[at:at + VERIFY_CHUNK]))
        keys = digest.digest()
    return hmac.compare_digest(hmac.digest(keys, message, "sha256"), mac[2 * CHECK_BYTES:])


def key_id(secret: bytes) -> str:
    """The secret's key id in hex (16 digits): ``HMAC-SHA256(S, "ldpsim/key-id/v1")[:8]``, which names the
    deployment secret in logs and credentials files without revealing it."""
    return hmac.digest(secret, KEY_ID_CONTEXT, "sha256")[:KEY_ID_BYTES].hex()


@dataclass(frozen=True)
class Credentials:
    """The credentials of the devices ``first .. first + count - 1`` (``keys``: their ``k_d`` concatenated),
    derived from the secret whose :func:`key_id` is ``key_id``."""

    first: int
    count: int
    key_id: str
    keys: bytes

    def ids(self) -> np.ndarray:
        return np.arange(self.first, self.first + self.count, dtype=np.int64)

    def keys_of(self, ids: np.ndarray) -> bytes:
        """The concatenated credentials of ``ids`` (each one of these devices)."""
        at = np.asarray(ids, dtype=np.int64) - self.first
        if at.size and (at.min() < 0 or at.max() >= self.count):
            raise CredentialsError(f"holds devices {self.first:,}-{self.first + self.count - 1:,} only")
        if at.size and np.array_equal(at, np.arange(at[0], at[0] + at.size)):  # a run of ids: one slice
            return self.keys[int(at[0]) * KEY_BYTES:(int(at[0]) + at.size) * KEY_BYTES]
        table = np.frombuffer(self.keys, dtype=np.uint8).reshape(-1, KEY_BYTES)
        return table[at].tobytes()


def pack_credentials(secret: bytes, first: int, count: int) -> bytes:
    """A credentials file's bytes for the devices ``first .. first + count - 1`` (format: module docstring)."""
    if first < 0 or count < 1 or first + count > 2**63:
        raise ValueError(f"devices {first}..{first + count - 1}: expected count >= 1 ids in [0, 2^63)")
    head = (CREDENTIALS_MAGIC + struct.pack(">QQ", first, count)
            + bytes.fromhex(key_id(secret)))
    body = head + device_keys(secret, np.arange(first, first + count, dtype=np.uint64))
    return body + hashlib.sha256(body).digest()


def unpack_credentials(raw: bytes) -> Credentials:
    """The credentials in a file's bytes; :class:`CredentialsError` names what is wrong."""
    magic = len(CREDENTIALS_MAGIC)
    if raw[:magic] != CREDENTIALS_MAGIC:
        raise CredentialsError("not an ldpsim credentials file (write one with `ldpsim credentials`)")
    if len(raw) < CREDENTIALS_OVERHEAD + KEY_BYTES:
        raise CredentialsError(f"truncated: {len(raw):,} bytes")
    first, count = struct.unpack(">QQ", raw[magic:magic + 16])
    if count < 1 or first + count > 2**63:
        raise CredentialsError(f"damaged: devices {first:,} + {count:,}")
    _check_size(len(raw), count)
    if not hmac.compare_digest(hashlib.sha256(raw[:-32]).digest(), raw[-32:]):
        raise CredentialsError("damaged: its SHA-256 does not match its contents")
    at = magic + 16
    return Credentials(int(first), int(count), raw[at:at + KEY_ID_BYTES].hex(), bytes(raw[at + KEY_ID_BYTES:-32]))


def _check_size(size: int, count: int) -> None:
    """A credentials file of ``size`` bytes must hold the ``count`` keys its header names."""
    expected = CREDENTIALS_OVERHEAD + count * KEY_BYTES
    if size != expected:
        raise CredentialsError(f"truncated or damaged: {size:,} bytes, expected {expected:,} for {count:,} devices")


def read_credentials(path: str | Path) -> Credentials:
    """The credentials file at ``path`` (a regular file; see :func:`unpack_credentials`)."""
    head = len(CREDENTIALS_MAGIC) + 16
    with _regular_file(path, "credentials", CredentialsError) as (f, size):
        raw = f.read(head)  # the header first: a file of the wrong size is refused before it is read
        if len(raw) == head and raw.startswith(CREDENTIALS_MAGIC):
            try:
                _check_size(size, struct.unpack(">Q", raw[head - 8:])[0])
            except CredentialsError as exc:
                raise CredentialsError(f"{path}: {exc}") from None
            raw += f.read()
    try:
        return unpack_credentials(raw)
    except CredentialsError as exc:
        raise CredentialsError(f"{path}: {exc}") from None
