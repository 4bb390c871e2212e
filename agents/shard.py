"""Device cohorts answered outside the SimPy process: the work of one shard, and the agent that drives shards.

A cohort's answer to a collector message is a pure function of its device side's state, the world's values
on the world's day, the message, the simulated time and the network's keyed fates (docs/design.md section 3):
nothing in it depends on another cohort. :func:`answer_cohort` computes it: the device side's batch and
charges, the batch split by the network into the sub-batches that arrive on time and late (wire bytes and
delays) and the reports lost. :class:`~agents.cohort.CohortAgent` (a SimPy process per cohort) uses it
in-process; :class:`CohortShard` holds the cohorts of one shard (a contiguous range of them) for a worker
process (scenarios/parallel.py); :class:`ShardedCohorts` is the one SimPy process that stands for every
cohort of a sharded run: when a broadcast arrives it has every shard answer at once, then, in cohort order,
records the charges in the ledger and puts each sub-batch on the simulated network, exactly as the cohorts'
own processes would have at that simulated time. Digests therefore do not depend on how cohorts are sharded.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import numba as nb
import numpy as np
import simpy

from agents.world import World
from collector.network import Network
from protocols import wire
from protocols.base import DeviceSide, Observer
from protocols.ledger import Charge, Entry, Ledger
from protocols.messages import CollectionRequest, Decision, ReportBatch, Threshold

__all__ = ["BROADCAST_KINDS", "Answer", "CohortShard", "ShardPool", "ShardedCohorts", "ThreadShards", "answer_cohort"]

BROADCAST_KINDS = {CollectionRequest: 1, Decision: 2, Threshold: 3}  # keys of the downlink loss draws


@dataclass
class Answer:
    """One cohort's answer to one collector message: its charges, and its report sub-batches as
    (wire bytes, delay in simulated seconds, reports) in sending order; ``lost``: reports the network lost."""

    charges: list[Charge] = field(default_factory=list)
    sent: list[tuple[bytes, float, int]] = field(default_factory=list)
    lost: int = 0
    #: the charges already checked by the ledger (Ledger.check, on the thread that answered), to be added in
    #: cohort order; None: not checked yet (the run's thread records ``charges``)
    entries: list[Entry | None] | None = None


@nb.njit(cache=True, nogil=True)
def _take_kernel(a, idx, out):  # pragma: no cover (compiled)
    """out[i] = a[idx[i]] (half the time of numpy's fancy indexing, which checks every index)."""
    for i in range(idx.shape[0]):
        out[i] = a[idx[i]]


#: the dtypes :func:`_take` gathers with its kernel (native byte order; the wire's, and ids)
_TAKEN = frozenset(np.dtype(t) for t in (np.uint8, np.uint32, np.uint64, np.int32, np.int64, np.float32, np.float64))


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]`` for ``idx`` valid indices into ``a`` (the network's on-time or late reports of a batch):
    compiled for a one-dimensional contiguous column of the wire's numbers, numpy's for anything else."""
    a = np.asarray(a)  # a wire.Bits column as the plain array it views
    if a.ndim != 1 or a.dtype not in _TAKEN or not a.flags.c_contiguous or idx.dtype != np.int64:
        return a[idx]
    out = np.empty(idx.shape[0], dtype=a.dtype)
    _take_kernel(a, idx, out)
    return out


def _subset(batch: ReportBatch, idx: np.ndarray, devices: np.ndarray | None = None) -> ReportBatch:
    """The reports of ``batch`` at ``idx`` (``devices``: their ids, when the network's fate wrote them)."""
    cols = {k: (wire.bits(_take(v, idx)) if isinstance(v, wire.Bits) else _take(v, idx))
            for k, v in batch.columns.items()}
    return ReportBatch(round=batch.round, protocol=batch.protocol,
                       devices=_take(batch.devices, idx) if devices is None else devices, columns=cols)


def answer_cohort(device: DeviceSide, ids: np.ndarray, world: World, network: Network,
                  msg: CollectionRequest | Decision | Threshold, day: int, now: float) -> Answer:
    """The answer of the cohort ``device`` (devices ``ids``) to ``msg`` received at ``now`` on its own ``day``,
    reading the world's values on the world's current day."""
    values, _ = world.values(ids)
    present = world.present(ids)
    got = network.received(ids, msg.round, BROADCAST_KINDS[type(msg)])
    if got is not None:
        present = got if present is None else present & got
    batch, charges = device.respond(msg, day, values, now, present)
    out = Answer(charges=list(charges))
    if batch is None or len(batch) == 0:
        return out
    before = network.traffic.reports_lost
    fate = network.fate(batch.devices, batch.round, msg.deadline - now)
    out.lost = network.traffic.reports_lost - before
    for idx, delay, devices in ((fate.on_time, fate.on_time_delay, fate.on_time_devices),
                                (fate.late, fate.late_delay, None)):
        if idx.size:
            sub = batch if idx.size == len(batch) else _subset(batch, idx, devices)
            out.sent.append((wire.encode(sub), float(delay), int(idx.size)))
    return out


def decode_broadcast(raw: bytes) -> tuple[CollectionRequest | Decision | Threshold | None, bool]:
    """The collector message a cohort answers in ``raw``; or None, with whether the bytes could not be decoded
    at all (a wire error: each cohort counts it as a rejected message) or held another kind of message."""
    try:
        msg = wire.decode(raw)
    except wire.WireError:
        return None, True
    return (msg, False) if isinstance(msg, (CollectionRequest, Decision, Threshold)) else (None, False)


def _deadline(raw: bytes) -> float:
    """The deadline of the collector message ``raw`` (inf when it has none or is not one)."""
    msg, _ = decode_broadcast(raw)
    return float(msg.deadline) if msg is not None else math.inf


def signed_ids(device_ids: np.ndarray) -> np.ndarray:
    """A cohort's device ids as int64 for indexing: a view of the device side's own ids where they are uint64
    (ids are below 2**63), so a population's ids are held once."""
    ids = np.asarray(device_ids)
    return ids.view(np.int64) if ids.dtype == np.uint64 else ids.astype(np.int64, copy=False)


def _run_now(job: Callable[[], Any]) -> Future:
    """An executor's ``submit`` that runs ``job`` at once, on the calling thread (a worker process has no core
    to spare beside its own: it computes ahead between its answers)."""
    done: Future = Future()
    try:
        done.set_result(job())
    except BaseException as exc:  # handed to whoever asks for the result, as an executor would
        done.set_exception(exc)
    return done


def guard_counts(devices: Iterable[Any]) -> dict[str, int]:
    """The device sides' enforcement counters, summed: device-reports refused for the budget, and collector
    messages ignored, once per device (protocols.guard)."""
    devices = list(devices)
    return {"refusals": sum(d.guard.refusals for d in devices),
            "ignored": sum(d.guard.device_messages_ignored for d in devices)}


def cohort_day(now: float, round_seconds: float) -> int:
    """The devices' own round counter: rounds start every ``round_seconds``, the first at time 0."""
    return int(now // round_seconds) + 1


class CohortShard:
    """The device sides of a contiguous run of cohorts (``cohorts``: (lo, hi) id ranges), with their own world
    (restricted to the shard's ids when it has no stateful behaviors) and the network's keyed fates."""

    def __init__(self, params: Any, seed: int, limits: Any, world: World, network: Network,
                 cohorts: list[tuple[int, int]], round_seconds: float) -> None:
        self.world, self.network, self.round_seconds = world, network, float(round_seconds)
        self.cohorts = [(int(lo), int(hi)) for lo, hi in cohorts]
        # uint64 ids, the device sides' own type: taken as they are, not copied
        self.devices = [params.make_devices(seed, np.arange(lo, hi, dtype=np.uint64), limits) for lo, hi in self.cohorts]
        self.ids = [signed_ids(d.device_ids) for d in self.devices]
        self.observers = [(i, d) for i, d in enumerate(self.devices) if isinstance(d, Observer)]

    def _at(self, day: int) -> World:
        """The world moved to ``day``, its values computed (taken from its twin when :meth:`prefetch` computed
        them)."""
        self.world.advance_to(day)
        self.world.values(np.empty(0, dtype=np.int64))
        return self.world

    def prefetch(self, day: int) -> None:
        """Compute the world's values on ``day`` before anyone asks (:meth:`agents.world.World.prefetch`, here
        and now): a worker calls it right after sending a broadcast's answers, so it runs while the run's
        process takes the reports in, and the next day's request finds them ready. Worlds with behaviors (state
        from day to day) or with values from a data set are left alone, as World.prefetch leaves them."""
        self.world.prefetch(day, _run_now)

    def observe(self, day: int) -> None:
        """The devices' daily look at their counters (world moved to ``day`` first)."""
        self._at(day)
        for i, device in self.observers:
            values, _ = self.world.values(self.ids[i])
            device.observe(day, values, self.world.present(self.ids[i]))

    def answer(self, raw: bytes, world_day: int, now: float) -> tuple[list[Answer], int]:
        """Every cohort's answer to the broadcast ``raw`` received at ``now`` (the world at ``world_day``), and
        how many cohorts could not decode it."""
        self._at(world_day)
        msg, bad = decode_broadcast(raw)
        if msg is None:
            return [Answer() for _ in self.devices], len(self.devices) if bad else 0
        day = cohort_day(now, self.round_seconds)
        return [answer_cohort(d, ids, self.world, self.network, msg, day, now)
                for d, ids in zip(self.devices, self.ids)], 0

    def values(self, day: int, out: np.ndarray) -> int:
        """Write the shard's devices' values on ``day`` into ``out`` (all devices' positions, this shard's
        range filled) and return how many of them were clipped."""
        self._at(day)
        lo, hi = self.cohorts[0][0], self.cohorts[-1][1]
        values, clipped = self.world.totals(lo, hi)
        out[lo:hi] = values
        return clipped

    def guards(self) -> dict[str, int]:
        return guard_counts(self.devices)


class ThreadShards:
    """Cohorts answered by threads of the run's own process, every cohort reading the run's world: the in-process
    counterpart of worker processes (scenarios/parallel.py). The device sides' and the network's kernels release
    the GIL (numba ``nogil``), so on several cores the cohorts' work runs at once. A broadcast's cohorts are
    handed to the threads one by one, in cohort order, and their answers come back as an iterator in cohort order
    that yields each as soon as it is ready: the run's thread records a cohort's charges and puts its reports on
    the network while the threads compute the next cohorts. Each cohort has its own device side and its own
    network fates, so a run is the same for every number of threads. With ``threads`` = 1 the calling thread
    answers the cohorts itself, together, without a SimPy process, an inbox and a decoding of every broadcast
    each.

    ``check``: the ledger's :meth:`~protocols.ledger.Ledger.check`, run on the thread that answered a cohort, so
    that the run's thread only adds the checked charges.

    ``ahead``: once a broadcast's cohorts are handed out, the world's next day is computed in a twin of the world
    (:meth:`agents.world.World.prefetch`) on a spare core, while the run's thread takes the reports in and closes
    the round; the next day's request finds its values ready. The first day is started at once, so the twin
    draws the devices' levels while the run builds its collector and ledger.

    ``submit``: with ``ahead``, a further thread for the run's own side work: once a broadcast's charges are
    recorded, :class:`ShardedCohorts` has the ledger compute the round's spend distribution there
    (:meth:`~protocols.ledger.Ledger.distribution_ahead`) while its thread takes the reports in."""

    def __init__(self, params: Any, seed: int, limits: Any, world: World, network: Any,
                 shards: list[list[tuple[int, int]]], round_seconds: float, ahead: bool = False,
                 check: Callable[[Charge], Entry | None] | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.world, self.check = world, check
        self.threads = len(shards)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ldpsim-cohorts") if self.threads > 1 else None
        self._ahead = (self._pool or ThreadPoolExecutor(1, thread_name_prefix="ldpsim-world")) if ahead else None
        self._side = ThreadPoolExecutor(1, thread_name_prefix="ldpsim-side") if ahead else None
        # the first day (its levels drawn) started first, while this builds the device sides and the run its
        # other parts
        self._prefetch(world.day + 1)
        cohorts = [c for shard in shards for c in shard]
        try:
            self.shard = CohortShard(params, seed, limits, world, Network(None, network, seed),
                                     cohorts, round_seconds)
        except BaseException:  # device sides that cannot be built: no thread left drawing levels for no one
            self.close()
            raise
        self.nets = [Network(None, network, seed) for _ in cohorts]

    def _ready(self, day: int) -> None:
        """The world at ``day`` with its values computed, before any cohort reads them."""
        self.world.advance_to(day)
        self.world.values(np.empty(0, dtype=np.int64))

    def observe(self, day: int) -> None:
        self._ready(day)
        self.shard.observe(day)

    def answer(self, raw: bytes, world_day: int, now: float) -> tuple[Iterable[Answer], int]:
        self._ready(world_day)
        shard = self.shard
        msg, bad = decode_broadcast(raw)
        if msg is None:
            return [Answer() for _ in shard.devices], len(shard.devices) if bad else 0
        day = cohort_day(now, shard.round_seconds)

        def one(i: int) -> Answer:
            ans = answer_cohort(shard.devices[i], shard.ids[i], self.world, self.nets[i], msg, day, now)
            if self.check is not None:
                ans.entries = [self.check(c) for c in ans.charges]
            return ans

        answers: Iterable[Answer]
        if self._pool is None:
            answers = [one(i) for i in range(len(shard.devices))]
        else:
            futures = [self._pool.submit(one, i) for i in range(len(shard.devices))]
            answers = (f.result() for f in futures)
        self._prefetch(world_day + 1)  # with threads, queued behind the cohorts: it starts as they run out of them
        return answers, 0

    @property
    def submit(self) -> Callable[..., Any] | None:
        """Where the run's thread may hand work of its own to run beside it (an executor's ``submit``; None on
        one core): a thread of its own, so that the work does not queue behind the next day's values."""
        return self._side.submit if self._side is not None else None

    def _prefetch(self, day: int) -> None:
        if self._ahead is not None:
            self.world.prefetch(day, self._ahead.submit, parts=self.threads)

    def values(self, day: int) -> tuple[np.ndarray, int]:
        self._ready(day)
        return self.world.totals(0, self.world.n)

    def guards(self) -> dict[str, int]:
        return self.shard.guards()

    def close(self) -> None:
        self.world.settle()
        for pool in {self._pool, self._ahead, self._side}:
            if pool is not None:
                pool.shutdown(wait=True)


class ShardPool(Protocol):
    """Shards that answer together (scenarios/parallel.py): each call returns every cohort's result in
    cohort order, whichever shard holds it."""

    def observe(self, day: int) -> None: ...

    def answer(self, raw: bytes, world_day: int, now: float) -> tuple[Iterable[Answer], int]: ...

    def values(self, day: int) -> tuple[np.ndarray, int]: ...

    def guards(self) -> dict[str, int]: ...


class _FanoutInbox:
    """The single inbox of :class:`ShardedCohorts`, counted by the network as one copy per cohort."""

    def __init__(self, env: simpy.Environment, copies: int) -> None:
        self.store: simpy.Store = simpy.Store(env)
        self.copies = copies

    def put(self, raw: bytes) -> Any:
        return self.store.put(raw)


class ShardedCohorts:
    """Every cohort of a run as one SimPy process whose answers the shards compute (module docstring)."""

    def __init__(self, env: simpy.Environment, pool: ShardPool, n_cohorts: int, world: World, network: Network,
                 ledger: Ledger, send: Callable[[bytes], object]) -> None:
        self.env, self.pool, self.world, self.network, self.ledger, self.send = env, pool, world, network, ledger, send
        self.inbox = _FanoutInbox(env, n_cohorts)
        self.rejected = 0  # collector messages the cohorts could not decode (one per cohort)
        #: ``ahead(submit, on_time)``: called with the pool's ``submit`` once a broadcast's answers are recorded
        #: and on the network, ``on_time`` the reports due before its deadline (the runner's RoundBook.ahead)
        self.ahead: Callable[[Callable[..., Any], int], None] | None = None
        self.process = env.process(self.run())

    def observe(self, day: int) -> None:
        self.pool.observe(day)

    def run(self):
        while True:
            raw = yield self.inbox.store.get()
            now = float(self.env.now)
            answers, rejected = self.pool.answer(raw, self.world.day, now)
            self.rejected += rejected
            on_time, deadline = 0, _deadline(raw)
            for ans in answers:  # in cohort order, as the cohorts' own processes would at this instant
                # checked on the thread that answered (ThreadShards), or here
                for entry in ans.entries if ans.entries is not None else map(self.ledger.check, ans.charges):
                    if entry is not None:
                        self.ledger.add(entry)
                self.network.traffic.reports_lost += ans.lost
                for data, delay, reports in ans.sent:
                    self.network.transmit(data, delay, self.send, reports=reports)
                    on_time += reports if now + delay < deadline else 0
            submit = getattr(self.pool, "submit", None)
            if submit is not None:  # the broadcast's charges are in: the round's spend figures, beside the reports
                self.ledger.distribution_ahead(submit)
                if self.ahead is not None:
                    self.ahead(submit, on_time)
