"""Parallel cohorts in one run (scenarios/parallel.py, agents/shard.py): the run is the same whatever the number
of worker processes and the cohort size: digests, traffic, device counters and the ledger's spend history."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from scenarios import output, parallel, runner, schema


def _run(name: str, workers: int, cohort: int, *extra: str) -> tuple[dict, runner.RunResult]:
    sc = schema.load(name, ["population.devices=2400", f"simulation.cohort_size={cohort}",
                            f"simulation.workers={workers}", "rounds=6", *extra])
    result = runner.run(sc)
    return output.summary(result), result


def _same_run(a: tuple[dict, runner.RunResult], b: tuple[dict, runner.RunResult]) -> None:
    (sa, ra), (sb, rb) = a, b
    assert sa["digests"] == sb["digests"]
    assert sa["messages"] == sb["messages"] and sa["reports"] == sb["reports"]
    assert ra.guards == rb.guards and ra.device_rejected == rb.device_rejected
    assert ra.ledger.history == rb.ledger.history
    assert np.array_equal(ra.ledger.spend, rb.ledger.spend)
    for x, y in zip(ra.rounds, rb.rounds, strict=True):  # the truth and its sd, whichever thread computed them
        np.testing.assert_array_equal(np.asarray(x.truth), np.asarray(y.truth))
        np.testing.assert_array_equal(np.asarray(x.sd_theory), np.asarray(y.sd_theory))


@pytest.mark.parametrize("name, extra", [
    ("app_usage_31d", ("collector.behavior=replay",)),  # memoized reports, a hostile collector repeating rounds
    ("thresh_drift", ("rounds=8", "protocol.epoch_length=2")),  # the devices observe every day; votes, decisions
    ("topl_pos", ()),  # thresholds broadcast mid-round
    ("weekday_usage", ()),  # behaviors: every shard's world computes the whole population
    ("apps_multi", ("population.groups.1.joins=3",)),  # several counters a device; devices joining late
])
def test_two_workers_run_exactly_what_one_process_runs(name, extra, monkeypatch):
    one = _run(name, 1, 300, "simulation.threads=1", *extra)
    two = _run(name, 2, 300, *extra)
    assert two[1].extra["workers"] == 2 and one[1].extra["workers"] == 1 and one[1].extra["threads"] == 1
    _same_run(one, two)  # the same cohorts: the same messages too
    assert _run(name, 1, 700, *extra)[0]["digests"] == two[0]["digests"]  # other cohorts: the same digests
    threaded = _run(name, 1, 300, "simulation.threads=3", *extra)  # the cohorts answered by 3 threads
    assert threaded[1].extra["threads"] == 3 and threaded[1].extra["workers"] == 1
    _same_run(one, threaded)
    # auto on a large run of small cohorts: the cohorts answered together by the run's own thread
    monkeypatch.setattr(parallel, "AUTO_THREAD_DEVICE_ROUNDS", 0)
    together = _run(name, 1, 300, *extra)
    assert together[0]["parallelism"] == {"workers": 1, "threads": 1,
                                          "engine": "cohorts answered together in the run's thread"}
    _same_run(one, together)
    # summary.json says how the cohorts were answered
    assert threaded[0]["parallelism"] == {"workers": 1, "threads": 3, "engine": "threads"}
    assert two[0]["parallelism"] == {"workers": 2, "threads": 1, "engine": "worker processes"}
    assert one[0]["parallelism"] == {"workers": 1, "threads": 1, "engine": "one SimPy process per cohort"}


def test_threads_resolve_to_the_cores_for_runs_in_one_process_only(monkeypatch):
    """0: a SimPy process per cohort; 1: the cohorts answered together by the run's thread; T: T threads."""
    monkeypatch.setattr(parallel, "available_cores", lambda: 6)
    big, large = parallel.AUTO_THREAD_DEVICE_ROUNDS, parallel.AUTO_THREAD_COHORT
    assert parallel.resolve_threads(0, 1, big, 1, 100, large) == 6  # auto, large cohorts: one thread per core
    assert parallel.resolve_threads(0, 1, big, 1, 100, large - 1) == 1  # small cohorts: together, one thread
    assert parallel.resolve_threads(0, 1, big - 1, 1, 100, large) == 0  # small runs: a process per cohort
    assert parallel.resolve_threads(0, 1, big, 1, 4, large) == 4  # never more than the cohorts
    assert parallel.resolve_threads(0, 1, big, 1, 1, large) == 0  # one cohort: its own process
    assert parallel.resolve_threads(0, 3, big, 1, 100, large) == 0  # worker processes answer instead
    assert parallel.resolve_threads(5, 1, 10, 1, 100, 10) == 5  # an explicit number is taken as it is
    assert parallel.resolve_threads(1, 1, big, 1, 100, large) == 0  # 1: a SimPy process per cohort


def test_workers_resolve_to_the_cores_only_for_large_runs_and_never_beyond_the_cohorts(monkeypatch):
    cores = parallel.available_cores()
    assert parallel.resolve_workers(0, 1000, 10, 5) == 1  # small: no worker processes
    assert parallel.resolve_workers(0, 10_000_000, 31, 1000) == (min(cores, 1000) if cores >= 4 else 1)
    monkeypatch.setattr(parallel, "available_cores", lambda: 16)
    assert parallel.resolve_workers(0, 10_000_000, 31, 1000) == 16  # large, on many cores: one per core
    assert parallel.resolve_workers(0, 10_000_000, 31, 9) == 9
    monkeypatch.setattr(parallel, "available_cores", lambda: 2)
    assert parallel.resolve_workers(0, 10_000_000, 31, 1000) == 1  # 2 cores: one process is faster
    assert parallel.resolve_workers(2, 10_000_000, 31, 1000) == 2  # unless asked
    assert parallel.resolve_workers(8, 1000, 10, 3) == 3
    shards = parallel.split_cohorts([(0, 10), (10, 20), (20, 30), (30, 35)], 2)
    assert shards == [[(0, 10), (10, 20)], [(20, 30), (30, 35)]]
    assert parallel.split_cohorts([(0, 5)], 4) == [[(0, 5)]]


def test_a_worker_that_fails_is_a_clear_error_and_no_process_is_left(monkeypatch):
    sc = schema.load("quickstart", ["population.devices=1000", "simulation.cohort_size=200", "simulation.workers=2"])
    spawned: list = []
    real = parallel.ProcessShards.__init__

    def broken(self, data, shards):
        spawned.append(self)
        real(self, {**data, "seed": "not a seed"}, shards)  # the worker cannot rebuild the scenario

    monkeypatch.setattr(parallel.ProcessShards, "__init__", broken)
    with pytest.raises(parallel.WorkerError, match="seed"):
        runner.run(sc)
    assert spawned and not spawned[0].procs  # closed: every worker waited for


def test_a_bad_workers_value_names_the_key():
    with pytest.raises(schema.ScenarioError, match="simulation.workers"):
        schema.load("quickstart", ["simulation.workers=-1"])
    with pytest.raises(schema.ScenarioError, match="simulation.threads"):
        schema.load("quickstart", ["simulation.threads=2000"])


@pytest.mark.parametrize("name, extra", [
    ("app_usage_31d", ()),  # scripted changes on days 15 and 22 (a redrawn fraction of a group)
    ("apps_multi", ("population.groups.1.joins=3",)),  # several counters a device; devices joining late
])
def test_a_shard_computing_the_next_day_ahead_serves_the_same_values_and_answers(name, extra):
    """A worker's shard computes the next day's values in a twin world while the run's process takes the
    reports in (CohortShard.prefetch): every day's values, presence and answers equal a shard's that does not."""
    from agents.shard import CohortShard
    from agents.world import World
    from collector.network import Network
    from protocols import wire
    from protocols.messages import CollectionRequest

    sc = schema.load(name, ["population.devices=1200", *extra])

    def shard() -> CohortShard:
        world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value, span=(400, 1200))
        return CohortShard(sc.protocol, sc.seed, sc.limits, world, Network(None, sc.network, sc.seed),
                           [(400, 800), (800, 1200)], sc.simulation.round_seconds)

    ahead, plain = shard(), shard()
    out_a, out_p = np.zeros(sc.devices), np.zeros(sc.devices)
    taken = 0
    for day in range(1, sc.rounds + 1):
        now = (day - 1) * sc.simulation.round_seconds
        raw = wire.encode(CollectionRequest(round=day, protocol=sc.protocol.name, deadline=now + 3600.0))
        a, b = ahead.answer(raw, day, now), plain.answer(raw, day, now)
        assert [x.sent for x in a[0]] == [x.sent for x in b[0]] and a[1] == b[1]
        assert [[(c.reason, c.amount, c.devices.tolist()) for c in x.charges] for x in a[0]] == \
               [[(c.reason, c.amount, c.devices.tolist()) for c in x.charges] for x in b[0]]
        ahead.prefetch(day + 1)
        assert ahead.values(day, out_a) == plain.values(day, out_p)  # the day's own world still serves it
        assert np.array_equal(out_a, out_p)
        world = ahead._at(day + 1)
        taken += world._ahead is not None and world._cache is world._ahead._cache
    assert taken == sc.rounds  # every next day's values came from the twin that computed them ahead


@pytest.mark.parametrize("name, extra", [
    ("app_usage_31d", ()),  # behavior changes on days 15 and 22: the twin applies them as the world does
    ("apps_multi", ("population.groups.1.joins=3",)),  # several counters a device; devices joining late
    ("topl_pos", ()),  # values drawn from a data set every day
    ("thresh_drift", ("rounds=21",)),  # private bits
])
@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("threads, parts", [(1, 1), (3, 4)])
def test_a_world_computing_its_next_day_in_a_twin_serves_the_values_it_would_compute(name, extra, held, threads,
                                                                                     parts):
    """World.prefetch: day d + 1 computed in background threads by a twin (a copy of the levels when the world
    holds them, else drawn afresh), in ``parts`` jobs over the devices, gives exactly the values and clipped
    count the world computes itself, change days included, and the world keeps serving its own day meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from agents.world import World

    sc = schema.load(name, ["population.devices=3000", "rounds=24", *extra])

    def world() -> World:
        return World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)

    ahead, plain = world(), world()
    ids = np.arange(sc.devices)
    taken = 0
    with ThreadPoolExecutor(threads) as pool:
        for day in range(1, sc.rounds + 1):
            ahead.advance_to(day)
            plain.advance_to(day)
            if held:
                ahead.levels  # the world holds its levels: the twin starts from a copy of them
            va, ca = ahead.values(ids)
            vp, cp = plain.values(ids)
            assert np.array_equal(va, vp) and ca == cp
            if day > 1:
                taken += ahead._cache is ahead._ahead._cache  # the day's values came from the twin
            assert ahead.prefetch(day + 1, pool.submit, parts=parts)
            again, _ = ahead.values(ids)  # still today's values while tomorrow's are computed
            assert np.array_equal(again, vp)
        ahead.settle()
    assert taken == sc.rounds - 1


def test_a_world_with_behaviors_or_values_from_elsewhere_computes_nothing_ahead():
    from concurrent.futures import ThreadPoolExecutor

    from agents.world import World

    sc = schema.load("weekday_usage", ["population.devices=500"])
    with ThreadPoolExecutor(1) as pool:
        w = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
        w.advance_to(1)
        assert not w.prefetch(2, pool.submit)  # behaviors keep state from day to day
        sc = schema.load("quickstart", ["population.devices=500"])
        w = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
        w.use_values(lambda day: (np.zeros(500), 0))
        w.advance_to(1)
        assert not w.prefetch(2, pool.submit)
        assert not World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value).prefetch(0, pool.submit)


@pytest.mark.parametrize("cores", [1, 2])
def test_threads_stream_answers_and_compute_the_next_day_ahead_without_changing_the_run(cores, monkeypatch):
    """Threads hand out cohorts one by one and the run's thread takes each answer as it is ready, each cohort with
    its own network fates (loss and jitter here, so every cohort loses reports and some arrive late); on a
    machine with a spare core the world's next day is computed ahead. The run equals one SimPy process per
    cohort: digests, traffic (lost reports counted per cohort), ledger."""
    net = ("network.loss=0.1", "network.jitter=600", "network.deadline=900")
    one = _run("app_usage_31d", 1, 300, "simulation.threads=1", *net)
    monkeypatch.setattr(runner, "available_cores", lambda: cores)
    guessed: list[bool] = []  # whether each round's truth and sd were computed ahead for its reports
    close = runner.RoundBook.close

    def counted(self, t, result, *args):
        guessed.append(self._ahead is not None and self._ahead[:2] == (self.world.day, result.reports))
        return close(self, t, result, *args)

    monkeypatch.setattr(runner.RoundBook, "close", counted)
    for threads in (2, 3):
        guessed.clear()
        got = _run("app_usage_31d", 1, 300, f"simulation.threads={threads}", *net)
        _same_run(one, got)
        assert got[0]["reports"]["lost"] > 0 and got[0]["messages"]["late"] > 0
        assert (got[1].world._ahead is not None) == (cores > 1)
        if cores > 1:  # the last round's day was computed ahead, and no day after it (the run asks for none)
            assert got[1].world._ahead.day == got[1].scenario.rounds
        # on a spare core every round's figures were computed ahead, for the reports due before the deadline
        assert guessed == [cores > 1] * got[1].scenario.rounds


def test_a_world_asked_for_another_day_than_it_computed_ahead_computes_that_day_itself():
    """The twin computed day d + 1 but the world moved on to d + 2 (THRESH asks only every epoch, a hostile
    collector skips): the world does not serve the twin's day as its own, and the twin goes on from there."""
    from concurrent.futures import ThreadPoolExecutor

    from agents.world import World

    sc = schema.load("app_usage_31d", ["population.devices=2000"])
    ahead = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    plain = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ids = np.arange(sc.devices)
    with ThreadPoolExecutor(1) as pool:
        for day in (1, 3, 4, 7, 16, 17, 23, 30):
            ahead.advance_to(day)
            plain.advance_to(day)
            va, ca = ahead.values(ids)
            vp, cp = plain.values(ids)
            assert np.array_equal(va, vp) and ca == cp, day
            ahead.prefetch(day + 1, pool.submit)
        assert not ahead.prefetch(5, pool.submit)  # the past: nothing to compute
        ahead.settle()


def test_a_world_computes_no_day_ahead_past_its_last_day_but_still_serves_it():
    """``last_day`` (a run's rounds): the day after it is not computed ahead, and when asked for (a hostile
    collector's extra round) the world computes it itself, the same values as a world without the bound."""
    from concurrent.futures import ThreadPoolExecutor

    from agents.world import World

    sc = schema.load("app_usage_31d", ["population.devices=2000"])
    bounded = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value, last_day=3)
    plain = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ids = np.arange(sc.devices)
    with ThreadPoolExecutor(1) as pool:
        bounded.advance_to(2)
        assert bounded.prefetch(3, pool.submit)
        bounded.advance_to(3)
        bounded.values(ids)
        assert not bounded.prefetch(4, pool.submit)
    bounded.advance_to(4)
    plain.advance_to(4)
    assert np.array_equal(bounded.values(ids)[0], plain.values(ids)[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_cohorts_answered_by_threads_count_a_garbled_broadcast_once_per_cohort(threads):
    """Bytes that are no wire message are a rejected message for every cohort (as each cohort's own process
    would count it); a wire message that is no broadcast is answered by nobody and rejected by nobody."""
    from agents.shard import ThreadShards
    from agents.world import World
    from protocols import wire
    from protocols.messages import ReportBatch

    sc = schema.load("quickstart", ["population.devices=900"])
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    pool = ThreadShards(sc.protocol, sc.seed, sc.limits, world, sc.network,
                        parallel.split_cohorts(runner.cohort_slices(900, 300), threads), sc.simulation.round_seconds)
    try:
        answers, rejected = pool.answer(b"\x93garbage", 1, 0.0)
        assert rejected == 3 and all(not a.sent and not a.charges for a in answers)
        other = wire.encode(ReportBatch(round=1, protocol=sc.protocol.name, devices=np.arange(2, dtype=np.uint64),
                                        columns={"bit": np.array([0, 1], np.uint8)}))
        answers, rejected = pool.answer(other, 1, 0.0)
        assert rejected == 0 and all(not a.sent for a in answers)
    finally:
        pool.close()


def test_round_figures_computed_ahead_are_taken_only_for_the_day_and_reports_they_assumed():
    """RoundBook.ahead (a runtime starts it once a broadcast's answers are out, on another core, guessing the
    reports due before the deadline): close takes the job's truth and sd only when the round closes on the
    same day with that many reports; otherwise it computes them, so the figures never depend on the guess."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from agents.world import World
    from protocols.base import RoundResult
    from protocols.ledger import Ledger

    class Log:
        def info(self, *args, **kwargs):
            pass

    sc = schema.load("quickstart", ["population.devices=500"])
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    book = runner.RoundBook(sc, world, Ledger(sc.devices), sc.protocol.make_collector(sc.devices), Log())

    def poisoned(job):  # figures no protocol computes: seen in the record only if the job's are taken
        done: Future = Future()
        done.set_result((1e9, -1.0))
        return done

    def own(reports):
        values = world.values(np.arange(sc.devices))[0]
        return sc.protocol.truth(values), sc.protocol.estimate_sd(values, reports)

    world.advance_to(1)
    book.ahead(poisoned, 480)
    rec = book.close(1, RoundResult(1, 0.5, 480), 10.0, 0)
    assert (rec.truth, rec.sd_theory) == (1e9, -1.0)  # the guess held: the job's figures
    book.ahead(poisoned, 480)
    rec = book.close(2, RoundResult(2, 0.5, 479), 20.0, 0)  # a report fewer than guessed
    assert (rec.truth, rec.sd_theory) == own(479)
    book.ahead(poisoned, 480)
    world.advance_to(2)  # the round closes on another day than the job read
    rec = book.close(3, RoundResult(3, 0.5, 480), 30.0, 0)
    assert (rec.truth, rec.sd_theory) == own(480)
    rec = book.close(4, RoundResult(4, 0.5, 480), 40.0, 0)  # no job: computed
    assert (rec.truth, rec.sd_theory) == own(480)
    with ThreadPoolExecutor(1) as pool:  # a real job: the very figures close computes
        book.ahead(pool.submit, 470)
        assert book._ahead is not None
        rec = book.close(5, RoundResult(5, 0.5, 470), 50.0, 0)
    assert (rec.truth, rec.sd_theory) == own(470)
    gate = threading.Event()
    timer = threading.Timer(30.0, gate.set)  # frees the thread in the end: a close that waited would see the job run
    timer.start()
    with ThreadPoolExecutor(1) as pool:  # a job still queued behind other side work: cancelled, computed by close
        pool.submit(gate.wait)
        book.ahead(pool.submit, 460)
        job = book._ahead[2]
        rec = book.close(6, RoundResult(6, 0.5, 460), 60.0, 0)
        assert job.cancelled()  # never ran: the close did not wait for it
        gate.set()
    timer.cancel()
    assert (rec.truth, rec.sd_theory) == own(460)


def _prefetched_days_equal(ahead, plain, ids, parts: int, days: int) -> np.ndarray:
    """Days 1..days of world ``ahead``, each prefetched by ``parts`` threads from the day before (the first with
    its levels), equal those ``plain`` computes itself; returns ``ahead``'s last day's values."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(parts) as pool:
        assert ahead.prefetch(1, pool.submit, parts=parts)
        for day in range(1, days + 1):
            ahead.advance_to(day)
            plain.advance_to(day)
            va, ca = ahead.values(ids)
            vp, cp = plain.values(ids)
            assert np.array_equal(va, vp) and ca == cp, day
            assert ahead.prefetch(day + 1, pool.submit, parts=parts)
        ahead.settle()
    return va


def test_device_sides_that_cannot_be_built_leave_no_thread_behind(monkeypatch):
    """The first day is started before the device sides are built; if building them fails, the error reaches
    the caller and the threads drawing that day are stopped with it."""
    from agents.shard import ThreadShards
    from agents.world import World

    sc = schema.load("quickstart", ["population.devices=20000"])
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)

    def broken(*args, **kwargs):
        raise ValueError("no device side today")

    monkeypatch.setattr(type(sc.protocol), "make_devices", broken)
    before = set(threading.enumerate())
    with pytest.raises(ValueError, match="no device side today"):
        ThreadShards(sc.protocol, sc.seed, sc.limits, world, sc.network, [[(0, 10000)], [(10000, 20000)]],
                     sc.simulation.round_seconds, ahead=True)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


@pytest.mark.parametrize("turn", range(4))
@pytest.mark.parametrize("parts", [2, 3])
def test_a_twin_fills_every_kind_of_device_in_parts_as_the_world_would(parts, turn):
    """The parts that draw a twin's first levels also fill each device's sd, Bernoulli flag and data set: a
    world of normal, Bernoulli and data-set groups (two sharing one data set) gives the same values day after
    day, in parts or whole, with a change that moves part of a group to another data set; the groups in turn
    (``turn``) so that each kind lies across a boundary between parts."""
    from agents.world import Change, Dist, Group, World

    short, long_ = np.arange(1.0, 40.0), np.arange(50.0, 400.0, 7.0)
    groups = [Group("bits", 0.2, Dist("bernoulli", value=0.3)),
              Group("short", 0.25, Dist("data", data=short)),
              Group("mixed", 0.25, Dist("data", data=short), jitter_sd=1.0),
              Group("steady", 0.3, Dist("normal", mean=30.0, sd=8.0), jitter_sd=2.0)]
    groups = groups[turn:] + groups[:turn]
    changes = [Change(3, "mixed", counter=Dist("data", data=long_), fraction=0.5)]
    ahead, plain = (World(5, 2003, groups, changes, 300.0) for _ in range(2))
    ids = np.arange(2003)
    va = _prefetched_days_equal(ahead, plain, ids, parts, 5)
    twin = ahead._ahead
    assert twin is not None and len(twin._pools) == 2  # the shared data set registered once
    b = dict(zip((g.name for g in groups), zip(plain.bounds, plain.bounds[1:])))  # the kinds on the last day:
    assert set(va[slice(*b["bits"])].tolist()) == {0.0, 1.0}  # bits, and values of the first data set
    assert set(va[slice(*b["short"])].tolist()) <= set(short.tolist())


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_twin_draws_its_first_levels_in_parts_as_the_world_would(parts, monkeypatch):
    """Threads prefetch the first day before the run's world holds anything: the twin draws the devices' levels
    in ``parts`` jobs (one per thread), then the day's values. They equal the world's own, day after day,
    a change on the first day and a redrawn fraction of a group included."""
    from agents.world import World

    sc = schema.load("app_usage_31d", ["population.devices=3001", "rounds=24", "changes.0.round=1"])
    drawn: list[tuple[int, int]] = []
    draw = World._draw_levels
    monkeypatch.setattr(World, "_draw_levels", lambda self, levels, a, b: drawn.append((a, b)) or draw(self, levels, a, b))
    ahead = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    plain = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ids = np.arange(sc.devices)
    _prefetched_days_equal(ahead, plain, ids, parts, sc.rounds)
    assert ahead._levels is None  # the world itself never drew: its twin did
    # the twin's draw in parts covering the population once (parts = 1: the twin's own _hold, in one call)
    first = drawn[:parts] if parts > 1 else drawn[:1]
    assert sorted(first) == [(sc.devices * k // parts, sc.devices * (k + 1) // parts) for k in range(parts)]


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="sends Ctrl-C to a process group (os.killpg): POSIX only")
@pytest.mark.parametrize("how", ["ctrl-c", "term"])
def test_ctrl_c_stops_a_run_with_worker_processes_in_one_line(tmp_path, how) -> None:
    """Ctrl-C reaches the whole process group: the run says "ldpsim: interrupted" alone (its shard workers and its
    picture process each printed a KeyboardInterrupt traceback), its workers are killed rather than waited for
    (10 s each, blocked on a reply nobody read), and no process of the group is left. SIGTERM to the run's
    process alone (a scheduler's stop) is handled the same way: "ldpsim: terminated", status 143, and the
    partial run directory removed (the default handler ended the process on the spot, leaving both)."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "scenarios.cli", "run", "app_usage_31d", "--set",
                             "population.devices=100000", "--set", "rounds=400", "--set", "simulation.workers=2",
                             "--set", "simulation.cohort_size=20000", "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # as from a shell: an ignored SIGINT is inherited, and a test before this one in the
                            # same test process (a sweep worker's set-up run in-process) may have ignored it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # until a few rounds have run
        events = out / "events.jsonl"
        if events.is_file() and events.read_text().count('"round"') >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    if how == "term":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (143 if how == "term" else 130)
    said = "ldpsim: terminated" if how == "term" else "ldpsim: interrupted"
    assert "Traceback" not in err and err.strip().splitlines()[-1] == said, err[-3000:]
    assert not out.exists()  # the run created it: no partial run is left behind
    # nothing of the group is left running (its picture process may still be importing matplotlib at low
    # priority: it ends when it next reads its closed input)
    gone = False
    for _ in range(600):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            gone = True
            break
        time.sleep(0.05)
    assert gone, "a process of the run's group outlived it"


def test_a_run_that_stops_early_kills_its_workers_before_closing(monkeypatch) -> None:
    """An interrupted or failed run kills its shard workers (ProcessShards.abort) instead of sending them an exit
    a busy one would not read; a finished run only closes them."""
    calls: list[str] = []
    real_abort, real_close = parallel.ProcessShards.abort, parallel.ProcessShards.close
    monkeypatch.setattr(parallel.ProcessShards, "abort", lambda self: (calls.append("abort"), real_abort(self))[0])
    monkeypatch.setattr(parallel.ProcessShards, "close", lambda self: (calls.append("close"), real_close(self))[0])
    sc = schema.load("quickstart", ["population.devices=2000", "rounds=2", "simulation.workers=2",
                                    "simulation.cohort_size=500"])
    runner.run(sc)
    assert calls == ["close"]
    calls.clear()

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run(sc)
    assert calls == ["abort", "close"]
