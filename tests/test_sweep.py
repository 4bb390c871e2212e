"""``ldpsim sweep``: the grid and its derived seeds, the tidy table, worker-count independence, resuming an
interrupted sweep, refusing a different sweep, up-front validation, [sweep] tables, table-valued grid values,
failed runs and plots; longest-first scheduling, pinned workers, results.parquet and Dask clusters (a real
LocalCluster resuming a sweep, a stand-in for what is submitted). Tiny runs (300 devices, 2 rounds) keep the
whole file fast."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

from protocols.keyed import stream_key
from scenarios import runner, schema, sweep
from scenarios.cli import main
from scenarios.schema import ScenarioError

REPO = Path(__file__).resolve().parent.parent  # this checkout

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--set", "population.devices=300", "--set", "rounds=2", "--set", "simulation.cohort_size=100",
         "--set", "changes=[]"]
GRID = ["--grid", "protocol.epsilon=0.5,1,2", "--grid", "protocol.name=1bitmean,1bitrrpm"]
COLUMNS = ["protocol.epsilon", "protocol.name", "repetition", "seed", "devices", "protocol", "errors_of", "error_mean_abs",
           "error_max_abs", "error_rmse", "error_rounds_without_estimate", "epsilon_max", "epsilon_mean",
           "epsilon_p50", "epsilon_p99", "guarantee", "within_guarantee", "privacy_scope", "worst_case_loss",
           "wall_seconds"]
COUNTERS = 'population.groups.0.counter={dist="constant",value=12},{dist="uniform",low=0,high=24}'


def sweep_cli(out: Path, *extra: str, grid: list[str] = GRID, repeat: str | None = "2",
              scenario: str = "quickstart") -> int:
    swept = {g.split("=", 1)[0].strip() for g in grid[1::2]}
    small = [x for k, v in zip(SMALL[::2], SMALL[1::2]) if v.split("=", 1)[0] not in swept for x in (k, v)]
    args = ["sweep", scenario, *grid, "--out", str(out), "--quiet", *small, *extra]
    return main(args + (["--repeat", repeat] if repeat is not None else []))


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def without_wall(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rows]


def runs_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "runs.jsonl").read_text(encoding="utf-8").splitlines()]


def count_runs(monkeypatch, fail=lambda scenario: False) -> list[int]:
    """Patch the runner (used by in-process sweeps, --workers 1) to count runs; ``fail`` makes some raise."""
    calls: list[int] = []
    real = runner.run

    def counting(scenario, *a, **kw):
        calls.append(scenario.seed)
        if fail(scenario):
            raise RuntimeError("boom: injected failure")
        return real(scenario, *a, **kw)

    monkeypatch.setattr(runner, "run", counting)
    return calls


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "w2"
    assert sweep_cli(out, "--workers", "2") == 0
    return out


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "w1"
    assert sweep_cli(out, "--workers", "1") == 0
    return out


# ------------------------------------------------------------------------------------------ the grid
def test_split_values_keeps_brackets_braces_and_quotes_together():
    assert sweep.split_values("0.5, 1,2") == ["0.5", "1", "2"]
    assert sweep.split_values('{dist="constant",value=12},{dist="uniform",low=0,high=24}') == \
        ['{dist="constant",value=12}', '{dist="uniform",low=0,high=24}']
    assert sweep.split_values('[1,2],"a,b",\'c,"d\',x') == ["[1,2]", '"a,b"', "'c,\"d'", "x"]
    for bad in ("{a=1", "[1,2", '"open', "1]"):
        with pytest.raises(ValueError):
            sweep.split_values(bad)


def test_grid_values_are_toml_values_and_round_trip():
    key, values = sweep.parse_grid_arg(COUNTERS)
    assert key == "population.groups.0.counter"
    assert values == [{"dist": "constant", "value": 12}, {"dist": "uniform", "low": 0, "high": 24}]
    assert sweep.parse_grid_arg("protocol.name=1bitmean,\"1bitrrpm\"")[1] == ["1bitmean", "1bitrrpm"]
    assert sweep.parse_grid_arg("x=1,2.5,true,[1,2]")[1] == [1, 2.5, True, [1, 2]]
    for v in [1, -2.5, 1e-7, float("inf"), True, "a \"q\" b", [1, "x"], {"dist": "normal", "sd": 0.5}]:
        assert schema._parse_value(sweep.toml_text(v)) == v
    for bad in ("protocol.epsilon", "=1,2", "protocol.epsilon=1,,2", "protocol.epsilon={a=1"):
        with pytest.raises(ScenarioError):
            sweep.parse_grid_arg(bad)


def test_cross_product_size_and_derived_seeds():
    sw = sweep.plan("quickstart", ["protocol.epsilon=0.5,1,2", "protocol.name=1bitmean,1bitrrpm",
                                   "network.loss=0,0.1"], repeat=4, overrides=["seed=7"])
    assert len(sw.points) == 3 * 2 * 2
    assert len(set(sw.points)) == len(sw.points)
    assert sw.seeds == [stream_key(7, sweep.SWEEP_PURPOSE, r) & (2**63 - 1) for r in range(4)]
    assert len(set(sw.seeds)) == 4 and all(0 <= s < 2**63 for s in sw.seeds)
    assert sweep.derive_seeds(8, 4) != sw.seeds  # they follow the base seed
    assert sw.point_data(sw.points[-1])["network"]["loss"] == 0.1
    assert sw.point_data(sw.points[-1])["protocol"]["name"] == "1bitrrpm"


def test_every_grid_point_shares_the_repetition_seeds(two_workers):
    sw = json.loads((two_workers / "sweep.json").read_text(encoding="utf-8"))
    runs = runs_of(two_workers)
    assert len(runs) == 3 * 2 * 2
    by_point: dict[str, dict[int, int]] = {}
    for run in runs:
        by_point.setdefault(json.dumps(run["point"], sort_keys=True), {})[run["repetition"]] = run["seed"]
        assert run["summary"]["seed"] == run["seed"]  # the run really used it
    assert len(by_point) == 6
    for seeds in by_point.values():
        assert [seeds[r] for r in range(2)] == sw["seeds"]
    assert sw["seeds"][0] != sw["seeds"][1]


# ------------------------------------------------------------------------------------------- results
def test_results_csv_has_one_row_per_run_and_the_expected_columns(two_workers):
    header, rows = read_csv(two_workers / "results.csv")
    assert header == COLUMNS
    assert len(rows) == 12 == len(runs_of(two_workers))
    assert {(r["protocol.epsilon"], r["protocol.name"], r["repetition"]) for r in rows} == \
        {(e, p, str(k)) for e in ("0.5", "1", "2") for p in ("1bitmean", "1bitrrpm") for k in (0, 1)}
    for r in rows:
        assert r["protocol"] == r["protocol.name"] and r["devices"] == "300"
        assert float(r["error_mean_abs"]) >= 0 and float(r["wall_seconds"]) > 0
    naive = [r for r in rows if r["protocol"] == "1bitmean"]  # 1bitmean spends epsilon' every round
    assert {(r["protocol.epsilon"], float(r["epsilon_max"])) for r in naive} == \
        {(r["protocol.epsilon"], float(r["epsilon_mean"])) for r in naive}
    # two kinds of epsilon figure, named apart: 1bitrrpm's is spend within a behavior pattern, with the worst-case
    # loss of its whole transcript beside it (quickstart's gamma = 0.1: bounded)
    assert {r["privacy_scope"] for r in naive} == {"whole transcript"} and {r["worst_case_loss"] for r in naive} == {""}
    memo = [r for r in rows if r["protocol"] == "1bitrrpm"]
    assert {r["privacy_scope"] for r in memo} == {"within behavior pattern"}
    assert all(0 < float(r["worst_case_loss"]) < math.inf for r in memo)


def test_two_workers_and_one_worker_give_the_same_rows(two_workers, one_worker):
    h2, rows2 = read_csv(two_workers / "results.csv")
    h1, rows1 = read_csv(one_worker / "results.csv")
    assert h1 == h2
    assert without_wall(rows1) == without_wall(rows2)
    def digests(out: Path) -> list[str]:
        return sorted(json.dumps(r["summary"]["digests"], sort_keys=True) for r in runs_of(out))

    assert digests(one_worker) == digests(two_workers)


def test_plots_exist_for_every_error_figure(two_workers):
    """One picture per error figure; the count of rounds without an estimate only where some run has one
    (a flat line at 0 says nothing)."""
    header, rows = read_csv(two_workers / "results.csv")
    assert all(r["error_rounds_without_estimate"] == "0" for r in rows)
    figures = {c for c in header if c.startswith("error_")} - {"error_rounds_without_estimate"}
    assert {p.stem for p in two_workers.glob("*.png")} == figures
    for name in figures:
        assert (two_workers / f"{name}.png").read_bytes()[:8] == PNG_MAGIC


#: Student's t quantile t(0.975, 1): the 95% interval of a mean of two runs (a table value, not computed here)
T_975_ONE_DF = 12.706204736174707


def test_points_csv_gives_each_points_mean_spread_and_95_percent_interval(two_workers):
    """points.csv against results.csv, recomputed here with the statistics module: per grid point and figure,
    the runs, mean, sample sd (n - 1), standard error sd / sqrt(n) and mean -+ t(0.975, n - 1) se."""
    import statistics

    header, rows = read_csv(two_workers / "results.csv")
    pheader, prows = read_csv(two_workers / "points.csv")
    assert pheader == ["protocol.epsilon", "protocol.name", "figure", "errors_of", "runs", "mean", "sd", "se",
                       "ci95_low", "ci95_high"]
    figures = [c for c in header if c.startswith(("error_", "epsilon_"))]
    points = sorted({(r["protocol.epsilon"], r["protocol.name"]) for r in rows})
    assert len(prows) == len(points) * len(figures)
    spread = 0
    for p in prows:
        runs = [r for r in rows if (r["protocol.epsilon"], r["protocol.name"]) == (p["protocol.epsilon"],
                                                                                    p["protocol.name"])]
        values = [float(r[p["figure"]]) for r in runs]
        assert int(p["runs"]) == len(values) == 2
        mean, sd = statistics.fmean(values), statistics.stdev(values)
        se = sd / math.sqrt(2)
        assert float(p["mean"]) == pytest.approx(mean, rel=1e-12, abs=1e-300)
        assert float(p["sd"]) == pytest.approx(sd, rel=1e-9, abs=1e-12)
        assert float(p["se"]) == pytest.approx(se, rel=1e-9, abs=1e-12)
        assert float(p["ci95_low"]) == pytest.approx(mean - T_975_ONE_DF * se, rel=1e-9, abs=1e-9)
        assert float(p["ci95_high"]) == pytest.approx(mean + T_975_ONE_DF * se, rel=1e-9, abs=1e-9)
        spread += sd > 0
        # what an error is an error of, as results.csv says; nothing for a count of rounds or a spend
        expected_of = runs[0]["errors_of"] if p["figure"].startswith("error_") and \
            p["figure"] != "error_rounds_without_estimate" else ""
        assert p["errors_of"] == expected_of
    assert spread > len(prows) // 3  # the repetitions' seeds differ: most figures move from run to run


def test_a_point_with_one_run_has_no_spread_rather_than_a_spread_of_zero(tmp_path):
    out = tmp_path / "once"
    assert sweep_cli(out, "--workers", "1", grid=["--grid", "protocol.epsilon=1,2"], repeat="1") == 0
    _, rows = read_csv(out / "results.csv")
    _, prows = read_csv(out / "points.csv")
    assert prows and all(p["runs"] == "1" for p in prows)
    for p in prows:
        (run,) = [r for r in rows if r["protocol.epsilon"] == p["protocol.epsilon"]]
        assert float(p["mean"]) == float(run[p["figure"]])
        assert p["sd"] == p["se"] == p["ci95_low"] == p["ci95_high"] == ""  # unknown, not 0


def test_log_axis_rule_and_its_use(tmp_path, monkeypatch):
    assert sweep.log_axis([0.5, 1, 2, 16])
    assert not sweep.log_axis([0.5, 1, 2, 8])  # a factor of 16
    assert not sweep.log_axis([0, 1, 100])
    assert not sweep.log_axis(["a", "b"])

    import matplotlib.axes

    scales: list[str] = []
    real = matplotlib.axes.Axes.set_xscale
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xscale",
                        lambda ax, value, **kw: (scales.append(value), real(ax, value, **kw))[1])
    for values, expected in (("0.25,1,8", ["log"]), ("0.5,1,2", [])):
        sw = sweep.plan("quickstart", [f"protocol.epsilon={values}"], repeat=2)
        rows = [{"protocol.epsilon": x, "error_mean_abs": 1.0 + r} for x in values.split(",") for r in (0, 1)]
        scales.clear()
        assert sweep.plot_figures(sw, ["protocol.epsilon", "error_mean_abs"], rows, tmp_path) == \
            [tmp_path / "error_mean_abs.png"]
        assert scales == expected


def _executed(sw, out: Path) -> tuple[list[str], list[dict]]:
    """``sw`` run into ``out``; results.csv's header and rows as tidy() made them."""
    sweep.execute(sw, out, quiet=True)
    return sweep.tidy(sw, sweep.load_records(sw, out))


def _ylabels(monkeypatch) -> list[str]:
    """Every y label set from now on."""
    import matplotlib.axes

    labels: list[str] = []
    real = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel",
                        lambda ax, text, **kw: (labels.append(text), real(ax, text, **kw))[1])
    return labels


def test_plot_axes_say_what_each_figure_is_and_in_what_units(tmp_path, monkeypatch):
    """A sweep's y axis names the figure in words and what it is an error of, as each run's summary says it
    (in the unit the scenario gives its counters, quickstart's seconds; a plugin's own words); a count stays a
    count; a run recorded before summaries said it gets its protocol's words looked up."""
    small = ["population.devices=500", "rounds=2"]
    sw = sweep.plan("quickstart", ["protocol.epsilon=1,2"], repeat=2, workers=1, overrides=small)
    header, rows = _executed(sw, tmp_path / "a")
    assert [row["errors_of"] for row in rows] == ["of each round's mean counter, in seconds"] * 4
    labels = _ylabels(monkeypatch)
    sweep.plot_figures(sw, header, rows, tmp_path)
    assert labels[0] == "mean |error| over every estimated number\n(of each round's mean counter, in seconds)"
    # a run recorded before summaries said what its errors are of: its protocol's words, its unit
    assert sweep._errors_of({"protocol": "1bitrrpm", "unit": "seconds"}) == rows[0]["errors_of"]
    assert sweep._errors_of({"protocol": "no-such-protocol"}) is None
    labels.clear()  # a plugin's own words for its estimate: those, without the scenario's seconds
    own = sweep.plan("quickstart", ["population.devices=500,600"], repeat=1, workers=1, overrides=[
        "rounds=2", 'protocol={name="tests.support:ShareOneBit",epsilon=1,max_value=86400}'])
    header, rows = _executed(own, tmp_path / "b")
    sweep.plot_figures(own, header, rows, tmp_path)
    assert labels[0] == "mean |error| over every estimated number\n(of each round's share of the day in use)"
    labels.clear()  # rows without the column (made by hand): the figure alone; a count is a count
    header = ["protocol.epsilon", "error_mean_abs", "error_rounds_without_estimate"]
    rows = [{"protocol.epsilon": x, "error_mean_abs": 1.0 + r, "error_rounds_without_estimate": r}
            for x in ("1", "2") for r in (0, 1)]
    sweep.plot_figures(sw, header, rows, tmp_path)
    assert labels == ["mean |error| over every estimated number", "rounds without an estimate (a count)"]


def test_a_mean_and_a_histogram_in_one_sweep_get_a_column_and_a_panel_each(tmp_path, monkeypatch):
    """A sweep over a mean protocol (seconds) and a histogram protocol (frequencies): results.csv and
    results.parquet say on each row what its errors are of, and each error figure is drawn as one panel per
    kind, each with its own y axis and its own words, no line joining the two."""
    import pyarrow.parquet as pq
    from matplotlib.figure import Figure

    both = ['protocol={name="1bitmean",epsilon=1,max_value=86400},'
            '{name="dbitflip",epsilon=1,max_value=86400,buckets=16,bits=2}']
    sw = sweep.plan("quickstart", both, repeat=2, workers=1, overrides=["population.devices=3000", "rounds=2"])
    seen: dict[str, Figure] = {}
    monkeypatch.setattr("scenarios.plots.save", lambda fig, path, dpi=110: seen.setdefault(Path(path).stem, fig))
    _executed(sw, tmp_path / "out")
    with open(tmp_path / "out" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(row["run_protocol"], row["errors_of"]) for row in rows} == {
        ("1bitmean", "of each round's mean counter, in seconds"), ("dbitflip", "of each bucket's frequency")}
    assert str(pq.read_table(tmp_path / "out" / "results.parquet").schema.field("errors_of").type) == "string"
    mean_abs = seen["error_mean_abs"]
    assert [ax.get_ylabel() for ax in mean_abs.axes] == [
        "mean |error| over every estimated number\n(of each round's mean counter, in seconds)",
        "mean |error| over every estimated number\n(of each bucket's frequency)"]
    # each panel one line (an errorbar's data line) at its own protocol's x only
    top, bottom = ([c.lines[0] for c in ax.containers] for ax in mean_abs.axes)
    assert [list(line.get_xdata()) for line in top] == [[0]] and [list(line.get_xdata()) for line in bottom] == [[1]]
    assert min(top[0].get_ydata()) > 10 > 1 > max(bottom[0].get_ydata())  # seconds above, frequencies below
    assert len(seen["error_wasserstein"].axes) == 1  # only the histogram has it


@pytest.mark.parametrize("gammas, where", [(4, "inside"), (12, "beside"), (36, "note")])
def test_a_plot_of_many_lines_keeps_its_axes_readable(tmp_path, monkeypatch, gammas, where):
    """Up to 10 lines: a legend inside the axes; up to 20: beside them in a wider figure; beyond: no legend (36
    to 63 entries had covered the whole plot, cut off at the right) and a note naming what the lines vary."""
    from matplotlib.figure import Figure

    seen: list[Figure] = []
    monkeypatch.setattr("scenarios.plots.save", lambda fig, path, dpi=110: seen.append(fig))
    values = [round(0.01 * i, 2) for i in range(gammas)]
    sw = sweep.plan("quickstart", ["protocol.epsilon=1,2", "protocol.gamma=" + ",".join(map(str, values))], repeat=2)
    labels = sweep.value_labels(sw.grid["protocol.gamma"])
    rows = [{"protocol.epsilon": x, "protocol.gamma": g, "error_mean_abs": 1.0 + r} for x in ("1", "2")
            for g in labels for r in (0, 1)]
    sweep.plot_figures(sw, ["protocol.epsilon", "protocol.gamma", "error_mean_abs"], rows, tmp_path)
    (fig,) = seen
    ax = fig.axes[0]
    legend = ax.get_legend()
    notes = [t.get_text() for t in ax.texts]
    if where == "note":
        assert legend is None and notes == [f"{gammas} lines, one per combination of protocol.gamma: too many to "
                                            "label (results.csv has every run)"]
        return
    assert legend is not None and len(legend.get_texts()) == gammas and not notes
    beside = legend.get_bbox_to_anchor().transformed(ax.transAxes.inverted()).x0 > 1.0
    assert beside == (where == "beside") and (fig.get_figwidth() > 8) == beside


# -------------------------------------------------------------------------------------------- resume
def test_resume_runs_only_the_missing_runs(tmp_path, one_worker, monkeypatch):
    out = tmp_path / "resume"
    shutil.copytree(one_worker, out)
    lines = (out / "runs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    drop = {1, 4, 5, 10}
    kept = [line for i, line in enumerate(lines) if i not in drop]
    (out / "runs.jsonl").write_text("".join(kept), encoding="utf-8")
    calls = count_runs(monkeypatch)

    assert sweep_cli(out, "--workers", "1") == 0
    assert len(calls) == len(drop)
    after = (out / "runs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(after) == len(lines) and after[:len(kept)] == kept
    _, resumed = read_csv(out / "results.csv")
    _, uninterrupted = read_csv(one_worker / "results.csv")
    assert without_wall(resumed) == without_wall(uninterrupted)

    calls.clear()
    assert sweep_cli(out, "--workers", "1") == 0  # complete: nothing to run
    assert calls == []


def test_a_line_cut_short_is_dropped_and_rerun(tmp_path, one_worker, monkeypatch):
    out = tmp_path / "cut"
    shutil.copytree(one_worker, out)
    text = (out / "runs.jsonl").read_text(encoding="utf-8")
    (out / "runs.jsonl").write_text(text[:len(text) - 40], encoding="utf-8")  # a kill during the last write
    calls = count_runs(monkeypatch)
    assert sweep_cli(out, "--workers", "1") == 0
    assert len(calls) == 1
    assert len(runs_of(out)) == 12

    lines = text.splitlines(keepends=True)  # a kill just before the last newline: the line itself is whole
    (out / "runs.jsonl").write_text("".join(lines[1:]).rstrip("\n"), encoding="utf-8")
    calls.clear()
    assert sweep_cli(out, "--workers", "1") == 0
    assert len(calls) == 1 and len(runs_of(out)) == 12


def test_a_different_sweep_is_refused_without_force(tmp_path, one_worker, capsys):
    out = tmp_path / "other"
    shutil.copytree(one_worker, out)
    before = (out / "runs.jsonl").read_bytes()
    capsys.readouterr()
    assert sweep_cli(out, "--workers", "1", grid=["--grid", "protocol.epsilon=0.5,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ldpsim: error: --out") and "--force" in err[0]
    assert (out / "runs.jsonl").read_bytes() == before
    assert sweep_cli(out, "--workers", "1", repeat="1") == 2  # fewer repetitions would drop finished runs
    assert sweep_cli(out, "--workers", "1", "--set", "seed=5") == 2  # and so is another scenario

    assert sweep_cli(out, "--workers", "1", "--force", grid=["--grid", "protocol.epsilon=0.5,4"]) == 0
    _, rows = read_csv(out / "results.csv")
    assert sorted({r["protocol.epsilon"] for r in rows}) == ["0.5", "4"] and len(rows) == 4
    assert len(runs_of(out)) == 4


def test_a_bad_grid_value_fails_before_any_run(tmp_path, monkeypatch, capsys):
    calls = count_runs(monkeypatch)
    out = tmp_path / "bad"
    assert sweep_cli(out, "--workers", "1", grid=["--grid", "protocol.name=1bitmean,1bitrrpm",
                                                  "--grid", "protocol.epsilon=1,-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ldpsim: error:")
    assert "protocol.epsilon=-1" in err[0] and "protocol.epsilon: must be" in err[0]
    assert calls == [] and not (out / "runs.jsonl").exists()
    # a value only bad in combination with another key's value names the whole point
    assert sweep_cli(out, grid=["--grid", "network.deadline=100,3000", "--grid", "network.latency=0.05,200"]) == 2
    assert "grid point network.deadline=100, network.latency=200: network.latency" in capsys.readouterr().err
    assert calls == []


@pytest.mark.parametrize("grid, repeat, needle", [
    (["--grid", "seed=1,2"], "2", "--grid seed"),
    (["--grid", "protocol.epsilon=1,1"], "2", "--grid protocol.epsilon: value 1 given twice"),
    (["--grid", "protocol.epsilon=1,2,1.0"], "2", "--grid protocol.epsilon: values 1 and 1.0 are the same number"),
    (["--grid", "population.devices=1e3,1000"], "2", "values 1000.0 and 1000 are the same number"),
    (["--grid", "protocol.epsilon=1,2,1.0,2"], "2", "--grid protocol.epsilon: values 1 and 1.0 are the same number"),
    (GRID + ["--grid", "protocol.epsilon=3"], "2", "--grid protocol.epsilon: given twice"),
    (["--grid", "protocol.epsilonn=1,2"], "2", "protocol.epsilonn: unknown key"),
    (["--grid", "population.groups.7.share=1"], "2", "--grid population.groups.7.share"),
    ([], "2", "no grid"),
    (GRID, "0", "--repeat: must be an integer >= 1"),
    (GRID, "many", "--repeat: must be an integer >= 1"),
    (GRID + ["--workers", "0"], "2", "--workers: must be an integer >= 1"),
    (GRID + ["--set", "seed=-3"], "2", "seed: must be an integer in [0, 2^63), got -3"),
])
def test_argument_errors_are_one_line_with_status_2(tmp_path, capsys, grid, repeat, needle):
    assert sweep_cli(tmp_path / "x", grid=grid, repeat=repeat) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ldpsim: error:") and needle in err[0], err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("table, grid, needle", [
    ('"protocol.epsilonn" = [1, 2]', [], "[sweep.grid] protocol.epsilonn=1: protocol.epsilonn: unknown key"),
    ('"protocol.epsilon" = [1, -2]', [], "[sweep.grid] protocol.epsilon=-2: protocol.epsilon: must be"),
    ('"protocol.epsilon" = [1, 1]', [], "[sweep.grid] protocol.epsilon: value 1 given twice"),
    ('"protocol.epsilon" = [1, 2]', ["--grid", "protocol.epsilon=1,-3"], "--grid protocol.epsilon=-3: protocol.epsilon"),
])
def test_an_error_in_the_file_grid_names_the_file_table_not_the_option(tmp_path, capsys, table, grid, needle):
    """A bad [sweep.grid] entry is reported as [sweep.grid], where the user wrote it (it was reported as a
    --grid the user never gave); a --grid that replaces it as --grid."""
    study = tmp_path / "study.toml"
    base = schema.resolve_path("quickstart").read_text(encoding="utf-8")
    study.write_text(base + f"\n[sweep]\nrepeat = 1\n[sweep.grid]\n{table}\n", encoding="utf-8")
    assert main(["sweep", str(study), *grid, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ldpsim: error: {needle}"), err
    assert not (tmp_path / "x").exists()


def test_an_interrupted_sweep_says_what_it_kept_and_that_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C after three of twelve runs: status 130, one line naming the three runs kept in runs.jsonl and
    that the same command resumes; it then runs the nine others only."""
    out = tmp_path / "cut"

    def interrupt_at_fourth(scenario):
        if len(calls) == 4:
            raise KeyboardInterrupt
        return False

    calls = count_runs(monkeypatch, fail=interrupt_at_fourth)
    assert sweep_cli(out, "--workers", "1") == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"ldpsim: interrupted: 3 of 12 run(s) are kept in {out / 'runs.jsonl'}; the same command "
                       "resumes with the rest")
    monkeypatch.undo()
    calls = count_runs(monkeypatch)
    assert sweep_cli(out, "--workers", "1") == 0 and len(calls) == 9


def test_repeat_is_required_somewhere(tmp_path, capsys):
    assert sweep_cli(tmp_path / "x", repeat=None) == 2
    assert "--repeat: required" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- failed runs
def test_a_failing_run_is_recorded_and_the_sweep_carries_on(tmp_path, monkeypatch, capsys):
    out = tmp_path / "fail"
    seeds = sweep.derive_seeds(42, 2)
    calls = count_runs(monkeypatch, fail=lambda sc: sc.protocol.epsilon == 2.0 and sc.seed == seeds[1])
    assert sweep_cli(out, "--workers", "1") == 1
    assert len(calls) == 12
    failed = [json.loads(line) for line in (out / "failed.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(failed) == 2
    for f in failed:
        assert f["point"]["protocol.epsilon"] == 2 and f["repetition"] == 1 and f["seed"] == seeds[1]
        assert "boom: injected failure" in f["error"] and "Traceback" in f["traceback"]
    assert len(runs_of(out)) == 10 and len(read_csv(out / "results.csv")[1]) == 10
    assert "2 run(s) failed" in capsys.readouterr().err

    monkeypatch.undo()
    calls = count_runs(monkeypatch)
    assert sweep_cli(out, "--workers", "1") == 0  # the retry runs only the two failed runs
    assert len(calls) == 2 and not (out / "failed.jsonl").exists()
    assert len(read_csv(out / "results.csv")[1]) == 12


# --------------------------------------------------------------------------- [sweep] tables, table values
SWEEP_TABLE = """
[sweep]
repeat = 2
workers = 1
[sweep.grid]
"protocol.epsilon" = [0.5, 2]
"population.groups.0.counter" = [{ dist = "constant", value = 600 }, { dist = "normal", mean = 900, sd = 50 }]
"""


def test_a_sweep_table_in_the_scenario_file(tmp_path, capsys):
    path = tmp_path / "swept.toml"
    path.write_text((schema.SHIPPED / "quickstart.toml").read_text(encoding="utf-8") + SWEEP_TABLE,
                    encoding="utf-8")
    with pytest.raises(ScenarioError, match="sweep: unknown key"):
        schema.load(str(path))  # the plain loader rejects it, so the sweep must take it out first
    assert sweep_cli(tmp_path / "a", scenario=str(path), grid=[], repeat=None) == 0
    header, rows = read_csv(tmp_path / "a" / "results.csv")
    assert header[:3] == ["protocol.epsilon", "population.groups.0.counter", "repetition"]
    assert len(rows) == 2 * 2 * 2
    assert {r["population.groups.0.counter"] for r in rows} == {"constant", "normal"}
    assert "1 worker(s)" in capsys.readouterr().err  # workers = 1 from the file

    # the command line overrides the file: --repeat, and --grid for the same key
    assert sweep_cli(tmp_path / "b", "--grid", "protocol.epsilon=1,4,8", scenario=str(path), grid=[],
                     repeat="1") == 0
    _, rows = read_csv(tmp_path / "b" / "results.csv")
    assert len(rows) == 3 * 2 * 1
    assert {r["protocol.epsilon"] for r in rows} == {"1", "4", "8"}

    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text(encoding="utf-8").replace("repeat = 2", "repeats = 2"), encoding="utf-8")
    assert sweep_cli(tmp_path / "c", scenario=str(bad), grid=[], repeat=None) == 2
    assert "sweep.repeats: unknown key" in capsys.readouterr().err
    bad.write_text(path.read_text(encoding="utf-8").replace("repeat = 2", 'repeat = "2"'), encoding="utf-8")
    assert sweep_cli(tmp_path / "c", scenario=str(bad), grid=[], repeat=None) == 2
    assert "sweep.repeat: must be an integer >= 1" in capsys.readouterr().err
    bad.write_text(path.read_text(encoding="utf-8").replace("[0.5, 2]", "0.5"), encoding="utf-8")
    assert sweep_cli(tmp_path / "c", scenario=str(bad), grid=[], repeat=None) == 2
    assert "sweep.grid.protocol.epsilon: must be a non-empty array" in capsys.readouterr().err


def test_table_valued_grid_values_get_short_labels(tmp_path):
    out = tmp_path / "tables"
    assert sweep_cli(out, "--workers", "1", grid=["--grid", COUNTERS, "--grid", "protocol.gamma=0,0.2"]) == 0
    header, rows = read_csv(out / "results.csv")
    assert header[:2] == ["population.groups.0.counter", "protocol.gamma"]
    assert [r["population.groups.0.counter"] for r in rows] == ["constant"] * 4 + ["uniform"] * 4
    assert runs_of(out)[0]["point"]["population.groups.0.counter"] in (
        {"dist": "constant", "value": 12}, {"dist": "uniform", "low": 0, "high": 24})
    assert (out / "error_mean_abs.png").read_bytes()[:8] == PNG_MAGIC  # a categorical x axis
    # tables with the same dist are told apart by the entries in which they differ (a whole protocol table:
    # topl_fig8_*.toml); labels that would still collide fall back to compact JSON for every value of the key
    assert sweep.value_labels([{"dist": "normal", "mean": 1}, {"dist": "normal", "mean": 2}]) == ["mean=1", "mean=2"]
    assert sweep.value_labels([{"name": "topl", "max_value": 29, "bins": 29, "integer": True},
                               {"name": "topl", "max_value": 500, "bins": 1024}]) == \
        ["max_value=29, bins=29, integer=true", "max_value=500, bins=1024"]
    assert sweep.value_labels([{"dist": "constant", "value": 1}, {"low": 0}, 0.5, "x"]) == \
        ["dist=constant, value=1", "low=0", "0.5", "x"]
    assert sweep.value_labels([{"a": 1}, {"a": 1.0}, "a=1"]) == ['{"a":1}', '{"a":1.0}', '"a=1"']


# ------------------------------------------------------------------ scheduling, results.parquet, clusters
@pytest.fixture
def no_plots(monkeypatch):
    """Skip the PNGs (tested above) where a test only looks at which runs ran, and where."""
    monkeypatch.setattr(sweep, "plot_figures", lambda *a, **kw: [])


def digests_by_run(out: Path) -> dict[tuple[str, int], str]:
    return {(json.dumps(r["point"], sort_keys=True), r["repetition"]): json.dumps(r["summary"]["digests"],
                                                                                 sort_keys=True)
            for r in runs_of(out)}


def test_runs_go_longest_first(tmp_path, monkeypatch, no_plots):
    order: list[tuple[int, int]] = []
    real = runner.run
    monkeypatch.setattr(runner, "run", lambda sc, *a, **kw: (order.append((sc.devices, sc.rounds)),
                                                             real(sc, *a, **kw))[1])
    grid = ["--grid", "population.devices=200,800,400", "--grid", "rounds=1,3"]
    assert sweep_cli(tmp_path / "o", "--workers", "1", grid=grid, repeat="1") == 0
    assert sorted(order) == sorted((d, r) for d in (200, 800, 400) for r in (1, 3))
    assert [d * r for d, r in order] == [2400, 1200, 800, 600, 400, 200]
    # equal costs keep grid order (ties are stable); the pool gets the same order as the in-process loop
    jobs = [{"index": i, "scenario": {"rounds": r, "population": {"devices": d}}}
            for i, (d, r) in enumerate([(10, 2), (5, 4), (40, 1), (20, 1)])]
    monkeypatch.setattr(sweep, "job_cost", lambda data: data["rounds"] * data["population"]["devices"])
    assert [j["index"] for j in sweep.longest_first(jobs)] == [2, 0, 1, 3]


def test_a_local_pool_gets_its_jobs_longest_first(tmp_path, monkeypatch, no_plots):
    seen: list[tuple[list[int], int]] = []

    def fake_pool(jobs, workers):
        seen.append(([j["scenario"]["population"]["devices"] for j in jobs], workers))
        return iter([sweep.sweep_worker.run_job(j) for j in jobs])

    monkeypatch.setattr(sweep, "run_jobs", fake_pool)
    assert sweep_cli(tmp_path / "p", "--workers", "2", grid=["--grid", "population.devices=100,300,200"],
                     repeat="2") == 0
    assert seen == [([300, 300, 200, 200, 100, 100], 2)]


class FakeDask:
    """Just enough of ``distributed`` to see what a sweep submits: functions, arguments, priorities."""

    def __init__(self):
        self.submitted: list[tuple] = []
        self.clients: list[str] = []
        self.closed = 0

    def module(self):
        fake = self

        class Client:
            def __init__(self, where, **kw):
                fake.clients.append(where if isinstance(where, str) else f"local:{where.n}")

            def submit(self, fn, *args, priority=0, pure=True, key=None):
                fake.submitted.append((fn, args, priority, pure, key))
                return Future(fn(*args))

            def cancel(self, futures):
                pass

            def run(self, fn, *args):
                assert fn is sweep.sweep_worker.local_cluster_init and args == (os.getpid(),)

            def close(self):
                fake.closed += 1

        class LocalCluster:
            def __init__(self, n_workers, threads_per_worker, processes, env, **kw):
                assert threads_per_worker == 1 and processes and env["NUMBA_NUM_THREADS"] == "1"
                self.n = n_workers

            def close(self):
                fake.closed += 1

        class Future:
            def __init__(self, value):
                self.value = value

            def result(self):
                return self.value

            def release(self):
                pass

        import types

        return types.SimpleNamespace(Client=Client, LocalCluster=LocalCluster, as_completed=iter)


def test_a_cluster_gets_plain_data_longest_first(tmp_path, monkeypatch, no_plots):
    fake = FakeDask()
    monkeypatch.setitem(sys.modules, "distributed", fake.module())
    monkeypatch.setattr(sweep.sweep_worker, "pin_threads", lambda: None)  # do not pin this test process
    monkeypatch.setattr(sweep.sweep_worker, "exit_with_parent", lambda parent: None)
    grid = ["--grid", "population.devices=100,300,200"]
    assert sweep_cli(tmp_path / "c", "--cluster", "local:3", grid=grid, repeat="1") == 0
    assert fake.clients == ["local:3"] and fake.closed == 2
    assert [s[0] for s in fake.submitted] == [sweep.sweep_worker.cluster_job] * 3
    assert [s[1][0]["scenario"]["population"]["devices"] for s in fake.submitted] == [300, 200, 100]
    assert [s[2] for s in fake.submitted] == [3, 2, 1]  # Dask runs the highest priority first
    assert len({s[4] for s in fake.submitted}) == 3 and not any(s[3] for s in fake.submitted)
    for _, args, *_ in fake.submitted:  # only plain data crosses: the job survives a JSON round trip
        assert json.loads(json.dumps(args)) == list(args)
    assert len(runs_of(tmp_path / "c")) == 3

    fake.submitted.clear()
    assert sweep_cli(tmp_path / "d", "--cluster", "tcp://sched.example:8786", grid=grid, repeat="1") == 0
    assert fake.clients[-1] == "tcp://sched.example:8786"
    assert all(s[1][1] is None for s in fake.submitted)  # workers it did not start do not watch this process


@pytest.mark.parametrize("value", ["foo", "local:0", "local:x", "local:", "tcp://host", "tcp://host:0",
                                   "tcp://host:99999", "http://host:8786", "tcp://:8786"])
def test_bad_cluster_values_are_one_line_errors(tmp_path, capsys, value):
    assert sweep_cli(tmp_path / "x", "--cluster", value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ldpsim: error: --cluster"), err
    if value == "foo":
        assert err[0] == "ldpsim: error: --cluster: expected tcp://HOST:PORT or local:N, got 'foo'"
    assert not (tmp_path / "x").exists()


def test_cluster_and_workers_together_are_refused(tmp_path, capsys):
    assert sweep_cli(tmp_path / "x", "--cluster", "local:2", "--workers", "2") == 2
    assert "--workers: not used with --cluster" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_missing_dask_extra_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` fails
    calls = count_runs(monkeypatch)
    assert sweep_cli(tmp_path / "x", "--cluster", "local:2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ldpsim: error: --cluster needs the dask extra: pip install -e '{REPO}[dask]'"]
    assert calls == [] and not (tmp_path / "x").exists()
    with pytest.raises(ScenarioError, match=r"needs the dask extra"):
        sweep.execute(sweep.plan("quickstart", ["protocol.epsilon=1,2"], repeat=1), tmp_path / "y",
                      cluster=sweep.parse_cluster("local:1"))
    assert not (tmp_path / "y").exists()


def test_results_parquet_holds_the_csv_rows_typed(two_workers):
    import pyarrow as pa
    import pyarrow.parquet as pq

    header, rows = read_csv(two_workers / "results.csv")
    table = pq.read_table(two_workers / "results.parquet")
    assert table.column_names == header == COLUMNS and table.num_rows == len(rows) == 12
    types = dict(zip(table.column_names, table.schema.types))
    assert types["protocol.epsilon"] == pa.float64() and types["protocol.name"] == pa.string()
    assert types["repetition"] == types["seed"] == types["devices"] == pa.int64()
    counts = {"error_rounds_without_estimate"}
    assert all(types[c] == (pa.int64() if c in counts else pa.float64())
               for c in header if c.startswith(("error_", "epsilon_", "wall")))
    assert types["guarantee"] == pa.float64() and types["within_guarantee"] == pa.bool_()
    for got, want in zip(table.to_pylist(), rows):
        for c in header:
            assert (sweep._cell(got[c]) if c != "protocol.epsilon" else float(want[c])) == \
                (want[c] if c != "protocol.epsilon" else got[c]), c
    meta = json.loads(table.schema.metadata[b"ldpsim.sweep"])
    assert meta["grid"] == {"protocol.epsilon": [0.5, 1, 2], "protocol.name": ["1bitmean", "1bitrrpm"]}
    assert not [p.name for p in two_workers.iterdir() if "tmp" in p.name]  # written then renamed


def test_a_run_in_a_pool_or_cluster_worker_keeps_its_cohorts_there(monkeypatch):
    """A worker is one core: a run left on auto `[simulation] workers` and `threads` gets 1 of each there (no
    shard processes or threads per run); in-process (--workers 1) it keeps auto; an explicit value is kept
    everywhere."""
    seen: list[tuple[int, int]] = []

    def record(sc, *a, **kw):
        seen.append((sc.simulation.workers, sc.simulation.threads))
        raise RuntimeError("recorded")

    monkeypatch.setattr(runner, "run", record)
    monkeypatch.setattr(sweep.sweep_worker, "pin_threads", lambda: None)  # do not pin this test process
    monkeypatch.setattr(sweep.sweep_worker, "warm", lambda scenarios: None)
    auto = sweep.build_jobs(sweep.plan("quickstart", ["protocol.epsilon=1"], repeat=1))[0]
    three = sweep.build_jobs(sweep.plan("quickstart", ["protocol.epsilon=1"], repeat=1,
                                        overrides=["simulation.workers=3"]))[0]
    two_threads = sweep.build_jobs(sweep.plan("quickstart", ["protocol.epsilon=1"], repeat=1,
                                              overrides=["simulation.threads=2"]))[0]
    for job in (auto, three, two_threads):
        for run in (sweep.sweep_worker.run_job, sweep.sweep_worker.pool_job, sweep.sweep_worker.cluster_job):
            assert "recorded" in run(job)["error"]
    assert seen == [(0, 0), (1, 1), (1, 1), (3, 0), (3, 1), (3, 1), (0, 2), (1, 2), (1, 2)]


def test_pinning_a_worker_thread_to_one_numba_thread(monkeypatch):
    import threading

    import numba

    for key in sweep.sweep_worker.THREAD_ENV:
        monkeypatch.setenv(key, "7")  # restored after the test
    seen: list[int] = []
    t = threading.Thread(target=lambda: (sweep.sweep_worker.pin_threads(), seen.append(numba.get_num_threads())))
    t.start()
    t.join()
    assert seen == [1]  # numba keeps the count per thread: this test's own thread is untouched
    assert all(os.environ[k] == "1" for k in sweep.sweep_worker.THREAD_ENV)
    with sweep._environ({"LDPSIM_SWEEP_TEST": "x"}):
        assert os.environ["LDPSIM_SWEEP_TEST"] == "x"
    assert "LDPSIM_SWEEP_TEST" not in os.environ


def test_a_cluster_resumes_a_sweep_with_the_same_digests(tmp_path, one_worker, two_workers, no_plots):
    """--cluster local:2 (a real Dask LocalCluster) finishes a sweep begun locally: only the missing runs
    (every 1bitrrpm run: one protocol, so each worker warms one) run, and every run's digests equal those
    of the in-process and the two-process sweeps."""
    out = tmp_path / "cluster"
    shutil.copytree(one_worker, out)
    lines = (out / "runs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["point"]["protocol.name"] == "1bitmean"]
    (out / "runs.jsonl").write_text("".join(kept), encoding="utf-8")
    assert len(kept) == 6
    assert sweep_cli(out, "--cluster", "local:2") == 0
    after = (out / "runs.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(after) == 12 and after[:6] == kept
    assert digests_by_run(out) == digests_by_run(one_worker) == digests_by_run(two_workers)
    assert len(digests_by_run(out)) == 12
    _, rows = read_csv(out / "results.csv")
    assert without_wall(rows) == without_wall(read_csv(one_worker / "results.csv")[1])


def test_a_grid_over_the_whole_protocol_table_keeps_the_protocol_column_apart(tmp_path):
    """A grid key named like a fixed results column (here the whole [protocol] table, as the Ding studies vary
    it) keeps its values under its own name; the fixed column becomes run_protocol."""
    path = tmp_path / "grid.toml"
    path.write_text((schema.SHIPPED / "quickstart.toml").read_text(encoding="utf-8") + """
[sweep]
repeat = 1
[sweep.grid]
protocol = [{ name = "1bitmean", epsilon = 1.0, max_value = 3600 }, { name = "laplace", epsilon = 1.0, max_value = 3600 }]
""", encoding="utf-8")
    assert main(["sweep", str(path), "--workers", "1", "--set", "population.devices=400", "--set", "rounds=2",
                 "--out", str(tmp_path / "out"), "--quiet"]) == 0
    with open(tmp_path / "out" / "results.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["run_protocol"] for r in rows] == ["1bitmean", "laplace"]
    assert rows[0]["protocol"] != rows[1]["protocol"]


def test_a_set_of_a_swept_key_is_refused_rather_than_silently_replaced_by_the_grid(tmp_path):
    """``--set population.devices=...`` on a sweep whose grid varies population.devices (or a --set of a table
    holding a swept key) would be overwritten at every grid point: the sweep refuses it in one line naming
    both."""
    with pytest.raises(ScenarioError, match=r"--set population\.devices: the grid sets 'population\.devices'"):
        sweep.plan("quickstart", ["population.devices=100,200"], repeat=1, overrides=["population.devices=50"])
    with pytest.raises(ScenarioError, match=r"--set protocol: the grid sets 'protocol\.epsilon'"):
        sweep.plan("quickstart", ["protocol.epsilon=1,2"], repeat=1,
                   overrides=['protocol={name = "1bitmean", epsilon = 1.0, max_value = 86400}'])
    assert sweep.plan("quickstart", ["protocol.epsilon=1,2"], repeat=1, overrides=["rounds=3"]).base["rounds"] == 3


def test_a_set_under_a_table_the_grid_sets_whole_applies_on_top_of_every_point(tmp_path, capsys):
    """A study whose grid sets the whole protocol table (topl_fig8_*.toml) can still be shrunk from the
    command line: ``--set protocol.holdout=...`` applies to every point after its values, is part of the
    sweep's identity (a resume with another value is refused), and an error in it names the point."""
    tables = ['protocol ={name = "1bitmean", epsilon = 1.0, max_value = 86400}',
              'protocol ={name = "1bitmean", epsilon = 2.0, max_value = 3600}']
    plan = sweep.plan("quickstart", [tables[0] + "," + tables[1].split("=", 1)[1]], repeat=1,
                      overrides=["protocol.epsilon=0.5", "rounds=2", "population.devices=300"])
    assert plan.on_every_point == ("protocol.epsilon=0.5",) and plan.base["rounds"] == 2
    points = [plan.point_data(p)["protocol"] for p in plan.points]
    assert [(t["epsilon"], t["max_value"]) for t in points] == [(0.5, 86400), (0.5, 3600)]
    out = tmp_path / "out"
    assert main(["sweep", "quickstart", "--grid", tables[0] + "," + tables[1].split("=", 1)[1], "--repeat", "1",
                 "--workers", "1", "--set", "protocol.epsilon=0.5", "--set", "rounds=2", "--set",
                 "population.devices=300", "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "sweep.json").read_text())["on_every_point"] == ["protocol.epsilon=0.5"]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted(r["summary"]["privacy"]["round_epsilon"] for r in runs) == [0.5, 0.5]
    capsys.readouterr()
    assert main(["sweep", "quickstart", "--grid", tables[0] + "," + tables[1].split("=", 1)[1], "--repeat", "1",
                 "--workers", "1", "--set", "protocol.epsilon=0.75", "--set", "rounds=2", "--set",
                 "population.devices=300", "--out", str(out), "--quiet"]) == 2
    assert "on_every_point differ" in capsys.readouterr().err
    with pytest.raises(ScenarioError, match=r"--grid protocol=.*: protocol\.epsilon: must be"):
        sweep.plan("quickstart", [tables[0]], repeat=1, overrides=["protocol.epsilon=-1"])
    # a --set only the grid's tables take (dBitFlipPM's buckets; the base scenario's 1BitRRPM has none), with
    # another key swept too: checked on the points, not on the base with the other key alone
    grid = ('protocol ={name = "dbitflippm", epsilon = 1.0, max_value = 86400, buckets = 8, bits = 2}, '
            '{name = "dbitflippm", epsilon = 2.0, max_value = 86400, buckets = 16, bits = 2}')
    plan = sweep.plan("quickstart", [grid, "rounds=2,4"], repeat=1,
                      overrides=["protocol.buckets=4", "population.devices=300"])
    assert {plan.point_data(p)["protocol"]["buckets"] for p in plan.points} == {4}


def test_a_sweep_of_a_protocol_that_spends_past_its_guarantee_exits_1(tmp_path, capsys):
    """A plugin whose devices charge more than its guarantee says: `ldpsim run` exits 1 for it, but a sweep of it
    said every run finished and exited 0, results.csv holding no guarantee. Now results.csv says each run's
    guarantee and whether its devices kept within it, and the sweep names the runs in one line and exits 1."""
    out = tmp_path / "out"
    table = 'protocol={name = "tests.support:UnderstatedKFlip", epsilon = 1.0, max_value = 86400, buckets = 8}'
    args = ["sweep", "quickstart", "--grid", "rounds=2,3", "--repeat", "1", "--workers", "1", "--set", table,
            "--set", "population.devices=200", "--out", str(out), "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "ldpsim: error: privacy: 2 run(s) where a device spent past the protocol's own guarantee" in err
    assert "rounds=2, repetition 0: max spend 2.0, guarantee 1.0 (and 1 more)" in err
    _, rows = read_csv(out / "results.csv")
    assert [(r["guarantee"], r["within_guarantee"]) for r in rows] == [("1.0", "false"), ("1.5", "false")]
    assert main(args) == 1  # resumed: nothing left to run, the breach is still said
    honest = ["sweep", "quickstart", "--grid", "rounds=2,3", "--repeat", "1", "--workers", "1", "--set",
              table.replace("tests.support:UnderstatedKFlip", "kflip"), "--set", "population.devices=200",
              "--out", str(tmp_path / "honest"), "--quiet"]
    assert main(honest) == 0
    _, rows = read_csv(tmp_path / "honest" / "results.csv")
    assert {r["within_guarantee"] for r in rows} == {"true"}


def test_a_study_resumed_with_another_set_on_every_point_is_refused(tmp_path):
    """scenarios/studies/ding_patterns.py checks its own resumes with sweep.differences, on_every_point
    included, so runs at two settings never mix in one directory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ding_patterns", Path(__file__).resolve().parent.parent /
                                                  "scenarios" / "studies" / "ding_patterns.py")
    assert spec is not None and spec.loader is not None
    dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp)
    grid = ['protocol ={name = "1bitrrpm", epsilon = 1.0, max_value = 86400, granularity = 3600}, '
            '{name = "1bitrrpm", epsilon = 2.0, max_value = 86400, granularity = 3600}']
    dp.prepare(sweep.plan("quickstart", grid, repeat=1, overrides=["protocol.granularity=7200"]), tmp_path, False)
    dp.prepare(sweep.plan("quickstart", grid, repeat=1, overrides=["protocol.granularity=7200"]), tmp_path, False)
    with pytest.raises(ScenarioError, match="on_every_point differ"):
        dp.prepare(sweep.plan("quickstart", grid, repeat=1, overrides=["protocol.granularity=1800"]), tmp_path,
                   False)
    assert sweep.differences({k: v for k, v in json.loads((tmp_path / "sweep.json").read_text()).items()
                              if k != "on_every_point"}, {**json.loads((tmp_path / "sweep.json").read_text()),
                                                          "on_every_point": []}) == []


@pytest.mark.parametrize("study", ["ding_mean", "ding_histogram", "low_population", "topl_pos"])
def test_a_shipped_study_is_the_sweep_its_study_file_plans(study):
    """The shipped docs/<study>/sweep.json is the sweep its study file plans today, so repeating the documented
    command resumes it: a label-only key added to the study file since ([population] unit) must not make it
    another sweep, while any key that changes the runs does."""
    shipped = json.loads((Path(__file__).resolve().parent.parent / "docs" / study / "sweep.json").read_text())
    plan = sweep.plan(str(schema.SHIPPED / "studies" / f"{study}.toml"), [], repeat=None).definition()
    assert sweep.differences(shipped, plan) == []
    moved = json.loads(json.dumps(plan))
    moved["scenario_data"]["seed"] += 1
    assert sweep.differences(shipped, moved) == ["scenario_data"]


def test_a_key_swept_beside_a_whole_table_is_checked_with_the_sets_on_top():
    """The README's small try of the ToPL figure-8 study (2 tables x 2 epsilons x 2 weightings): ``--set
    protocol.holdout=1024`` (under the protocol table the study's grid sets whole) is what makes 4,096 devices
    valid, so the check of another swept key (the threshold epsilon) alone on the base applies it too; without
    it the sweep is refused, naming it."""
    spec = str(schema.SHIPPED / "studies" / "topl_fig8_dns.toml")
    small = ["population.devices=4096", "simulation.cohort_size=4096", "rounds=2"]
    plan = sweep.plan(spec, ["protocol.threshold_epsilon=0.5,2", "protocol.method=sw-w"], repeat=1,
                      overrides=small + ["protocol.holdout=1024"])
    assert len(plan.points) == 8 and {plan.point_data(p)["protocol"]["holdout"] for p in plan.points} == {1024}
    with pytest.raises(ScenarioError, match=r"protocol\.holdout: must be .* below 4096, got 65536$"):
        sweep.plan(spec, ["protocol.threshold_epsilon=0.5,2", "protocol.method=sw-w"], repeat=1, overrides=small)


def test_a_damaged_sweep_directory_resumes_or_is_refused_in_one_line(tmp_path, capsys):
    """runs.jsonl of bytes that are not text, or a line whose summary is not as a run writes it (figures of
    other types, figure names that would be paths), is dropped (and rerun) rather than a traceback or a file
    outside the directory; a sweep.json that is no object is another sweep; a typo of a repeat count is
    refused at once rather than planned for minutes."""
    out = tmp_path / "sw"
    argv = ["sweep", "quickstart", "--quiet", "--set", "population.devices=300", "--set", "rounds=2", "--repeat",
            "1", "--grid", "protocol.epsilon=0.5,1", "--workers", "1", "--out", str(out)]
    assert main(argv) == 0
    lines = (out / "runs.jsonl").read_text().splitlines()
    (out / "runs.jsonl").write_bytes(b"\xff\xfe\x00garbage\n" + lines[1].encode() + b"\n")
    assert main(argv) == 0 and "dropped 1 unreadable" in capsys.readouterr().err
    # edited figures: not objects, a string or a bool for a number, a name that would be a plot file's path
    for damage in ({"error": "bad"}, {"error": None}, {"error": {"mean_abs": "x"}}, {"epsilon": {"max": True}},
                   {"error": {"../../escape": 1.0}}, {"error": {"a/b": 1.0}}, {"devices": "300"},
                   {"wall_seconds": [1]}, {"epsilon": None}, {"error": {"mean_abs": 10**400}},
                   {"devices": 10**30}):
        bad = json.loads(lines[0])
        bad["summary"].update(damage)
        (out / "runs.jsonl").write_text(json.dumps(bad) + "\n" + lines[1] + "\n")
        assert main(argv) == 0 and "dropped 1 unreadable" in capsys.readouterr().err
        assert len((out / "runs.jsonl").read_text().splitlines()) == 2
        assert {p.name for p in out.glob("error_*.png")} == {f"error_{k}.png" for k, v in json.loads(lines[1])[
            "summary"]["error"].items() if k != "rounds_without_estimate" or v}  # the figures of the run not edited
        assert not list(tmp_path.glob("*.png")) and not (out / "error_a").exists()
    for name in ("runs.jsonl", "sweep.json"):  # a FIFO: reading it blocked the resume for ever
        kept = (out / name).read_bytes()
        (out / name).unlink()
        os.mkfifo(out / name)
        assert main(argv) == 2 and f"{name} is not a regular file" in capsys.readouterr().err
        (out / name).unlink()
        (out / name).write_bytes(kept)
    (out / "sweep.json").write_text("[]")
    assert main(argv) == 2 and "holds a different sweep" in capsys.readouterr().err
    with pytest.raises(ScenarioError, match=r"^2,000,000,000 runs .* exceed the limit of 10,000,000"):
        sweep.plan("quickstart", ["protocol.epsilon=0.5,1"], repeat=1_000_000_000)


def test_a_sweep_is_extended_with_more_repetitions_or_grid_values_but_never_cut_down(tmp_path, monkeypatch,
                                                                                     capsys, no_plots):
    """The same command with --repeat 2 after --repeat 1, then a third grid value: only the new runs run, the
    finished ones are kept as they were, and the results equal a sweep run whole at once. Fewer repetitions or
    a grid value fewer would drop finished runs: refused, runs.jsonl untouched."""
    grid = ["--grid", "protocol.epsilon=1,2"]
    out, whole = tmp_path / "grown", tmp_path / "whole"
    calls = count_runs(monkeypatch)
    assert sweep_cli(out, "--workers", "1", grid=grid, repeat="1") == 0 and len(calls) == 2
    first = (out / "runs.jsonl").read_text()
    assert sweep_cli(out, "--workers", "1", grid=grid, repeat="2") == 0 and len(calls) == 4
    assert sweep_cli(out, "--workers", "1", grid=["--grid", "protocol.epsilon=1,2,4"], repeat="2") == 0
    assert len(calls) == 6 and (out / "runs.jsonl").read_text().startswith(first)
    assert sweep_cli(whole, "--workers", "1", grid=["--grid", "protocol.epsilon=1,2,4"], repeat="2") == 0
    assert sorted(map(str, without_wall(read_csv(out / "results.csv")[1]))) == \
        sorted(map(str, without_wall(read_csv(whole / "results.csv")[1])))
    assert digests_by_run(out) == digests_by_run(whole)
    kept = (out / "runs.jsonl").read_text()
    capsys.readouterr()
    for smaller, repeat in ((["--grid", "protocol.epsilon=1,4"], "2"), (["--grid", "protocol.epsilon=1,2,4"], "1")):
        assert sweep_cli(out, "--workers", "1", grid=smaller, repeat=repeat) == 2
        assert "may be extended, with more repetitions or grid values, but not cut down" in capsys.readouterr().err
        assert (out / "runs.jsonl").read_text() == kept and len(calls) == 12


def test_a_key_inside_a_swept_table_applies_on_top_of_it_whatever_the_order(tmp_path, monkeypatch) -> None:
    """--grid protocol.epsilon before --grid protocol={...}: every run had the table's epsilon while its row
    said otherwise (a new user's figure of error against epsilon was flat). The key inside the table now
    applies after it; points that still give one scenario (a table's epsilon replaced by the grid's) are
    refused; and the plots' x axis is the first key with more than one value."""
    import matplotlib.axes

    tables = ('protocol={name="1bitmean",epsilon=1,max_value=86400},'
              '{name="dbitflip",epsilon=1,max_value=86400,buckets=24,bits=2}')
    s = sweep.plan("quickstart", ["protocol.epsilon=0.25,4", tables], repeat=1)
    eps = {(p[0], p[1]["name"], schema.parse(s.point_data(p)).protocol.epsilon) for p in s.points}
    assert eps == {(0.25, "1bitmean", 0.25), (0.25, "dbitflip", 0.25), (4, "1bitmean", 4.0), (4, "dbitflip", 4.0)}
    same = 'protocol={name="1bitmean",epsilon=1,max_value=86400},{name="1bitmean",epsilon=2,max_value=86400}'
    with pytest.raises(ScenarioError, match="give the same scenario: one grid key replaces what another sets"):
        sweep.plan("quickstart", ["protocol.epsilon=0.5,1", same], repeat=1)
    xlabels: list[str] = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xlabel", lambda ax, text, *a, **k: xlabels.append(text))
    one = sweep.plan("quickstart", ["population.devices=2000", "protocol.epsilon=0.5,1,2"], repeat=2)
    rows = [{"population.devices": "2000", "protocol.epsilon": e, "error_mean_abs": 1.0 + r}
            for e in ("0.5", "1", "2") for r in (0, 1)]
    sweep.plot_figures(one, ["population.devices", "protocol.epsilon", "error_mean_abs"], rows, tmp_path)
    assert xlabels == ["protocol.epsilon"]
