"""The worked plugin (examples/ldpsim-losue, L-OSUE) in the project's own suite, in-process.

Installing the example into a fresh virtual environment would be slow, so its own tests
(examples/ldpsim-losue/tests/test_losue.py: the conformance kit, the estimator against theory, the
multi-freq-ldpy cross-check) are loaded here and collected as this module's tests, with the example's folder on
sys.path and scenarios naming the protocol ``ldpsim_losue:LosueParams`` (module:Class), which needs no install.
When the example *is* installed (``pip install -e examples/ldpsim-losue``), its entry point is checked too.
The shipped scenario losue_usage.toml runs under both runtimes with equal digests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from protocols import registry

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ldpsim-losue"
MODULE_CLASS = "ldpsim_losue:LosueParams"

if importlib.util.find_spec("ldpsim_losue") is None:  # not installed: import it from its folder
    sys.path.insert(0, str(EXAMPLE))


def _load_example_tests():
    spec = importlib.util.spec_from_file_location("ldpsim_losue_example_tests", EXAMPLE / "tests" / "test_losue.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.NAME = MODULE_CLASS  # the example's scenarios name the protocol module:Class here
    return module


_example = _load_example_tests()
# the example's tests and fixtures become this module's (pytest collects test_* and fixtures from its globals)
globals().update({k: v for k, v in vars(_example).items() if k.startswith("test_") or k == "scenario"})


def test_example_declares_its_entry_point() -> None:
    """The example's pyproject.toml registers ``losue`` in the group the registry reads, pointing at the class
    the module:Class name loads."""
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    assert eps == {"losue": MODULE_CLASS}
    assert "ldpsim" in meta["project"]["dependencies"]
    assert registry.lookup(MODULE_CLASS).params.__name__ == "LosueParams"


def test_installed_entry_point_is_the_example() -> None:
    """The README's test command installs the example; its entry point is what the registry finds."""
    assert _example.entry_point_installed(), \
        "the example plugin is not installed: pip install -e examples/ldpsim-losue (the README's test command does)"
    entry = registry.lookup("losue")
    assert entry.source == "plugin: ldpsim-losue"
    assert entry.params is registry.lookup(MODULE_CLASS).params
    assert "losue" in [r.name for r in registry.available()]


def test_shipped_scenario_runs_simulated_and_live_with_equal_digests() -> None:
    """examples/ldpsim-losue/losue_usage.toml (scaled down), named module:Class: ``ldpsim run`` and ``ldpsim
    live`` give the same transcript, ledger and estimates digests."""
    from collector.server import LiveSettings
    from scenarios import live, output, runner, schema

    sc = schema.load(str(EXAMPLE / "losue_usage.toml"),
                     [f'protocol.name="{MODULE_CLASS}"', "population.devices=2000", "simulation.cohort_size=300"])
    assert sc.protocol.name == "losue"
    sim = output.summary(runner.run(sc))
    got = output.summary(asyncio.run(live.run_embedded(
        sc, connections=3, settings=LiveSettings(stage_timeout=5.0, read_timeout=1.0, startup_timeout=20.0))))
    assert got["digests"] == sim["digests"]
    assert sim["privacy"]["within_guarantee"] and sim["error"]["hist_max_abs"] < 0.1


def test_privacy_audit_takes_the_installed_plugin_by_name(monkeypatch) -> None:
    """`ldpsim privacy-audit losue`: the plugin's ``examples`` table is what a name audits, as for a built-in;
    a registered protocol without one is told so (not "neither a protocol nor a scenario")."""
    from scenarios import privacy_audit
    from scenarios.schema import ScenarioError

    table = privacy_audit.default_table("losue")
    assert table == {"name": "losue", "epsilon": 2.0, "eps_1": 1.0, "max_value": 24.0, "buckets": 8}
    monkeypatch.setattr(registry.lookup("losue").params, "examples", {})
    with pytest.raises(ScenarioError, match=r"^protocol 'losue' gives no example \[protocol\] table"):
        privacy_audit.main("losue", 100, 2, True, None, None, ())


def test_audit_of_a_protocol_without_a_reference_model_is_an_input_error(tmp_path, monkeypatch, capsys) -> None:
    """A plugin may leave out ``reference_model``; auditing its run is then a directory the audit cannot check:
    one line naming what is missing and exit 2 (not a traceback, not exit 1, which means "failed")."""
    from scenarios import cli, output, runner, schema

    sc = schema.load(str(EXAMPLE / "losue_usage.toml"),
                     [f'protocol.name="{MODULE_CLASS}"', "population.devices=300", "rounds=3"])
    output.write_run_dir(runner.run(sc), tmp_path / "run", transcript="always")
    assert cli.main(["audit", str(tmp_path / "run")]) == 2  # it names a module to import: refused unless allowed
    assert "pass --allow-code if you trust it" in capsys.readouterr().err
    assert cli.main(["audit", str(tmp_path / "run"), "--allow-code"]) == 0  # with its model
    capsys.readouterr()
    monkeypatch.setattr(registry.lookup(MODULE_CLASS).params, "reference_model", None)
    assert cli.main(["audit", str(tmp_path / "run"), "--allow-code"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no reference model for protocol 'losue'" in err[0], err


def test_privacy_audit_finds_the_example_table_under_the_module_class_name() -> None:
    """``ldpsim privacy-audit ldpsim_losue:LosueParams`` said the class gave no example table: its ``examples``
    are keyed by the wire name (losue). A module:Class name with one example gets that example."""
    from scenarios import privacy_audit

    table = privacy_audit.default_table(MODULE_CLASS)
    cls = registry.lookup(MODULE_CLASS).params
    assert table == {"name": MODULE_CLASS, **cls.examples["losue"]}
    assert privacy_audit.default_table("losue") in (None, {"name": "losue", **cls.examples["losue"]})
