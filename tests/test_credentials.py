"""Per-shard credentials files (protocols/auth.py, `ldpsim credentials`, `ldpsim devices --credentials`): a device
process gets its own devices' credentials and never the deployment secret, so that it can speak for those devices
and no other. The expected keys come from the reference definition (auth.device_key: plain hmac.digest), not from
the code that writes the files."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.client import CollectorRefused
from protocols import auth
from protocols.ledger import Ledger
from scenarios import live
from tests.test_live_hardening import FAST, HOST, SECRET, Harness, scenario, simulated

CLI = [sys.executable, "-m", "scenarios.cli"]
SMALL = ["--set", "population.devices=300", "--set", "rounds=3", "--set", "network.loss=0"]


def reference_keys(secret: bytes, ids) -> bytes:
    return b"".join(auth.device_key(secret, int(d)) for d in ids)


def forged(raw: bytes, first: int) -> bytes:
    """A credentials file edited to claim other devices, its digest recomputed (what an attacker can do)."""
    magic = len(auth.CREDENTIALS_MAGIC)
    body = raw[:magic] + struct.pack(">Q", first) + raw[magic + 8:-32]
    return body + hashlib.sha256(body).digest()


# ----------------------------------------------------------------------------------------------- the file format
def test_a_credentials_file_holds_exactly_its_devices_keys() -> None:
    raw = auth.pack_credentials(SECRET, 1000, 37)
    creds = auth.unpack_credentials(raw)
    assert (creds.first, creds.count) == (1000, 37)
    assert creds.keys == reference_keys(SECRET, range(1000, 1037))
    assert len(raw) == auth.CREDENTIALS_OVERHEAD + 37 * auth.KEY_BYTES
    assert SECRET not in raw
    assert creds.key_id == auth.key_id(SECRET) != auth.key_id(SECRET + b"!")
    assert len(creds.key_id) == 16
    # a run of ids is a slice, scattered ids a gather: both the devices' own keys
    assert creds.keys_of(np.arange(1010, 1020)) == reference_keys(SECRET, range(1010, 1020))
    assert creds.keys_of(np.array([1036, 1000, 1017])) == reference_keys(SECRET, [1036, 1000, 1017])
    for outside in ([999], [1037], [1000, 1037]):
        with pytest.raises(auth.CredentialsError, match="holds devices 1,000-1,036 only"):
            creds.keys_of(np.array(outside))


@pytest.mark.parametrize("damage, message", [
    (lambda raw: b"ldpsim/secret/v1" + raw[16:], "not an ldpsim credentials file"),
    (lambda raw: raw[:-1], "truncated or damaged"),
    (lambda raw: raw + b"\0", "truncated or damaged"),
    (lambda raw: raw[:60] + bytes([raw[60] ^ 1]) + raw[61:], "SHA-256 does not match"),
    (lambda raw: raw[:20], "truncated"),
    (lambda raw: raw[:24] + struct.pack(">Q", 0) + raw[32:], "damaged: devices"),
])
def test_a_damaged_credentials_file_is_refused_with_what_is_wrong(damage, message) -> None:
    with pytest.raises(auth.CredentialsError, match=message):
        auth.unpack_credentials(damage(auth.pack_credentials(SECRET, 5, 3)))


# ----------------------------------------------------------------------------------------------- live, in-process
@pytest.mark.asyncio
async def test_shards_with_their_own_credentials_run_and_a_forged_file_speaks_for_no_other_device() -> None:
    """Two shards authenticated by their credentials alone (no secret on the device side; the second over two
    connections) give the simulated run's digests; a third client holding shard 2's keys in a file edited to
    claim shard 1's devices (its digest recomputed) is refused at the MAC check, with the reason, and costs the
    run nothing."""
    settings = dataclasses.replace(FAST, secret=SECRET)
    h = Harness(scenario(), settings)
    await h.listen()
    n, days = h.sc.devices, live.process_days(h.sc)
    files = [auth.pack_credentials(SECRET, int(live.shard(n, i, 2)[0]), live.shard_size(n, i, 2)) for i in range(2)]
    # shard 1 on one connection, shard 2 on two (the second signs with keys from the middle of its file)
    parts = [(0, live.shard(n, 0, 2))] + [(1, half) for half in np.array_split(live.shard(n, 1, 2), 2)]
    h.clients = [live.build_client(h.sc, ids, h.ledger, HOST, h.port, days,
                                   credentials=auth.unpack_credentials(files[i])) for i, ids in parts]
    h.tasks = [asyncio.create_task(c.run()) for c in h.clients]
    h.start_run()
    await h.registered()
    stolen = auth.unpack_credentials(forged(files[1], 0))  # shard 2's keys, claiming devices 0..n/2 - 1
    stranger = live.build_client(h.sc, live.shard(n, 0, 2), Ledger(n), HOST, h.port, credentials=stolen)
    with pytest.raises(CollectorRefused, match="without a valid mac"):
        await asyncio.wait_for(stranger.run(), 10)
    got = await h.finish()
    assert got["digests"] == simulated() and h.server.drops == {"auth": 1}
    assert got["live"]["authenticated"] is True and got["live"]["connections"] == 3 + 1  # and the stranger


# ----------------------------------------------------------------------------------------------- the commands
def cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})


def test_ldpsim_credentials_writes_one_private_file_per_shard(tmp_path) -> None:
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    done = cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "3", "--out", "creds", *SMALL,
               cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert auth.key_id(SECRET) in done.stdout and "--credentials creds/credentials-shard-I-of-3.bin" in done.stdout
    held = []
    for i in (1, 2, 3):
        path = tmp_path / "creds" / f"credentials-shard-{i}-of-3.bin"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creds = auth.read_credentials(path)
        assert creds.keys == reference_keys(SECRET, creds.ids())
        held.extend(creds.ids().tolist())
    assert held == list(range(300))  # every device once, in the shards `ldpsim devices --shard I/3` hosts
    assert sorted(p.name for p in (tmp_path / "creds").iterdir()) == [f"credentials-shard-{i}-of-3.bin"
                                                                      for i in (1, 2, 3)]  # no temporary left
    again = cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "3", "--out", "creds", *SMALL,
                cwd=tmp_path)
    assert again.returncode == 2 and "already holds credentials-shard-1-of-3.bin and 2 more" in again.stderr
    for bad, said in ((["--shards", "0"], "--shards 0: expected 1 to 300"),
                      (["--shards", "two"], "--shards 'two': expected an integer")):
        out = cli("credentials", "quickstart", "--secret-file", "secret", "--out", "c2", *bad, *SMALL, cwd=tmp_path)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_ldpsim_devices_refuses_another_shard_s_file_and_a_damaged_one_before_connecting(tmp_path) -> None:
    (tmp_path / "secret").write_bytes(SECRET)
    assert cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "2", "--out", ".", *SMALL,
               cwd=tmp_path).returncode == 0
    base = ["devices", "quickstart", "--connect", f"{HOST}:1", *SMALL]  # nothing listens there: errors come first
    wrong = cli(*base, "--shard", "1/2", "--credentials", "credentials-shard-2-of-2.bin", cwd=tmp_path)
    assert wrong.returncode == 2
    assert ("--credentials credentials-shard-2-of-2.bin: holds devices 150-299, not shard 1/2's 0-149"
            in wrong.stderr), wrong.stderr
    both = cli(*base, "--credentials", "credentials-shard-2-of-2.bin", "--secret-file", "secret", cwd=tmp_path)
    assert both.returncode == 2 and "--credentials and --secret-file: give one" in both.stderr
    raw = (tmp_path / "credentials-shard-1-of-2.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(raw[:-5])
    cut = cli(*base, "--shard", "1/2", "--credentials", "cut.bin", cwd=tmp_path)
    assert cut.returncode == 2 and "--credentials cut.bin: truncated or damaged" in cut.stderr
    assert len(cut.stderr.strip().splitlines()) == 1


def test_serve_with_a_secret_and_shards_with_their_credentials_files(tmp_path) -> None:
    """The deployment as the README describes it: the operator writes the files, `serve` has the secret, each
    `devices` process only its file; every report is accepted, and a device process given the secret is warned."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    (tmp_path / "secret").write_bytes(SECRET)
    assert cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "2", "--out", "c", *SMALL,
               cwd=tmp_path).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen(CLI + ["serve", "quickstart", "--port", str(port), "--out", "srv", "--quiet",
                                     "--secret-file", "secret", *SMALL],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    shards = [subprocess.Popen(CLI + ["devices", "quickstart", "--connect", f"{HOST}:{port}", "--shard", f"{i}/2",
                                      "--credentials", f"c/credentials-shard-{i}-of-2.bin", *SMALL],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for i in (1, 2)]
    try:
        for p in shards:
            _, err = p.communicate(timeout=90)
            assert p.returncode == 0, err.decode()[-2000:]
            assert f"credentials of key id {auth.key_id(SECRET)}" in err.decode()
            assert "warning: --secret-file" not in err.decode()
        _, err = server.communicate(timeout=60)
        assert server.returncode == 0, err.decode()[-2000:]
        assert f"authenticated under key id {auth.key_id(SECRET)}" in err.decode()
    finally:
        for p in (server, *shards):
            p.kill()
    summary = json.loads((tmp_path / "srv" / "summary.json").read_text())
    assert summary["live"]["authenticated"] is True and summary["reports"]["accepted"] == 300 * 3
    assert summary["live"]["dropped"] == {} and summary["live"]["connections"] == 2


def test_credentials_are_never_written_through_a_planted_link_and_a_failed_set_leaves_no_file(tmp_path) -> None:
    """With --force, a link planted at a file's name is replaced by a new 0600 file, not written through (the
    files are created new under random names, then renamed); a set that cannot be finished (one name is a
    directory) fails with one line and leaves no temporary file."""
    (tmp_path / "secret").write_bytes(SECRET)
    out = tmp_path / "c"
    out.mkdir()
    (tmp_path / "stolen").write_bytes(b"")
    os.chmod(tmp_path / "stolen", 0o644)
    (out / "credentials-shard-1-of-2.bin").symlink_to(tmp_path / "stolen")
    done = cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "2", "--out", "c", "--force",
               *SMALL, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "stolen").read_bytes() == b""
    target = out / "credentials-shard-1-of-2.bin"
    assert not target.is_symlink() and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert auth.read_credentials(target).count == 150
    (out / "credentials-shard-2-of-3.bin").mkdir()
    failed = cli("credentials", "quickstart", "--secret-file", "secret", "--shards", "3", "--out", "c", "--force",
                 *SMALL, cwd=tmp_path)
    assert failed.returncode == 2 and "--out c: cannot write the credentials files" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_a_file_whose_size_disagrees_with_its_header_is_refused_with_both_sizes(tmp_path) -> None:
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.write(auth.CREDENTIALS_MAGIC + struct.pack(">QQ", 0, 1000))
        f.truncate(1 << 30)  # sparse: 1 GiB announced by its size, 1,000 devices by its header
    with pytest.raises(auth.CredentialsError, match="1,073,741,824 bytes, expected 32,072 for 1,000 devices"):
        auth.read_credentials(path)


@pytest.mark.asyncio
async def test_a_client_with_credentials_stops_and_says_why_when_the_collector_sends_no_challenge(monkeypatch):
    """A collector started without a secret sends no Challenge: a client holding credentials used to wait,
    reconnect and end a minute later blaming the network; it now stops with the reason."""
    from agents import client as client_module

    monkeypatch.setattr(client_module, "NO_CHALLENGE_AFTER", 0.3)
    h = Harness(scenario(), dataclasses.replace(FAST, hello_timeout=30.0))
    await h.listen()
    n = h.sc.devices
    creds = auth.unpack_credentials(auth.pack_credentials(SECRET, 0, n))
    c = live.build_client(h.sc, live.shard(n, 0, 1), Ledger(n), HOST, h.port, credentials=creds)
    c.challenge_timeout = 0.5
    try:
        with pytest.raises(CollectorRefused, match=r"sent no challenge in \d+ s: it does not authenticate devices"):
            await asyncio.wait_for(c.run(), 10)
    finally:
        await h.server.close()
    assert c.connections == 1
