"""Ding, Kulkarni, Yekhanin (NIPS 2017), figure 3: how many users share each behavior pattern (docs/ding_patterns.md).

Section 3.2 of the paper defines a user's behavior pattern (Definition 2) as the sequence of the user's
alpha-point-rounded counter values under permanent memoization, taken up to a renaming of the distinct
values. Its width is the number of distinct values. Theorem 4 makes a user of width w (w eps)-indistinguishable
from the users who share its pattern, so the number of users in a pattern, its *support*, is how many users a
user blends with. Section 3.2.2 plots, on 31 days of two apps' usage by 3 million users, every pattern's
support in decreasing order and the share of users in patterns of support at least K, for several grid steps
s. This study does the same on a synthetic population (the paper's data are not public):

    python scenarios/studies/ding_patterns.py scenarios/app_usage_3apps_31d.toml \\
        --grid protocol.granularity=86400,21600,3600,900,300,60 --repeat 3 --out docs/ding_patterns

The patterns are the ones the attack metrics count (scenarios/attacks.py, docs/attacks.md section 3): the memo
inputs come from the protocol's own device side (``attacks.memo_inputs``: 1BitRRPM's keyed alpha-point rounding
to the grid {0, s, ..., m}), then ``attacks.first_occurrence`` and ``attacks.pattern_support``. A pattern
depends only on the true values, the seed and s, not on the reports, so this study computes each day's true
values from the scenario's world (agents/world.py, as a run does) and never simulates the network or the
collector. ``tests/test_ding_patterns.py`` checks that the supports equal those of a full run's attack
metrics.

Apps. A group whose name is ``APP/KIND`` holds counters of app APP, and each app's patterns are counted on its
own, as the paper does per app. If no group name holds a "/", the whole population is one app, ``all``.

Grid and resuming. The grid, repetitions and seeds are those of ``ldpsim sweep`` (scenarios/sweep.py:
``--grid``, ``--repeat``, ``--set``, a [sweep] table, repetition seeds derived from the scenario's seed). The
protocol must be memoized: 1BitRRPM (vary ``protocol.granularity``) or dBitFlipPM. DIR holds ``sweep.json``,
``runs.jsonl`` (one line per finished grid point and repetition: the pattern figures of every app under
``summary``, with the seconds spent on the true values and on the patterns), ``results.csv`` (one row per
point, repetition and app; ``pattern_seconds`` is the point's time without its true values), ``supports.csv``
(every support value with how many patterns have it: the figure's data) and the figures and table of
``plot_ding_patterns.py``.
Repeating the command computes only what is missing from runs.jsonl; a directory that holds another study is
refused unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import string
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from agents.world import World, split_shares
from scenarios import attacks, sweep
from scenarios.schema import Scenario, ScenarioError, parse, read

#: the K of the results table's "share of devices in patterns with support >= K" columns
K_COLUMNS = (2, 3, 10, 100, 1_000, 10_000, 100_000)
#: the most supported patterns kept per app (support, width and the pattern as a word)
TOP_PATTERNS = 5
#: the letters of a pattern word: round t shows the letter of its memo input's class in order of first use
LETTERS = string.ascii_uppercase + string.ascii_lowercase + string.digits
ALL = "all"  # the app of a population whose group names name no app
OUTPUTS = ("runs.jsonl", "results.csv", "supports.csv", "sweep.json")


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------------------- the inputs
def check_protocol(sc: Scenario) -> None:
    """A ScenarioError unless the protocol memoizes one report per memo input, one collection per round."""
    p = sc.protocol
    if attacks.family(p) is None or not getattr(p, "memoized", False):
        raise ScenarioError(f"protocol.name: {p.name} does not memoize its reports: behavior patterns "
                            "(Definition 2) need a memoized protocol such as 1bitrrpm or dbitflippm")
    if int(getattr(p, "epoch_length", 1)) != 1:
        raise ScenarioError(f"protocol.name: {p.name} collects once per epoch, not once per round")


def app_ids(sc: Scenario) -> dict[str, np.ndarray]:
    """The device ids of each app, in order of first appearance: a group named ``APP/KIND`` belongs to APP;
    with no "/" in any group name the whole population is the one app ``all``."""
    names = [g.name for g in sc.groups]
    bounds = split_shares(sc.devices, [g.share for g in sc.groups])
    if not any("/" in n for n in names):
        return {ALL: np.arange(sc.devices, dtype=np.int64)}
    parts: dict[str, list[np.ndarray]] = {}
    for i, name in enumerate(names):
        app = name.split("/", 1)[0]
        if "/" not in name or not app:
            raise ScenarioError(f"population.groups[{i}].name: {name!r} names no app; name every group APP/KIND "
                                "(or none, for one app)")
        parts.setdefault(app, []).append(np.arange(bounds[i], bounds[i + 1], dtype=np.int64))
    return {app: np.concatenate(ids) for app, ids in parts.items()}


def true_values(sc: Scenario) -> np.ndarray:
    """Every device's true value in rounds 1..R, (devices, R), NaN where a device is absent: the world's
    values as a run's round book keeps them for the attack metrics (scenarios/runner.py, RoundBook.close)."""
    world = World(sc.seed, sc.devices, sc.groups, sc.changes, sc.protocol.max_value)
    ids = np.arange(sc.devices, dtype=np.int64)
    out = np.empty((sc.devices, sc.rounds), dtype=np.float64)
    for r in range(1, sc.rounds + 1):
        world.advance_to(r)
        values, _ = world.values(ids)
        present = world.present(ids)
        out[:, r - 1] = values if present is None else np.where(present, values, np.nan)
    return out


# ------------------------------------------------------------------------------------------- the patterns
def pattern_word(row: np.ndarray) -> str:
    """A canonical row (``attacks.first_occurrence``) as a word: round t shows the letter of its memo input,
    the inputs lettered A, B, ... in order of first use; "-" where the device was absent. ``AAAAABB`` is a
    week whose weekend differs from its weekdays."""
    starts = sorted({int(v) for v in row.tolist() if v >= 0})
    letter = {v: LETTERS[min(k, len(LETTERS) - 1)] for k, v in enumerate(starts)}
    return "".join(letter[int(v)] if v >= 0 else "-" for v in row.tolist())


def top_patterns(canon: np.ndarray, support: np.ndarray, k: int = TOP_PATTERNS) -> list[dict[str, Any]]:
    """The ``k`` patterns with the largest supports (ties: the pattern of the lowest device id first): support,
    width and word."""
    out: list[dict[str, Any]] = []
    left = np.ones(support.size, dtype=bool)
    while len(out) < k and left.any():
        i = int(np.flatnonzero(left)[np.argmax(support[left])])
        row = canon[i]
        same = left & (support == support[i])
        same[same] = (canon[same] == row).all(axis=1)
        left &= ~same
        out.append({"support": int(support[i]), "width": int(attacks.pattern_width(row[None])[0]),
                    "word": pattern_word(row)})
    return out


def app_patterns(inputs: np.ndarray) -> dict[str, Any]:
    """The behavior patterns of one app's devices from their memo inputs (devices, rounds; -1 absent).

    ``support_counts``: [support, patterns with that support] for every support value, largest first (the
    supports in decreasing order are each support repeated that many times); ``width_counts``: [width,
    devices]; ``alone_by_round``: the share of devices alone in their pattern of rounds 1..t, for every t;
    ``top``: the most supported patterns (:func:`top_patterns`)."""
    n = inputs.shape[0]
    if n == 0:
        return {"devices": 0, "patterns": 0, "support_counts": [], "width_counts": [], "alone_by_round": [],
                "top": []}
    canon = attacks.first_occurrence(inputs)
    pats = attacks.pattern_support(canon)
    values, devices = np.unique(pats.support, return_counts=True)
    width = attacks.pattern_width(canon)
    w_vals, w_counts = np.unique(width, return_counts=True)
    return {
        "devices": int(n),
        "patterns": int(pats.count[-1]),
        "support_counts": [[int(v), int(d // v)] for v, d in zip(values[::-1].tolist(), devices[::-1].tolist())],
        "width_counts": [[int(w), int(c)] for w, c in zip(w_vals.tolist(), w_counts.tolist())],
        "alone_by_round": [float(a) for a in pats.alone.tolist()],
        "top": top_patterns(canon, pats.support),
    }


def width_one_expected(truth: np.ndarray, s: float) -> np.ndarray:
    """Per device, the probability over its alpha ~ U[0, s) that 1BitRRPM rounds all its values to one grid
    value (width 1), given the values: max(0, 1 - R/s), R = max - min of its values. The grid index of x is
    floor(x/s + alpha/s), so the cuts between grid cells sit at j s - alpha, one per s at a uniform offset,
    and the values share a cell exactly when no cut falls in (min, max]. A device never present counts 1."""
    with np.errstate(invalid="ignore"):
        here = ~np.isnan(truth).all(axis=1)
        spread = np.zeros(truth.shape[0])
        spread[here] = np.nanmax(truth[here], axis=1) - np.nanmin(truth[here], axis=1)
    return np.maximum(0.0, 1.0 - spread / s)


def patterns_of(sc: Scenario, truth: np.ndarray | None = None) -> dict[str, Any]:
    """Every app's behavior patterns in ``sc`` (its true values computed unless given): the ``summary`` of
    one record of runs.jsonl. For 1BitRRPM each app also has ``width_one_expected``, the mean of
    :func:`width_one_expected` over its devices: the share of its devices in width-1 patterns that the
    alpha-point rule predicts from their values (the measured share is in ``width_counts``)."""
    check_protocol(sc)
    t0 = time.perf_counter()
    if truth is None:
        truth = true_values(sc)
    rounds = np.arange(1, sc.rounds + 1)
    inputs = attacks.memo_inputs(sc.protocol, sc.seed, truth, rounds)
    p: Any = sc.protocol
    one = width_one_expected(truth, float(p.granularity)) if attacks.family(p) == "onebit" else None
    apps = {}
    for app, ids in app_ids(sc).items():
        apps[app] = app_patterns(inputs[ids])
        apps[app]["width_one_expected"] = float(one[ids].mean()) if one is not None and ids.size else None
    memo = (f"grid index of the device's keyed alpha-point rounding to {{0, s, ..., m}}, s = {p.granularity:g}"
            if attacks.family(p) == "onebit" else
            f"position of the value's bucket in J plus one, or 0 (k = {p.buckets}, d = {p.bits})")
    return {"devices": sc.devices, "rounds": sc.rounds, "protocol": p.name, "memo_input": memo,
            "granularity": float(p.granularity) if getattr(p, "granularity", None) is not None else None,
            "max_value": float(p.max_value), "apps": apps, "wall_seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------- the tables
def share_at_least(support_counts: list[list[int]], k: float) -> float:
    """The share of devices in patterns with support >= k."""
    total = sum(s * c for s, c in support_counts)
    return sum(s * c for s, c in support_counts if s >= k) / total if total else float("nan")


def app_row(app: str, fig: dict[str, Any]) -> dict[str, Any]:
    """One app's columns of results.csv."""
    sc_ = fig["support_counts"]
    n = fig["devices"]
    top = fig["top"][0] if fig["top"] else {"support": 0, "width": 0, "word": ""}
    second = fig["top"][1] if len(fig["top"]) > 1 else None
    widths = fig["width_counts"]
    width_one = sum(c for w, c in widths if w == 1)
    row = {"app": app, "app_devices": n, "patterns": fig["patterns"],
           "largest_support": top["support"], "largest_share": top["support"] / n if n else None,
           "largest_width": top["width"],
           "second_share": second["support"] / n if second and n else None,
           "second_word": second["word"] if second else None,
           "share_alone": sum(c for s, c in sc_ if s == 1) / n if n else None,
           "share_support_le_2": sum(s * c for s, c in sc_ if s <= 2) / n if n else None,
           "mean_width": sum(w * c for w, c in widths) / n if n else None,
           "width_one_share": width_one / n if n else None,
           "width_one_expected": fig.get("width_one_expected")}
    row.update({f"share_support_ge_{k}": share_at_least(sc_, k) for k in K_COLUMNS})
    return row


def tables(study: sweep.Sweep, records: dict[tuple[int, int], dict[str, Any]]) -> tuple[
        list[str], list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """results.csv (one row per point, repetition and app) and supports.csv (one row per point, repetition,
    app and support value: how many patterns have it), ordered by point, repetition, app."""
    labels = {k: dict(zip(map(_canon, vs), sweep.value_labels(vs))) for k, vs in study.grid.items()}
    head = [*study.keys, "repetition", "seed"]
    results, supports = [], []
    for key in sorted(records):
        rec = records[key]
        base = {k: labels[k][_canon(rec["point"][k])] for k in study.keys}
        base.update(repetition=rec["repetition"], seed=rec["seed"])
        for app, fig in rec["summary"]["apps"].items():
            results.append({**base, **app_row(app, fig), "pattern_seconds": rec["summary"]["wall_seconds"]})
            supports += [{**base, "app": app, "support": s, "patterns": c, "devices": s * c}
                         for s, c in fig["support_counts"]]
    empty = {"devices": 0, "patterns": 0, "support_counts": [], "width_counts": [], "top": []}
    cols = [*head, *app_row("", empty), "pattern_seconds"]
    return cols, results, [*head, "app", "support", "patterns", "devices"], supports


# ------------------------------------------------------------------------------------------- the study
def _truth_key(data: dict[str, Any]) -> str:
    """What the true values depend on: the scenario without its protocol table, but with m."""
    rest = {k: v for k, v in data.items() if k != "protocol"}
    return _canon([rest, (data.get("protocol") or {}).get("max_value")])


def compute(study: sweep.Sweep, todo: list[tuple[int, int]]) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(point index, repetition, summary) for each pair in ``todo``; points that share their true values
    (they differ only in the protocol, e.g. in s) are computed one after another on one copy of them."""
    points = study.points
    jobs = []
    for i, rep in todo:
        data = {**study.point_data(points[i]), "seed": study.seeds[rep]}
        jobs.append((_truth_key(data), i, rep, data))
    jobs.sort(key=lambda j: (j[0], j[1], j[2]))
    key, truth, truth_seconds = None, None, 0.0
    for k, i, rep, data in jobs:
        sc = parse(data)
        check_protocol(sc)
        if k != key:
            key, truth = k, None
            t0 = time.perf_counter()
            truth = true_values(sc)
            truth_seconds = time.perf_counter() - t0
        summary = patterns_of(sc, truth)
        summary["truth_seconds"] = truth_seconds
        yield i, rep, summary


def prepare(study: sweep.Sweep, out: Path, force: bool) -> None:
    """Create ``out``, refuse one that holds another study (unless ``force``: then start over) and write
    sweep.json, as ``ldpsim sweep`` does."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ScenarioError(f"--out {out}: cannot create the study directory: {exc.strerror or exc}") from None
    mine = json.loads(json.dumps(study.definition()))
    meta = out / "sweep.json"
    if force:
        for name in OUTPUTS:
            (out / name).unlink(missing_ok=True)
    elif meta.exists():
        try:
            theirs = json.loads(meta.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            theirs = {}
        diff = sweep.differences(theirs, mine)
        if diff:
            raise ScenarioError(f"--out {out}: holds a different study ({', '.join(diff)} differ); pass --force "
                                "to start over or choose another directory")
    elif (out / "runs.jsonl").exists():
        raise ScenarioError(f"--out {out}: holds runs.jsonl but no sweep.json; pass --force to start over")
    tmp = meta.with_name("sweep.json.tmp")
    tmp.write_text(json.dumps(mine, indent=2) + "\n", encoding="utf-8")
    tmp.replace(meta)


def execute(study: sweep.Sweep, out: Path, force: bool = False, quiet: bool = False) -> tuple[int, int]:
    """Compute the missing (point, repetition) pairs into ``out`` and rebuild its tables; returns (computed now,
    already done)."""
    for i in range(len(study.points)):  # every point's protocol is checked before anything is written
        check_protocol(parse(study.point_data(study.points[i])))
    prepare(study, out, force)
    done = sweep.load_records(study, out)
    points = study.points
    todo = [(i, r) for r in range(study.repeat) for i in range(len(points)) if (i, r) not in done]
    if not quiet:
        print(f"ding_patterns: {study.name}: {len(points)} grid points x {study.repeat} repetitions "
              f"({len(done)} already done) -> {out}", file=sys.stderr)
    computed = 0
    with open(out / "runs.jsonl", "a", encoding="utf-8") as runs:
        for i, rep, summary in compute(study, todo):
            head = {"point": dict(zip(study.keys, points[i])), "repetition": rep, "seed": study.seeds[rep]}
            runs.write(json.dumps({**head, "summary": summary}) + "\n")
            runs.flush()
            computed += 1
            if not quiet:
                apps = ", ".join(f"{a} {f['patterns']:,} patterns" for a, f in summary["apps"].items())
                print(f"  {computed}/{len(todo)}: {head['point']} repetition {rep}: {apps} "
                      f"({summary['wall_seconds']:.1f} s)", file=sys.stderr)
    rebuild(study, out)
    return computed, len(done)


def rebuild(study: sweep.Sweep, out: Path) -> None:
    """results.csv and supports.csv from runs.jsonl."""
    records = sweep.load_records(study, out)
    cols, rows, s_cols, s_rows = tables(study, records)
    sweep.write_results(out / "results.csv", cols, rows)
    sweep.write_results(out / "supports.csv", s_cols, s_rows)


def _plotter() -> Any:
    """plot_ding_patterns.py beside this file, as a module."""
    path = Path(__file__).with_name("plot_ding_patterns.py")
    spec = importlib.util.spec_from_file_location("plot_ding_patterns", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Behavior-pattern supports (Ding et al. 2017, figure 3) over a grid")
    ap.add_argument("scenario", help="a scenario .toml file (may hold a [sweep] table), or a shipped name")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="vary a scenario key, as in ldpsim sweep (e.g. protocol.granularity=86400,3600,60)")
    ap.add_argument("--repeat", metavar="R", help="repetitions per grid point (default: [sweep] repeat, else 1)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario key")
    ap.add_argument("--out", required=True, metavar="DIR", help="study directory (created; resumed if it holds "
                                                                 "the same study)")
    ap.add_argument("--force", action="store_true", help="start over in --out, even if it holds another study")
    ap.add_argument("--no-plots", action="store_true", help="write the tables only")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        _, data = read(args.scenario)
        has_repeat = isinstance(data.get("sweep"), dict) and "repeat" in data["sweep"]
        study = sweep.plan(args.scenario, args.grid, args.repeat if args.repeat is not None or has_repeat else 1,
                           1, args.set)
        out = Path(args.out)
        computed, done = execute(study, out, force=args.force, quiet=args.quiet)
        if not args.no_plots:
            _plotter().plot(out)
    except ScenarioError as exc:
        print(f"ding_patterns: error: {exc}", file=sys.stderr)
        return 2
    print(f"ding_patterns: {study.name}: {computed} computed now, {done} already done, "
          f"{time.perf_counter() - t0:.1f} s -> {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
