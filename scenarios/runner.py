"""Run a scenario in simulated time: world, device cohorts, network, collector, ledger, event log.

The round loop: at the start of round r (time (r - 1) x round_seconds) the world applies scripted changes,
the collector broadcasts a collection request, cohorts answer through the network until the deadline, the
collector closes the round into an estimate, and the per-round spend distribution is logged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, TextIO

import numpy as np
import simpy
import structlog

from agents.cohort import CohortAgent
from agents.shard import ShardedCohorts, ThreadShards, guard_counts
from agents.world import World
from collector import spill
from collector.hostile import Hostility
from collector.network import Network, Traffic
from collector.process import CollectorProcess, CollectorStats
from protocols import transcript as canonical
from protocols.base import CollectorSide, Observer, ProtocolParams
from protocols.ledger import Ledger
from scenarios import attacks, failure
from scenarios.metrics import round_metrics
from scenarios.parallel import ProcessShards, available_cores, resolve_threads, resolve_workers, split_cohorts
from scenarios.schema import Scenario


@dataclass
class RoundRecord:
    round: int
    time: float
    truth: float | np.ndarray
    estimate: float | np.ndarray
    reports: int
    clipped: int
    sd_theory: float | np.ndarray  # closed-form sd of the estimate given the round's true values and the reports that arrived
    info: dict = dataclasses.field(default_factory=dict)  # protocol-specific figures (THRESH: global_update, ...)


class RunCollector(Protocol):
    """What a run's result keeps of its collector: the simulated CollectorProcess or the live server."""

    protocol: CollectorSide
    stats: CollectorStats


class RunNetwork(Protocol):
    """What a run's result keeps of its network: the messages and bytes it carried."""

    traffic: Traffic


@dataclass
class RunResult:
    scenario: Scenario
    rounds: list[RoundRecord]
    ledger: Ledger
    world: World
    collector: RunCollector
    network: RunNetwork
    transcript_digest: str
    wall_seconds: float
    device_rejected: int | None  # collector messages the devices could not decode (None: not known here)
    guards: dict[str, int] = field(default_factory=dict)  # device-side counters: refusals, ignored
    extra: dict[str, Any] = field(default_factory=dict)
    #: [analysis] attacks: every device's true value in collection round t at column t - 1 ((devices, rounds)
    #: float64, NaN where a device was not in the population); None when the attacks are off or not applicable
    true_values: np.ndarray | None = None


class Clock(Protocol):
    """The time the events are stamped with: a SimPy environment's, or a live run's nominal clock."""

    @property
    def now(self) -> float: ...


def _event_logger(stream: TextIO | None, clock: Clock) -> Any:
    """A structlog logger writing JSON lines with the simulated time on every event."""

    def add_sim_time(_, __, event: dict) -> dict:
        event["sim_time"] = float(clock.now)
        return event

    if stream is None:
        return structlog.wrap_logger(structlog.ReturnLogger(), processors=[lambda *_: ""])
    processors: list[Any] = [add_sim_time, structlog.processors.add_log_level, structlog.processors.JSONRenderer()]
    return structlog.wrap_logger(structlog.WriteLogger(stream), processors=processors)


def bucket_width(params: ProtocolParams) -> float:
    """Value width of a histogram bucket (1 for protocols without buckets)."""
    k = getattr(params, "buckets", None)
    return params.max_value / k if k else 1.0


def protocol_parameters(params: ProtocolParams) -> dict[str, Any]:
    """A protocol's parameters by name (the run_started event, summary.json ``parameters``): a dataclass's
    fields, else the public attributes of the instance (a plugin's parameter class need not be a dataclass)."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        named = dataclasses.asdict(params)
    else:
        named = {k: v for k, v in getattr(params, "__dict__", {}).items() if not k.startswith("_")}
    named.pop("warnings", None)  # what the table held that did not apply: the scenario's warnings, printed
    return named


def cohort_slices(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def run(scenario: Scenario, events: TextIO | None = None,
        progress: Callable[[int, int], None] | None = None,
        engine: Callable[[dict, list[tuple[int, int]]], Any] | None = None) -> RunResult:
    """Run ``scenario``; JSON-lines events go to ``events``; ``progress(done, total)`` after each round.
    ``engine(scenario data, cohort slices)``: the pool of device shards of another engine (a ShardPool with
    ``workers``, ``stats()`` and ``close()``, e.g. scenarios/ray_engine.py) instead of ``[simulation] workers``."""
    t0 = time.perf_counter()
    sc = scenario
    slices = cohort_slices(sc.devices, sc.simulation.cohort_size)
    started: float | None = None  # seconds to start another engine (Ray: ray.init; its actors start meanwhile)
    if engine is not None:
        pool: Any = engine(sc.as_run, slices)
        workers = pool.workers
        started = time.perf_counter() - t0
    else:
        workers = resolve_workers(sc.simulation.workers, sc.devices, sc.rounds, len(slices))
        # the cohorts' work in shard processes (scenarios/parallel.py), started first: they load while this builds
        pool = ProcessShards(sc.as_run, split_cohorts(slices, workers)) if workers > 1 else None
    finished = False
    try:
        result = _run(sc, t0, slices, workers, pool, events, progress)
        finished = True
        if started is not None:  # part of wall_seconds, said apart
            result.extra["parallelism"]["start_seconds"] = started
        return result
    finally:
        if isinstance(pool, ProcessShards) and not finished:  # interrupted, or failed: stop the workers now
            pool.abort()
        if pool is not None:
            pool.close()


def _run(sc: Scenario, t0: float, slices: list[tuple[int, int]], workers: int, pool: Any,
         events: TextIO | None, progress: Callable[[int, int], None] | None) -> RunResult:
    env = simpy.Environment()
    log = _event_logger(events, env).bind(run=sc.name, seed=sc.seed)
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value, last_day=sc.rounds)
    ledger = Ledger(sc.devices)
    network = Network(env, sc.network, sc.seed)
    protocol = sc.protocol.make_collector(sc.devices)
    spill.attach(protocol)  # large non-bit transcripts go to a temporary directory, not RAM

    hostility = Hostility(sc.behavior, sc.protocol.max_value)
    collector = CollectorProcess(env, protocol, network, [], sc.network.deadline, log, hostility)
    cohorts: list[Any] = []
    answering = 0 if pool is not None else resolve_threads(sc.simulation.threads, workers, sc.devices, sc.rounds,
                                                           len(slices), sc.simulation.cohort_size)
    threads = max(answering, 1)
    if answering:  # the cohorts answered together by shards in threads of this process, reading this world
        pool = ThreadShards(sc.protocol, sc.seed, sc.limits, world, sc.network, split_cohorts(slices, threads),
                            sc.simulation.round_seconds, ahead=available_cores() >= 2, check=ledger.check)
    if pool is not None:
        sharded = ShardedCohorts(env, pool, len(slices), world, network, ledger, collector.deliver)
        if not isinstance(pool, ThreadShards):
            world.use_values(pool.values)  # the truth from the values the workers compute anyway
        collector.cohort_inboxes.append(sharded.inbox)
        observing = isinstance(sc.protocol.make_devices(sc.seed, np.arange(1), sc.limits), Observer)
        observers: list[Any] = [sharded] if observing else []
    else:
        for lo, hi in slices:
            device = sc.protocol.make_devices(sc.seed, np.arange(lo, hi), sc.limits)
            cohorts.append(CohortAgent(env, device, world, network, ledger, collector.deliver,
                                       sc.simulation.round_seconds))
        collector.cohort_inboxes.extend(c.inbox for c in cohorts)
        observers = [c for c in cohorts if isinstance(c.device, Observer)]
    log.info("run_started", devices=sc.devices, rounds=sc.rounds, protocol=protocol_parameters(sc.protocol),
             cohorts=len(slices), workers=workers, round_epsilon=sc.protocol.round_epsilon)

    book = RoundBook(sc, world, ledger, protocol, log)
    if isinstance(pool, ThreadShards):  # (worker processes' values come in a buffer the next day reuses)
        sharded.ahead = book.ahead

    def new_day(r: int, honest: bool = True):
        """Wait for round r's start; the world moves to it and the devices look at their counters."""
        start = (r - 1) * sc.simulation.round_seconds
        if env.now < start:
            yield env.timeout(start - env.now)
        if honest:
            book.advance_day(r)
        else:
            world.advance_to(r)
        for cohort in observers:
            cohort.observe(r)

    submit = getattr(pool, "submit", None)

    def clock():
        for r in range(1, sc.rounds + 1):
            yield from new_day(r)
            if r % book.epoch_length:
                continue
            t = r // book.epoch_length
            book.before_collect(t)
            result = yield env.process(collector.run_round(t))
            book.close(t, result, env.now, collector.stats.rejected)
            if submit is not None and hasattr(protocol, "stages"):  # the digest's inputs, beside the next round
                canonical.prepare_ahead(protocol.stages(), submit)
            if progress is not None:
                progress(r, sc.rounds)
        for t in hostility.extra_rounds(sc.collections):  # a hostile collector asking for more
            for r in range((t - 1) * book.epoch_length + 1, t * book.epoch_length + 1):
                yield from new_day(r, honest=False)
            yield env.process(collector.run_round(t))
            log.info("round_beyond_horizon", round=t, reports=collector.stats.reports_accepted)

    done = env.process(clock())
    try:
        env.run(until=done)
    except Exception as exc:  # which round it broke in, for the one line of a plugin's error (scenarios/failure.py)
        exc.add_note(f"{failure.ROUND_NOTE}{int(env.now // sc.simulation.round_seconds) + 1}")
        raise
    finally:
        if isinstance(pool, ThreadShards):
            pool.close()
    engine = ("one SimPy process per cohort" if pool is None else "threads" if isinstance(pool, ThreadShards)
              and threads > 1 else "cohorts answered together in the run's thread" if isinstance(pool, ThreadShards)
              else "worker processes" if isinstance(pool, ProcessShards) else getattr(pool, "engine", "other"))
    extra: dict[str, Any] = {"workers": workers, "threads": threads,
                             "parallelism": {"workers": workers, "threads": threads, "engine": engine}}
    if pool is not None:
        guards, rejected = pool.guards(), sharded.rejected
        if not isinstance(pool, ThreadShards):
            extra["worker_stats"] = pool.stats()
            if any("restarts" in st for st in extra["worker_stats"]):  # shards restarted and rebuilt by replay
                extra["parallelism"]["restarts"] = int(sum(st.get("restarts", 0) for st in extra["worker_stats"]))
    else:
        guards, rejected = guard_counts([c.device for c in cohorts]), sum(c.rejected for c in cohorts)
    wall = time.perf_counter() - t0
    log.info("run_finished", wall_seconds=wall, messages_rejected=collector.stats.rejected)
    return RunResult(sc, book.records, ledger, world, collector, network, protocol.transcript_digest(), wall,
                     rejected, guards, extra=extra, true_values=book.true_values)


class RoundBook:
    """The world-side bookkeeping of a run, shared by the simulated and the live runtime: scripted changes,
    the truth of each round (for THRESH the mean of the group probabilities over the epoch), ToPL's oracle
    threshold, round records, spend snapshots and the round_closed event."""

    def __init__(self, sc: Scenario, world: World, ledger: Ledger, protocol: Any, log: Any) -> None:
        self.sc, self.world, self.ledger, self.protocol, self.log = sc, world, ledger, protocol, log
        self.kind, self.width = sc.protocol.kind, bucket_width(sc.protocol)
        self.epoch_length = int(getattr(sc.protocol, "epoch_length", 1))  # rounds per collection (THRESH: l)
        self.all_ids = np.arange(sc.devices)
        self.records: list[RoundRecord] = []
        self._levels: list[float] = []
        self._before: dict = {}
        # [analysis] attacks: a copy of every device's true value per collection round (scenarios/attacks.py)
        keep = sc.attacks and attacks.not_applicable(sc.protocol) is None
        self.true_values = np.full((sc.devices, sc.collections), np.nan) if keep else None
        self._ahead: tuple[int, int, Any] | None = None  # (day, reports, future of (truth, sd)): see ahead
        self.fired_through = 0  # the last day whose behaviors' changes are in the event log (log_fired)

    def ahead(self, submit: Callable[..., Any], reports: int) -> None:
        """Start computing the open round's truth and estimate sd (the protocol's ``truth``, ``estimate_sd``) as
        a job given to ``submit`` (another core), expecting ``reports`` reports: the runtime's thread takes the
        reports in meanwhile. :meth:`close` takes the job's figures only if the round closes on the same day
        with that many reports; else it computes them itself, so the figures never depend on this call. The
        job reads the day's values, which no one writes once computed."""
        self._drop_ahead()
        if self.kind == "epoch" or self.world.counters is not None:  # several counters: values() computes them
            return
        values, _ = self.world.values(self.all_ids)
        present = self.world.present(self.all_ids)
        self._ahead = (self.world.day, int(reports),
                       submit(functools.partial(self._figures, values, present, reports)))

    def _figures(self, values: np.ndarray, present: np.ndarray | None, reports: int) -> tuple[Any, Any]:
        """The round's truth and the estimate's theoretical sd for ``reports`` reports (NaN for none), both of
        the devices present that day (``present``; None: everyone): the reports estimate their figure, not
        that of devices yet to join or gone. NaN (of the truth's shape) when none is present."""
        protocol = self.sc.protocol
        if present is not None:
            if not present.any():
                nan = np.full_like(np.asarray(protocol.truth(values[:1]), dtype=np.float64), np.nan)
                return (float(nan) if nan.ndim == 0 else nan), math.nan
            values = values[present]
        return protocol.truth(values), protocol.estimate_sd(values, reports) if reports else math.nan

    def _drop_ahead(self) -> None:
        """Forget the figures computed ahead, cancelling the job if it has not started (a later broadcast of the
        round, or a guess that did not hold)."""
        ahead, self._ahead = self._ahead, None
        cancel = getattr(ahead[2], "cancel", None) if ahead is not None else None
        if cancel is not None:
            cancel()

    def advance_day(self, day: int) -> None:
        for change in self.world.advance_to(day):
            self.log.info("behavior_change", round=day, group=change.group, fraction=change.fraction)
        if self.kind == "epoch":  # the day's mean probability over the devices present (NaN: none is)
            present = self.world.present(self.all_ids)
            levels = self.world.levels if present is None else self.world.levels[present]
            self._levels.append(float(levels.mean()) if levels.size else math.nan)

    def log_fired(self) -> None:
        """Log each change a behavior made (``behavior_fired``: round, group, behavior, devices) that the world
        recorded for a day up to its current one (computed by now) and not logged yet."""
        for day, group, behavior, devices in self.world.behavior_fired:
            if self.fired_through < day <= self.world.day:
                self.log.info("behavior_fired", round=day, group=group, behavior=behavior, devices=devices)
        self.fired_through = max(self.fired_through, self.world.day)

    def before_collect(self, t: int) -> None:
        """The protocol's reference figures for collection t from the true values (its ``before_collect``
        hook, e.g. ToPL's oracle threshold), added to the round's info when it closes."""
        hook = getattr(self.sc.protocol, "before_collect", None)
        self._before = {} if hook is None else hook(t, lambda: self.world.values(self.all_ids)[0], self.protocol)

    def close(self, t: int, result: Any, now: float, rejected: int) -> RoundRecord:
        sc, kind = self.sc, self.kind
        result.info.update(self._before)
        values, clipped = self.world.values(self.all_ids)
        self.log_fired()
        present = self.world.present(self.all_ids)
        if self.true_values is not None and 1 <= t <= self.true_values.shape[1]:
            self.true_values[:, t - 1] = values if present is None else np.where(present, values, np.nan)
        if kind == "epoch":
            days = np.array(self._levels)  # each day's mean over the devices present
            truth = float(days[~np.isnan(days)].mean()) if not np.isnan(days).all() else math.nan
            self._levels.clear()
            levels = self.world.levels if present is None else self.world.levels[present]
            sd = sc.protocol.estimate_sd(levels, result.reports) if result.reports and levels.size else math.nan
        else:
            ahead = self._ahead
            self._drop_ahead()  # a job not started yet (the side thread busy) is cancelled: computed here instead
            if ahead is not None and ahead[:2] == (self.world.day, result.reports) \
                    and not getattr(ahead[2], "cancelled", lambda: False)():
                truth, sd = ahead[2].result()
            else:
                truth, sd = self._figures(values, present, result.reports)
        rec = RoundRecord(t, now, truth, result.estimate, result.reports, clipped, sd, result.info)
        self.records.append(rec)
        spend = self.ledger.close_round(t, now)
        shown = {"truth": truth, "estimate": result.estimate} if kind in ("mean", "epoch", "stream") else {}
        self.log.info("round_closed", round=t, **shown, **round_metrics(kind, truth, result.estimate, self.width),
                      **result.info, reports=result.reports, clipped=clipped, rejected=rejected,
                      spend={k: v for k, v in spend.items() if k not in ("round", "time")})
        return rec
