"""Every built-in protocol through the conformance kit (scenarios/conformance.py), the same checks a plugin's own
tests run: cohort split, live equals simulated, wire round-trip and fuzz, hostile collectors, audit, privacy
audit."""

from __future__ import annotations

import pytest

from protocols import registry
from scenarios import conformance as testing
from scenarios import privacy_audit

#: the [protocol] table each built-in protocol is checked with (the privacy audit's defaults; THRESH with
#: 2-day epochs so that its epoch state is exercised)
TABLES = {name: {**privacy_audit.default_table(name), **({"epoch_length": 2} if name == "thresh" else {})}
          for name in registry.builtin_names()}


@pytest.fixture(scope="module", params=sorted(TABLES))
def scenario(request):
    return testing.scenario_for(TABLES[request.param], devices=240, rounds=6)


@pytest.mark.parametrize("check", sorted(testing.CHECKS))
def test_builtin_protocol_conforms(scenario, check: str) -> None:
    if check == "privacy_audit":
        testing.check_privacy_audit(scenario, trials=1500)
    else:
        testing.CHECKS[check](scenario)


def _kflip_with_devices(devices: type, rounds: int):  # type: ignore[no-untyped-def]
    """The kit's k-ary randomized response scenario (60 devices) with ``devices`` as its device side."""
    import dataclasses

    from protocols.baselines import KFlipParams

    @dataclasses.dataclass(frozen=True)
    class Params(KFlipParams):
        def make_devices(self, seed, device_ids, limits=None):
            return devices(self, seed, device_ids, limits)

    sc = testing.scenario_for(TABLES["kflip"], devices=60, rounds=rounds)
    return dataclasses.replace(sc, protocol=Params(**dataclasses.asdict(sc.protocol)))


def test_a_broken_protocol_fails_the_kit() -> None:
    """The kit can fail: a protocol whose devices draw from an unkeyed generator depends on the cohort split."""
    import numpy as np

    from protocols.baselines import KFlipDevices

    class Unkeyed(KFlipDevices):
        def report(self, round_, values):
            rng = np.random.default_rng(int(self.device_ids[0]) + round_)  # depends on the cohort's first id
            return {"y": rng.integers(0, self.params.buckets, self.device_ids.size).astype(np.uint8)}

    sc = _kflip_with_devices(Unkeyed, rounds=2)
    with pytest.raises(testing.ConformanceError, match="cohort split"):
        testing.check_cohort_split(sc)


def test_a_protocol_that_charges_past_the_budget_fails_the_kit() -> None:
    """A device side that never asks Guard.affordable is stopped by the guard at the charge that would pass the
    budget (BudgetOverrun: the cohort's answer is not sent), and the kit says so."""
    import dataclasses

    import numpy as np

    from protocols.baselines import KFlipDevices
    from protocols.guard import BudgetOverrun

    class Careless(KFlipDevices):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.guard.affordable = lambda cost, rows=None: np.ones(np.asarray(rows).shape, dtype=bool)

    sc = _kflip_with_devices(Careless, rounds=4)
    with pytest.raises(testing.ConformanceError, match="budget.*must ask Guard.affordable"):
        testing.check_hostile(sc)
    from scenarios import runner

    with pytest.raises(BudgetOverrun):
        runner.run(dataclasses.replace(sc, budget=1.5 * sc.protocol.round_epsilon))


def test_an_audit_failure_is_told_in_a_few_short_lines() -> None:
    """A device side whose reports are not the reference model's fails check_audit with the audit's verdict line
    and one line per kind of mismatch (its count, one example), not the whole audit record; a long value in
    an example (a report of 1,024 bits) is abbreviated."""
    import numpy as np

    from protocols.baselines import KFlipDevices
    from scenarios import audit

    class OffByOne(KFlipDevices):
        def report(self, round_, values):
            y = super().report(round_, values)["y"]
            return {"y": ((y.astype(np.int64) + (self.device_ids == 7)) % self.params.buckets).astype(y.dtype)}

    with pytest.raises(testing.ConformanceError) as caught:
        testing.check_audit(_kflip_with_devices(OffByOne, rounds=2))
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("audit: ldpsim audit is not clean: audit failed: 60 device(s)"), lines[0]
    assert any(line.startswith("  report_value: ") and '"device": 7' in line for line in lines), lines
    assert len(lines) <= 6 and all(len(line) < 400 for line in lines), lines
    long = {"mismatches": {"report_value": {"count": 1, "examples": [{"transcript": list(range(1024))}]}}}
    (line,) = audit.mismatch_lines(long)
    assert line.endswith('[0, 1, 2, 3, 4, 5, 6, 7, "... 1,024 values in all"]}') and len(line) < 120, line


def test_keep_going_runs_every_check_and_names_each_failure(monkeypatch) -> None:
    """run_conformance(keep_going=True) runs the checks after a failed one and raises one error naming each
    failure; without it the first failure stops the kit (the later checks do not run)."""
    ran: list[str] = []

    def fake(name: str, fails: bool):  # type: ignore[no-untyped-def]
        def check(sc):  # type: ignore[no-untyped-def]
            ran.append(name)
            if fails:
                raise testing.ConformanceError(f"{name}: broken on purpose")
            return name
        return check

    monkeypatch.setattr(testing, "CHECKS", {"a": fake("a", True), "b": fake("b", False), "c": fake("c", True)})
    with pytest.raises(testing.ConformanceError) as caught:
        testing.run_conformance(None, keep_going=True)
    assert ran == ["a", "b", "c"]
    assert str(caught.value).splitlines() == ["2 of 3 checks failed:", "a: broken on purpose", "c: broken on purpose"]
    ran.clear()
    with pytest.raises(testing.ConformanceError, match="^a: broken on purpose$"):
        testing.run_conformance(None)
    assert ran == ["a"]
    assert testing.run_conformance(None, only=["b"]) == {"b": "b"}
    with pytest.raises(ValueError, match="no conformance check 'z'"):
        testing.run_conformance(None, only=["z"])


def test_the_conformance_command(monkeypatch, capsys) -> None:
    """``ldpsim conformance``: a line a check, exit 0 when all pass; a failing check is named with its first line,
    the others still run, exit 1; a name that is no check, a target that is neither a protocol nor a scenario,
    and a scenario too small exit 2 with one line."""
    import json

    from scenarios import cli

    assert cli.main(["conformance", "1bitrrpm", "--only", "cohort_split,audit", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["cohort_split", "passed"] and out[1].split()[:2] == ["audit", "passed"]
    assert out[-1] == "1bitrrpm: 2 of 2 checks passed (400 devices x 6 rounds)"

    def broken(sc):  # type: ignore[no-untyped-def]
        raise testing.ConformanceError("wire: broken on purpose\nsecond line")

    monkeypatch.setitem(testing.CHECKS, "wire", broken)
    assert cli.main(["conformance", "app_usage_31d", "--only", "wire,cohort_split", "--json", "--devices", "60",
                     "--set", "protocol.epsilon=2"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["protocol"], doc["devices"]) == ("1bitrrpm", 60)
    assert [(r["check"], r["passed"]) for r in doc["checks"]] == [("cohort_split", True), ("wire", False)]
    assert doc["checks"][1]["error"] == "wire: broken on purpose\nsecond line"
    assert cli.main(["conformance", "1bitrrpm", "--only", "wire", "--quiet"]) == 1
    assert "wire  FAILED" in capsys.readouterr().out
    for argv, needle in ((["conformance", "1bitrrpm", "--only", "bogus"], "no conformance check 'bogus'"),
                         (["conformance", "nope"], "'nope' is neither a protocol"),
                         (["conformance", "1bitrrpm", "--devices", "5"], "at least 20 devices")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
