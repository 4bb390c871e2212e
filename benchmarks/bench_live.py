"""Benchmark: device reports per second one live collector process takes over loopback TCP.

Runs the shipped quickstart (1BitRRPM, gamma = 0.1) in the live runtime with loss 0 and one cohort per
connection: the collector (scenarios.live.build_server, as ``ldpsim serve`` runs it) in this process, and
every device client in ONE child process, so the collector's process is measured alone. For each round it
times, on the collector, the span from the broadcast of the collection request to the moment every
connection has acknowledged (reports accepted / that span = reports per second), with the CPU time both
processes spent in it; it also reports the registration time (every connection's Hello), the collector's
peak memory (ru_maxrss) and CPU time. Results are appended to benchmarks/results.jsonl and printed as a
README table row: connections x devices | rounds | registration | reports/s overall | per-round range |
collector CPU-seconds per second while collecting (1 = a core saturated) | collector peak RSS | collector CPU.

The child hosts all connections in one asyncio loop sharing one World (the population's true values): the
``ldpsim devices`` path (``--clients cli``) builds one full-population World per connection, which at
1,000 x 1,000 is ~1,000 x 33 MB of memory and 1,000 x 1,000,000 value draws per round on the device side.

    python benchmarks/bench_live.py                                    # 1,000 connections x 1,000 devices, 5 rounds
    python benchmarks/bench_live.py --connections 100 --devices-per-connection 1000 --rounds 3 --no-record
    python benchmarks/bench_live.py --connections 100 --clients cli --no-record   # devices via `ldpsim devices`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from scenarios import schema  # noqa: E402
from yardstick import append_result  # noqa: E402  (benchmarks/yardstick.py)

HOST = "127.0.0.1"
SETTINGS = dict(stage_timeout=60.0, read_timeout=30.0, startup_timeout=120.0)
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def overrides(args: argparse.Namespace) -> list[str]:
    return [f"population.devices={args.connections * args.devices_per_connection}", f"rounds={args.rounds}",
            "network.loss=0", f"simulation.cohort_size={args.devices_per_connection}"]


def raise_open_files(connections: int) -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to what ``connections`` sockets (plus slack) need; children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + 512
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            sys.exit(f"bench_live: {connections} connections need {need} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def warm_up() -> float:
    """Load numba's compiled kernels (world values, device responses) before anything is timed."""
    from scenarios import runner

    t = time.perf_counter()
    runner.run(schema.load("quickstart", ["population.devices=1000", "rounds=2", "simulation.cohort_size=500"]))
    return time.perf_counter() - t


def proc_cpu(pid: int) -> float | None:
    """user + system CPU seconds of a live process (all its threads), from /proc; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def listen_overflows() -> int | None:
    """The kernel's TcpExt ListenOverflows counter (system-wide): handshakes dropped for a full accept queue."""
    try:
        with open("/proc/net/netstat", encoding="ascii") as f:
            rows = [line.split() for line in f if line.startswith("TcpExt:")]
        return int(rows[1][rows[0].index("ListenOverflows")])
    except (OSError, IndexError, ValueError):
        return None


def proc_peak_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


# ---------------------------------------------------------------------------------------------- the child
async def client_main(args: argparse.Namespace) -> None:
    """Child process: every connection's devices in one loop, sharing one World and one Ledger."""
    from agents.client import DeviceClient
    from agents.world import World
    from protocols.ledger import Ledger
    import numpy as np

    warm = warm_up()
    t0 = time.perf_counter()
    sc = schema.load("quickstart", overrides(args))
    host, _, port = args.client.rpartition(":")
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ledger = Ledger(sc.devices)
    k, n = args.devices_per_connection, args.connections
    clients = [DeviceClient(sc.protocol, sc.seed, np.arange(i * k, (i + 1) * k, dtype=np.int64),
                            sc.simulation.cohort_size, world, ledger, sc.network.deadline, sc.network.latency,
                            host, int(port)) for i in range(n)]
    setup = time.perf_counter() - t0
    print(json.dumps({"event": "ready", "setup_seconds": round(setup, 3)}), flush=True)
    t1 = time.perf_counter()
    parent = os.getppid()

    async def orphaned() -> None:  # the collector is gone (killed): stop instead of reconnecting until timeout
        while os.getppid() == parent:
            await asyncio.sleep(0.5)

    run = asyncio.ensure_future(asyncio.gather(*(c.run() for c in clients)))
    watch = asyncio.ensure_future(orphaned())
    done, _ = await asyncio.wait({run, watch}, timeout=args.timeout, return_when=asyncio.FIRST_COMPLETED)
    status = "done" if run in done else "orphaned" if watch in done else "timeout"
    for task in (run, watch):
        task.cancel()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "event": "end", "status": status, "warmup_seconds": round(warm, 3), "setup_seconds": round(setup, 3),
        "session_seconds": round(time.perf_counter() - t1, 3),
        "connects": sum(c.connections for c in clients), "finished": sum(c.done for c in clients),
        "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 3), "peak_memory_mb": round(ru.ru_maxrss / 1024),
        "ledger_spend_max": float(ledger.spend.max()),
    }), flush=True)


# ---------------------------------------------------------------------------------------------- the collector
class Probe:
    """Timestamps on the collector, by wrapping the instance's own methods (collector/server.py unchanged)."""

    def __init__(self, server, child_pid: callable) -> None:
        from protocols.messages import CollectionRequest

        self.server, self.child_pid = server, child_pid
        self.rounds: list[dict] = []
        self.first_connection: float | None = None
        self.connections_seen = 0
        orig_broadcast, orig_check, orig_handle = server._broadcast, server._check_acks, server._handle
        orig_start, orig_closed = server.on_round_start, server.on_round_closed

        async def broadcast(msg, *rest) -> None:  # rest: the nominal time (downlink.jsonl)
            if isinstance(msg, CollectionRequest):
                self.rounds.append({"round": msg.round, "t_broadcast": time.perf_counter(),
                                    "cpu0": time.process_time(), "child_cpu0": self._child_cpu(),
                                    "reports0": server.stats.reports_accepted})
                await orig_broadcast(msg, *rest)
                self.rounds[-1]["t_sent"] = time.perf_counter()
            else:
                await orig_broadcast(msg, *rest)

        def check_acks() -> None:
            orig_check()
            if self.rounds and "t_acked" not in self.rounds[-1] and server._acked.is_set():
                self._mark_acked()

        async def handle(reader, writer) -> None:
            if self.first_connection is None:
                self.first_connection = time.perf_counter()
            self.connections_seen += 1
            await orig_handle(reader, writer)

        def round_start(t: int) -> None:
            t0 = time.perf_counter()
            orig_start(t)
            self.pending_start = (t0, time.perf_counter() - t0)

        def round_closed(t: int, result, close_time: float) -> None:
            rec = self.rounds[-1]
            if "t_acked" not in rec:  # stage timed out: the span ends here
                self._mark_acked()
                rec["timed_out"] = True
            rec["t_round_start"], rec["round_start_seconds"] = self.pending_start
            t0 = time.perf_counter()
            orig_closed(t, result, close_time)
            rec["t_closed"] = time.perf_counter()
            rec["book_close_seconds"] = rec["t_closed"] - t0
            rec["reports"] = server.stats.reports_accepted - rec["reports0"]

        server._broadcast, server._check_acks, server._handle = broadcast, check_acks, handle
        server.on_round_start, server.on_round_closed = round_start, round_closed

    def _child_cpu(self) -> float | None:
        pid = self.child_pid()
        return None if pid is None else proc_cpu(pid)

    def _mark_acked(self) -> None:
        rec = self.rounds[-1]
        rec["t_acked"] = time.perf_counter()
        rec["cpu1"] = time.process_time()
        rec["child_cpu1"] = self._child_cpu()


async def collector_main(args: argparse.Namespace) -> dict:
    from collector.server import LiveSettings
    from protocols.ledger import Ledger
    from scenarios import live

    sc = schema.load("quickstart", overrides(args))
    ledger = Ledger(sc.devices)
    server, book, _ = live.build_server(sc, ledger, None, LiveSettings(**SETTINGS))
    child: subprocess.Popen | None = None
    probe = Probe(server, lambda: child.pid if child is not None and child.poll() is None else None)
    port = await server.start(HOST, 0)

    tmp = tempfile.TemporaryDirectory(prefix="bench_live_")
    out_path, err_path = Path(tmp.name) / "child.out", Path(tmp.name) / "child.err"
    sets = [x for o in overrides(args) for x in ("--set", o)]
    if args.clients == "cli":
        cmd = [sys.executable, "-m", "scenarios.cli", "devices", "quickstart", *sets, "--connections",
               str(args.connections), "--shard", "1/1", "--connect", f"{HOST}:{port}"]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--client", f"{HOST}:{port}", "--connections",
               str(args.connections), "--devices-per-connection", str(args.devices_per_connection), "--rounds",
               str(args.rounds), "--timeout", str(args.timeout + 30)]  # the parent's time box ends first
    cpu_start = time.process_time()
    t_spawn = time.perf_counter()
    overflows: list[int | None] = [listen_overflows()]
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        child = subprocess.Popen(cmd, cwd=str(ROOT.parent), stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL)
    registered_at: list[float] = []

    async def registration() -> None:
        await server._registered.wait()
        registered_at.append(time.perf_counter())
        overflows.append(listen_overflows())

    async def child_watch() -> None:
        while child.poll() is None:
            await asyncio.sleep(0.25)

    reg_task = asyncio.create_task(registration())
    run_task = asyncio.create_task(server.run())
    watch_task = asyncio.create_task(child_watch())
    failure: str | None = "interrupted"
    try:
        failure = None
        done, _ = await asyncio.wait({run_task, watch_task}, timeout=args.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if run_task not in done:
            if watch_task in done:  # the child is gone before the run ended: give the server a moment, then stop
                done, _ = await asyncio.wait({run_task}, timeout=5)
            if run_task not in done:
                failure = (f"child exited with status {child.returncode} before the run ended" if watch_task.done()
                           else f"run did not finish within --timeout {args.timeout:g} s")
                run_task.cancel()
        if run_task.done() and not run_task.cancelled() and run_task.exception() is not None:
            failure = f"server.run raised {run_task.exception()!r}"
        t_run_end = time.perf_counter()
        child_peak = proc_peak_rss_mb(child.pid) if child.poll() is None else None
        if failure is None:
            await server.wait_for_clients_to_leave(30)
    finally:
        for task in (reg_task, run_task, watch_task):
            task.cancel()
        if failure is not None and child.poll() is None:
            child.kill()  # a failed run: its connections then end by themselves (EOF), without cancelled handlers
        await server.close()
        await server.wait_for_clients_to_leave(5)
        try:  # a finished run: the child leaves by itself after End
            await asyncio.to_thread(child.wait, 60)
        except (subprocess.TimeoutExpired, asyncio.CancelledError):
            child.kill()
            child.wait(10)
    cpu_total = time.process_time() - cpu_start
    ru = resource.getrusage(resource.RUSAGE_SELF)
    ru_child = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_out = out_path.read_text()
    child_err = err_path.read_text()
    tmp.cleanup()
    child_end = next((json.loads(line) for line in child_out.splitlines()
                      if line.startswith("{") and '"end"' in line), None)
    child_ready = next((json.loads(line) for line in child_out.splitlines()
                        if line.startswith("{") and '"ready"' in line), None)

    rounds = []
    for rec in probe.rounds:
        if "t_acked" not in rec:
            continue
        span = rec["t_acked"] - rec["t_broadcast"]
        reports = rec.get("reports", server.stats.reports_accepted - rec["reports0"])
        c0, c1 = rec.get("child_cpu0"), rec.get("child_cpu1")
        rounds.append({
            "round": rec["round"], "reports": reports, "collect_seconds": round(span, 4),
            "reports_per_second": round(reports / span) if span > 0 else None,
            "broadcast_seconds": round(rec["t_sent"] - rec["t_broadcast"], 4),
            "collector_cpu_seconds": round(rec["cpu1"] - rec["cpu0"], 4),
            "devices_cpu_seconds": None if c0 is None or c1 is None else round(c1 - c0, 3),
            "round_start_seconds": round(rec.get("round_start_seconds", 0.0), 4),
            "close_seconds": round(rec["t_closed"] - rec["t_acked"], 4) if "t_closed" in rec else None,
            "timed_out": rec.get("timed_out", False),
        })
    total_reports = sum(r["reports"] for r in rounds)
    total_span = sum(r["collect_seconds"] for r in rounds)
    cycle = (probe.rounds[-1]["t_closed"] - probe.rounds[0]["t_round_start"]
             if probe.rounds and "t_closed" in probe.rounds[-1] and "t_round_start" in probe.rounds[0] else None)
    collector_cpu_collect = sum(r["collector_cpu_seconds"] for r in rounds)
    dev_cpu = [r["devices_cpu_seconds"] for r in rounds]
    errors = [abs(r.estimate - r.truth) for r in book.records]
    expected = sc.devices * args.rounds
    if failure is None and total_reports != expected:
        failure = f"{total_reports} reports accepted, expected {expected}"
    if failure is None and any(r["timed_out"] for r in rounds):
        failure = "a stage timed out"
    return {
        "benchmark": "live_collector_loopback",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "scenario": "quickstart", "protocol": sc.protocol.name,
        "connections": args.connections, "devices_per_connection": args.devices_per_connection,
        "devices": sc.devices, "rounds": args.rounds, "clients": args.clients,
        "ok": failure is None, "failure": failure,
        "registration_seconds": (round(registered_at[0] - probe.first_connection, 3)
                                 if registered_at and probe.first_connection else None),
        "registration_from_spawn_seconds": round(registered_at[0] - t_spawn, 3) if registered_at else None,
        "child_setup_seconds": (child_ready or {}).get("setup_seconds"),
        # system-wide kernel counter over the registration phase: connects dropped for a full accept queue
        # (asyncio.start_server's default backlog is 100), each retried by TCP after about a second
        "listen_overflows_during_registration": (overflows[1] - overflows[0] if len(overflows) == 2
                                                 and None not in overflows else None),
        "connections_accepted": probe.connections_seen,
        "reports_accepted": total_reports,
        "collect_seconds": round(total_span, 3),
        "reports_per_second": round(total_reports / total_span) if total_span > 0 else None,
        "reports_per_second_round_cycle": round(total_reports / cycle) if cycle else None,
        "per_round": rounds,
        "collector": {
            "peak_memory_mb": round(ru.ru_maxrss / 1024),
            "cpu_seconds": round(ru.ru_utime + ru.ru_stime, 3),  # the whole process (imports, warm-up too)
            "cpu_seconds_from_spawn": round(cpu_total, 3),
            "cpu_seconds_collecting": round(collector_cpu_collect, 3),
            "cpu_share_collecting": round(collector_cpu_collect / total_span, 3) if total_span > 0 else None,
            "frames_received": server.stats.received, "frames_sent": server.frames_sent,
            "rejected": server.stats.rejected, "dropped_connections": server.dropped,
        },
        "devices_process": {
            "cpu_seconds": round(ru_child.ru_utime + ru_child.ru_stime, 3),
            "cpu_seconds_collecting": None if None in dev_cpu or not dev_cpu else round(sum(dev_cpu), 3),
            "peak_memory_mb": round(ru_child.ru_maxrss / 1024) if child_peak is None else round(child_peak),
            "exit_status": child.returncode, "report": child_end,
            "stderr_tail": child_err.strip().splitlines()[-5:] if child_err.strip() else [],
        },
        "wall_seconds": round(t_run_end - t_spawn, 3),
        "mean_abs_error": float(sum(errors) / len(errors)) if errors else None,
        "rlimit_nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--devices-per-connection", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clients", choices=("shared-world", "cli"), default="shared-world",
                    help="device process: one loop sharing one World (default), or `ldpsim devices`")
    ap.add_argument("--timeout", type=float, default=900.0, help="real seconds the whole run may take at most")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results.jsonl")
    ap.add_argument("--client", help=argparse.SUPPRESS)  # HOST:PORT: run as the device child process
    args = ap.parse_args()
    if not (1 <= args.connections and 1 <= args.devices_per_connection and 1 <= args.rounds):
        ap.error("--connections, --devices-per-connection and --rounds must be at least 1")
    raise_open_files(args.connections)
    if args.client:
        asyncio.run(client_main(args))
        return

    warm = warm_up()
    record = asyncio.run(collector_main(args))
    record["jit_warmup_seconds"] = round(warm, 3)
    print(json.dumps(record, indent=2))
    per = [r["reports_per_second"] for r in record["per_round"] if r["reports_per_second"]]
    rng = f"{min(per) / 1e3:,.0f}-{max(per) / 1e3:,.0f} k/s" if per else "-"
    overall = record["reports_per_second"]
    col = record["collector"]
    print(f"| {args.connections:,} x {args.devices_per_connection:,} | {args.rounds} | "
          f"{record['registration_seconds'] if record['registration_seconds'] is not None else '-'} s | "
          f"{overall / 1e3:,.0f} k/s | {rng} | {col['cpu_share_collecting']} | "
          f"{col['peak_memory_mb']:,} MB | {col['cpu_seconds']:.1f} s |" if overall and record["ok"] else
          f"| {args.connections:,} x {args.devices_per_connection:,} | failed: {record['failure']} |")
    if not record["ok"]:
        print(f"bench_live: FAILED: {record['failure']}", file=sys.stderr)
    if not args.no_record and record["ok"]:
        append_result(record)
    sys.exit(0 if record["ok"] else 1)


if __name__ == "__main__":
    main()
