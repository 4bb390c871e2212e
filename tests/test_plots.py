"""The histogram picture (scenarios/plots.py): a bar and an error bar per bucket up to MANY_BUCKETS, then one
outline per series, so a run over 65,536 buckets draws three shapes instead of 131,072 (it took minutes); in both
forms the picture shows the last round's truth and estimate bucket by bucket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scenarios import plots


def _drawn(monkeypatch: pytest.MonkeyPatch, k: int) -> tuple[Any, np.ndarray, np.ndarray, float]:
    """The histogram figure of 3 rounds over k buckets (kept instead of saved), with its last round's truth and
    estimate and the bucket width."""
    rng = np.random.default_rng(k)
    truth = rng.dirichlet(np.ones(k), size=3)
    est = truth + rng.normal(0, 1e-3, truth.shape)
    sd, width = np.full(truth.shape, 1e-3), 24 / k
    kept: list[Any] = []
    monkeypatch.setattr(plots, "save", lambda fig, path, dpi=110: kept.append(fig))
    per_round = [{"max_abs": 0.01, "wasserstein": 0.1}] * 3
    plots.histogram_plot(Path("unused.png"), np.arange(1, 4), per_round, truth, est, sd, width, "t", [2])
    return kept[0], truth[-1], est[-1], width


def test_few_buckets_get_a_bar_and_an_error_bar_each(monkeypatch: pytest.MonkeyPatch) -> None:
    fig, truth, est, width = _drawn(monkeypatch, 24)
    bottom = fig.axes[1]
    assert len(bottom.patches) == 24
    assert np.allclose([p.get_height() for p in bottom.patches], truth)
    centers, drawn = bottom.lines[0].get_data()
    assert np.allclose(drawn, est) and np.allclose(centers, (np.arange(24) + 0.5) * width)


def test_many_buckets_are_drawn_as_one_outline_per_series(monkeypatch: pytest.MonkeyPatch) -> None:
    k = 4 * plots.MANY_BUCKETS
    fig, truth, est, width = _drawn(monkeypatch, k)
    bottom = fig.axes[1]
    assert len(bottom.patches) == 0 and len(bottom.collections) == 2  # truth and the band: no shape per bucket
    x, y = next(line for line in bottom.lines if line.get_label() == "estimate").get_data()
    # a step "post" outline: bucket i's estimate from edge i to edge i + 1
    assert np.allclose(x, np.arange(k + 1) * width) and np.allclose(y[:-1], est)
    (truth_path,) = bottom.collections[0].get_paths()
    top = truth_path.vertices[:, 1]
    assert top.max() == pytest.approx(truth.max()) and top.min() == pytest.approx(0.0)
    assert f"{k:,} buckets" in bottom.get_title()


def test_round_and_epoch_axes_are_ticked_at_whole_numbers(tmp_path, monkeypatch) -> None:
    """A run of 3 rounds: the estimates, spend and attack plots tick rounds 1, 2, 3, never 1.5 (a round is a
    count), and no line of a change after the last round (quickstart's is in round 8) stretches the axis to it;
    THRESH's comparison ticks whole epochs."""
    from matplotlib.figure import Figure

    from scenarios import compare, output, runner, schema

    ticks: list[list[float]] = []
    xlabels: list[str] = []
    real = Figure.savefig

    def spy(fig, *args, **kwargs):
        fig.canvas.draw()  # the locators choose their ticks when drawn
        for ax in fig.axes:
            label = ax.get_xlabel()
            xlabels.append(label)
            if label.startswith(("round", "epoch", "located round")):
                lo, hi = ax.get_xlim()
                ticks.append([t for t in ax.get_xticks() if lo <= t <= hi])
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    result = runner.run(schema.load("quickstart", ["population.devices=300", "rounds=3"]))
    output.write_run_dir(result, tmp_path / "run", painter=None)
    compare.compare(schema.load("thresh_stable", ["population.devices=300", "rounds=21"]), tmp_path / "cmp")
    assert len(ticks) >= 5 and all(t and all(float(x).is_integer() for x in t) for t in ticks), ticks
    assert max(max(t) for t in ticks[:-1]) <= 3, ticks
    assert xlabels[-1] == "epoch (7 rounds of 24 h each)", xlabels  # THRESH's comparison: how long an epoch is


def test_a_histogram_title_names_d_only_for_a_protocol_that_has_one(tmp_path, monkeypatch) -> None:
    """dBitFlip's pictures say d (bits per report); k-ary randomized response has no d and said "d = 1"."""
    from scenarios import output, plots, runner, schema

    titles: list[str] = []
    monkeypatch.setattr(plots, "histogram_plot", lambda *args: titles.append(args[7]))
    for table in ('protocol={name="kflip", epsilon=1, max_value=86400, buckets=6}',
                  'protocol={name="dbitflippm", epsilon=1, max_value=86400, buckets=6, bits=2}'):
        result = runner.run(schema.load("quickstart", [table, "population.devices=300", "rounds=2"]))
        output.write_run_dir(result, tmp_path / str(len(titles)), painter=None)
    assert "k = 6, ε = 1" in titles[0] and "d =" not in titles[0], titles
    assert "k = 6, d = 2, ε = 1" in titles[1], titles


def test_a_declared_unit_labels_the_pictures_the_error_line_and_the_summary(tmp_path, monkeypatch) -> None:
    """``[population] unit``: the estimate and error axes of a mean, the histogram's value axis and its
    Wasserstein distance, the one-line report's error and summary.json say it; a scenario without one says
    "mean counter" and ``unit: null``, never a unit it was not given."""
    import json

    from matplotlib.figure import Figure

    from scenarios import metrics, output, runner, schema

    labels: list[str] = []
    real = Figure.savefig

    def spy(fig, *args, **kwargs):
        labels.extend(t for ax in fig.axes for t in (ax.get_xlabel(), ax.get_ylabel(),
                                                      *(h.get_label() for h in ax.get_lines())))
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    small = ["population.devices=300", "rounds=2"]
    result = runner.run(schema.load("quickstart", small))  # unit = "seconds"
    output.write_run_dir(result, tmp_path / "mean", painter=None)
    assert {"mean counter (seconds)", "estimate − truth (seconds)"} <= set(labels), labels
    assert json.loads((tmp_path / "mean" / "summary.json").read_text())["unit"] == "seconds"
    assert "in seconds" in metrics.error_of(result.scenario.protocol, result.scenario.unit)
    labels.clear()
    hist = runner.run(schema.load("usage_histogram", small))  # unit = "hours"
    output.write_run_dir(hist, tmp_path / "hist", painter=None)
    assert {"value (hours)", "Wasserstein-1 (hours)"} <= set(labels), labels
    labels.clear()
    raw = schema.load("quickstart", small).raw
    unsaid = {**raw, "population": {k: v for k, v in raw["population"].items() if k != "unit"}}
    plain = runner.run(schema.parse(unsaid))
    output.write_run_dir(plain, tmp_path / "plain", painter=None)
    assert "mean counter" in labels and not any("seconds" in t for t in labels), labels
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())["unit"] is None
    assert "in the counter's units" in metrics.error_of(plain.scenario.protocol, plain.scenario.unit)
    labels.clear()  # a unit of dollars: drawn as written (matplotlib took "$_$" for math and failed)
    dollars = runner.run(schema.parse({**raw, "population": {**raw["population"], "unit": "$_$"}}))
    output.write_run_dir(dollars, tmp_path / "dollars", painter=None)
    assert r"mean counter (\$_\$)" in labels, labels


@pytest.mark.parametrize("unit", ["", " seconds", "x" * 41, "a\nb", 3])
def test_a_unit_that_labels_nothing_readable_is_refused(unit) -> None:
    from scenarios import schema

    raw = schema.load("quickstart").raw
    bad = {**raw, "population": {**raw["population"], "unit": unit}}
    with pytest.raises(schema.ScenarioError, match=r"^population\.unit"):
        schema.parse(bad)


def test_a_plugin_s_own_estimate_label_takes_no_unit_in_the_error_line() -> None:
    """A plugin that words what it estimates (estimate_label) may not estimate in the counters' unit: its
    picture drops the unit, and the error line names the estimate in the plugin's words (it had said "mean
    counter, in seconds")."""
    from types import SimpleNamespace

    from scenarios import metrics

    plain_mean = SimpleNamespace(kind="mean")
    labelled = SimpleNamespace(kind="mean", estimate_label="share of devices over a limit")
    assert metrics.error_of(plain_mean, "seconds") == "of each round's mean counter, in seconds"
    assert metrics.error_of(labelled, "seconds") == "of each round's share of devices over a limit"


@pytest.mark.parametrize("band", ["truth ± 1.96 sd (theory)", "truth ± 1.96 sd (theory, upper bound) " + "x" * 20,
                                  "truth ± 1.96 sd (theory, upper bound) " + "x" * 60])
def test_the_estimates_legend_stays_off_the_points(monkeypatch: pytest.MonkeyPatch, band: str) -> None:
    """The estimates picture's legend sits above its axes, inside the figure (in its upper right corner it
    covered the late rounds' points), on more rows when its labels are long."""
    kept: list[Any] = []
    monkeypatch.setattr(plots, "save", lambda fig, path, dpi=110: kept.append(fig))
    rounds = np.arange(1, 32)
    truth = np.full(31, 100.0)
    plots.estimates_plot(Path("unused.png"), rounds, truth, truth + 90.0, np.full(31, 10.0), "t", [8],
                         band_label=band)
    (fig,) = kept
    fig.canvas.draw()
    top = fig.axes[0]
    legend = top.get_legend().get_window_extent()
    axes, figure = top.get_window_extent(), fig.bbox
    assert legend.y0 >= axes.y1 - 1  # above the axes: no point under it
    assert figure.x0 <= legend.x0 and legend.x1 <= figure.x1 + 1 and legend.y1 <= figure.y1 + 1
