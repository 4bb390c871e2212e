"""The privacy audit (scenarios/privacy_audit.py): canaries through the real device sides, the likelihood-ratio
test, Clopper-Pearson bounds. A lower bound above a protocol's claim fails here; so must a device that spends
more than it charges."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from protocols import keyed
from protocols.baselines import LAPLACE, LaplaceDevices, LaplaceParams
from protocols.dbitflip import DBITFLIPPM, DBitFlipParams
from protocols.keyed import Purpose, stream_key
from protocols.messages import CollectionRequest
from protocols.onebit import MEMOIZED, NAIVE, OneBitDevices, OneBitParams
from scenarios import privacy_audit as pa
from scenarios.cli import main
from scenarios.schema import PROTOCOLS, load


# ------------------------------------------------------------------------------------------- statistics
def test_clopper_pearson_edges_and_coverage() -> None:
    n = 1000
    lo, hi = pa.clopper_pearson(0, n)
    assert lo == 0 and hi == pytest.approx(1 - 0.005 ** (1 / n), rel=1e-9)  # the closed form at k = 0
    lo, hi = pa.clopper_pearson(n, n)
    assert hi == 1 and lo == pytest.approx(0.005 ** (1 / n), rel=1e-9)
    # coverage: a 99% interval misses p = 0.3 in about 1% of 4000 binomial samples (at most 1% by construction)
    k = np.random.default_rng(5).binomial(200, 0.3, 4000)
    lo, hi = pa.clopper_pearson(k, 200)
    miss = np.mean((lo > 0.3) | (hi < 0.3))
    assert miss < 0.01 + 3 * math.sqrt(0.01 * 0.99 / 4000)


def test_threshold_is_chosen_on_calibration_and_direction_found() -> None:
    """Scores are log P1/P0: the upper tail has ratio P1/P0 = 0.49/0.05, the lower tail P0/P1 = 0.5/0.01, so
    the best test guesses input 0 on the lowest score (direction -1) and eps_hat is near ln 50."""
    rng = np.random.default_rng(1)
    s0 = rng.choice([-1.0, 0.0, 1.0], 50000, p=[0.5, 0.45, 0.05])
    s1 = rng.choice([-1.0, 0.0, 1.0], 50000, p=[0.01, 0.5, 0.49])
    d = pa.choose_test(s0[:10000], s1[:10000])
    assert d == pa.Decision(-1, -1.0)
    out = pa.evaluate(d, s0[10000:], s1[10000:])
    assert 0 < out.eps_lb < out.eps_hat < out.eps_ub
    assert abs(out.eps_hat - math.log(50)) < 4 * math.sqrt(1 / (0.01 * 40000) + 1 / (0.5 * 40000))


# ------------------------------------------------------------------------------------------- likelihoods
def _enumerate(params, values: np.ndarray, ids: np.ndarray, columns) -> tuple[dict, dict]:
    """Empirical transcript frequencies of the real device side against the model's probabilities."""
    T = values.size
    dev = params.make_devices(3, ids)
    rows = []
    for r in range(1, T + 1):
        batch, _ = dev.respond(CollectionRequest(round=r, protocol=params.name, deadline=1e9), r,
                               np.full(ids.size, values[r - 1]), 0.0)
        rows.append({k: np.asarray(v).reshape(ids.size, -1) for k, v in batch.columns.items()})
    flat = np.concatenate([np.concatenate([r[c] for c in columns], axis=1) for r in rows], axis=1)
    keys, first, counts = np.unique(flat, axis=0, return_index=True, return_counts=True)
    present = np.ones((ids.size, T), dtype=bool)
    ll = params.log_likelihood(values, [{k: v[first] for k, v in r.items()} for r in rows], present[first])
    return dict(zip(map(tuple, keys), counts / ids.size)), dict(zip(map(tuple, keys), np.exp(ll)))


@pytest.mark.parametrize("gamma", [0.0, 0.15])
def test_memoized_onebit_likelihood_matches_the_device(gamma: float) -> None:
    """1BitRRPM's closed-form transcript probabilities (alpha integrated out) equal the device's frequencies,
    for values off the grid (the rounding is random) with a repeat and a change."""
    params = OneBitParams(MEMOIZED, 1.0, 1.0, 0.25, gamma)
    values = np.array([0.3, 0.55, 0.3, 0.9])
    n = 200_000
    freq, model = _enumerate(params, values, np.arange(n), ["bit"])
    assert sum(model.values()) <= 1 + 1e-9
    for key, f in freq.items():
        p = model[key]
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (key, f, p)
    # and the model puts all its mass on transcripts the device produces (up to the unseen rare ones)
    assert sum(model.values()) > 1 - 5 / math.sqrt(n)


def test_memoized_dbitflip_likelihood_matches_the_device() -> None:
    params = DBitFlipParams(DBITFLIPPM, 1.0, 1.0, 4, 2, 0.1)
    values = np.array([0.1, 0.9, 0.1])  # buckets 0, 3, 0: the memo input returns
    n = 300_000
    freq, model = _enumerate(params, values, np.arange(n), ["j", "b"])
    # the model's probability is conditional on J (sent with every report): compare P[bits | J] per J
    by_j: dict[tuple, float] = {}
    for key, f in freq.items():
        by_j[key[:2]] = by_j.get(key[:2], 0.0) + f
    for key, f in freq.items():
        pj = by_j[key[:2]]
        p = model[key]
        assert abs(f / pj - p) < 5 * math.sqrt(p * (1 - p) / (pj * n)) + 1e-12, (key, f / pj, p)


# ------------------------------------------------------------------------------------------- the audit
@pytest.mark.parametrize("protocol", [p for p in PROTOCOLS if not pa.is_central(p)])
def test_no_lower_bound_exceeds_its_claim(protocol: str) -> None:
    """Every protocol, one report and 6-round transcripts (THRESH under the always_update collector)."""
    for game in pa.games(6):
        row = pa.audit_game(pa.default_table(protocol), game, 3000, seed=7)
        assert row.eps_lb is not None and row.claimed is not None
        assert not row.exceeds, (protocol, game.name, row.eps_lb, row.claimed)
        assert row.eps_lb >= 0


def test_randomized_response_lower_bound_is_tight() -> None:
    """1BitMean at eps = 1, one report: TPR = e/(e + 1), FPR = 1/(e + 1); with 80,000 held-out canaries per input
    the 99% bounds cost about 2.576 x 1.45 sqrt(1/80,000) of each log rate, so eps_lb > 0.97 and eps_hat is
    within 4 sd of 1."""
    row = pa.audit_game(pa.default_table(NAIVE), pa.games(1)[0], 100_000, seed=3)
    p = math.e / (math.e + 1)
    sd = math.sqrt(2 * (1 - p) / (p * row.test_trials) + 2 * p / ((1 - p) * row.test_trials)) / math.sqrt(2)
    assert abs(row.eps_hat - 1.0) < 4 * sd
    assert 0.97 < row.eps_lb <= 1.0
    assert row.statistic == "exact likelihood ratio"


@dataclasses.dataclass(frozen=True)
class OverspendingParams(OneBitParams):
    """1BitMean whose devices randomize at 1.3 eps while the ledger charges eps (the planted bug)."""

    def make_devices(self, seed, device_ids, limits=None):
        dev = OneBitDevices(self, seed, device_ids, limits)
        e = math.exp(1.3 * self.epsilon)
        dev._p0, dev._slope = 1.0 / (e + 1.0), (e - 1.0) / (e + 1.0)
        return dev


def test_audit_catches_a_device_that_spends_more_than_it_charges() -> None:
    def plant(sc):
        return dataclasses.replace(sc, protocol=OverspendingParams(**dataclasses.asdict(sc.protocol)))

    table = pa.default_table(NAIVE)
    row = pa.audit_game(table, pa.games(1)[0], 100_000, seed=4, transform=plant)
    assert row.claimed == pytest.approx(1.0)  # the ledger still says eps
    assert row.exceeds and row.eps_lb > 1.15  # eps_hat ~ 1.3
    honest = pa.audit_game(table, pa.games(1)[0], 100_000, seed=4)
    assert not honest.exceeds


@dataclasses.dataclass(frozen=True)
class UnflippedParams(OneBitParams):
    """1BitRRPM whose devices send the memoized bit itself while the parameters (and the ledger, which charges
    eps for a memo reveal either way) say gamma = 0.1: each report leaks eps = 1, above the per-report
    guarantee eps' = 0.776 that output perturbation promises."""

    def make_devices(self, seed, device_ids, limits=None):
        honest = OneBitParams(**{**dataclasses.asdict(self), "gamma": 0.0})
        return honest.make_devices(seed, device_ids, limits)


def test_the_one_report_game_holds_output_perturbation_to_its_per_report_guarantee() -> None:
    """The one-report game is checked against round_epsilon where it is below the charge: devices that skip
    output perturbation (leaking eps = 1 a report) exceed the claim 0.776, which the ledger's charge of 1
    would have passed; the honest devices do not."""
    table = {"name": MEMOIZED, "epsilon": 1.0, "max_value": 1.0, "granularity": 1.0, "gamma": 0.1}
    game = pa.games(1)[0]

    def plant(sc):
        return dataclasses.replace(sc, protocol=UnflippedParams(**dataclasses.asdict(sc.protocol)))

    leaky = pa.audit_game(table, game, 100_000, seed=4, transform=plant)
    assert leaky.claimed == pytest.approx(math.log((0.8 * math.e / (math.e + 1) + 0.1) / (0.8 / (math.e + 1) + 0.1)))
    assert leaky.exceeds and leaky.eps_lb > 0.85  # eps_hat ~ 1
    honest = pa.audit_game(table, game, 100_000, seed=4)
    assert honest.claimed == leaky.claimed and not honest.exceeds


class FloatLaplaceDevices(LaplaceDevices):
    """The textbook float Laplace report x + Laplace(m/eps) by inversion: its low-order bits depend on x."""

    def report(self, round_, values):
        u = keyed.uniform(stream_key(self.seed, Purpose.NOISE, round_), self.device_ids) - 0.5
        return {"y": values - self.params.scale * np.sign(u) * np.log1p(-2 * np.abs(u))}


@dataclasses.dataclass(frozen=True)
class FloatLaplaceParams(LaplaceParams):
    """The float Laplace with its textbook likelihood, log density -|y - x|/scale (evaluated in floats)."""

    def make_devices(self, seed, device_ids, limits=None):
        return FloatLaplaceDevices(self, seed, device_ids, limits)

    def log_likelihood(self, values, reports, present):
        y = reports[0]["y"][:, 0]
        return -np.abs(y - values[0]) / self.scale


def test_audit_catches_the_floating_point_laplace_leak() -> None:
    """Mironov (CCS 2012): a float x + noise reveals x through its least significant bits. The shipped Laplace
    reports on a grid and passes; the float version fails the same audit."""
    table = pa.default_table(LAPLACE)
    game = pa.games(1)[0]
    floating = pa.audit_game(table, game, 20_000, seed=2, transform=lambda sc: dataclasses.replace(
        sc, protocol=FloatLaplaceParams(**dataclasses.asdict(sc.protocol))))
    assert floating.exceeds and floating.eps_lb > 1.5
    assert not pa.audit_game(table, game, 20_000, seed=2).exceeds


@dataclasses.dataclass(frozen=True)
class OpaqueFloatLaplaceParams(LaplaceParams):
    """The float Laplace without a likelihood: the audit must find the leak with its empirical test."""

    log_likelihood = None  # type: ignore[assignment]

    def make_devices(self, seed, device_ids, limits=None):
        return FloatLaplaceDevices(self, seed, device_ids, limits)


def test_empirical_test_reads_the_low_bits_of_real_values() -> None:
    table = pa.default_table(LAPLACE)
    row = pa.audit_game(table, pa.games(1)[0], 50_000, seed=2, transform=lambda sc: dataclasses.replace(
        sc, protocol=OpaqueFloatLaplaceParams(**dataclasses.asdict(sc.protocol))))
    assert row.statistic.startswith("empirical")
    assert row.exceeds, row.eps_lb


def test_memoized_claims_follow_behavior_patterns() -> None:
    """Within a pattern the ledger is the claim (and memoization keeps a constant input at eps however many
    rounds); across patterns without output perturbation the worst case is unbounded and the audit shows a
    large lower bound."""
    rows = {g.name: pa.audit_game(pa.default_table(MEMOIZED), g, 5000, seed=1)
            for g in pa.games(12)}
    assert rows["light vs heavy"].claimed == pytest.approx(1.0) and rows["light vs heavy"].eps_lb <= 1.0
    assert math.isinf(rows["change vs none"].claimed) and rows["change vs none"].eps_lb > 4


# ------------------------------------------------------------------------------------------- command line
def test_command_line_json_and_files(tmp_path, capsys) -> None:
    assert main(["privacy-audit", "kflip", "--trials", "500", "--rounds", "4", "--json", "--out",
                 str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["game"] for r in rows] == [g.name for g in pa.games(4)]
    for r in rows:
        assert {"protocol", "rounds", "claimed", "eps_hat", "eps_lb", "trials"} <= set(r)
        assert r["protocol"] == "kflip" and r["trials"] == 500
    assert {p.name for p in tmp_path.iterdir()} == {"privacy_audit.json", "privacy_audit.csv", "kflip.png"}
    # each game's two inputs, in words (games(4): a change at collection 3 against none; at 2 against at 3)
    inputs = {r["game"]: (r["input0"], r["input1"]) for r in rows}
    assert inputs["one report"] == ("0 from collection 1", "max_value from collection 1")
    assert inputs["change vs none"] == ("0 from collection 1", "0 from collection 1, max_value from collection 3")
    assert inputs["change round"] == ("0 from collection 1, max_value from collection 2",
                                      "0 from collection 1, max_value from collection 3")
    with (tmp_path / "privacy_audit.csv").open() as fh:
        assert [(r["input0"], r["input1"]) for r in csv.DictReader(fh)] == list(inputs.values())
    assert pa.games(2)[1].described(bits=True) == {"input0": "bit 0 from collection 1",
                                                   "input1": "bit 1 from collection 1"}


def test_command_line_errors(capsys) -> None:
    assert main(["privacy-audit", "nosuchthing", "--trials", "100"]) == 2
    assert "neither a protocol" in capsys.readouterr().err
    assert main(["privacy-audit", "kflip", "--trials", "5"]) == 2
    assert "--trials" in capsys.readouterr().err


def test_the_default_folder_is_named_for_the_scenario_file(tmp_path, monkeypatch, capsys) -> None:
    """Without --out the results go to runs/privacy-audit-<scenario name>-<time>: the file's name, not
    "quickstart.toml" with its suffix and its directories."""
    from pathlib import Path

    scenario = Path(__file__).resolve().parent.parent / "scenarios" / "quickstart.toml"
    monkeypatch.chdir(tmp_path)
    assert main(["privacy-audit", str(scenario), "--trials", "200", "--rounds", "2", "--quiet"]) in (0, 1)
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("privacy-audit-quickstart-") and ".toml" not in folder.name, folder.name
    assert (folder / "privacy_audit.json").is_file()
    assert f"wrote runs/{folder.name}/privacy_audit.json" in capsys.readouterr().out


def test_a_set_protocol_name_audits_and_labels_that_protocol(tmp_path, capsys) -> None:
    """`privacy-audit quickstart --set protocol.name=1bitmean` audited 1BitMean (its claims were 1BitMean's
    fresh-report ones) in rows and files labelled 1bitrrpm, the scenario's own protocol."""
    out = tmp_path / "pa"
    assert main(["privacy-audit", "quickstart", "--set", "protocol.name=1bitmean", "--rounds", "2", "--trials",
                 "200", "--json", "--out", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["protocol"] for r in rows} == {"1bitmean"}
    two = next(r for r in rows if r["game"] == "light vs heavy")
    fresh = load("quickstart", ["protocol.name=1bitmean"]).protocol
    assert two["claimed"] == pytest.approx(2 * fresh.round_epsilon)  # fresh reports: two rounds, two charges
    assert (out / "1bitmean.png").is_file() and not (out / "1bitrrpm.png").exists()


def test_the_default_folder_of_a_module_class_target_is_a_plain_name(tmp_path, monkeypatch) -> None:
    """A `module:Class` target, or a run's scenario.json, named the folder with its ':' and path
    (runs/privacy-audit-_tmp_x_scenario.json-<time>): only letters, digits, '.', '_' and '-' now."""
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    target = str(Path(__file__).resolve().parent.parent / "scenarios" / "quickstart.toml")
    run = tmp_path / "run"
    assert main(["run", target, "--set", "population.devices=200", "--set", "rounds=2", "--out", str(run),
                 "--quiet"]) == 0
    assert main(["privacy-audit", str(run / "scenario.json"), "--trials", "100", "--rounds", "1", "--quiet"]) in (0, 1)
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("privacy-audit-scenario-"), folder.name
    import re

    assert re.fullmatch(r"[A-Za-z0-9._-]+", folder.name), folder.name


def test_the_picture_flags_a_lower_bound_above_its_claim(tmp_path, monkeypatch) -> None:
    """The exit code and the table said EXCEEDS CLAIM; the picture drew the offending bar like every other one.
    It is now red and annotated."""
    import matplotlib.axes

    from scenarios import privacy_audit as pa

    notes: list[tuple[str, str]] = []
    real = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(matplotlib.axes.Axes, "annotate",
                        lambda ax, text, xy, **kw: (notes.append((text, kw.get("color"))), real(ax, text, xy, **kw))[1])

    def row(game: str, lb: float) -> pa.Row:
        return pa.Row("p", game, 1, 0.5, "ledger", 0.5, lb + 0.1, lb, lb + 0.2, None, None, None, None, 100, 100,
                      "exact", "honest", 0.1, None)

    pa.draw([row("ok", 0.3), row("leaky", 0.9)], tmp_path / "p.png")
    assert notes == [("0.30", "black"), ("0.90\nEXCEEDS CLAIM", "tab:red")], notes
