"""A sharded run beyond one machine: ``ldpsim run SCENARIO --engine ray`` hosts the device shards as Ray actors.

The optional extra ``pip install 'ldpsim[ray]'``. The run's process (the Ray driver) keeps what it keeps in every
run: the SimPy event loop, the collector, the ledger, the event log and the truth. Each of the ``[simulation]
workers`` shards (0, auto: 2) is a Ray actor holding one :class:`~agents.shard.CohortShard` (a contiguous run of
cohorts with its own world and the network's keyed fates), built from the scenario's plain-data input exactly
as a worker process of scenarios/parallel.py builds it. :class:`RayShards` is the same
:class:`~agents.shard.ShardPool` as :class:`~scenarios.parallel.ProcessShards`: the collector's broadcasts go
to every actor as the very wire bytes a cohort would receive (a THRESH decision, a ToPL threshold, a
collection request), each actor answers with its cohorts' charges and wire-encoded report sub-batches, and
the driver feeds them to the simulated network in cohort order. Only plain data, bytes and numpy arrays
cross Ray (Ray's own transport serializes them); digests are those of the single-process run.

Restart: an actor is created with ``max_restarts`` and ``max_task_retries = 0``; Ray restarts a dead actor by
running its constructor again, which rebuilds the shard's devices from the keyed randomness. Its state
then lacks what the messages of the run so far did to it, so the driver keeps the ordered history of the
commands that change a shard's state (the days observed, the broadcasts answered with their world day and
time, the days whose values were read) and every call carries its position in that history. A call that
fails because the actor died or is restarting (``ray.exceptions.RayActorError``: ``ActorUnavailableError``
while it restarts, ``ActorDiedError``), or that finds the actor behind (restarted between two calls), makes
the driver wait for the actor, replay the missing commands into it (their answers discarded: a device's state
is a function of its keys and the messages it received), and send the call again. An actor that ran a call
whose reply was lost returns that reply again rather than running it twice.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable

import numpy as np

from scenarios import failure
from scenarios.extras import install_command
from scenarios.parallel import _RERAISED, WorkerError, _build_shard, _pack_charge, _unpack_charge, split_cohorts
from scenarios.schema import ScenarioError

__all__ = ["RayShards", "ShardActor", "engine", "require_ray", "DEFAULT_SHARDS", "MISSING"]

#: shards of ``--engine ray`` when ``[simulation] workers`` is 0 (auto)
DEFAULT_SHARDS = 2

MISSING = f"--engine ray needs the ray extra: {install_command('ray')}"

#: what every shard actor's process runs with: one numba (and BLAS) thread, as a worker process of parallel.py
#: (set by the actor itself, not as a Ray runtime_env: the actors can then start in Ray's pre-started workers)
_ENV = {"NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

def require_ray() -> Any:
    """The ``ray`` module, or a :class:`ScenarioError` naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise ScenarioError(MISSING) from None
    return ray


def _first_line(exc: Any) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _last_line(exc: Any) -> str:
    """The last line of a remote traceback (the exception raised in the actor)."""
    text = str(exc).strip()
    return text.splitlines()[-1][-500:] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------- the actor
class ShardActor:
    """One shard's cohorts in a Ray actor: plain data in, plain data out (wrapped by ``ray.remote`` in
    :class:`RayShards`). ``applied`` counts the state-changing commands it has run since it was (re)built."""

    def __init__(self, scenario_data: dict, cohorts: list[list[int]]) -> None:
        os.environ.update(_ENV)  # for the libraries not imported yet
        import numba

        numba.set_num_threads(1)  # per thread: Ray runs a (synchronous) actor's constructor and calls on one
        self.shard = _build_shard(scenario_data, [(int(a), int(b)) for a, b in cohorts])
        self.lo, self.hi = int(cohorts[0][0]), int(cohorts[-1][1])
        self.applied = 0
        self.last: tuple[int, Any] = (-1, None)  # the latest state-changing call's position and reply
        self.busy = [0.0, 0.0, 0.0]  # seconds computing answers, packing them, and CPU seconds for both
        self.replayed = 0

    def position(self) -> int:
        return self.applied

    def step(self, seq: int, op: str, args: tuple) -> Any:
        """Run the state-changing command ``op`` at position ``seq`` of the run's history; ``{"behind": n}``
        (nothing run) when this actor has run only n commands, e.g. after a restart."""
        if seq == self.applied - 1 and self.last[0] == seq:
            return self.last[1]  # it ran, its reply was lost: the same reply, not a second run
        if seq != self.applied:
            return {"behind": self.applied}
        out = self._apply(op, args, reply=True)
        self.applied += 1
        self.last = (seq, out)
        return out

    def read(self, seq: int, op: str) -> Any:
        """A read-only command (guards, stats) once ``seq`` commands have run; else ``{"behind": n}``."""
        if seq != self.applied:
            return {"behind": self.applied}
        if op == "guards":
            return self.shard.guards()
        if op == "stats":
            return {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "answer_seconds": self.busy[0], "send_seconds": self.busy[1], "cpu_seconds": self.busy[2],
                    "replayed": float(self.replayed)}
        raise ValueError(f"unknown command {op!r}")

    def replay(self, start: int, commands: list) -> int:
        """Run ``commands`` (the run's history from position ``start``), discarding their replies; returns how
        many commands this actor has run."""
        if start == self.applied:
            for op, args in commands:
                self._apply(op, tuple(args), reply=False)
                self.applied += 1
                self.replayed += 1
            self.last = (-1, None)
        return self.applied

    def _apply(self, op: str, args: tuple, reply: bool) -> Any:
        shard = self.shard
        if op == "observe":
            shard.observe(int(args[0]))
            return None
        if op == "answer":
            t0, c0 = time.perf_counter(), time.process_time()
            answers, rejected = shard.answer(bytes(args[0]), int(args[1]), float(args[2]))
            if not reply:
                return None
            t1 = time.perf_counter()
            out = {"rejected": int(rejected), "cohorts": [
                [[_pack_charge(c) for c in a.charges], [[d, t, k] for d, t, k in a.sent], int(a.lost)]
                for a in answers]}
            self.busy[0] += t1 - t0
            self.busy[1] += time.perf_counter() - t1
            self.busy[2] += time.process_time() - c0
            return out
        if op == "values":
            shard.world.advance_to(int(args[0]))
            values, clipped = shard.world.totals(self.lo, self.hi)  # before any split over apps
            return (np.ascontiguousarray(values), int(clipped)) if reply else None
        raise ValueError(f"unknown command {op!r}")


# ------------------------------------------------------------------------------------------- the run's side
#: seconds :func:`_reachable` waits for a Ray head's port
CONNECT_TIMEOUT = 10.0


def _reachable(address: str | None) -> None:
    """ScenarioError unless something accepts TCP connections at a ``HOST:PORT`` Ray address (``ray.init`` retries
    a head that is not there for ever, printing warnings: a new user's run sat at 0% for nine minutes). Other
    forms (None, ``auto``, ``ray://...``) are left to Ray, which refuses them at once."""
    if not address or "://" in address or address == "auto":
        return
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ScenarioError(f"--ray-address {address}: expected HOST:PORT, auto or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise ScenarioError(f"--ray-address {address}: no Ray head there ({exc.strerror or exc}; start one with "
                            f"`ray start --head`, or leave the option out for a local Ray)") from None


class RayShards:
    """``len(shards)`` Ray actors, each answering for one contiguous run of cohorts (agents.shard.ShardPool).

    ``address``: the Ray cluster to join when Ray is not initialized yet (None: start a local instance); a Ray
    started here is shut down by :meth:`close`. ``max_restarts``: how often Ray restarts each actor;
    ``restart_timeout``: seconds to wait for a restarted actor before the run fails."""

    engine = "ray actors"  # what summary.json's "parallelism" calls it

    def __init__(self, scenario_data: dict, shards: list[list[tuple[int, int]]], address: str | None = None,
                 max_restarts: int = 3, restart_timeout: float = 300.0, cpus_per_shard: float = 1.0) -> None:
        ray = require_ray()
        self._ray = ray
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            import logging

            _reachable(address)
            try:
                ray.init(address=address or "local", include_dashboard=False, logging_level=logging.WARNING,
                         configure_logging=False)
            except Exception as exc:  # no cluster there, a bad address
                where = f"--ray-address {address}" if address else "--engine ray"
                raise ScenarioError(f"{where}: cannot start or join Ray: {_first_line(exc)}") from None
        self.shards = [[(int(lo), int(hi)) for lo, hi in s] for s in shards]
        self.workers = len(self.shards)
        self.devices = self.shards[-1][-1][1]
        self.restart_timeout = float(restart_timeout)
        self.history: list[tuple[str, tuple]] = []  # the state-changing commands so far, in order
        self.recoveries = [0] * self.workers  # replays into a restarted (or lagging) actor, per shard
        self._values: np.ndarray | None = None
        self.actors: list[Any] = []
        try:
            cpus = float(ray.cluster_resources().get("CPU", 0.0))
            if cpus_per_shard and cpus < cpus_per_shard * self.workers:
                raise ScenarioError(f"simulation.workers: {self.workers} Ray shards need {cpus_per_shard:g} CPU "
                                    f"each; the Ray cluster has {cpus:g}")
            remote = ray.remote(ShardActor).options(
                max_restarts=int(max_restarts), max_task_retries=0, num_cpus=cpus_per_shard,
                scheduling_strategy="SPREAD")
            # the actors start (import, build their devices) while the run's process builds its own side
            self.actors = [remote.remote(scenario_data, [list(c) for c in s]) for s in self.shards]
        except BaseException:
            self.close()
            raise

    # -- calls, with recovery
    def _errors(self) -> tuple[type[BaseException], ...]:
        exc = self._ray.exceptions
        return tuple(getattr(exc, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError")
                     if hasattr(exc, n))

    def _call(self, method: str, seq: int, *args: Any) -> list[Any]:
        """Every shard's reply to ``method(seq, *args)`` (sent to all at once), in shard order."""
        refs = [getattr(a, method).remote(seq, *args) for a in self.actors]
        return [self._get(k, ref, method, seq, args) for k, ref in enumerate(refs)]

    def _get(self, k: int, ref: Any, method: str, seq: int, args: tuple) -> Any:
        """Shard ``k``'s reply to the call ``ref`` (``method(seq, *args)``); when the actor died, is restarting
        or is behind, wait for it, replay the history it lacks, and make the call again."""
        errors: tuple[type[BaseException], ...] = self._errors()
        failed: type[BaseException] = self._ray.exceptions.RayTaskError
        while True:
            try:
                out = self._ray.get(ref)
            except failed as exc:  # an exception in the shard's code: no restart would help
                own = getattr(exc, "cause", None)  # the actor's own exception (Ray carries it back)
                if type(own).__name__ in _RERAISED:  # one the command reports in one line, as a worker's is
                    raise _RERAISED[type(own).__name__](str(own)[:2000]) from None
                error = WorkerError(f"Ray shard {k} failed: {_last_line(exc)}")
                if isinstance(own, BaseException):  # its frames stay in the actor: read them from the text
                    error.user_line = (failure.describe(own)
                                       or failure.describe_text(str(exc), own))  # (the text holds them)
                raise error from None
            except errors as exc:
                if getattr(exc, "actor_init_failed", False):  # its constructor raised: Ray does not restart it
                    raise WorkerError(f"Ray shard {k} could not start: {_last_line(exc)}") from None
                cause: Any = exc
            else:
                if not (isinstance(out, dict) and "behind" in out):
                    return out
                cause = f"behind at {out['behind']} of {seq}"
            self._catch_up(k, seq, cause)
            ref = getattr(self.actors[k], method).remote(seq, *args)

    def _catch_up(self, k: int, seq: int, cause: Any) -> None:
        """Wait until actor ``k`` answers (``restart_timeout`` at most), then replay into it the commands of
        ``history[:seq]`` it lacks."""
        deadline = time.monotonic() + self.restart_timeout
        ray, actor = self._ray, self.actors[k]
        errors: tuple[type[BaseException], ...] = self._errors()
        died: Any = getattr(ray.exceptions, "ActorDiedError", ())
        pause, dead_since = 0.05, None
        while True:
            try:
                applied = int(ray.get(actor.position.remote()))
                if applied < seq:
                    applied = int(ray.get(actor.replay.remote(applied, self.history[applied:seq])))
                if applied >= seq:
                    self.recoveries[k] += 1
                    return
            except errors as exc:
                cause = exc
                # ActorUnavailableError while Ray restarts it; ActorDiedError once it will not (restarts spent)
                now = time.monotonic()
                dead_since = (dead_since or now) if isinstance(exc, died) else None
                if dead_since is not None and now - dead_since > 2.0:
                    raise WorkerError(f"Ray shard {k} died and was not restarted: {_first_line(exc)}") from None
            if time.monotonic() > deadline:
                raise WorkerError(f"Ray shard {k} did not come back within {self.restart_timeout:g} s: "
                                  f"{_first_line(cause)}")
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _step(self, op: str, *args: Any) -> list[Any]:
        """Every shard's reply to the state-changing command ``op``, which then joins the history."""
        out = self._call("step", len(self.history), op, args)
        self.history.append((op, args))
        return out

    def _read(self, op: str) -> list[Any]:
        """Every shard's reply to the read-only command ``op``, once it has run the whole history."""
        return self._call("read", len(self.history), op)

    # -- the ShardPool
    def observe(self, day: int) -> None:
        self._step("observe", int(day))

    def answer(self, raw: bytes, world_day: int, now: float) -> tuple[list, int]:
        from agents.shard import Answer

        answers, rejected = [], 0
        for reply in self._step("answer", bytes(raw), int(world_day), float(now)):
            rejected += int(reply["rejected"])
            for charges, sent, lost in reply["cohorts"]:
                answers.append(Answer([_unpack_charge(c) for c in charges],
                                      [(bytes(d), float(t), int(n)) for d, t, n in sent], int(lost)))
        return answers, rejected

    def values(self, day: int) -> tuple[np.ndarray, int]:
        """Every device's value on ``day``: the shards' slices, concatenated (valid until the next call), and
        how many were clipped."""
        clipped = 0
        for s, (part, n) in zip(self.shards, self._step("values", int(day))):
            lo, hi = s[0][0], s[-1][1]
            if self._values is None or self._values.shape[1:] != part.shape[1:]:
                self._values = np.empty((self.devices, *part.shape[1:]), dtype=part.dtype)
            self._values[lo:hi] = part
            clipped += int(n)
        assert self._values is not None
        return self._values, clipped

    def guards(self) -> dict[str, int]:
        out = {"refusals": 0, "ignored": 0}
        for reply in self._read("guards"):
            for k in out:
                out[k] += int(reply[k])
        return out

    def stats(self) -> list[dict[str, float]]:
        """Each actor's peak resident memory (``peak_mb``, since its last start), seconds computing answers
        and packing them, CPU seconds, commands replayed into it (``replayed``) and the driver's recoveries
        of it (``restarts``)."""
        return [{**{k: float(v) for k, v in r.items()}, "restarts": float(n)}
                for r, n in zip(self._read("stats"), self.recoveries)]

    def close(self) -> None:
        ray = self._ray
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
        self._own_ray = False

    def __enter__(self) -> "RayShards":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine(address: str | None = None, shards: int = 0, **options: Any) -> Callable[[dict, list], RayShards]:
    """The pool factory of ``runner.run(..., engine=...)``: ``shards`` Ray actors (0: :data:`DEFAULT_SHARDS`,
    never more than the cohorts). Raises :class:`ScenarioError` at once when Ray is not installed."""
    require_ray()

    def make(scenario_data: dict, slices: list[tuple[int, int]]) -> RayShards:
        n = max(1, min(int(shards) or DEFAULT_SHARDS, len(slices)))
        return RayShards(scenario_data, split_cohorts(slices, n), address=address, **options)

    return make
