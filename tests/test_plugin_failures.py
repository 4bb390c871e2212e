"""A user's own code that raises (a plugin protocol's device or collector side, its reference model) is one
line naming where and what (file, line, function, exception, round), on every runtime; an exception raised
in ldpsim itself keeps its traceback (a bug to report), and LDPSIM_TRACEBACK=1 keeps every traceback."""

from __future__ import annotations

import asyncio
import functools
import operator
import re
import time

import pytest

from scenarios import conformance, failure, live, schema
from scenarios.cli import main

KFLIP = 'epsilon = 1.0, max_value = 86400, buckets = 8'
SMALL = ["--set", "population.devices=600", "--set", "rounds=4", "--set", "changes=[]", "--quiet"]


def _table(name: str) -> str:
    return f'protocol={{name = "tests.support:{name}", {KFLIP}}}'


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("ldpsim: error")]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("runtime", [[], ["--set", "simulation.threads=2", "--set", "simulation.cohort_size=100"],
                                     ["--set", "simulation.workers=2", "--set", "simulation.cohort_size=100"]],
                         ids=["simpy", "threads", "workers"])
def test_a_device_side_that_raises_is_one_line_naming_its_file_function_and_round(tmp_path, capsys, runtime):
    out = tmp_path / "run"
    assert main(["run", "quickstart", "--set", _table("RaisingDevicesKFlip"), *SMALL, *runtime,
                 "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert re.fullmatch(r"ldpsim: error: tests/support\.py:\d+, in report: RuntimeError: plugin device side "
                        r"failed on purpose \(during round 3; LDPSIM_TRACEBACK=1 shows the traceback\)", line), line
    assert not out.exists()  # no partial run left behind


def test_a_collector_side_that_raises_is_one_line(tmp_path, capsys):
    assert main(["run", "quickstart", "--set", _table("RaisingEstimateKFlip"), *SMALL,
                 "--out", str(tmp_path / "run")]) == 2
    line = _one_line(capsys)
    assert re.fullmatch(r"ldpsim: error: tests/support\.py:\d+, in estimate: ZeroDivisionError: plugin estimate "
                        r"failed on purpose \(during round 1; LDPSIM_TRACEBACK=1 shows the traceback\)", line), line


def test_ldpsim_traceback_keeps_the_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LDPSIM_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="plugin device side failed on purpose") as caught:
        main(["run", "quickstart", "--set", _table("RaisingDevicesKFlip"), *SMALL, "--out", str(tmp_path / "run")])
    assert "ldpsim: during round 3" in caught.value.__notes__


def test_an_exception_raised_in_ldpsim_itself_keeps_its_traceback(tmp_path, monkeypatch):
    """A bug in ldpsim (here: its summary raising from a C function, no frame of the user's) is not dressed as
    the user's error."""
    from scenarios import output

    monkeypatch.setattr(output, "summary", functools.partial(operator.truediv, 1))  # raises in C: no test frame
    with pytest.raises(TypeError, match="unsupported operand"):
        main(["run", "quickstart", *SMALL, "--out", str(tmp_path / "run")])
    try:
        int("x")
    except ValueError as exc:
        assert failure.describe(exc) is not None  # this test file is a user's code: its own frame counts


def test_a_live_run_whose_device_side_raises_stops_at_once_in_one_line(tmp_path, capsys):
    """The collector used to wait out each stage's timeout for the failed devices (41 s by default) and fail
    later with a traceback; the client's error now ends the run at once."""
    sc = schema.load("quickstart", [_table("RaisingDevicesKFlip"), "population.devices=300", "rounds=4",
                                    "changes=[]"])
    from collector.server import LiveSettings

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="plugin device side failed on purpose"):
        asyncio.run(live.run_embedded(sc, 2, settings=LiveSettings(stage_timeout=300.0)))
    assert time.monotonic() - t0 < 150  # not the 300 s stage timeout (functional: it did not wait for it)
    out = tmp_path / "live"
    assert main(["live", "quickstart", "--set", _table("RaisingDevicesKFlip"), *SMALL, "--out", str(out)]) == 2
    assert re.fullmatch(r"ldpsim: error: tests/support\.py:\d+, in report: RuntimeError: plugin device side "
                        r"failed on purpose \(LDPSIM_TRACEBACK=1 shows the traceback\)", _one_line(capsys))
    assert not out.exists()


def test_conformance_reports_each_check_of_a_raising_protocol_and_goes_on(capsys):
    """Every check runs and says that the protocol raised and where (the command died at the first one); the
    API's keep_going names each failure, chained to the exception."""
    assert main(["conformance", "quickstart", "--set", _table("RaisingDevicesKFlip"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "cohort_split" in out and "passed" in out  # (the wire check reads round 1 only: it passes)
    failed = {line.split()[0]: line for line in out.splitlines() if "FAILED" in line}
    assert set(failed) == {"cohort_split", "live_equals_simulated", "hostile", "audit", "privacy_audit"}, out
    assert all(re.search(r"raised tests/support\.py:\d+, in report: RuntimeError", line)
               for check, line in failed.items() if check != "audit"), out
    # no reference model to replay its devices with: said by the audit check, before a run, without a path
    assert failed["audit"].endswith("audit: no reference model for protocol 'raisingdeviceskflip': give its "
                                    "parameter class a reference_model (a ReferenceDevice subclass) to audit it")
    sc = conformance.scenario_for({"name": "tests.support:RaisingDevicesKFlip", "epsilon": 1.0,
                                   "max_value": 86400, "buckets": 8})
    with pytest.raises(conformance.ConformanceError, match="cohort_split: raised") as caught:
        conformance.run_conformance(sc, only=["cohort_split", "wire"], keep_going=True)
    assert "1 of 2 checks failed" in str(caught.value)

