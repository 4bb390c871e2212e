"""The paper studies' plot scripts (scenarios/studies/plot_*.py) on sweeps run now, small, as README and
docs/reproductions.md tell a user to try them: each draws its figures from what `ldpsim sweep` writes today (the
Ding plot had matched only the shipped results.csv, whose labels an older sweep wrote, and failed on every fresh
sweep), titles them with the sweep's own size, and says in one line when given another study's directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scenarios import schema
from scenarios.cli import main

STUDIES = schema.SHIPPED / "studies"


def _sweep(out: Path, study: str, *args: str) -> Path:
    assert main(["sweep", str(STUDIES / study), "--out", str(out), "--workers", "1", "--quiet", *args]) == 0
    return out


def _plot(script: str, directory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STUDIES / script), str(directory)], capture_output=True, text=True,
                          timeout=300, cwd=directory.parent)


@pytest.fixture(scope="module")
def ding_mean(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("studies") / "ding_mean"
    return _sweep(out, "ding_mean.toml", "--grid", "population.devices=300,600", "--grid", "protocol.epsilon=1,3",
                  "--repeat", "2", "--set", "rounds=3")


def test_the_ding_plot_draws_a_sweep_run_now(ding_mean: Path) -> None:
    p = _plot("plot_ding.py", ding_mean)
    assert p.returncode == 0, p.stderr[-2000:]
    for name in ("fig_vs_n.png", "fig_vs_eps.png", "fig_grid.png", "summary_table.md"):
        assert (ding_mean / name).stat().st_size > 0, name
    table = (ding_mean / "summary_table.md").read_text(encoding="utf-8")
    assert "1bitrrpm" in table and "laplace" in table  # every protocol of the grid matched back to its runs


def test_a_plot_script_given_another_study_says_so_in_one_line(ding_mean: Path, tmp_path: Path) -> None:
    p = _plot("plot_low_population.py", ding_mean)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("plot_low_population.py: error: ") and line.endswith(
        "not a low_population study: its results.csv has no column protocol.bits, population.groups.0.counter")
    low = _sweep(tmp_path / "low", "low_population.toml", "--grid", "population.devices=300", "--grid",
                 "protocol.epsilon=1", "--grid", "protocol.bits=1", "--repeat", "2", "--set", "rounds=2")
    p = _plot("plot_ding.py", low)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("plot_ding.py: error: ") and "not a ding_mean or ding_histogram study" in line, line
    p = _plot("plot_low_population.py", low)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (low / "fig_hist_max_abs.png").stat().st_size > 0


def test_the_topl_plots_title_the_sweep_that_ran_and_state_no_spread_of_one_run(tmp_path: Path) -> None:
    """A small figure-8 sweep (README's "try it small") is titled with its own 2 rounds x 4,096 devices and
    1,024 holdout reports, not the study's 8 x 131,072 and 65,536; one repetition prints no numpy warning."""
    fig8 = tmp_path / "fig8"
    _sweep(fig8 / "dns", "topl_fig8_dns.toml", "--repeat", "1", "--set", "population.devices=4096", "--set",
           "simulation.cohort_size=4096", "--set", "rounds=2", "--set", "protocol.holdout=1024", "--grid",
           "protocol.threshold_epsilon=0.4,2")
    p = _plot("plot_topl_fig8.py", fig8)
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr[-2000:]
    sys.path.insert(0, str(STUDIES))
    try:
        import plot_topl_fig8
    finally:
        sys.path.remove(str(STUDIES))
    data = {"dns": plot_topl_fig8.cells_of(plot_topl_fig8.rows_of(fig8 / "dns"))}
    assert plot_topl_fig8.describe_setting(fig8, data) == ("2 rounds x 4,096 devices = 8,192 values, 1,024 holdout "
                                                           "reports")
    pos = _sweep(tmp_path / "pos", "topl_pos.toml", "--set", "population.devices=2000", "--set", "rounds=3",
                 "--grid", "protocol.epsilon=1,3", "--repeat", "1")
    p = _plot("plot_topl_pos.py", pos)
    assert p.returncode == 0 and "Warning" not in p.stderr, p.stderr[-2000:]
    assert "± " not in (pos / "summary_table.md").read_text(encoding="utf-8")  # one run: no spread stated


def test_the_ding_panels_leave_out_a_lower_bar_a_log_axis_cannot_draw() -> None:
    """On the log axes of the Ding figures, a point whose mean - sd is 0 or below gets no lower bar (it was drawn
    down to the panel's bottom, as if the error could reach 0); the others keep mean - sd; the panel counts
    the points it left a bar out of, for the figure's title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sys.path.insert(0, str(STUDIES))
    try:
        import plot_ding
    finally:
        sys.path.remove(str(STUDIES))

    class Study:  # the little of plot_ding.Study a panel reads
        ns, epss, variants = [100, 1000], [1.0], ["v"]
        tables = {"v": {"name": "1bitmean"}}

        def stats(self, v, group, n, eps):  # type: ignore[no-untyped-def]
            return (50.0, 20.0) if n == 100 else (10.0, 30.0)  # mean, sd: the second reaches below 0

    fig, ax = plt.subplots()
    assert plot_ding.panel(ax, Study(), "g", "n", 1.0, {"v": ("tab:blue", "o")}, closed=False) == 1
    (bars,) = ax.collections  # the error bars: one segment a point, (x, low) to (x, high)
    lows = sorted((seg[0][0], seg[0][1]) for seg in bars.get_segments())
    assert lows == [(100.0, 30.0), (1000.0, 10.0)]  # 50 - 20; and the mean itself: no lower bar
    plt.close(fig)
