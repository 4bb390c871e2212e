"""Parallel cohorts in one run (scenarios/parallel.py, agents/shard.py): the run is the same whatever the number
of worker processes and the cohort size: digests, traffic, device counters and the ledger's spend history."""

from __future__ import annotations

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


@pytest.mark.parametrize("name, extra", [
    ("app_usage_31d", ("collector.behavior=replay",)),  # memoized reports, a hostile collector repeating rounds
    ("thresh_drift", ("rounds=8", "protocol.epoch_length=2")),  # the devices observe every day; votes, decisions
    ("topl_pos", ()),  # thresholds broadcast mid-round
    ("weekday_usage", ()),  # behaviors: every shard's world computes the whole population
    ("apps_multi", ("population.groups.1.joins=3",)),  # several counters a device; devices joining late
])
def test_two_workers_run_exactly_what_one_process_runs(name, extra):
    one = _run(name, 1, 300, *extra)
    two = _run(name, 2, 300, *extra)
    assert two[1].extra["workers"] == 2 and one[1].extra["workers"] == 1
    _same_run(one, two)  # the same cohorts: the same messages too
    assert _run(name, 1, 700, *extra)[0]["digests"] == two[0]["digests"]  # other cohorts: the same digests


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
