"""The command line: ``ldpsim run`` writes a complete, self-consistent run directory; runs are reproducible
from the seed; errors are one line on stderr with exit status 2 and no traceback."""

from __future__ import annotations

import csv
import json
import re
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from scenarios import schema
from scenarios.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FILES = ["summary.json", "estimates.csv", "ledger.csv", "spend.csv", "spend_over_time.csv", "scenario.json",
             "events.jsonl", "estimates.png", "spend.png"]
SMALL = ["--set", "population.devices=2000", "--set", "simulation.cohort_size=700"]


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------- the quickstart run
@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "qs"
    rc = main(["run", "quickstart", "--out", str(out), "--quiet"])
    return rc, out


def test_run_exits_zero_and_writes_every_file(quickstart_run):
    rc, out = quickstart_run
    assert rc == 0
    for name in RUN_FILES:
        assert (out / name).is_file(), name
        assert (out / name).stat().st_size > 0, name
    for name in ("estimates.png", "spend.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_the_one_line_report_names_its_units_and_a_misspelt_scenario_gets_a_suggestion(tmp_path, capsys):
    """A new user's reading: the spend figures are epsilon and the trailing seconds are the simulation's (the
    process takes longer); `ldpsim run quikstart` suggests the shipped quickstart."""
    assert main(["run", "quickstart", "--out", str(tmp_path / "r"), "--quiet", *SMALL, "--set", "rounds=8"]) == 0
    line = capsys.readouterr().out.strip()
    assert "; per-device spend (epsilon): max " in line and re.search(r"; simulated in \d+\.\d\d s$", line), line
    assert main(["run", "quikstart", "--out", str(tmp_path / "q"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip().endswith("no such file (nor a shipped scenario of that name); did you "
                                                    "mean 'quickstart'?")


def test_summary_keys(quickstart_run):
    _, out = quickstart_run
    s = summary_of(out)
    for key in ("protocol", "seed", "devices", "rounds", "error", "epsilon", "messages", "digests", "wall_seconds"):
        assert key in s, key
    assert set(s["error"]) >= {"mean_abs", "max_abs"}
    assert set(s["epsilon"]) >= {"max", "mean", "p50", "p99"}
    assert set(s["messages"]) >= {"sent", "delivered", "rejected"}
    assert set(s["digests"]) >= {"transcript", "ledger", "estimates"}
    assert (s["protocol"], s["seed"], s["devices"], s["rounds"]) == ("1bitrrpm", 42, 20_000, 14)
    for d in s["digests"].values():
        assert isinstance(d, str) and len(d) == 64 and int(d, 16) >= 0
    assert isinstance(s["wall_seconds"], float) and s["wall_seconds"] > 0
    assert 0 <= s["error"]["mean_abs"] <= s["error"]["max_abs"]
    assert s["messages"]["delivered"] <= s["messages"]["sent"]
    assert 0 < s["epsilon"]["mean"] <= s["epsilon"]["max"]
    assert s["epsilon"]["p50"] <= s["epsilon"]["p99"] <= s["epsilon"]["max"]


def test_scenario_json_is_the_validated_input(quickstart_run):
    _, out = quickstart_run
    written = json.loads((out / "scenario.json").read_text(encoding="utf-8"))
    assert written == schema.load("quickstart").as_run  # the input, with [analysis] attacks resolved
    assert schema.parse(written).name == "quickstart"  # and it can be run again


def test_estimates_csv_one_row_per_round(quickstart_run):
    _, out = quickstart_run
    header, rows = read_csv(out / "estimates.csv")
    assert header[:3] == ["round", "truth", "estimate"]
    assert [int(r["round"]) for r in rows] == list(range(1, 15))
    s = summary_of(out)
    errors = [abs(float(r["estimate"]) - float(r["truth"])) for r in rows]
    assert s["error"]["mean_abs"] == pytest.approx(np.mean(errors), rel=1e-12)
    assert s["error"]["max_abs"] == pytest.approx(max(errors), rel=1e-12)
    # the light users' usage doubles at round 8: the truth must show it
    truth = [float(r["truth"]) for r in rows]
    assert np.mean(truth[7:]) - np.mean(truth[:7]) > 1000


def test_events_jsonl(quickstart_run):
    _, out = quickstart_run
    lines = (out / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines
    events = [json.loads(line) for line in lines]
    for e in events:
        assert isinstance(e["sim_time"], (int, float)) and not isinstance(e["sim_time"], bool), e
        assert math.isfinite(e["sim_time"])
    times = [e["sim_time"] for e in events]
    assert times == sorted(times)  # simulated time never goes back
    closed = [e for e in events if e["event"] == "round_closed"]
    assert [e["round"] for e in closed] == list(range(1, 15))
    assert events[0]["event"] == "run_started" and events[-1]["event"] == "run_finished"
    # the logged estimates are the ones in estimates.csv
    _, rows = read_csv(out / "estimates.csv")
    assert [e["estimate"] for e in closed] == [float(r["estimate"]) for r in rows]
    assert [e["truth"] for e in closed] == [float(r["truth"]) for r in rows]


def test_ledger_agrees_with_spend(quickstart_run):
    _, out = quickstart_run
    _, spend_rows = read_csv(out / "spend.csv")
    spend = {int(r["device"]): float(r["spend"]) for r in spend_rows}
    assert sorted(spend) == list(range(20_000))  # every device, once
    header, ledger_rows = read_csv(out / "ledger.csv")
    assert header == ["device", "round", "time", "reason", "amount"]
    assert ledger_rows
    total = defaultdict(float)
    for r in ledger_rows:  # summed in file order, as the ledger accumulated them
        total[int(r["device"])] += float(r["amount"])
        assert 1 <= int(r["round"]) <= 14
    assert set(total) <= set(spend)
    mismatched = [d for d, s in spend.items() if total.get(d, 0.0) != s]
    assert not mismatched, [(d, total.get(d, 0.0), spend[d]) for d in mismatched[:5]]
    # and the summary's spend statistics are those of spend.csv
    values = np.array([spend[d] for d in range(20_000)])
    eps = summary_of(out)["epsilon"]
    assert eps["max"] == values.max()
    assert eps["mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert eps["p50"] == pytest.approx(np.quantile(values, 0.5), rel=1e-12)
    assert eps["p99"] == pytest.approx(np.quantile(values, 0.99), rel=1e-12)
    assert values.max() > values.min()  # memoization: devices differ in how many grid values they revealed


def test_spend_over_time_matches_the_end(quickstart_run):
    _, out = quickstart_run
    _, rows = read_csv(out / "spend_over_time.csv")
    assert [int(r["round"]) for r in rows] == list(range(1, 15))
    eps = summary_of(out)["epsilon"]
    assert float(rows[-1]["max"]) == eps["max"]
    assert float(rows[-1]["mean"]) == pytest.approx(eps["mean"], rel=1e-12)
    means = [float(r["mean"]) for r in rows]
    assert means == sorted(means)  # cumulative spend never decreases


# --------------------------------------------------------------------------------------------- determinism
def _digests(out: Path, seed: int, capsys) -> dict:
    assert main(["run", "quickstart", "--out", str(out), "--quiet", "--set", f"seed={seed}", *SMALL]) == 0
    capsys.readouterr()
    s = summary_of(out)
    assert s["seed"] == seed and s["devices"] == 2000
    return s["digests"]


def test_same_seed_same_digests_other_seed_differs(tmp_path, capsys):
    a = _digests(tmp_path / "a", 5, capsys)
    b = _digests(tmp_path / "b", 5, capsys)
    c = _digests(tmp_path / "c", 6, capsys)
    assert a == b
    for k in ("transcript", "ledger", "estimates"):
        assert a[k] != c[k], k
    assert (tmp_path / "a" / "estimates.csv").read_bytes() == (tmp_path / "b" / "estimates.csv").read_bytes()
    assert (tmp_path / "a" / "ledger.csv").read_bytes() == (tmp_path / "b" / "ledger.csv").read_bytes()


def test_digests_do_not_depend_on_cohort_size(tmp_path, capsys):
    base = ["run", "quickstart", "--quiet", "--set", "seed=9", "--set", "population.devices=1500"]
    assert main([*base, "--out", str(tmp_path / "a"), "--set", "simulation.cohort_size=1500"]) == 0
    assert main([*base, "--out", str(tmp_path / "b"), "--set", "simulation.cohort_size=101"]) == 0
    capsys.readouterr()
    assert summary_of(tmp_path / "a")["digests"] == summary_of(tmp_path / "b")["digests"]


def test_small_run_cohort_size_one(tmp_path, capsys):
    out = tmp_path / "small"
    rc = main(["run", "quickstart", "--out", str(out), "--quiet", "--json", "--set", "simulation.cohort_size=1",
               "--set", "population.devices=300", "--set", "rounds=3"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    s = summary_of(out)
    assert (s["devices"], s["rounds"], s["cohort_size"]) == (300, 3, 1)
    _, rows = read_csv(out / "estimates.csv")
    assert len(rows) == 3
    _, spend = read_csv(out / "spend.csv")
    assert len(spend) == 300
    events = [json.loads(line) for line in (out / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    assert events[0]["cohorts"] == 300
    assert sum(e["event"] == "round_closed" for e in events) == 3
    # --json prints the summary
    assert json.loads(captured.out[captured.out.index("{"):]) == s
    # the change at round 8 no longer happens within 3 rounds: a warning, not an error
    assert "warning: changes[0].round" in captured.err


def test_no_ledger_rows(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "quickstart", "--out", str(out), "--quiet", "--no-ledger-rows", *SMALL]) == 0
    capsys.readouterr()
    assert not (out / "ledger.csv").exists()
    assert (out / "spend.csv").is_file() and (out / "summary.json").is_file()


# -------------------------------------------------------------------------------------------------- errors
def _cli() -> list[str]:
    script = Path(sys.executable).with_name("ldpsim")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "scenarios.cli"]


def ldpsim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def assert_clean_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ldpsim: error: "), p.stderr
    for needle in needles:
        assert needle in p.stderr, (needle, p.stderr)


def test_a_run_directory_scenario_json_runs_again_from_the_command_line(quickstart_run, tmp_path, capsys):
    """`ldpsim run RUN_DIR/scenario.json` repeats the run: the same digests. A .json that is not a scenario
    object, or not JSON, is one line and exit 2."""
    _, out = quickstart_run
    assert main(["run", str(out / "scenario.json"), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert summary_of(tmp_path / "again")["digests"] == summary_of(out)["digests"]
    capsys.readouterr()
    for text, needle in (("[1, 2]", "must be a JSON object, not list"), ("{", "not valid JSON")):
        (tmp_path / "bad.json").write_text(text, encoding="utf-8")
        assert main(["run", str(tmp_path / "bad.json"), "--out", str(tmp_path / "no"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_the_run_line_says_what_kind_of_number_the_guarantee_is(tmp_path, capsys):
    """Memoized protocols: the guarantee holds within a behavior pattern, and the worst-case loss (a different
    number, larger here) stands beside it; THRESH's guarantee is plain."""
    assert main(["run", "quickstart", *SMALL, "--out", str(tmp_path / "q"), "--quiet"]) == 0
    line = capsys.readouterr().out
    worst = summary_of(tmp_path / "q")["privacy"]["worst_case_loss"]["value"]
    assert f"(guarantee 14 within a behavior pattern; worst-case loss {worst:.4g})" in line, line
    assert main(["run", "thresh_stable", "--set", "population.devices=1500", "--out", str(tmp_path / "t"),
                 "--quiet"]) == 0
    line = capsys.readouterr().out
    assert "(guarantee 3);" in line and "behavior pattern" not in line, line


def test_a_budget_shows_in_the_run_line_and_on_spend_png(tmp_path, capsys, monkeypatch):
    """A budget the devices enforce is in the one-line report with the reports refused for it (summary.json's
    count), and drawn on spend.png beside the guarantee (it was only in summary.json)."""
    from scenarios import plots

    drawn: list = []
    real = plots.spend_plot
    monkeypatch.setattr(plots, "spend_plot", lambda *a, **k: (drawn.append(a), real(*a, **k))[1])
    assert main(["run", "quickstart", *SMALL, "--set", "privacy.budget=2", "--out", str(tmp_path / "b"),
                 "--quiet"]) == 0
    refused = summary_of(tmp_path / "b")["privacy"]["refusals"]
    assert refused > 0
    assert f"; budget 2, {refused:,} reports refused for it)" in capsys.readouterr().out
    assert main(["run", "quickstart", *SMALL, "--out", str(tmp_path / "n"), "--quiet"]) == 0
    assert "budget" not in capsys.readouterr().out
    # small runs draw in this process: the budget's line is the last argument, none without a budget
    assert drawn[0][-1] == (2.0, "budget 2 (devices refuse reports past it)") and drawn[1][-1] is None


def test_hostile_inputs_are_one_line_errors(tmp_path, capsys):
    """Found by a hostile-input pass, each was a traceback or worse: a scenario of thousands of nested arrays
    (RecursionError in the TOML reader), a superscript digit as an array index (isdigit() but not int()), a data
    file whose bad line numpy's message would quote (the scenario may point at /proc/self/environ)."""
    (tmp_path / "deep.toml").write_text("x = " + "[" * 5000 + "]" * 5000, encoding="utf-8")
    secret = tmp_path / "data.txt"
    secret.write_text("1\n2\nTOKEN=s3cr3t\n", encoding="utf-8")
    for argv, needle in ((["run", str(tmp_path / "deep.toml")], "input nested too deeply"),
                         (["run", "quickstart", "--set", "population.groups.\u00b2.share=1"], "is not an index"),
                         (["run", "quickstart", "--set",
                           f'population.groups.0.counter={{dist="data", path="{secret}"}}'],
                          "is not one number per line (line 3)")):
        assert main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "s3cr3t" not in err[0], err


def test_an_out_path_under_a_file_is_one_line_in_every_command(tmp_path, capsys):
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    out = str(tmp_path / "afile" / "sub")
    for argv in (["live", "quickstart", "--set", "population.devices=200", "--set", "rounds=2", "--quiet"],
                 ["privacy-audit", "1bitmean", "--trials", "100", "--rounds", "2", "--quiet"],
                 ["compare", "thresh_stable", "--set", "population.devices=300", "--quiet"]):
        assert main([*argv, "--out", out]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"ldpsim: error: {out}: Not a directory", (argv, err)


def test_an_out_name_the_file_system_refuses_is_one_line_in_every_command(tmp_path, capsys):
    """A path component longer than the file system takes (255 bytes) was a traceback of OSError from `run`
    (found by a hostile-input pass): now one line naming the path and the system's reason, and nothing left."""
    out = str(tmp_path / ("a" * 300))
    for argv in (["run", "quickstart", "--set", "population.devices=200", "--set", "rounds=2", "--quiet"],
                 ["live", "quickstart", "--set", "population.devices=200", "--set", "rounds=2", "--quiet"],
                 ["privacy-audit", "1bitmean", "--trials", "100", "--rounds", "2", "--quiet"]):
        assert main([*argv, "--out", out]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"ldpsim: error: {out}") and err[-1].endswith(": File name too long"), (argv, err)
        assert not [line for line in err if not line.startswith("ldpsim: ")], err  # no traceback
    assert list(tmp_path.iterdir()) == []


def test_bad_scenario_file(tmp_path):
    text = (schema.SHIPPED / "quickstart.toml").read_text(encoding="utf-8")
    assert "share = 0.7" in text
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("share = 0.7", "share = 0.6"), encoding="utf-8")
    p = ldpsim("run", str(bad), "--out", str(tmp_path / "out"), "--quiet", cwd=tmp_path)
    assert_clean_error(p, "population.groups", "sum to 1", "0.9")
    assert not (tmp_path / "out").exists()


def test_bad_set(tmp_path):
    p = ldpsim("run", "quickstart", "--out", str(tmp_path / "out"), "--quiet", "--set", "protocol.epsilon=-1",
               cwd=tmp_path)
    assert_clean_error(p, "protocol.epsilon")
    assert not (tmp_path / "out").exists()


def test_bad_set_form(tmp_path):
    p = ldpsim("run", "quickstart", "--out", str(tmp_path / "out"), "--set", "population.groups.7.share=1",
               cwd=tmp_path)
    assert_clean_error(p, "population.groups.7")


def test_nonexistent_scenario(tmp_path):
    missing = str(tmp_path / "nowhere" / "missing.toml")
    p = ldpsim("run", missing, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert_clean_error(p, missing)
    assert not (tmp_path / "out").exists()


def test_finished_run_needs_force(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "quickstart", "--out", str(out), "--quiet", "--set", "seed=1", *SMALL]) == 0
    capsys.readouterr()
    before = {name: (out / name).read_bytes() for name in ("summary.json", "events.jsonl", "estimates.csv")}
    p = ldpsim("run", "quickstart", "--out", str(out), "--quiet", "--set", "seed=2", *SMALL, cwd=tmp_path)
    assert_clean_error(p, "--out", "--force")
    for name, data in before.items():
        assert (out / name).read_bytes() == data, name  # the finished run is untouched
    rc = main(["run", "quickstart", "--out", str(out), "--quiet", "--force", "--set", "seed=2", *SMALL])
    capsys.readouterr()
    assert rc == 0
    assert summary_of(out)["seed"] == 2
    assert (out / "summary.json").read_bytes() != before["summary.json"]


def test_out_without_summary_is_reused(tmp_path, capsys):
    """A directory without summary.json (an unfinished run, or just empty) is not a finished run."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "events.jsonl").write_text("stale\n", encoding="utf-8")
    assert main(["run", "quickstart", "--out", str(out), "--quiet", *SMALL]) == 0
    capsys.readouterr()
    assert "stale" not in (out / "events.jsonl").read_text(encoding="utf-8")
    assert (out / "summary.json").is_file()


def test_a_run_removes_only_its_own_files(tmp_path, capsys):
    """--out into a folder of the user's own files: the run used to delete every *.csv, *.png, *.jsonl and
    *.parquet there (a thesis_data.csv, a compare.png). Now only the names a run writes go, with the temporary
    files a killed run left; a forced rerun, and a run that fails, leave the user's files as they were."""
    from scenarios import cli

    out = tmp_path / "mine"
    out.mkdir()
    mine = {"thesis_data.csv": "a,b\n1,2\n", "figure.png": "not a png", "notes.jsonl": "{}\n",
            "table.parquet": "x", "compare.csv": "epoch\n"}
    for name, text in mine.items():
        (out / name).write_text(text, encoding="utf-8")
    (out / ".ledger.tmp-999.parquet").write_text("half", encoding="utf-8")  # a killed run's
    assert main(["run", "quickstart", "--out", str(out), "--quiet", *SMALL]) == 0
    assert main(["run", "quickstart", "--out", str(out), "--quiet", "--force", *SMALL]) == 0
    capsys.readouterr()
    for name, text in mine.items():
        assert (out / name).read_text(encoding="utf-8") == text, name
    assert not (out / ".ledger.tmp-999.parquet").exists()
    written = {p.name for p in out.iterdir()} - set(mine)
    assert written <= set(cli.RUN_FILES), written - set(cli.RUN_FILES)  # every file a run writes is cleared
    cli.discard_partial_run(out, remove_dir=True)  # what a failed run does: the run's files go, the user's stay
    assert {p.name for p in out.iterdir()} == set(mine)


def test_out_that_is_a_file(tmp_path):
    """--out naming an existing file is an argument error (one line, exit 2), not a traceback."""
    target = tmp_path / "afile"
    target.write_text("not a directory\n", encoding="utf-8")
    p = ldpsim("run", "quickstart", "--out", str(target), "--quiet", *SMALL, cwd=tmp_path)
    assert_clean_error(p, "--out", str(target))
    assert target.read_text(encoding="utf-8") == "not a directory\n"


def test_forced_run_that_fails_leaves_no_summary(tmp_path, capsys, monkeypatch):
    """summary.json marks a complete run directory: once --force starts overwriting a finished run, the old
    summary.json must not survive next to the new, unfinished files."""
    from scenarios import runner

    out = tmp_path / "run"
    assert main(["run", "quickstart", "--out", str(out), "--quiet", *SMALL]) == 0

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    assert main(["run", "quickstart", "--out", str(out), "--quiet", "--force", *SMALL]) == 130
    capsys.readouterr()
    assert not (out / "summary.json").exists()
    assert list(out.iterdir()) == []  # nor any other file of either run (events.jsonl of the failed one)
    fresh = tmp_path / "new" / "run"  # a directory the failed run made itself is removed
    assert main(["run", "quickstart", "--out", str(fresh), "--quiet", *SMALL]) == 130
    assert not fresh.exists() and (tmp_path / "new").is_dir()


def test_run_process_output_and_imports(tmp_path):
    """The ``ldpsim run`` process (which ends with os._exit after the atexit handlers: scenarios/cli.py
    _exit_now) prints its whole report and summary, and never imports pandas or pyplot."""
    out = tmp_path / "run"
    cmd = [*_cli(), "run", "quickstart", "--out", str(out), "--quiet", "--json", "--set", "population.devices=500",
           "--set", "rounds=3"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    report = [line for line in p.stderr.splitlines() if line.startswith("mean |error|")]  # --json: on stderr
    assert len(report) == 1 and "(of each round's mean counter, in seconds)" in report[0]
    assert json.loads(p.stdout) == summary_of(out)
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "numba" in imported and "matplotlib" in imported  # the switch worked
    assert not imported & {"pandas", "matplotlib.pyplot", "pyarrow.compute"}, imported & {"pandas", "matplotlib.pyplot"}


def test_compare_shows_a_progress_bar_per_run_unless_quiet(tmp_path, capsys):
    """ldpsim compare runs the protocol and its naive baseline: a progress bar for each (stderr), none with
    --quiet, the same table either way."""
    args = ["compare", "thresh_stable", "--set", "population.devices=500", "--set", "rounds=42"]
    assert main(args + ["--out", str(tmp_path / "a")]) == 0
    shown = capsys.readouterr()
    assert "simulating thresh" in shown.err and "simulating naive" in shown.err and "42/42" in shown.err
    assert main(args + ["--out", str(tmp_path / "b"), "--quiet"]) == 0
    quiet = capsys.readouterr()
    assert "simulating" not in quiet.err and "%|" not in quiet.err
    assert quiet.out == shown.out.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    # a finished comparison is not overwritten without --force (it was, silently), and is with it
    before = (tmp_path / "b" / "compare.json").stat().st_mtime_ns
    assert main(args + ["--out", str(tmp_path / "b"), "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (f"ldpsim: error: --out {tmp_path / 'b'}: holds a finished comparison; "
                                               "pass --force to overwrite it or choose another")
    assert (tmp_path / "b" / "compare.json").stat().st_mtime_ns == before
    assert main(args + ["--out", str(tmp_path / "b"), "--quiet", "--force"]) == 0


@pytest.mark.parametrize("argv, flag", [
    (["live", "quickstart", "--connections", "0"], "--connections"),
    (["live", "quickstart", "--connections", "-3"], "--connections"),
    (["live", "quickstart", "--stage-timeout", "-1"], "--stage-timeout"),
    (["live", "quickstart", "--hello-timeout", "nan"], "--hello-timeout"),
    (["serve", "quickstart", "--port", "99999"], "--port"),
    (["serve", "quickstart", "--round-pause", "-0.5"], "--round-pause"),
    (["serve", "quickstart", "--max-connections", "0"], "--max-connections"),
    (["devices", "quickstart", "--connect", "127.0.0.1:7337", "--connections", "0"], "--connections"),
])
def test_live_commands_refuse_bad_numbers_before_doing_anything(argv, flag, tmp_path, capsys):
    """Connections, ports and timeouts out of range are refused by the parser (exit 2, one line naming the
    option), not accepted and then crashing at the end of a run, or reported as a run that did nothing."""
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--out", str(tmp_path / "x")] if argv[0] != "devices" else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"ldpsim {argv[0]}: error: argument {flag}"), err
    assert not (tmp_path / "x").exists()


def test_serve_on_a_port_in_use_is_one_line_and_leaves_no_run_directory(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "quickstart", "--port", str(port), "--out", str(tmp_path / "srv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ldpsim: error: cannot listen on 127.0.0.1:{port}: ") and "\n" not in err, err
    assert list((tmp_path / "srv").iterdir()) == []  # no journal, no events.jsonl
    assert main(["devices", "quickstart", "--connect", "127.0.0.1:70000"]) == 2
    assert "port 1-65535" in capsys.readouterr().err


def test_run_json_writes_only_the_summary_on_stdout(tmp_path, capsys):
    """`ldpsim run --json | jq`: the one-line report goes to stderr, stdout is summary.json alone."""
    assert main(["run", "quickstart", *SMALL, "--set", "rounds=2", "--out", str(tmp_path / "r"), "--quiet",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == summary_of(tmp_path / "r")
    assert "mean |error|" in err


def test_protocol_summaries_are_whole_or_cut_at_a_word():
    """`ldpsim protocols`: a summary is its docstring's first paragraph on one line, cut with "..." only past
    the limit (1bitmulti and thresh used to stop mid-sentence at a line break)."""
    from protocols import registry

    for r in registry.available():
        text = r.summary
        assert 0 < len(text) <= registry.SUMMARY_CHARS and "\n" not in text, r.name
        assert text.endswith((".", ")", "...")), (r.name, text)


def test_live_says_which_simulated_network_settings_it_does_not_apply(tmp_path, capsys):
    """Over real TCP there is no keyed loss, downlink loss or jitter: `ldpsim live` says so in one note and
    summary.json names them, instead of silently giving a run without the loss the scenario asked for."""
    small = ["--set", "population.devices=300", "--set", "rounds=2"]
    assert main(["live", "quickstart", *small, "--set", "network.loss=0.1", "--set", "network.jitter=2",
                 "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("ldpsim: note:")]
    assert notes == ["ldpsim: note: a live run over real TCP does not simulate the scenario's network loss 0.1, "
                     "jitter 2 (summary.json live.network_not_applied)"]
    assert "live rounds" in err  # the progress bar
    assert summary_of(tmp_path / "a")["live"]["network_not_applied"] == {"loss": 0.1, "jitter": 2.0}
    assert main(["live", "quickstart", *small, "--set", "network.loss=0", "--out", str(tmp_path / "b"),
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "note:" not in err and "live rounds" not in err and "%|" not in err
    assert summary_of(tmp_path / "b")["live"]["network_not_applied"] == {}


def test_compare_of_a_frequency_oracle_prints_the_mean_max_item_error(tmp_path, capsys):
    """HeavyTHRESH's comparison is read by its mean max item error (summary.json hist_max_abs, the figure the
    README quotes): the console line shows it, with the value compare.json holds, for both sides."""
    assert main(["compare", "heavythresh_shift", "--set", "population.devices=2000", "--out", str(tmp_path),
                 "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = json.loads((tmp_path / "compare.json").read_text())
    for name, line in zip(("heavythresh", "naive"), lines):
        assert line.lstrip().startswith(f"{name}:")
        assert f"mean max item error {table[name]['error']['hist_max_abs']:.4g};" in line, line
    assert main(["compare", "thresh_stable", "--set", "population.devices=500", "--set", "rounds=42", "--out",
                 str(tmp_path / "t"), "--quiet"]) == 0
    assert "item error" not in capsys.readouterr().out  # THRESH estimates means: no items


def test_the_readme_python_example_writes_a_run_directory_the_audit_accepts(tmp_path, monkeypatch, capsys):
    """The README's "From Python" block, run as written (in a scratch directory): it writes the run directory
    the CLI writes, events.jsonl included, and `ldpsim audit` finds everything in agreement."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    block = re.search(r"From Python.*?```python\n(.*?)```", readme, re.S)
    assert block is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "README.md", "exec"), {})
    run_dir = tmp_path / "runs" / "from-python"
    assert {"events.jsonl", "summary.json", "ledger.parquet", "transcript.parquet"} <= {
        p.name for p in run_dir.iterdir()}
    assert any('"round_closed"' in line for line in (run_dir / "events.jsonl").open(encoding="utf-8"))
    capsys.readouterr()
    assert main(["audit", str(run_dir), "--json"]) == 0


def test_more_connections_than_devices_open_one_a_device(tmp_path, capsys) -> None:
    """A hundred million connections built a hundred million shards before anything ran: a connection carries
    at least one device, so there are at most as many as devices (and a 1-device scenario still runs with the
    default 2)."""
    assert main(["live", "quickstart", "--connections", "100000000", "--set", "population.devices=3", "--set",
                 "rounds=2", "--quiet", "--out", str(tmp_path / "out")]) == 0
    assert "live run over 3 connection(s)" in capsys.readouterr().out


def test_connections_beyond_the_open_file_limit_are_one_line(tmp_path, capsys, monkeypatch) -> None:
    from collector import server

    monkeypatch.setattr(server, "fd_ceiling", lambda: 192)  # ulimit -n 256
    assert main(["live", "quickstart", "--connections", "200", "--set", "population.devices=300", "--quiet",
                 "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("ldpsim: error: --connections: 200 needs 400 open files; this process "
                                               "may open about 192 (ulimit -n)")


@pytest.mark.parametrize("command", [["run", "quickstart"], ["live", "quickstart"], ["serve", "quickstart"],
                                     ["devices", "quickstart", "--connect", "127.0.0.1:9"]])
def test_a_population_that_cannot_fit_in_memory_is_refused_up_front(tmp_path, capsys, monkeypatch, command) -> None:
    """4 billion devices (the schema's limit) at 100 bytes each against the memory available: one line before
    anything is allocated or written, not the kernel's OOM killer minutes into the run."""
    from scenarios import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 24 * 10**9)
    assert main([*command, "--set", "population.devices=4294967295", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == ("ldpsim: error: population.devices: 4,294,967,295 devices need at least 558 GB of memory (130 "
                   "bytes a device, 0.15 GB a process), and 24 GB is available")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command, says", [
    (["run", "quickstart", "--set", "population.devices=1024", "--set", "simulation.cohort_size=1", "--set",
      "simulation.workers=1024"], "simulation.workers: 1,024 devices and 1,024 worker processes need at least 154 GB"),
    (["sweep", "quickstart", "--workers", "1", "--repeat", "1", "--grid", "population.devices=1000,200000000"],
     "population.devices: 200,000,000 devices and 1 worker process need at least 26.1 GB"),
    (["sweep", "quickstart", "--workers", "200", "--repeat", "100", "--grid", "population.devices=100,200"],
     "--workers: 40,000 devices and 200 worker processes need at least 30"),
])
def test_worker_processes_and_a_sweep_s_largest_run_count_against_memory(tmp_path, capsys, monkeypatch, command,
                                                                         says) -> None:
    """A worker process costs about 150 MB (numpy, numba and the kernels), and a thousand of them were allowed;
    a sweep's run of 200M devices ran the machine out of memory where ldpsim run refused it. The line names
    what to change: the workers when they take the most (it blamed population.devices for 1,000 workers)."""
    from scenarios import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 24 * 10**9)
    assert main([*command, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_protocols_lists_each_protocol_with_a_line_of_its_own(capsys) -> None:
    """Classes that run several protocols (1bitmean and 1bitrrpm, dbitflip/dbitflippm/binflip) used to show
    their module's line under every name: each name now says what it is."""
    assert main(["protocols", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    lines = [r["summary"] for r in rows]
    assert len(set(lines)) == len(lines) and all(lines)
    by = {r["name"]: r["summary"] for r in rows}
    assert by["1bitrrpm"].startswith("1BitRRPM") and by["binflip"].startswith("BinFlip")


def test_a_shard_without_devices_is_refused(capsys) -> None:
    """300 devices over 301 shards leave shard 1 empty: it said "done" and exited 0 without connecting."""
    assert main(["devices", "quickstart", "--set", "population.devices=300", "--shard", "1/301", "--connect",
                 "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip() == "ldpsim: error: --shard 1/301: holds no device (300 devices over 301 shards)"


def test_run_exits_one_when_a_device_spends_past_the_protocols_own_guarantee(tmp_path, capsys):
    """A protocol whose guarantee understates what its devices spend: the run completes and keeps its directory
    (for `ldpsim audit`), says so in one line naming the spend and the guarantee, and exits 1 (it used to exit 0
    with only summary.json's within_guarantee false). The honest kflip exits 0."""
    def args(name: str, out: str) -> list[str]:
        table = f'protocol={{name = "{name}", epsilon = 1.0, max_value = 86400, buckets = 8}}'
        return ["run", "quickstart", "--out", str(tmp_path / out), "--set", table, "--set", "population.devices=200",
                "--set", "rounds=4", "--quiet"]

    assert main(args("kflip", "honest")) == 0
    capsys.readouterr()
    broken = args("tests.support:UnderstatedKFlip", "broken")
    assert main(broken) == 1
    err = capsys.readouterr().err
    assert "error: privacy: a device spent 4, past its guarantee (guarantee 2)" in err
    summary = json.loads((tmp_path / "broken" / "summary.json").read_text())
    assert summary["privacy"]["within_guarantee"] is False


def test_a_protocol_whose_parameter_class_is_not_a_dataclass_runs(tmp_path, capsys):
    """The README asks a plugin's parameter class for from_table and a few attributes, not for a dataclass: one
    that is a plain class crashed at the run's start (dataclasses.asdict in the run_started event). Its
    parameters are now its public attributes, in the event and in summary.json."""
    out = tmp_path / "r"
    table = 'protocol={name = "tests.support:PlainKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    assert main(["run", "quickstart", "--out", str(out), "--set", table, "--set", "population.devices=200",
                 "--set", "rounds=2", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parameters"] == {"name": "plainkflip", "epsilon": 1.0, "max_value": 86400.0, "buckets": 8,
                                     "round_epsilon": 1.0}
    started = next(json.loads(line) for line in (out / "events.jsonl").open() if '"run_started"' in line)
    assert started["protocol"]["name"] == "plainkflip"


def test_a_report_family_without_its_column_is_explained_not_a_crash(tmp_path, capsys):
    """report_family = "onebit" on a protocol whose report column is not named ``bit``: the run finished, then
    the attack metrics raised StopIteration and the run directory was deleted. Now the run is written and
    summary.json's attacks say which column the family reads and which the protocol has."""
    out = tmp_path / "r"
    table = 'protocol={name = "tests.support:MislabelledKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    assert main(["run", "quickstart", "--out", str(out), "--set", table, "--set", "population.devices=200",
                 "--set", "rounds=2", "--quiet"]) == 0
    why = json.loads((out / "summary.json").read_text())["attacks"]["averaging"]["why"]
    assert why.startswith("report_family 'onebit' reads a report column named 'bit', which this protocol's report "
                          "stage does not have (its columns: ")


@pytest.mark.parametrize("cls, needle, code", [
    ("NoKindKFlip", "error: protocol.name: 'tests.support:NoKindKFlip' made a parameter object without 'kind'", 2),
    ("NoEstimateKFlip", "error: protocol: KFlipCollector.estimate is not implemented: a protocol's device or "
                        "collector side must define it", 2)])
def test_a_plugin_missing_a_member_it_needs_is_one_line(tmp_path, capsys, cls, needle, code):
    """A parameter class without kind (AttributeError) and a collector side without estimate (a SimPy traceback
    ending in a bare NotImplementedError) each stopped with a traceback; now one line naming the member."""
    table = f'protocol={{name = "tests.support:{cls}", epsilon = 1.0, max_value = 86400, buckets = 8}}'
    assert main(["run", "quickstart", "--out", str(tmp_path / "r"), "--set", table, "--set",
                 "population.devices=200", "--set", "rounds=2", "--quiet"]) == code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert "Traceback" not in err and len(errors) == 1 and needle in errors[0], err


def test_a_protocol_class_that_names_itself_with_its_class_path_is_refused(tmp_path, capsys):
    """A module:Class protocol whose from_table keeps the name it was given ("tests.support:...") made a run in
    which every message was refused by the wire format and no device ever reported, with exit 0; now it is a
    one-line error naming the key."""
    table = 'protocol={name = "protocols.baselines:KFlipParams", epsilon = 1.0, max_value = 86400, buckets = 8}'
    code = main(["run", "quickstart", "--out", str(tmp_path / "r"), "--set", table, "--quiet"])
    assert code == 2
    assert "protocol.name: 'protocols.baselines:KFlipParams' made a parameter object named" in capsys.readouterr().err


def test_a_report_column_of_a_dtype_the_wire_cannot_carry_is_one_line(tmp_path, capsys):
    """A plugin collector declaring Column("y", np.uint16): the run stops at the start with one line naming
    the column and the dtypes that travel, exit 2 (it was a traceback from msgpack's encoder mid-run)."""
    table = 'protocol={name = "tests.support:Uint16KFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    assert main(["run", "quickstart", "--out", str(tmp_path / "r"), "--set", table, "--set",
                 "population.devices=200", "--set", "rounds=2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == ("ldpsim: error: protocol: report column 'y': dtype uint16 does not travel on the "
                                    "wire (one of f4, f8, i4, i8, u1, u4, u8; u1 for bits)"), err


@pytest.mark.parametrize("how", ["simulation.threads=1", "simulation.threads=2", "simulation.workers=2"])
def test_a_device_side_column_the_wire_cannot_carry_is_one_line(tmp_path, capsys, how):
    """A plugin whose collector declares u1 but whose device side sends uint16: the run stops with one line
    naming the protocol and the column, exit 2, whether the cohorts answer on the run's thread, on threads or in
    worker processes (it was msgpack's "dtype uint16 is not a wire dtype" in a traceback)."""
    table = 'protocol={name = "tests.support:Uint16DevicesKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    assert main(["run", "quickstart", "--out", str(tmp_path / "r"), "--set", table, "--set", "population.devices=400",
                 "--set", "simulation.cohort_size=100", "--set", how, "--set", "rounds=2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1] == (
        "ldpsim: error: protocol: uint16deviceskflip: the device side's report column 'y': dtype uint16 does not "
        "travel on the wire (one of f4, f8, i4, i8, u1, u4, u8; wire.bits for bits)"), err
    assert not (tmp_path / "r").exists()


def test_a_run_whose_collector_rejects_its_own_devices_says_so(tmp_path, capsys):
    """A device side sending float32 where its collector declares u1: the wire carries it, the collector rejects
    every batch. The run says so in one line with the first reason and exits 1 (it exited 0 with a warning), and
    summary.json names it; an honest run has no such line and first_rejection null, late batches (network jitter
    past the deadline) included."""
    table = 'protocol={name = "tests.support:Float32DevicesKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    assert main(["run", "quickstart", "--out", str(tmp_path / "bad"), "--set", table, "--set",
                 "population.devices=300", "--set", "rounds=2", "--quiet"]) == 1
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "its own devices' messages" in line]
    assert len(warning) == 1 and warning[0].startswith("ldpsim: error: the collector rejected 2 of its own "
                                                       "devices' messages"), err
    assert "column 'y' must be u1, got float32" in warning[0], warning
    messages = summary_of(tmp_path / "bad")["messages"]
    assert messages["rejected"] == 2 and messages["late"] == 0
    assert messages["first_rejection"] == "protocol: column 'y' must be u1, got float32"
    # honest, with late batches: a deadline shorter than most reports' delay
    assert main(["run", "quickstart", "--out", str(tmp_path / "late"), "--set", "population.devices=300", "--set",
                 "rounds=2", "--set", "network.jitter=2", "--set", "network.deadline=1", "--quiet"]) == 0
    assert "its own devices' messages" not in capsys.readouterr().err
    messages = summary_of(tmp_path / "late")["messages"]
    assert messages["late"] > 0 and messages["rejected"] == messages["late"] and messages["first_rejection"] is None
    # THRESH, two stages a round: a vote batch that arrives while the estimate stage is open is late, not a
    # disagreement (it was counted as "a thresh batch has exactly the columns ['est'], got ['vote']")
    assert main(["run", "thresh_stable", "--out", str(tmp_path / "thresh"), "--set", "population.devices=300", "--set",
                 "rounds=21", "--set", "network.jitter=900", "--quiet"]) == 0
    assert "its own devices' messages" not in capsys.readouterr().err
    messages = summary_of(tmp_path / "thresh")["messages"]
    assert messages["late"] >= 3 and messages["rejected"] == messages["late"] and messages["first_rejection"] is None


@pytest.mark.parametrize("command", ["run", "sweep", "compare", "audit"])
def test_an_unknown_option_is_told_with_the_command_s_own_usage(command, capsys):
    """`ldpsim sweep quickstart --bogus` printed the top-level usage (every command); now the command's own, and
    exit 2."""
    with pytest.raises(SystemExit) as stop:
        main([command, "quickstart", *(["--out", "unused"] if command == "sweep" else []), "--bogus"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: ldpsim {command} ") and err.strip().endswith(
        f"ldpsim {command}: error: unrecognized arguments: --bogus"), err


def test_an_unknown_option_before_the_command_is_told_with_the_top_level_usage(capsys):
    """`ldpsim --bogus run quickstart` was reported with `ldpsim run`'s usage, as if run had no --bogus."""
    with pytest.raises(SystemExit) as stop:
        main(["--bogus", "run", "quickstart"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ldpsim [-h]") and err.strip().endswith(
        "ldpsim: error: unrecognized arguments: --bogus"), err


def test_compare_of_a_protocol_without_a_baseline_names_those_that_have_one(capsys):
    assert main(["compare", "quickstart"]) == 2
    assert capsys.readouterr().err.strip() == (
        "ldpsim: error: protocol.name: '1bitrrpm' has no naive baseline to compare with: compare runs thresh and "
        "heavythresh against theirs at equal total privacy (a plugin names its own with baseline_table() on its "
        "parameter class)")


def test_an_interrupt_wrapped_by_a_c_extension_is_one_line(monkeypatch, capsys) -> None:
    """Ctrl-C while numba loads a cached kernel comes out as "SystemError: ... returned a result with an exception
    set" caused by the KeyboardInterrupt (a fresh clone's .ci/run showed the traceback): it is "ldpsim:
    interrupted", exit 130, like any interrupt (a SIGTERM so wrapped: "terminated", 143); a SystemError of
    another cause is not hidden."""
    from scenarios import cli

    def wrapped(args):  # type: ignore[no-untyped-def]
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise SystemError("<function _numba_unpickle> returned a result with an exception set") from exc

    monkeypatch.setattr(cli, "cmd_protocols", wrapped)
    assert main(["protocols"]) == 130
    assert capsys.readouterr().err.strip() == "ldpsim: interrupted"

    def terminated(args):  # type: ignore[no-untyped-def]
        # SIGTERM there (a fresh clone's .ci/run, its kernel cache cold, exited 130 "interrupted" for it)
        try:
            raise cli.Terminated
        except KeyboardInterrupt as exc:
            raise SystemError("<function _numba_unpickle> returned a result with an exception set") from exc

    monkeypatch.setattr(cli, "cmd_protocols", terminated)
    assert main(["protocols"]) == 143
    assert capsys.readouterr().err.strip() == "ldpsim: terminated"

    def other(args):  # type: ignore[no-untyped-def]
        raise SystemError("something else")

    monkeypatch.setattr(cli, "cmd_protocols", other)
    with pytest.raises(SystemError, match="something else"):
        main(["protocols"])


def test_a_large_run_says_it_is_writing_its_directory_after_the_progress_bar(tmp_path, monkeypatch, capsys):
    """Past WRITING_LINE devices x rounds, one line after the progress bar says the run directory is being
    written, naming the attack metrics when they are computed (seconds that were a silent pause); --quiet
    keeps it out."""
    from scenarios import cli

    monkeypatch.setattr(cli, "WRITING_LINE", 1)
    out = tmp_path / "r"
    assert main(["run", "quickstart", "--out", str(out), *SMALL, "--set", "analysis.attacks=true"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert f"ldpsim: writing {out}: tables, pictures, summary and attack metrics" in lines
    assert main(["run", "quickstart", "--out", str(tmp_path / "q"), "--quiet", *SMALL]) == 0
    assert "writing" not in capsys.readouterr().err
    monkeypatch.setattr(cli, "WRITING_LINE", 10**12)
    assert main(["run", "quickstart", "--out", str(tmp_path / "s"), *SMALL]) == 0
    assert "ldpsim: writing" not in capsys.readouterr().err
