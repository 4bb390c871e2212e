"""Parallel cohorts in one run: ``[simulation] workers = N`` shard processes answer for the device cohorts.

Design (measured in benchmarks/bench_parallel.py): the SimPy event loop, the collector side, the ledger and the
event log stay in the run's process, exact and unchanged; only the device side's work, which is a pure function
of keyed randomness (agents/shard.py), moves to the workers. Each worker is a separate Python process
(``python -m scenarios.parallel``) holding a contiguous run of cohorts and its own world restricted to their
ids. It rebuilds the scenario from the run's validated input (plain data) and speaks msgpack frames over its
stdin and stdout: the collector's broadcasts go out as the very wire bytes the cohorts would receive, and each
cohort's answer comes back as its charges and its report sub-batches, already wire-encoded with their network
delays. Nothing is pickled. Workers run numba with one thread each, so N workers use N cores.

Why processes speaking the wire format rather than shared-memory columns: the collector must receive each
report batch as bytes anyway (it decodes and checks them as it would a real device's), the answers of a
broadcast are a few bytes per device, and a worker that owns its devices' state outright needs no locking and
could as well run on another machine (the Ray engine of issue 13 hosts the same :class:`~agents.shard.CohortShard`).

The run's process waits while the shards answer a broadcast, so what it does alone between broadcasts (decode
and store the reports, close the round, the ledger's spend distribution, the truth) bounds the speed-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, BinaryIO

import numpy as np

from agents.behavior import BehaviorError
from protocols.base import DefinitionError
from protocols.guard import BudgetOverrun
from protocols.ledger import Charge
from scenarios import failure
from scenarios.pipes import child_command, read_frame, write_frame

__all__ = ["ProcessShards", "WorkerError", "resolve_threads", "resolve_workers", "split_cohorts", "AUTO_DEVICE_ROUNDS",
           "AUTO_MIN_CORES", "AUTO_THREAD_COHORT", "AUTO_THREAD_DEVICE_ROUNDS"]

#: ``workers = 0`` (auto): one worker per available core when devices x rounds is at least this and there are at
#: least :data:`AUTO_MIN_CORES` cores, else none (a worker costs about a second to start: below this size the run
#: is over sooner in one process).
AUTO_DEVICE_ROUNDS = 20_000_000
#: On 2 cores the run's own process already computes the world's values on both, and its serial work (storing
#: reports, closing rounds, the ledger) is a third of a 1BitRRPM run: 3M x 31 took 7.0-7.3 s in one process
#: against 8.5-9.0 s on 2 workers (benchmarks/bench_parallel.py), so auto runs in one process below 4 cores.
AUTO_MIN_CORES = 4

#: ``threads = 0`` (auto) in a run that stays in one process: from this many devices x rounds the cohorts are
#: answered together by shards (agents/shard.py ThreadShards) instead of a SimPy process each (no per-cohort
#: events and decoding); below it, a SimPy process per cohort.
AUTO_THREAD_DEVICE_ROUNDS = 1_000_000
#: ... and with cohorts of at least this many devices, by one thread per available core; with smaller cohorts
#: by the run's own thread, since the Python between the kernels (which takes turns on the GIL) is then most of
#: a cohort's work. On the 2-core project machine, 3M x 31 1BitRRPM (benchmarks/bench_parallel.py and the
#: alternations in the README): cohorts of 100,000 took a sixth less time on 2 threads than on one; cohorts of
#: 10,000, the same time on 2 threads, and a tenth less answered together on one than in their own processes.
AUTO_THREAD_COHORT = 50_000


class WorkerError(RuntimeError):
    """A shard worker failed or exited; the message carries its traceback's last lines, and ``user_line``
    where a user's own code raised it (scenarios/failure.py)."""

    user_line: str | None = None


#: errors a worker's device side raises that the parent raises again as they are (the command's one-line
#: report): a device side that charged past its budget, a scripted behavior that failed, a protocol that
#: cannot run (a report column the wire does not carry), a method a plugin left out
_RERAISED: dict[str, type[Exception]] = {"BudgetOverrun": BudgetOverrun, "BehaviorError": BehaviorError,
                                          "DefinitionError": DefinitionError,
                                          "NotImplementedError": NotImplementedError}


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers: int, devices: int, rounds: int, cohorts: int) -> int:
    """The worker processes of a run: ``workers`` (0: auto, see :data:`AUTO_DEVICE_ROUNDS`), never more than its
    cohorts; 1 means the cohorts run in the run's own process."""
    if workers == 0:
        cores = available_cores()
        workers = cores if devices * rounds >= AUTO_DEVICE_ROUNDS and cores >= AUTO_MIN_CORES else 1
    return max(1, min(int(workers), int(cohorts)))


def resolve_threads(threads: int, workers: int, devices: int, rounds: int, cohorts: int,
                    cohort_size: int = AUTO_THREAD_COHORT) -> int:
    """How a run in one process answers for its cohorts: 0, a SimPy process per cohort; T >= 1, shards answered
    by T threads (1: the run's own thread). ``threads`` is the scenario's: 0 auto (see
    :data:`AUTO_THREAD_DEVICE_ROUNDS` and :data:`AUTO_THREAD_COHORT`), 1 a SimPy process per cohort, T > 1
    that many threads, never more than the cohorts. With worker processes (``workers`` > 1): 0."""
    if workers > 1 or cohorts <= 1:
        return 0
    if threads == 0:
        if devices * rounds < AUTO_THREAD_DEVICE_ROUNDS:
            return 0
        threads = available_cores() if cohort_size >= AUTO_THREAD_COHORT else 1
        return max(1, min(int(threads), int(cohorts)))
    return 0 if threads == 1 else max(1, min(int(threads), int(cohorts)))


def split_cohorts(cohorts: list[tuple[int, int]], shards: int) -> list[list[tuple[int, int]]]:
    """Contiguous runs of cohorts with about equal device counts, one per shard (none empty)."""
    total = sum(hi - lo for lo, hi in cohorts)
    out: list[list[tuple[int, int]]] = [[] for _ in range(shards)]
    done = 0
    for c in cohorts:
        k = min(shards - 1, done * shards // max(total, 1))
        out[k].append(c)
        done += c[1] - c[0]
    return [s for s in out if s]




def _pack_charge(c: Charge) -> list:
    ids = np.asarray(c.devices)
    lo, hi = (int(ids[0]), int(ids[-1]) + 1) if ids.size else (0, 0)
    listed = None if hi - lo == ids.size else ids.astype("<u8").tobytes()
    return [c.round, c.time, c.reason, c.amount, c.cumulative, lo, hi, listed]


_RANGE = np.empty(0, np.int64)  # 0, 1, 2, ...: a charge of a contiguous id range is a read-only view of it


def _id_range(lo: int, hi: int) -> np.ndarray:
    """The ids lo..hi-1 as a read-only view of one shared range (no array per charge)."""
    global _RANGE
    if hi > _RANGE.size:
        _RANGE = np.arange(max(hi, 2 * _RANGE.size), dtype=np.int64)
        _RANGE.flags.writeable = False
    return _RANGE[lo:hi]


def _unpack_charge(v: list) -> Charge:
    rnd, time, reason, amount, cumulative, lo, hi, listed = v
    ids = _id_range(int(lo), int(hi)) if listed is None else np.frombuffer(listed, dtype="<u8").astype(np.int64)
    return Charge(int(rnd), float(time), str(reason), float(amount), ids, bool(cumulative))


# ------------------------------------------------------------------------------------------- the run's side
class ProcessShards:
    """``len(shards)`` worker processes, each answering for one contiguous run of cohorts (agents.shard.ShardPool)."""

    def __init__(self, scenario_data: dict, shards: list[list[tuple[int, int]]]) -> None:
        devices = shards[-1][-1][1]
        # the day's values of every device, written by the workers, read by the run's world (the truth): a file
        # in shared memory (/dev/shm where there is one), mapped by every process
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.values_path = tempfile.mkstemp(prefix="ldpsim-values-", suffix=".f8", dir=where)
        os.ftruncate(fd, max(devices, 1) * 8)
        os.close(fd)
        self._values = np.memmap(self.values_path, dtype=np.float64, mode="r+", shape=(max(devices, 1),))[:devices]
        env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs: list[subprocess.Popen] = []
        try:
            for cohorts in shards:
                proc = subprocess.Popen(child_command("scenarios.parallel"), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
                self.procs.append(proc)
                write_frame(proc.stdin, {"op": "init", "scenario": scenario_data,  # type: ignore[arg-type]
                                    "cohorts": [list(c) for c in cohorts], "values": self.values_path})
        except BaseException:
            self.close()
            raise
        self._started = False  # the workers start up while the run's process builds its own side

    def _start(self) -> None:
        if not self._started:
            self._started = True
            try:
                for proc in self.procs:
                    self._reply(proc)
            except BaseException:
                self.close()
                raise

    def _reply(self, proc: subprocess.Popen) -> Any:
        try:
            out = read_frame(proc.stdout)  # type: ignore[arg-type]
        except EOFError:
            proc.wait()
            raise WorkerError(f"a shard worker exited with status {proc.returncode}") from None
        if isinstance(out, dict) and "error" in out:
            if out.get("raise") in _RERAISED:  # the worker's own error, with its message
                raise _RERAISED[out["raise"]](str(out.get("message", "")))
            error = WorkerError(f"a shard worker failed: {out['error']}")
            if isinstance(out.get("user"), str):
                error.user_line = out["user"]
            raise error
        return out

    def _all(self, command: dict) -> list[Any]:
        self._start()
        for proc in self.procs:  # every worker starts at once; then the replies are read in shard order
            write_frame(proc.stdin, command)  # type: ignore[arg-type]
        return [self._reply(proc) for proc in self.procs]

    def observe(self, day: int) -> None:
        self._all({"op": "observe", "day": int(day)})

    def answer(self, raw: bytes, world_day: int, now: float) -> tuple[list, int]:
        from agents.shard import Answer

        answers, rejected = [], 0
        for reply in self._all({"op": "answer", "raw": raw, "day": int(world_day), "now": float(now)}):
            rejected += int(reply["rejected"])
            for charges, sent, lost in reply["cohorts"]:
                answers.append(Answer([_unpack_charge(c) for c in charges],
                                      [(bytes(d), float(t), int(k)) for d, t, k in sent], int(lost)))
        return answers, rejected

    def values(self, day: int) -> tuple[np.ndarray, int]:
        """Every device's value on ``day`` (computed by the workers; valid until the next call) and how many were
        clipped."""
        clipped = sum(int(r["clipped"]) for r in self._all({"op": "values", "day": int(day)}))
        return self._values, clipped

    def guards(self) -> dict[str, int]:
        out = {"refusals": 0, "ignored": 0}
        for reply in self._all({"op": "guards"}):
            for k in out:
                out[k] += int(reply[k])
        return out

    def stats(self) -> list[dict[str, float]]:
        """Each worker's peak resident memory so far (``peak_mb``) and its seconds computing answers and sending
        them (``answer_seconds``, ``send_seconds``, wall; ``cpu_seconds`` for these and the prefetching),
        and its seconds computing the next day's values ahead of the request (``prefetch_seconds``)."""
        return [{k: float(v) for k, v in r.items()} for r in self._all({"op": "stats"})]

    def abort(self) -> None:
        """Kill the workers at once (a run interrupted or failed: they hold nothing to save). A worker busy with
        a command, or blocked writing its reply, would not read the exit that :meth:`close` sends: it waited 10 s
        for each, then was killed anyway."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def close(self) -> None:
        for proc in self.procs:
            try:
                if proc.poll() is None:
                    write_frame(proc.stdin, {"op": "exit"})  # type: ignore[arg-type]
                    proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        if getattr(self, "values_path", None):
            try:
                os.unlink(self.values_path)
            except OSError:
                pass
            self.values_path = ""
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []

    def __enter__(self) -> "ProcessShards":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------- the worker
def _build_shard(scenario_data: dict, cohorts: list[tuple[int, int]]) -> Any:
    from agents.shard import CohortShard
    from agents.world import World
    from collector.network import Network
    from scenarios.schema import parse

    sc = parse(scenario_data)
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value,
                  span=(cohorts[0][0], cohorts[-1][1]), last_day=sc.rounds)
    network = Network(None, sc.network, sc.seed)  # keyed fates only: no SimPy here
    return CohortShard(sc.protocol, sc.seed, sc.limits, world, network, cohorts, sc.simulation.round_seconds)


def worker(stdin: BinaryIO, stdout: BinaryIO) -> int:
    """A shard worker's loop: init, then observe / answer / guards commands until exit or end of input."""
    shard = None
    busy = [0.0, 0.0, 0.0, 0.0]  # seconds computing answers, sending them, CPU seconds, seconds prefetching
    while True:
        try:
            cmd = read_frame(stdin)
        except EOFError:
            return 0
        try:
            op = cmd["op"]
            if op == "exit":
                stdout.flush()
                os._exit(0)  # nothing to tear down: skip the interpreter's (numba's) slow shutdown
            if op == "init":
                shard = _build_shard(cmd["scenario"], [(int(a), int(b)) for a, b in cmd["cohorts"]])
                values = np.memmap(cmd["values"], dtype=np.float64, mode="r+")
                write_frame(stdout, {"ok": True})
            elif shard is None:
                raise RuntimeError(f"{op!r} before init")
            elif op == "observe":
                shard.observe(int(cmd["day"]))
                write_frame(stdout, {"ok": True})
            elif op == "answer":
                t0, c0 = time.perf_counter(), time.process_time()
                answers, rejected = shard.answer(bytes(cmd["raw"]), int(cmd["day"]), float(cmd["now"]))
                t1 = time.perf_counter()
                write_frame(stdout, {"rejected": rejected, "cohorts": [
                    [[_pack_charge(c) for c in a.charges], [[d, t, k] for d, t, k in a.sent], a.lost]
                    for a in answers]})
                t2 = time.perf_counter()
                shard.prefetch(int(cmd["day"]) + 1)  # while the run's process takes the reports in
                busy[0] += t1 - t0
                busy[1] += t2 - t1
                busy[3] += time.perf_counter() - t2
                busy[2] += time.process_time() - c0
            elif op == "values":
                write_frame(stdout, {"clipped": shard.values(int(cmd["day"]), values)})
            elif op == "guards":
                write_frame(stdout, shard.guards())
            elif op == "stats":
                import resource

                write_frame(stdout, {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                "answer_seconds": busy[0], "send_seconds": busy[1], "cpu_seconds": busy[2],
                                "prefetch_seconds": busy[3]})
            else:
                raise RuntimeError(f"unknown command {op!r}")
        except Exception as exc:
            reply = {"error": "".join(traceback.format_exc().splitlines(True)[-6:])[-2000:]}
            user = failure.describe(exc)  # a plugin's own code that raised: where, found here where its frames are
            if user is not None:
                reply["user"] = user[:2000]
            if type(exc).__name__ in _RERAISED:  # an error the command reports in one line: raised again there
                reply["raise"], reply["message"] = type(exc).__name__, str(exc)[:2000]
            write_frame(stdout, reply)


if __name__ == "__main__":  # started by ProcessShards (pipes.child_command: SIGINT ignored)
    _frames = os.fdopen(os.dup(1), "wb")  # the frames go to the original stdout; anything printed, to stderr
    os.dup2(2, 1)
    from scenarios import allocator, jit

    allocator.tune()
    jit.skip_blas_probe()
    sys.exit(worker(sys.stdin.buffer, _frames))
