"""Benchmark: the live collector's registration under a flood (issue 13's live hardening).

Two shards of ``--devices`` each over 127.0.0.1, with a deployment secret. Two floods (``--kind``):

- ``valid-hellos`` (default): shard 0 registers; then ``--attackers`` connections holding shard 0's credentials
  send, one after another, Hellos for shard 0's devices with valid MACs (each refused as ``ids_held``), and
  shard 1 connects. Before the holder check moved ahead of the full MAC (and hosts took turns at the MAC
  check), each flooding Hello cost one key derivation per device of shard 0;
- ``partial-frames``: a second process, without credentials, keeps ``--attackers`` connections from ``--hosts``
  other loopback addresses (127.0.1.2 and up; default 8) each holding an incomplete 64 KiB frame (reconnecting
  when dropped, each held until just before the read timeout), so that the collector's pool of bytes for
  unregistered connections (256 MiB) stays full; then both shards connect. Before the pool dropped a
  connection of the host holding the most (collector/shares.py), the honest Hellos were the ones dropped;
- ``idle-churn``: the second process's ``--attackers`` connections from ``--hosts`` addresses (default 20) say
  nothing and reconnect as soon as they are closed, filling the connection limit (devices + 64: use a small
  ``--devices``); then the shards (``--shards``, default 2) connect. Before a crowded host gave way to a host
  with fewer connections at once, a newcomer could take only the place of a connection open a second;
- ``foreign-hellos``: the second process holds shard 0's credentials and, from ``--hosts`` addresses (default
  100), one connection each, sends Hellos naming shard 0's devices and 1% of shard 1's, whose credentials it
  lacks (the sample passes about half the time, the full MAC never), a different 1% each Hello, while shard 0
  stays away; once 3 Hellos a host have been refused, shard 1 connects, and the time is until it is
  registered. The failed Hellos' 1% slices mark most of shard 1, which is then checked among the peer's Hellos
  (the peer demotes a shard it does not hold: README, live hardening). Before networks took turns at the
  check, shard 1 waited behind one full MAC per address (3.2 s); now one per network.

The floods come from 127.0.1.2 and up, another /24 than the honest shards' 127.0.0.1; ``--same-network``
floods from 127.0.0.2 and up, the honest shards' own /24 (a peer in the shards' network: one turn between
them all, as before).

Reported: the time from the (last) shard's connect to the whole population being registered, with and without
the flood, measured in the same run (their ratio is the flood's cost), and the flood's size meanwhile.

    python benchmarks/bench_hello_flood.py                     # 2 x 50,000 devices, 8 attackers
    python benchmarks/bench_hello_flood.py --devices 200000 --attackers 32 --no-record
    python benchmarks/bench_hello_flood.py --kind partial-frames --attackers 4200
    python benchmarks/bench_hello_flood.py --kind idle-churn --devices 50 --attackers 1000

Results are appended to benchmarks/results.jsonl (one line) and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import secrets
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)

HOST = "127.0.0.1"
PROTOCOL = "1bitrrpm"


FRAME = 1 << 16  # the partial-frames flood: each connection's incomplete frame (its header says this many bytes)
DEFAULT_HOSTS = {"partial-frames": 8, "idle-churn": 20, "foreign-hellos": 100}  # the floods' addresses, from
# 127.0.1.2 on (--same-network: 127.0.0.2)


async def flood(kind: str, port: int, connections: int, hosts: int, seconds: float, secret: bytes = b"",
                devices: int = 0, network: str = "127.0.1") -> None:
    """A flood (run in a process of its own): ``connections`` peers on ``hosts`` loopback addresses, each
    reconnecting as soon as it is closed; with ``partial-frames`` each holds a frame one byte short of complete
    until just before the read timeout (2 s here), with ``idle-churn`` it says nothing, with ``foreign-hellos``
    it sends a Hello for shard 0 (``devices`` of them: their credentials from ``secret``) and 1% of shard 1
    (the next 1% each time)."""
    import numpy as np

    from protocols import auth, wire
    from protocols.framing import frame
    from protocols.messages import Hello

    body = b"\0" * (FRAME - 1)
    end = time.monotonic() + seconds
    own = np.arange(devices, dtype=np.uint64)
    slice_ = max(1, devices // 100)  # 1% of shard 1: a different one each Hello, round the shard
    keys = auth.device_keys(secret, own) + os.urandom(auth.KEY_BYTES * slice_) if secret else b""
    sent = [0]

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.001)
        while time.monotonic() < end:
            try:
                reader, writer = await asyncio.open_connection(HOST, port, local_addr=(f"{network}.{2 + i % hosts}", 0))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            try:
                if kind == "foreign-hellos":
                    length = int.from_bytes(await reader.readexactly(4), "big")
                    challenge = wire.decode(await reader.readexactly(length))
                    k, sent[0] = sent[0] % 100, sent[0] + 1
                    ids = np.concatenate([own, np.arange(devices + k * slice_, devices + (k + 1) * slice_,
                                                         dtype=np.uint64)])
                    mac = auth.hello_mac(keys, challenge.nonce, challenge.round, PROTOCOL, ids)
                    writer.write(frame(wire.encode(Hello(round=challenge.round, protocol=PROTOCOL, devices=ids,
                                                         mac=mac))))
                    while await reader.read(1 << 16):  # until the collector closes it
                        pass
                elif kind == "partial-frames":
                    await reader.readexactly(int.from_bytes(await reader.readexactly(4), "big"))  # the Challenge
                    writer.write(struct.pack(">I", FRAME) + body)
                    await writer.drain()
                    await asyncio.wait_for(reader.read(1), 1.8)
                else:
                    while await reader.read(1 << 16):  # until the collector closes it
                        pass
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                pass
            finally:
                writer.transport.abort()

    await asyncio.gather(*(one(i) for i in range(connections)))


async def register_shard_1(devices: int, attackers: int, secret: bytes, kind: str = "valid-hellos",
                           hosts: int = 0, shards: int = 2, network: str = "127.0.1") -> dict:
    """Seconds from shard 1's connect until the population is registered, with ``attackers`` flooding."""
    from collector.server import LiveSettings
    from protocols import auth, wire
    from protocols.framing import frame
    from protocols.ledger import Ledger
    from protocols.messages import Hello
    from scenarios import live
    from tests.support import protocol_scenario

    n = shards * devices
    sc = protocol_scenario(PROTOCOL, **{"population.devices": n, "rounds": 3, "simulation.cohort_size": devices,
                                         "network.loss": 0, "network.jitter": 0})
    settings = LiveSettings(stage_timeout=5.0, read_timeout=2.0, startup_timeout=120.0, hello_timeout=60.0,
                            write_timeout=2.0, secret=secret)
    server, _, _ = live.build_server(sc, Ledger(n), None, settings)
    port = await server.start(HOST, 0)
    shard0, shard1 = live.shard(n, 0, 2), live.shard(n, 1, 2)
    if kind != "valid-hellos":
        return await _under_flood(kind, server, sc, port, attackers, hosts or DEFAULT_HOSTS[kind], shards, secret,
                                  network)
    keys = auth.device_keys(secret, shard0)
    tasks = [asyncio.create_task(live.build_client(sc, shard0, Ledger(n), HOST, port, None, secret).run())]
    while server._held < shard0.size:
        await asyncio.sleep(0.01)
    stop, sent = asyncio.Event(), [0]

    async def attacker() -> None:
        while not stop.is_set():
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                length = int.from_bytes(await reader.readexactly(4), "big")
                challenge = wire.decode(await reader.readexactly(length))
                mac = auth.hello_mac(keys, challenge.nonce, challenge.round, PROTOCOL, shard0)
                writer.write(frame(wire.encode(Hello(round=challenge.round, protocol=PROTOCOL,
                                                     devices=shard0.astype("uint32"), mac=mac))))
                sent[0] += 1
                while await reader.read(1 << 16):  # until the collector closes it
                    pass
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

    tasks += [asyncio.create_task(attacker()) for _ in range(attackers)]
    await asyncio.sleep(0.5)  # the flood under way
    start = time.perf_counter()
    tasks.append(asyncio.create_task(live.build_client(sc, shard1, Ledger(n), HOST, port, None, secret).run()))
    await asyncio.wait_for(server._registered.wait(), 120)
    took = time.perf_counter() - start
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.close()
    return {"seconds": round(took, 3), "flooding_hellos": sent[0], "drops": dict(server.drops)}


async def _under_flood(kind: str, server, sc, port: int, attackers: int, hosts: int, shards: int,
                       secret: bytes, network: str) -> dict:
    """register_shard_1's floods without credentials: every shard connects once the flood fills what it aims
    at (the unregistered connections' buffer pool, or the connection limit), or after 10 s."""
    from protocols.ledger import Ledger
    from scenarios import live

    flooding = None
    if attackers:
        flooding = subprocess.Popen(["nice", sys.executable, __file__, "--flood", kind, "--port", str(port),
                                     "--attackers", str(attackers), "--hosts", str(hosts), "--devices",
                                     str(sc.devices // shards), "--network", network],
                                    env={**os.environ, "FLOOD_SECRET": secret.hex()})
        pool = server.unregistered_pool
        for _ in range(1000):
            await asyncio.sleep(0.01)
            if (pool.total >= 0.9 * pool.budget if kind == "partial-frames"
                    else server.drops.get("auth", 0) >= 3 * hosts if kind == "foreign-hellos"
                    else len(server.connections) >= server.max_connections):
                break
    held = (server.unregistered_pool.total if kind == "partial-frames" else
            server.drops.get("auth", 0) if kind == "foreign-hellos" else len(server.connections))
    start = time.perf_counter()
    n = sc.devices
    joining = range(1, shards) if kind == "foreign-hellos" else range(shards)  # (shard 0's devices stay away)
    tasks = [asyncio.create_task(live.build_client(sc, live.shard(n, i, shards), Ledger(n), HOST, port, None,
                                                   secret).run()) for i in joining]
    try:
        if kind == "foreign-hellos":
            while server._held < n - n // shards:
                await asyncio.sleep(0.005)
        else:
            await asyncio.wait_for(server._registered.wait(), 120)
        took = time.perf_counter() - start
    finally:
        if flooding is not None:
            flooding.kill()
            flooding.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.close()
    return {"seconds": round(took, 3), "held_at_connect": held, "drops": dict(server.drops)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=50_000, help="devices per shard (default 50,000)")
    parser.add_argument("--attackers", type=int, default=8, help="flooding connections (default 8)")
    parser.add_argument("--kind", choices=("valid-hellos", "partial-frames", "idle-churn", "foreign-hellos"),
                        default="valid-hellos",
                        help="the flood (default valid-hellos; see the module docstring)")
    parser.add_argument("--hosts", type=int, default=0, help="the flood's addresses (default 8 for partial-frames, "
                                                              "20 for idle-churn, 100 for foreign-hellos)")
    parser.add_argument("--shards", type=int, default=2, help="honest shards (default 2)")
    parser.add_argument("--same-network", action="store_true",
                        help="flood from 127.0.0.2 and up, the honest shards' /24 (default: 127.0.1.2 and up, "
                             "another /24)")
    parser.add_argument("--network", default="127.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--flood", choices=("partial-frames", "idle-churn", "foreign-hellos"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to results.jsonl")
    args = parser.parse_args()
    if args.devices < 1 or args.attackers < 1 or args.shards < 2 or not 0 <= args.hosts <= 250:
        parser.error("--devices and --attackers must be at least 1, --shards at least 2, --hosts at most 250")
    if args.flood is not None:  # a flood's own process
        asyncio.run(flood(args.flood, args.port, args.attackers, args.hosts, 120.0,
                          bytes.fromhex(os.environ.get("FLOOD_SECRET", "")), args.devices, args.network))
        return
    import structlog

    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())  # the collector's log lines: not here
    secret = secrets.token_bytes(32)
    hosts = args.hosts or DEFAULT_HOSTS.get(args.kind, 0)
    if args.kind == "foreign-hellos":
        args.attackers = max(args.attackers, hosts)  # (one connection a host)
    network = "127.0.0" if args.same_network else "127.0.1"
    asyncio.run(register_shard_1(args.devices, 0, secret, args.kind, hosts, args.shards))  # warm-up: not kept
    quiet = asyncio.run(register_shard_1(args.devices, 0, secret, args.kind, hosts, args.shards))
    flooded = asyncio.run(register_shard_1(args.devices, args.attackers, secret, args.kind, hosts, args.shards,
                                           network))
    entry = {"benchmark": "hello_flood", "python": platform.python_version(), "kind": args.kind,
             "devices_per_shard": args.devices, "shards": args.shards, "attackers": args.attackers,
             "register_seconds_quiet": quiet["seconds"], "register_seconds_flood": flooded["seconds"],
             "flood_over_quiet": round(flooded["seconds"] / quiet["seconds"], 2), "flood_drops": flooded["drops"]}
    if args.kind == "valid-hellos":
        entry["flooding_hellos"] = flooded["flooding_hellos"]
    else:
        entry["flood_hosts"] = hosts
        entry["flood_network"] = f"{network}.0/24" + (" (the honest shards')" if args.same_network else "")
        entry[{"partial-frames": "pool_bytes_at_connect", "idle-churn": "connections_at_connect",
               "foreign-hellos": "failed_hellos_at_connect"}[args.kind]] = flooded["held_at_connect"]
    print(json.dumps(entry))
    if not args.no_record:
        append_result(entry)


if __name__ == "__main__":
    main()
