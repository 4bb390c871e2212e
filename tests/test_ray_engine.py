"""A sharded run on Ray (scenarios/ray_engine.py): on a local Ray instance with 2 shards, the run's digests are
those of the single-process run (memoized reports, THRESH decisions, ToPL thresholds), also when a shard actor is
killed mid-run and Ray restarts it; a shard that cannot start or come back, and a missing extra, are one-line
errors.

The Ray tests need the ray extra (``pip install -e '.[ray]'``) and are skipped without it."""

from __future__ import annotations

import json
import os
import sys
import time

from pathlib import Path

import pytest


from scenarios import cli, output, runner, schema

REPO = Path(__file__).resolve().parent.parent  # this checkout

ROUNDS_6 = ["population.devices=2000", "simulation.cohort_size=300", "rounds=6"]


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install -e '.[ray]'")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def _load(name: str, *extra: str) -> schema.Scenario:
    return schema.load(name, [*ROUNDS_6, "simulation.workers=1", *extra])


def _digests(name: str, *extra: str) -> dict:
    """The single-process run's digests."""
    return output.summary(runner.run(_load(name, *extra)))["digests"]


def test_the_cli_runs_thresh_on_ray_with_the_digests_of_the_single_process_run(ray, tmp_path, capsys):
    # THRESH: the devices observe every day, vote, and apply the collector's decisions ([simulation] workers = 0:
    # 2 shards)
    thresh = ("rounds=8", "protocol.epoch_length=2")
    code = cli.main(["run", "thresh_drift", *[a for kv in (*ROUNDS_6, *thresh) for a in ("--set", kv)],
                     "--engine", "ray", "--out", str(tmp_path / "run"), "--quiet", "--no-ledger-rows"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["digests"] == _digests("thresh_drift", *thresh)
    line = capsys.readouterr().out.strip().splitlines()[-1]  # the one-line report: Ray's start-up said apart
    assert f"({summary['parallelism']['start_seconds']:.2f} s of it starting or joining Ray)" in line


def test_a_shard_s_protocol_error_is_the_command_s_one_line(ray, tmp_path, capsys):
    """A plugin's device side sending a column the wire cannot carry, in a Ray actor: the same one line and exit
    2 as on the run's own thread (it was a WorkerError traceback)."""
    table = 'protocol={name = "tests.support:Uint16DevicesKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    code = cli.main(["run", "quickstart", "--set", table, "--set", "population.devices=400", "--set", "rounds=2",
                     "--engine", "ray", "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("ldpsim: error: protocol: uint16deviceskflip: the device side's report "
                                            "column 'y': dtype uint16 does not travel on the wire"), err[-3:]


def test_topl_on_two_ray_shards_runs_exactly_what_one_process_runs(ray):
    from scenarios import ray_engine

    extra = ("rounds=3",)  # thresholds broadcast mid-round
    result = runner.run(_load("topl_pos", *extra), engine=ray_engine.engine(shards=2))
    assert result.extra["workers"] == 2
    parallelism = output.summary(result)["parallelism"]
    assert {k: v for k, v in parallelism.items() if k != "start_seconds"} == \
        {"workers": 2, "threads": 1, "engine": "ray actors", "restarts": 0}
    assert 0 < parallelism["start_seconds"] < result.wall_seconds  # starting the actors, said apart
    assert output.summary(result)["digests"] == _digests("topl_pos", *extra)
    assert [s["restarts"] for s in result.extra["worker_stats"]] == [0.0, 0.0]


def test_a_multi_app_scenario_on_two_ray_shards_has_the_truth_and_digests_of_one_process(ray):
    """Shards hand back each device's total before its split over apps (World.totals): the run's own world
    splits it once, so the per-app truth and the digests are those of the single-process run."""
    from scenarios import ray_engine

    extra = ("rounds=3", "population.groups.1.joins=2")
    result = runner.run(_load("apps_multi", *extra), engine=ray_engine.engine(shards=2))
    one = runner.run(_load("apps_multi", *extra))
    assert output.summary(result)["digests"] == output.summary(one)["digests"]
    assert [list(r.truth) for r in result.rounds] == [list(r.truth) for r in one.rounds]


def _until_restarted(ray, actor, timeout: float = 60.0) -> None:
    """Wait until Ray has restarted ``actor`` (a fresh one has run no command)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ray.get(actor.position.remote()) == 0:
                return
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.1)
    raise AssertionError("the actor was not restarted")


def test_killed_shards_are_restarted_and_rebuilt_by_replay_and_the_digests_do_not_change(ray):
    """Memoized reports (1BitRRPM) on 2 shards, each killed once (one between two rounds, one while it runs a
    call): the single-process run's digests and ledger. Then, its one restart spent, a shard killed again is a
    clear error."""
    from scenarios import parallel, ray_engine

    pools: list[ray_engine.RayShards] = []
    crashed: list = []

    class Crashing(ray_engine.RayShards):
        """Shard 1's process exits just before it would run the 10th command (mid-call for the driver); the
        pool is closed by the test, not by the run."""

        def _step(self, op, *args):
            if len(self.history) == 9:  # the exit runs before the step: an actor runs its calls in order
                crashed.append(self.actors[1].__ray_call__.remote(lambda _self: os._exit(1)))
            return super()._step(op, *args)

        def close(self):
            pass

    def make(data, slices):
        pools.append(Crashing(data, ray_engine.split_cohorts(slices, 2), max_restarts=1))
        return pools[0]

    def progress(done: int, _total: int) -> None:
        if done == 2:  # between rounds: shard 0 killed and restarted (Ray runs its constructor again)
            ray.kill(pools[0].actors[0], no_restart=False)
            _until_restarted(ray, pools[0].actors[0])

    sc = _load("app_usage_31d")
    one = runner.run(sc)  # the single-process run
    try:
        result = runner.run(sc, progress=progress, engine=make)
        assert output.summary(result)["digests"] == output.summary(one)["digests"]
        assert result.ledger.history == one.ledger.history
        stats = result.extra["worker_stats"]
        assert [s["restarts"] for s in stats] == [1.0, 1.0]  # each shard caught up once
        assert output.summary(result)["parallelism"]["restarts"] == 2  # and summary.json says so
        assert all(s["replayed"] > 0 for s in stats)  # ... by replaying what it had missed
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(crashed[0])  # it did exit

        ray.kill(pools[0].actors[1], no_restart=False)  # its one restart is spent
        with pytest.raises(ray.exceptions.RayActorError):
            for _ in range(600):  # ray.kill returns before the actor is gone
                ray.get(pools[0].actors[1].position.remote())
                time.sleep(0.1)
        with pytest.raises(parallel.WorkerError, match="shard 1 died and was not restarted"):
            pools[0].guards()
    finally:
        ray_engine.RayShards.close(pools[0])
    assert not pools[0].actors


def test_a_shard_that_cannot_start_is_a_clear_error_and_no_actor_is_left(ray):
    from scenarios import parallel, ray_engine

    pools: list[ray_engine.RayShards] = []

    def broken(data, slices):  # the actors cannot rebuild the scenario
        pools.append(ray_engine.RayShards({**data, "seed": "not a seed"}, ray_engine.split_cohorts(slices, 2)))
        return pools[0]

    with pytest.raises(parallel.WorkerError, match="could not start: .*seed"):
        runner.run(_load("quickstart"), engine=broken)
    assert pools and not pools[0].actors  # closed


def test_the_ray_engine_without_the_extra_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code = cli.main(["run", "quickstart", "--engine", "ray", "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    # this suite runs from a checkout: the extra added to it (a package index's ldpsim[ray] is not this code)
    assert err[-1] == f"ldpsim: error: --engine ray needs the ray extra: pip install -e '{REPO}[ray]'"
    assert not (tmp_path / "run").exists()  # before any file of the run


def test_a_ray_address_needs_the_ray_engine(capsys):
    assert cli.main(["run", "quickstart", "--ray-address", "auto"]) == 2
    assert "--ray-address: only with --engine ray" in capsys.readouterr().err


def test_a_ray_address_where_nothing_listens_is_one_line_at_once(monkeypatch) -> None:
    """ray.init retries a head that is not there for ever (a new user's run sat at 0% for nine minutes): a
    HOST:PORT where nothing accepts connections is refused before Ray is asked, one that listens is left to
    Ray, and a malformed address says which forms there are. Needs no Ray."""
    import socket

    from scenarios import ray_engine
    from scenarios.schema import ScenarioError

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free = closed.getsockname()[1]
    closed.close()
    try:
        ray_engine._reachable(f"127.0.0.1:{listening.getsockname()[1]}")
        for fine in (None, "auto", "ray://127.0.0.1:1"):
            ray_engine._reachable(fine)
        with pytest.raises(ScenarioError, match=rf"^--ray-address 127.0.0.1:{free}: no Ray head there"):
            ray_engine._reachable(f"127.0.0.1:{free}")
        with pytest.raises(ScenarioError, match="expected HOST:PORT, auto or ray://HOST:PORT"):
            ray_engine._reachable("nonsense")
    finally:
        listening.close()


def test_without_an_address_the_engine_starts_its_own_ray_rather_than_joining_one(monkeypatch) -> None:
    """No --ray-address: ray.init(address="local"), a Ray of the run's own. ray.init(address=None) would join a
    cluster that RAY_ADDRESS or an earlier `ray start` on this machine names, whatever its code or load. A given
    address is passed on as it is. Needs no Ray: a stand-in records the call."""
    from scenarios import ray_engine
    from scenarios.schema import ScenarioError

    asked: list = []

    class FakeRay:
        @staticmethod
        def is_initialized() -> bool:
            return False

        @staticmethod
        def init(**kw) -> None:
            asked.append(kw["address"])
            raise RuntimeError("stand-in: not starting anything")

    monkeypatch.setattr(ray_engine, "require_ray", lambda: FakeRay)
    monkeypatch.setattr(ray_engine, "_reachable", lambda address: None)
    for address, expected in ((None, "local"), ("auto", "auto"), ("10.0.0.1:6379", "10.0.0.1:6379")):
        with pytest.raises(ScenarioError, match="cannot start or join Ray: stand-in"):
            ray_engine.RayShards({}, [[(0, 10)]], address=address)
        assert asked[-1] == expected
