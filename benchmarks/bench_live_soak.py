"""Benchmark: the hardened live collector under attack (issue 10), and a long fuzz of the wire format.

1. **Fuzz** (in this process): ``--fuzz`` structure-aware inputs (tests/test_wire.py's generator: valid messages of
   every type with fields deleted, added, retyped and set to boundary values, broken array headers, nesting and
   object bombs, byte-level damage on top) through ``wire.decode``, and a fifth as many frame streams cut at
   random places through ``FrameDecoder``. Every input must decode (and re-encode) or raise WireError: the
   count of other exceptions is reported and must be 0.
2. **Soak** over 127.0.0.1, two phases in fresh collector processes with the same settings (deployment secret on,
   ``--send-buffer`` SO_SNDBUF, connection limit honest connections + 400): *baseline*, honest load alone, and
   *attack*, the same honest load while a third process attacks for the whole run:
   impersonators (Hellos for held ids with forged MACs), Hellos with out-of-range ids, garbage frames from the
   fuzz generator, deep-nesting and object bombs, oversized frame headers, trickled frames (a byte every 50 ms),
   never-reading sockets (a 1 KiB receive window: the broadcasts fill them, the write timeout drops them) and
   waves of idle connections beyond the limit. Honest device clients run in a child process (one loop, one
   shared World, as in bench_live.py), with the secret. Reported per phase: honest reports/s (broadcast to the
   last acknowledgement, per round), the collector's peak RSS and peak open file descriptors, its drops by
   cause, log lines, and the transcript digest (both phases must equal the simulated run's).

    python benchmarks/bench_live_soak.py                         # 200 connections x 1,000 devices, 150 rounds
    python benchmarks/bench_live_soak.py --connections 1000 --rounds 150 --no-record
    python benchmarks/bench_live_soak.py --fuzz 20000 --rounds 20 --no-record   # quick look

Results are appended to benchmarks/results.jsonl (one line) and printed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import resource
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from scenarios import schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)

HOST = "127.0.0.1"


def overrides(args: argparse.Namespace) -> list[str]:
    return [f"population.devices={args.connections * args.devices_per_connection}", f"rounds={args.rounds}",
            "network.loss=0", f"simulation.cohort_size={args.devices_per_connection}"]


def settings_for(args: argparse.Namespace, secret: bytes):
    from collector.server import LiveSettings

    return LiveSettings(stage_timeout=60.0, read_timeout=2.0, startup_timeout=120.0, hello_timeout=60.0,
                        write_timeout=2.0, max_connections=args.connections + 400, send_buffer=args.send_buffer,
                        secret=secret)


# ---------------------------------------------------------------------------------------------- 1. fuzz
def fuzz(n: int, seed: int) -> dict:
    import numpy as np

    from protocols import wire
    from tests.test_wire import check_decode, check_stream, fuzz_input, fuzz_stream

    rng = np.random.default_rng(seed)
    other: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    decoded = rejected = frames = 0
    t0 = time.perf_counter()
    for _ in range(n):
        raw = fuzz_input(rng)
        try:
            if check_decode(raw):
                decoded += 1
            else:
                rejected += 1
        except Exception as exc:  # the finding this benchmark looks for: must stay empty
            other[type(exc).__name__] += 1
            examples.setdefault(type(exc).__name__, raw[:200].hex())
    t_decode = time.perf_counter() - t0
    t1 = time.perf_counter()
    streams = n // 5
    for _ in range(streams):
        data, cuts = fuzz_stream(rng)
        try:
            frames += check_stream(data, cuts)
        except Exception as exc:
            other["stream:" + type(exc).__name__] += 1
            examples.setdefault("stream:" + type(exc).__name__, data[:200].hex())
    return {"inputs": n, "decoded": decoded, "wire_errors": rejected, "other_exceptions": dict(other),
            "examples": examples, "frame_streams": streams, "frames": frames,
            "decode_seconds": round(t_decode, 2), "inputs_per_second": round(n / t_decode),
            "stream_seconds": round(time.perf_counter() - t1, 2), "max_depth": wire.MAX_DEPTH,
            "max_objects": wire.MAX_OBJECTS}


# ---------------------------------------------------------------------------------------------- honest child
async def honest_main(args: argparse.Namespace) -> None:
    import numpy as np

    from agents.client import DeviceClient
    from agents.world import World
    from protocols.auth import read_secret
    from protocols.ledger import Ledger

    from bench_live import warm_up

    warm_up()
    sc = schema.load("quickstart", overrides(args))
    host, _, port = args.honest.rpartition(":")
    secret = read_secret(args.secret_file)
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ledger = Ledger(sc.devices)
    k = args.devices_per_connection
    t0 = time.perf_counter()
    clients = [DeviceClient(sc.protocol, sc.seed, np.arange(i * k, (i + 1) * k, dtype=np.int64),
                            sc.simulation.cohort_size, world, ledger, sc.network.deadline, sc.network.latency,
                            host, int(port), secret=secret) for i in range(args.connections)]
    print(json.dumps({"event": "ready", "setup_seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    run = asyncio.ensure_future(asyncio.gather(*(c.run() for c in clients)))
    parent = os.getppid()
    end = time.monotonic() + args.timeout
    while not run.done() and os.getppid() == parent and time.monotonic() < end:
        await asyncio.sleep(0.25)
    status = "done" if run.done() and run.exception() is None else "failed"
    run.cancel()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"event": "end", "status": status, "connects": sum(c.connections for c in clients),
                      "finished": sum(c.done for c in clients), "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2),
                      "peak_memory_mb": round(ru.ru_maxrss / 1024)}), flush=True)


# ---------------------------------------------------------------------------------------------- attacker child
async def attacker_main(args: argparse.Namespace) -> None:
    """Attacks until the parent goes away or ``--timeout`` passes; every loop is bounded by that clock."""
    import numpy as np

    from protocols import wire
    from protocols.framing import frame
    from protocols.messages import Hello
    from tests.test_wire import fuzz_input

    host, _, port_s = args.attacker.rpartition(":")
    port = int(port_s)
    n = args.connections * args.devices_per_connection
    k = args.devices_per_connection
    rng = np.random.default_rng(7)
    parent = os.getppid()
    stop = time.monotonic() + args.timeout
    attempts: collections.Counter = collections.Counter()
    outcome: collections.Counter = collections.Counter()

    def running() -> bool:
        return time.monotonic() < stop and os.getppid() == parent and not os.path.exists(args.stop_file)

    async def nap(seconds: float) -> None:
        end = time.monotonic() + seconds
        while running() and time.monotonic() < end:
            await asyncio.sleep(0.1)

    async def until_closed(reader: asyncio.StreamReader, limit: float) -> bool:
        end = time.monotonic() + limit
        while (left := end - time.monotonic()) > 0:
            try:
                if not await asyncio.wait_for(reader.read(1 << 16), left):
                    return True
            except (ConnectionError, asyncio.TimeoutError):
                return True
        return False

    def hello(ids, dtype="<u4", mac=None) -> bytes:
        return frame(wire.encode(Hello(1, "1bitrrpm", np.asarray(ids, dtype=dtype), mac)))

    async def one(kind: str, payload: bytes, read_challenge: bool = True, wait: float = 5.0) -> None:
        attempts[kind] += 1
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (OSError, asyncio.TimeoutError):
            outcome["connect_failed"] += 1
            return
        try:
            if read_challenge:
                await asyncio.wait_for(reader.readexactly(4), 5)  # the challenge's header (its body: ignored)
            writer.write(payload)
            await writer.drain()
            outcome["closed_by_server" if await until_closed(reader, wait) else "still_open"] += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            outcome["closed_by_server"] += 1
        finally:
            writer.close()

    async def impersonator() -> None:
        while running():
            i = int(rng.integers(args.connections))
            await one("impersonate", hello(np.arange(i * k, (i + 1) * k), mac=rng.bytes(32)))
            await asyncio.sleep(0.02)

    async def out_of_range() -> None:
        cases = [([2**63], "<u8"), ([2**64 - 1], "<u8"), ([n], "<u4"), ([0, 2**63], "<u8")]
        while running():
            ids, dt = cases[int(rng.integers(len(cases)))]
            await one("out_of_range", hello(ids, dt))
            await asyncio.sleep(0.05)

    async def garbage() -> None:
        bombs = [b"\x91" * 1000 + b"\x01", b"\xdd" + struct.pack(">I", 1_000_000) + b"\x90" * 1_000_000]
        while running():
            r = rng.random()
            if r < 0.1:
                payload = frame(bombs[int(rng.integers(2))])
            elif r < 0.2:
                payload = struct.pack(">I", wire.MAX_MESSAGE_BYTES + 1) + b"x" * 16
            else:
                payload = frame(fuzz_input(rng))
            await one("garbage", payload, wait=0.5)  # a frame that decodes (a refused batch) keeps its connection
            await asyncio.sleep(0.01)

    async def trickle() -> None:
        payload = hello(np.arange(k))
        while running():
            attempts["trickle"] += 1
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
            except (OSError, asyncio.TimeoutError):
                outcome["connect_failed"] += 1
                await asyncio.sleep(0.5)
                continue
            try:
                await asyncio.wait_for(reader.readexactly(4), 5)
                for i in range(len(payload)):
                    if not running() or reader.at_eof():
                        break
                    writer.write(payload[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(0.05)
                outcome["trickle_dropped" if await until_closed(reader, 5) else "trickle_still_open"] += 1
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                outcome["trickle_dropped"] += 1
            finally:
                writer.close()

    async def open_never_readers(count: int) -> list[socket.socket]:
        socks = []
        for _ in range(count):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.setblocking(False)
            try:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(s, (host, port)), 5)
                socks.append(s)
            except (OSError, asyncio.TimeoutError):
                s.close()
        attempts["never_read"] += len(socks)
        return socks

    async def never_readers(socks: list[socket.socket]) -> None:
        while running():
            await asyncio.sleep(0.2)
        for s in socks:
            s.close()

    async def flood() -> None:
        while running():
            attempts["flood"] += args.flood
            opened = await asyncio.gather(*(asyncio.wait_for(asyncio.open_connection(host, port), 5)
                                            for _ in range(args.flood)), return_exceptions=True)
            conns = [c for c in opened if isinstance(c, tuple)]
            outcome["flood_connected"] += len(conns)
            await nap(1.0)
            for _, w in conns:
                w.close()
            await nap(4.0)

    print(json.dumps({"event": "ready"}), flush=True)
    socks = await open_never_readers(20)  # first, so that the flood does not keep them out
    tasks = [*(impersonator() for _ in range(3)), out_of_range(), *(garbage() for _ in range(3)),
             *(trickle() for _ in range(20)), never_readers(socks), flood()]
    await asyncio.gather(*tasks, return_exceptions=True)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"event": "end", "attempts": dict(attempts), "outcome": dict(outcome),
                      "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2)}), flush=True)


# ---------------------------------------------------------------------------------------------- collector
class Probe:
    """Per round, on the collector: the broadcast of the collection request, the moment every connection has
    acknowledged, and the reports accepted (wrapping the instance's own methods)."""

    def __init__(self, server) -> None:
        from protocols.messages import CollectionRequest

        self.rounds: list[dict] = []
        broadcast, check, closed = server._broadcast, server._check_acks, server.on_round_closed

        async def timed_broadcast(msg, nominal=None) -> None:
            if isinstance(msg, CollectionRequest):
                self.rounds.append({"t_broadcast": time.perf_counter(), "r0": server.stats.reports_accepted})
            await broadcast(msg, nominal)

        def timed_check() -> None:
            check()
            if self.rounds and "t_acked" not in self.rounds[-1] and server._acked.is_set():
                self.rounds[-1]["t_acked"] = time.perf_counter()

        def timed_close(t, result, close_time) -> None:
            rec = self.rounds[-1]
            rec.setdefault("t_acked", time.perf_counter())
            rec["reports"] = server.stats.reports_accepted - rec["r0"]
            closed(t, result, close_time)

        server._broadcast, server._check_acks, server.on_round_closed = timed_broadcast, timed_check, timed_close


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


async def collector_main(args: argparse.Namespace) -> dict:
    from protocols.auth import read_secret
    from protocols.ledger import Ledger
    from scenarios import live

    from bench_live import warm_up

    warm_up()
    sc = schema.load("quickstart", overrides(args))
    secret = read_secret(args.secret_file)
    tmp = tempfile.TemporaryDirectory(prefix="bench_soak_")
    events_path = Path(tmp.name) / "events.jsonl"
    events = open(events_path, "w", encoding="utf-8")
    ledger = Ledger(sc.devices)
    server, book, _ = live.build_server(sc, ledger, events, settings_for(args, secret))
    children: dict[str, subprocess.Popen] = {}
    probe = Probe(server)
    port = await server.start(HOST, 0)
    common = ["--connections", str(args.connections), "--devices-per-connection", str(args.devices_per_connection),
              "--rounds", str(args.rounds), "--secret-file", args.secret_file, "--timeout", str(args.timeout + 30),
              "--flood", str(args.flood)]
    me = [sys.executable, str(Path(__file__).resolve())]
    outs = {}

    def spawn(name: str, flag: str) -> None:
        outs[name] = open(Path(tmp.name) / f"{name}.out", "w+")
        children[name] = subprocess.Popen(me + [flag, f"{HOST}:{port}"] + common, cwd=str(ROOT.parent),
                                          stdout=outs[name], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    peak_fds = [open_fds()]
    peak_connections = [0]
    stop_file = Path(tmp.name) / "stop"
    common += ["--stop-file", str(stop_file)]

    async def sample_fds() -> None:
        while True:
            peak_fds.append(open_fds())
            peak_connections.append(len(server.connections))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample_fds())
    t0 = time.perf_counter()
    spawn("honest", "--honest")
    failure = None
    try:
        await asyncio.wait_for(server._registered.wait(), 120)
        registered = time.perf_counter() - t0
        if args.phase == "attack":
            spawn("attacker", "--attacker")
            await asyncio.sleep(1.0)  # the attack is under way before the first round
        await asyncio.wait_for(server.run(), args.timeout)
        await server.wait_for_clients_to_leave(30)
    except asyncio.TimeoutError:
        failure, registered = "timed out", None
    finally:
        sampler.cancel()
        wall = time.perf_counter() - t0
        stop_file.touch()  # the attacker stops, and reports
        await server.close()
        for name, child in children.items():
            try:
                await asyncio.to_thread(child.wait, 60)
            except subprocess.TimeoutExpired:
                child.kill()
        events.close()
    lines = events_path.read_text().splitlines()
    texts = {}
    for name, f in outs.items():
        f.seek(0)
        texts[name] = f.read()
        f.close()
    reports = {name: json.loads(x) for name, text in texts.items() for x in text.splitlines()
               if x.startswith('{"event": "end"')}
    tails = {name: text[-1500:] for name, text in texts.items()}
    rounds = [r for r in probe.rounds if "t_acked" in r]
    spans = [r["t_acked"] - r["t_broadcast"] for r in rounds]
    per_round = [(r.get("reports", 0)) / s for r, s in zip(rounds, spans) if s > 0]
    total = sum(r.get("reports", 0) for r in rounds)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    events_by_kind = collections.Counter(json.loads(x).get("event") for x in lines)
    tmp.cleanup()
    return {
        "phase": args.phase, "failure": failure,
        "registration_seconds": round(registered, 3) if registered else None,
        "rounds": len(rounds), "reports_accepted": server.stats.reports_accepted,
        "reports_per_second": round(total / sum(spans)) if spans else None,
        "reports_per_second_median_round": round(sorted(per_round)[len(per_round) // 2]) if per_round else None,
        "stage_timeouts": events_by_kind.get("stage_timeout", 0),
        "transcript_digest": server.protocol.transcript_digest(),
        "dropped": dict(sorted(server.drops.items())), "connections_accepted": server.connections_accepted,
        "max_connections": server.max_connections,
        "log_lines": len(lines), "log_events": dict(events_by_kind),
        "peak_memory_mb": round(ru.ru_maxrss / 1024), "peak_open_fds": max(peak_fds),
        "peak_connections": max(peak_connections),
        "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 2), "wall_seconds": round(wall, 2),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "children": reports, "children_tail": {k: v for k, v in tails.items() if "Traceback" in v},
    }


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--devices-per-connection", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--fuzz", type=int, default=100_000, help="structure-aware fuzz inputs (0: no fuzz phase)")
    ap.add_argument("--flood", type=int, default=500, help="idle connections per flood wave (every 5 s)")
    ap.add_argument("--send-buffer", type=int, default=4096, help="the collector's SO_SNDBUF per connection")
    ap.add_argument("--timeout", type=float, default=300.0, help="real seconds one phase may take at most")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    ap.add_argument("--phase", choices=("baseline", "attack"), help=argparse.SUPPRESS)
    ap.add_argument("--honest", help=argparse.SUPPRESS)
    ap.add_argument("--attacker", help=argparse.SUPPRESS)
    ap.add_argument("--secret-file", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", default="/nonexistent", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from bench_live import raise_open_files

    raise_open_files(args.connections + 2 * args.flood + 400)
    if args.honest:
        asyncio.run(honest_main(args))
        return
    if args.attacker:
        asyncio.run(attacker_main(args))
        return
    if args.phase:
        print(json.dumps(asyncio.run(collector_main(args))), flush=True)
        return

    record: dict = {"benchmark": "live_soak", "date": time.strftime("%Y-%m-%d"),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                    "scenario": "quickstart", "connections": args.connections,
                    "devices_per_connection": args.devices_per_connection,
                    "devices": args.connections * args.devices_per_connection, "rounds": args.rounds,
                    "send_buffer": args.send_buffer, "flood_wave": args.flood}
    if args.fuzz:
        record["fuzz"] = fuzz(args.fuzz, seed=2026)
        print(json.dumps({"fuzz": record["fuzz"]}), flush=True)
    from scenarios import output, runner

    t = time.perf_counter()
    sim = output.summary(runner.run(schema.load("quickstart", overrides(args))))
    record["simulate_seconds"] = round(time.perf_counter() - t, 2)
    with tempfile.TemporaryDirectory(prefix="bench_soak_secret_") as d:
        path = Path(d) / "secret"
        path.write_text(secrets.token_hex(32))
        for phase in ("baseline", "attack"):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--secret-file", str(path),
                   "--connections", str(args.connections), "--devices-per-connection",
                   str(args.devices_per_connection), "--rounds", str(args.rounds), "--flood", str(args.flood),
                   "--send-buffer", str(args.send_buffer), "--timeout", str(args.timeout)]
            proc = subprocess.run(cmd, cwd=str(ROOT.parent), capture_output=True, text=True,
                                  timeout=args.timeout + 180)
            last = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            record[phase] = json.loads(last[-1]) if last else {"failure": f"exit {proc.returncode}",
                                                               "stderr": proc.stderr[-2000:]}
            record[phase]["digest_equals_simulation"] = record[phase].get("transcript_digest") == \
                sim["digests"]["transcript"]
            print(json.dumps({phase: record[phase]}), flush=True)
    base, att = record["baseline"], record["attack"]
    ok = (not record.get("fuzz", {}).get("other_exceptions") and base.get("failure") is None
          and att.get("failure") is None and base["digest_equals_simulation"] and att["digest_equals_simulation"]
          and base.get("stage_timeouts") == 0 and att.get("stage_timeouts") == 0)
    record["ok"] = bool(ok)
    if base.get("reports_per_second") and att.get("reports_per_second"):
        record["attack_throughput_ratio"] = round(att["reports_per_second"] / base["reports_per_second"], 3)
    print(f"fuzz: {record.get('fuzz', {}).get('inputs', 0):,} inputs, other exceptions "
          f"{record.get('fuzz', {}).get('other_exceptions')}; honest reports/s baseline "
          f"{base.get('reports_per_second')}, under attack {att.get('reports_per_second')}; "
          f"peak RSS {base.get('peak_memory_mb')} / {att.get('peak_memory_mb')} MB, peak fds "
          f"{base.get('peak_open_fds')} / {att.get('peak_open_fds')}; dropped under attack {att.get('dropped')}; "
          f"ok={record['ok']}", file=sys.stderr)
    if not args.no_record:
        append_result(record)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
